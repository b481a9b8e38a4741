"""Prefill side: one thread per decode worker that ships queued KV chunks over its link.

The forward thread only gathers a layer's new blocks into message buffers behind their headers
(:func:`layer_chunks`) and enqueues them (:meth:`PeerSender.submit`), so sending overlaps the
rest of the prefill forward; each chunk is one send (see wire.py), and its buffer goes back to
the pool after it. Where the link is slow, this thread encodes a transfer's chunks before they
go (codec.py; the choice is codec_policy.py's, per transfer). The link is built on the first
chunk, kept alive with keepalives, and torn down on any error; queued chunks of a broken link
are dropped and reported, never retried into a stale staging entry.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from duet.kv_transfer.p2p import codec, kv_layout
from duet.kv_transfer.p2p import link as p2p_link
from duet.kv_transfer.p2p.buffers import BufferPool
from duet.kv_transfer.p2p.codec_policy import CodecPolicy, LinkRate
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.cpu import unbind_current_thread
from duet.kv_transfer.p2p.metadata import SaveSpec
from duet.kv_transfer.p2p.stats import TransferStats
from duet.kv_transfer.p2p.wire import Header, Kind, control_message, stamp_sent

logger = logging.getLogger(__name__)


@dataclass
class Chunk:
    """One layer's KV for whole blocks of one transfer, as a ready-to-send message."""

    header: Header
    message: torch.Tensor  # uint8: the header, then the payload (from the sender's pool)
    ready: torch.cuda.Event | None  # set when ``message`` was filled on a CUDA stream
    last: bool  # the transfer's final chunk
    codec: str | None = None  # "on"/"off": the request's own choice of encoding; None: the sender's

    @property
    def nbytes(self) -> int:
        """KV bytes carried (what transfer statistics count)."""
        return self.header.payload_bytes


def layer_chunks(
    spec: SaveSpec,
    layer: int,
    num_layers: int,
    kv_layer: torch.Tensor,
    start: int,
    block_size: int,
    max_chunk_bytes: int,
    pool: BufferPool,
) -> Iterator[Chunk]:
    """Tokens [start, spec.end) of one layer (whole blocks) as messages of at most
    ``max_chunk_bytes`` of KV each, gathered from the layer's paged cache into pooled buffers."""
    first, last = kv_layout.block_span(start, spec.end, block_size)
    block_shape = tuple(kv_layer.shape[1:])
    per_message = max_chunk_bytes // (kv_layer[0].numel() * kv_layer.element_size())
    for lo in range(first, last, per_message):
        hi = min(lo + per_message, last)
        header = Header(
            Kind.KV,
            tid=spec.tid,
            layer=layer,
            num_layers=num_layers,
            start_block=lo,
            num_blocks=hi - lo,
            tokens_end=min(hi * block_size, spec.end),
            total_tokens=spec.total_tokens,
            block_shape=block_shape,
            dtype=kv_layer.dtype,
        )
        message = pool.acquire(header.message_bytes)
        header.write_into(message)
        kv_layout.gather_into(kv_layer, spec.block_ids[lo:hi], header.payload(message))
        ready = None
        if message.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        final = spec.last and layer == num_layers - 1 and hi == last
        yield Chunk(header, message, ready, final, spec.codec)


@dataclass
class _Posted:
    """A chunk whose send is in flight."""

    chunk: Chunk
    work: Any
    posted_at: float


