"""Decode side: accept prefill workers' links and land their KV chunks in the staging area.

One acceptor thread turns announcements at this worker's TCPStore into links; each link gets a
receiver thread that reads header, then payload straight into the staged tensor. A link that
errors or stays silent past the link timeout is torn down and its unfinished transfers fail,
so decode requests waiting on them end (recompute or error) instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch

from duet.kv_transfer.p2p import link as p2p_link
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.staging import StagingArea
from duet.kv_transfer.p2p.stats import TransferStats
from duet.kv_transfer.p2p.wire import Header, Kind

logger = logging.getLogger(__name__)


class Listener:
    """Hosts the rendezvous store at ``host:port`` and runs one receiver per connected peer."""

    def __init__(
        self, host: str, port: int, device: torch.device, staging: StagingArea, cfg: P2pConfig, stats: TransferStats
    ):
        self._device = device
        self._staging = staging
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
        try:
            while not self._stop.is_set():
                header = link.recv_header()
                if header.kind == Kind.BYE:
                    break
                if header.kind == Kind.ABORT:
                    self._staging.fail(header.tid, "aborted by sender", index)
                elif header.kind == Kind.KV:
                    self._land(link, header)
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

    def _land(self, link: p2p_link.PeerLink, h: Header) -> None:
        shape = h.payload_shape()
        entry = self._staging.open(h, link.index, self._cfg.staging_wait_s)
        target = None if entry is None else self._staging.target(entry, h)
        if target is None:
            self._stats.count("staging_drops")
            link.recv(torch.empty(shape, dtype=h.dtype, device=self._device))  # keep the link in step
            return
        start = time.monotonic()
        link.recv(target)
        self._stats.count("received_bytes", target.numel() * target.element_size())
        self._staging.landed(entry, h)
        if entry.completed is not None and entry.completed >= start:
            self._stats.count("received_transfers")
