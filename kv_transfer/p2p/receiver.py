"""Decode side: accept prefill workers' links and land their KV chunks in the staging area.

One acceptor thread turns announcements at this worker's TCPStore into links; each link gets a
receiver thread with ``recv_depth`` landing buffers of the largest message size, each with a
receive posted: while this thread handles one message, the next ones are already arriving in
the others, so the sender need not wait for it (see wire.py). A message that fills at least half
its buffer is staged where it landed and a fresh buffer from the pool takes its place; a smaller
one is copied into a buffer of its own size (cheap) so that staged KV holds at most twice its
bytes. So the bulk of the KV is copied once on this side, by the engine into its blocks. A link
that errors or stays silent past the link timeout is torn down and its unfinished transfers
fail, so decode requests waiting on them end (recompute or error) instead of hanging.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from datetime import timedelta

import torch

from duet.kv_transfer.p2p import codec
from duet.kv_transfer.p2p import link as p2p_link
from duet.kv_transfer.p2p.buffers import BufferPool
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.cpu import unbind_current_thread
from duet.kv_transfer.p2p.staging import Landed, StagingArea
from duet.kv_transfer.p2p.stats import TransferStats
from duet.kv_transfer.p2p.wire import HEADER_BYTES, Header, Kind

logger = logging.getLogger(__name__)


class Listener:
    """Hosts the rendezvous store at ``host:port`` and runs one receiver per connected peer."""

    def __init__(
        self,
        host: str,
        port: int,
        device: torch.device,
        staging: StagingArea,
        pool: BufferPool,
        cfg: P2pConfig,
        stats: TransferStats,
    ):
        self._device = device
        self._staging = staging
        self._pool = pool
        self._cfg = cfg
        self._stats = stats
        self._stop = threading.Event()
        self._links: dict[int, p2p_link.PeerLink] = {}
        self._lock = threading.Lock()
        self._rendezvous = p2p_link.Rendezvous(
            host,
            port,
            device,
            timedelta(seconds=cfg.connect_timeout_s),
            timedelta(seconds=cfg.link_timeout_s),
            cfg.max_chunk_bytes,
        )
        self._acceptor = threading.Thread(target=self._accept_loop, name="duet-p2p-accept", daemon=True)
        self._acceptor.start()

    @property
    def num_links(self) -> int:
        with self._lock:
            return len(self._links)

    def close(self) -> None:
        """Stop accepting and tear every link down."""
        self._stop.set()
        self._acceptor.join(timeout=2 * self._cfg.connect_timeout_s)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()

    def _accept_loop(self) -> None:
        unbind_current_thread()  # the receiver threads it starts inherit this
        while not self._stop.is_set():
            try:
                announced = self._rendezvous.poll(wait_s=0.5)
            except ValueError as e:  # backend mismatch: the peer's handshake times out
                logger.warning("p2p: refused a peer: %s", e)
                self._stats.count("handshake_failures")
                continue
            if announced is not None:
                threading.Thread(
                    target=self._serve, args=announced, name=f"duet-p2p-recv-{announced[0]}", daemon=True
                ).start()

    def _serve(self, index: int, peer: str) -> None:
        try:
            link = self._rendezvous.accept(index, peer)
        except (RuntimeError, TimeoutError) as e:
            logger.warning("p2p handshake with %s failed: %s", peer, e)
            self._stats.count("handshake_failures")
            return
        self._stats.count("handshakes")
        with self._lock:
            self._links[index] = link
        reason = "closed"
        # Several receives stay posted, so the sender's next messages flow in while this thread
        # waits for the GIL (the engine's busy loop holds it most of the time).
        posted = collections.deque()
        previous_ns = 0  # arrival of the previous message on this link
        try:
            for _ in range(max(self._cfg.recv_depth, 1)):
                buffer = self._pool.acquire(HEADER_BYTES + self._cfg.max_chunk_bytes)
                posted.append((buffer, link.post_recv(buffer)))
            while not self._stop.is_set():
                message, work = posted.popleft()
                link.wait(work)
                arrived_ns = time.monotonic_ns()
                header = Header.read_from(message)
                if header.kind == Kind.BYE:
                    break
                if header.kind == Kind.ABORT:
                    self._staging.fail(header.tid, "aborted by sender", index)
                elif header.kind == Kind.KV:
                    # The link carried this message from when it was sent, or from when the
                    # previous one arrived if that was later (it queued behind it).
                    wire_s = (arrived_ns - max(header.sent_ns, previous_ns)) / 1e9
                    message = self._land(link, header, message, max(wire_s, 0.0))
                previous_ns = arrived_ns
                posted.append((message, link.post_recv(message)))
        except (RuntimeError, ValueError) as e:  # includes peer death and silence past the timeout
            reason = f"link to {peer} broke: {e}"
            logger.warning("p2p: %s", reason)
            self._stats.count("link_failures")
        finally:
            link.close()
            with self._lock:
                self._links.pop(index, None)
            failed = self._staging.fail_link(index, reason)
            if failed:
                logger.warning("p2p: %d transfers from %s failed (%s)", len(failed), peer, reason)

    def _land(self, link: p2p_link.PeerLink, h: Header, message: torch.Tensor, wire_s: float) -> torch.Tensor:
        """Stage one KV message's payload; returns the buffer to post the next receive into."""
        if h.message_bytes > message.numel():
            raise ValueError(f"a {h.message_bytes}-byte message does not fit the {message.numel()}-byte buffer")
        entry = self._staging.open(h, link.index, self._cfg.staging_wait_s)
        if entry is None:
            self._stats.count("staging_drops")
            return message
        if h.encoded_bytes:  # decoded into a buffer of its own
            holder, next_buffer = self._pool.acquire(h.payload_bytes), message
            blocks = holder.view(h.dtype).view(h.payload_shape())
            group = codec.group_size(h.block_shape, h.dtype)
            try:
                if group is None:
                    raise ValueError(f"KV of shape {h.block_shape} and {h.dtype} cannot have been encoded")
                codec.decode(h.encoded_payload(message), group, blocks)
            except ValueError as e:  # a damaged message fails its transfer, not the link
                self._pool.release(holder)
                self._staging.fail(h.tid, str(e), link.index)
                return message
        elif 2 * h.payload_bytes >= message.numel():  # stage it where it landed
            holder, blocks, next_buffer = message, h.payload(message), self._pool.acquire(message.numel())
        else:
            holder, next_buffer = self._pool.acquire(h.payload_bytes), message
            blocks = holder.view(h.dtype).view(h.payload_shape())
            blocks.copy_(h.payload(message))
            if blocks.is_cuda:  # the engine's thread reads it next, on a stream of its own
                torch.cuda.current_stream(blocks.device).synchronize()
        landed = self._staging.land(entry, h, blocks, holder)
        if landed is Landed.DROPPED:
            self._pool.release(next_buffer if holder is message else holder)
            self._stats.count("staging_drops")
            return message
        self._stats.chunk_landed(h.tid, h.payload_bytes, wire_s, landed is Landed.COMPLETE)
        if landed is Landed.COMPLETE:
            self._stats.count("received_transfers")
        return next_buffer