class PeerSender:
    """Owns the link to one decode worker and a byte-bounded queue of chunks for it."""

    def __init__(
        self,
        host: str,
        port: int,
        me: str,
        device: torch.device,
        cfg: P2pConfig,
        stats: TransferStats,
        pool: BufferPool,
    ):
        self.peer = f"{host}:{port}"
        self._pool = pool
        self._host, self._port, self._me = host, port, me
        self._device = device
        self._cfg = cfg
        self._stats = stats
        self._queue: collections.deque[Chunk] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._link: p2p_link.PeerLink | None = None
        self._down_until = 0.0
        self._failed_tids: set[str] = set()
        self._codec: CodecPolicy | None = None  # made and used by the sender thread
        self._encoding: dict[str, bool] = {}  # per open transfer: sent encoded or not
        self._thread = threading.Thread(target=self._run, name=f"duet-p2p-send-{self.peer}", daemon=True)
        self._thread.start()

    def submit(self, chunk: Chunk) -> None:
        """Queue a chunk; waits for queue space up to the link timeout, then drops the transfer."""
        tid = chunk.header.tid
        deadline = time.monotonic() + self._cfg.link_timeout_s
        with self._cond:
            while self._queued_bytes + chunk.message.numel() > self._cfg.send_queue_bytes and self._queue:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    self._drop(chunk, "send queue full")
                    return
                self._cond.wait(left)
            if tid in self._failed_tids or time.monotonic() < self._down_until:
                self._drop(chunk, "peer unreachable")
                return
            self._queue.append(chunk)
            self._queued_bytes += chunk.message.numel()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and tear the link down (the peer's receiver sees BYE or an error)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=self._cfg.link_timeout_s)

    def _drop(self, chunk: Chunk, reason: str) -> None:
        """Fail the chunk's transfer once; later chunks of it are dropped until its last one."""
        tid = chunk.header.tid
        self._pool.release(chunk.message)
        with self._cond:
            if tid not in self._failed_tids:
                self._stats.send_failed(tid, self.peer, reason)
                self._failed_tids.add(tid)
            if chunk.last:
                self._failed_tids.discard(tid)
                self._encoding.pop(tid, None)

    def _next(self, wait: bool) -> Chunk | None:
        """The next queued chunk; None if there is none after waiting up to the keepalive
        period (``wait``) or at once, and on stop."""
        with self._cond:
            if wait and not self._queue and not self._stop:
                self._cond.wait(self._cfg.keepalive_s)
            if not self._queue:
                return None
            chunk = self._queue.popleft()
            self._queued_bytes -= chunk.message.numel()
            self._cond.notify_all()
            return chunk

    def _run(self) -> None:
        """Keep up to ``send_depth`` sends posted: the receiver takes them in order, and this
        thread does not have to win the GIL between two messages for the link to stay busy."""
        unbind_current_thread()
        self._codec = CodecPolicy(self._cfg.codec, self._host)
        in_flight: collections.deque[_Posted] = collections.deque()
        while True:
            chunk = self._next(wait=not in_flight)
            if chunk is not None:
                if len(in_flight) >= max(self._cfg.send_depth, 1):
                    self._complete(in_flight)
                self._post(chunk, in_flight)
            elif in_flight:
                self._complete(in_flight)
            elif self._stop:
                break
            else:
                self._keepalive()
        if self._link is not None:
            try:
                self._link.send(control_message(Header(Kind.BYE), self._device))
            except RuntimeError:
                pass  # the peer is gone already
            self._link.close()

    def _keepalive(self) -> None:
        if self._link is None:
            return
        try:
            self._link.send(control_message(Header(Kind.KEEPALIVE), self._device))
        except RuntimeError as e:
            self._broken(f"keepalive failed: {e}", collections.deque())

    def _post(self, chunk: Chunk, in_flight: collections.deque[_Posted]) -> None:
        tid = chunk.header.tid
        with self._cond:
            failed = tid in self._failed_tids
        if failed:
            self._drop(chunk, "earlier chunk failed")
            return
        if self._link is None and not self._connect():
            self._drop(chunk, "handshake failed")
            return
        assert self._link is not None
        if chunk.ready is not None:
            chunk.ready.synchronize()
        chunk = self._maybe_encoded(chunk)
        if not in_flight:
            self._link_rate().busy()
        posted_ns = time.monotonic_ns()
        stamp_sent(chunk.message, posted_ns)
        try:
            in_flight.append(_Posted(chunk, self._link.post_send(chunk.message), posted_ns / 1e9))
        except RuntimeError as e:
            self._drop(chunk, f"send failed: {e}")
            self._broken(str(e), in_flight)

    def _complete(self, in_flight: collections.deque[_Posted]) -> None:
        """Wait for the oldest send, then record it and recycle its buffer. (The wire time is
        measured where the message lands: with sends posted ahead and the kernel's socket
        buffer, a send completing says little about when its bytes moved.)"""
        posted = in_flight.popleft()
        chunk = posted.chunk
        assert self._link is not None
        try:
            self._link.wait(posted.work)
        except RuntimeError as e:
            self._drop(chunk, f"send failed: {e}")
            self._broken(str(e), in_flight)
            return
        now = time.monotonic()
        header = chunk.header
        self._stats.chunk_sent(header.tid, self.peer, chunk.nbytes, header.wire_bytes, posted.posted_at, now, chunk.last)
        self._pool.release(chunk.message)
        self._link_rate().completed(header.wire_bytes, now)
        if not in_flight:
            self._link_rate().idle()

    def _link_rate(self) -> LinkRate:
        assert self._codec is not None
        return self._codec.link

    def _maybe_encoded(self, chunk: Chunk) -> Chunk:
        """The chunk as it goes on the wire: encoded where its transfer was chosen to be (at
        its first chunk), else as it is."""
        assert self._codec is not None
        h = chunk.header
        encode = self._encoding.get(h.tid)
        if encode is None:
            chosen = chunk.codec == "on" if chunk.codec else self._codec.encode_transfer(h.dtype.itemsize)
            encode = self._encoding[h.tid] = chosen
        if chunk.last:
            del self._encoding[h.tid]
        group = codec.group_size(h.block_shape, h.dtype)
        if not encode or group is None or chunk.message.is_cuda:
            return chunk
        started = time.perf_counter()
        frame = codec.encode(h.payload(chunk.message), group)
        if len(frame) >= h.payload_bytes:  # incompressible: it goes raw
            return chunk
        header = dataclasses.replace(h, encoded_bytes=len(frame))
        message = self._pool.acquire(header.message_bytes)
        header.write_into(message)
        header.encoded_payload(message).numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
        self._codec.encoded(h.dtype.itemsize, h.payload_bytes, len(frame), time.perf_counter() - started)
        self._pool.release(chunk.message)
        return Chunk(header, message, None, chunk.last, chunk.codec)

    def _connect(self) -> bool:
        if time.monotonic() < self._down_until:
            return False
        try:
            self._link = p2p_link.connect(
                self._host,
                self._port,
                self._me,
                self._device,
                timedelta(seconds=self._cfg.connect_timeout_s),
                timedelta(seconds=self._cfg.link_timeout_s),
                self._cfg.max_chunk_bytes,
            )
        except (RuntimeError, TimeoutError, OSError) as e:
            logger.warning("p2p handshake with %s failed: %s", self.peer, e)
            self._stats.count("handshake_failures")
            self._down_until = time.monotonic() + self._cfg.reconnect_backoff_s
            return False
        self._stats.count("handshakes")
        return True

    def _broken(self, reason: str, in_flight: collections.deque[_Posted]) -> None:
        """Tear the link down and drop everything posted or queued for it."""
        logger.warning("p2p link to %s broke: %s", self.peer, reason)
        self._stats.count("link_failures")
        if self._link is not None:
            self._link.close()
            self._link = None
        lost = [posted.chunk for posted in in_flight]
        in_flight.clear()
        with self._cond:
            dropped, self._queue = self._queue, collections.deque()
            self._queued_bytes = 0
            self._cond.notify_all()
        for chunk in (*lost, *dropped):
            self._drop(chunk, "link broke")
