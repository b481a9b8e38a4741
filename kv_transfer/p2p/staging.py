"""Decode-side landing area for KV that arrived before (or while) its decode request waits.

Entries are keyed by transfer id, hold one ``[blocks, *block_shape]`` view per layer into one
buffer from the worker's :class:`BufferPool`, and are bounded in bytes. Every entry has a
deadline (its lease) and is freed on consumption, cancellation, failure or expiry, so nothing
staged can outlive a bounded time. Since freed buffers are reused, a thread that writes into an
entry (the receiver) or reads it (the engine copying it into its blocks) pins it first; the
buffer goes back to the pool only once it is freed and unpinned.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from duet.kv_transfer.p2p.buffers import BufferPool
from duet.kv_transfer.p2p.wire import Header


@dataclass
class StagedKV:
    """KV of one transfer, filled layer by layer, in block order per layer."""

    tid: str
    total_tokens: int
    layers: list[torch.Tensor]  # per layer: [blocks holding total_tokens, *block_shape]
    deadline: float
    link: int  # index of the link it arrives on; a broken link fails it
    received: list[int] = field(default_factory=list)  # per layer: tokens [0, n) landed
    nbytes: int = 0
    created: float = field(default_factory=time.monotonic)
    completed: float | None = None
    failure: str | None = None
    buffer: torch.Tensor | None = None  # the pooled memory behind ``layers``
    pins: int = 0  # threads reading or writing ``layers`` right now

    @property
    def complete(self) -> bool:
        return self.failure is None and all(n >= self.total_tokens for n in self.received)


class StagingArea:
    """Thread-safe, byte-bounded map of transfer id -> :class:`StagedKV`."""

    def __init__(self, capacity_bytes: int, lease_s: float, pool: BufferPool):
        self._capacity = capacity_bytes
        self._lease_s = lease_s
        self._pool = pool
        self._used = 0
        self._entries: dict[str, StagedKV] = {}
        self._cond = threading.Condition()

    @property
    def used_bytes(self) -> int:
        return self._used

    def open(self, h: Header, link: int, wait_s: float) -> StagedKV | None:
        """The entry ``h`` lands in, allocated on first use; None when it must be dropped.

        Waits up to ``wait_s`` for space (leases expire, decode requests consume), then gives
        up and leaves a failed tombstone so the decode request fails fast instead of waiting.
        """
        num_blocks = -(-h.total_tokens // h.block_shape[1])
        block_numel = h.block_shape[0] * h.block_shape[1] * h.block_shape[2]
        nbytes = h.num_layers * num_blocks * block_numel * h.dtype.itemsize
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                entry = self._entries.get(h.tid)
                if entry is not None:
                    return None if entry.failure else entry
                if nbytes > self._capacity:
                    break
                if self._used + nbytes <= self._capacity:
                    buffer = self._pool.acquire(nbytes)
                    shape = (h.num_layers, num_blocks, *h.block_shape)
                    entry = StagedKV(
                        h.tid, h.total_tokens, list(buffer.view(h.dtype).view(shape).unbind(0)),
                        time.monotonic() + self._lease_s, link,
                        received=[0] * h.num_layers, nbytes=nbytes, buffer=buffer,
                    )
                    self._entries[h.tid] = entry
                    self._used += nbytes
                    return entry
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._tombstone(h.tid, "staging full", link)
            return None

    def target(self, entry: StagedKV, h: Header) -> torch.Tensor | None:
        """The staged slice chunk ``h`` is copied into, pinned until :meth:`landed`; None (and
        the entry failed) if it does not fit the entry's layout, or if the entry already failed."""
        with self._cond:
            if entry.failure is not None:
                return None
            fits = (
                len(entry.layers) == h.num_layers
                and h.total_tokens == entry.total_tokens
                and h.start_block + h.num_blocks <= entry.layers[h.layer].shape[0]
                and entry.layers[h.layer].shape[1:] == h.block_shape
                and entry.layers[h.layer].dtype == h.dtype
            )
            if not fits:
                entry.failure = "layout mismatch"
                self._free(entry)
                return None
            entry.pins += 1
            return entry.layers[h.layer][h.start_block : h.start_block + h.num_blocks]

    def landed(self, entry: StagedKV, h: Header) -> None:
        """Record that chunk ``h`` is in place (its layer's tokens up to ``tokens_end`` are)
        and unpin the entry."""
        block_size = h.block_shape[1]
        with self._cond:
            self._unpin(entry)
            if entry.failure is None and h.start_block * block_size <= entry.received[h.layer]:
                entry.received[h.layer] = max(entry.received[h.layer], h.tokens_end)
            if entry.completed is None and entry.complete:
                entry.completed = time.monotonic()
                self._cond.notify_all()

    def wait_for_news(self, timeout_s: float) -> None:
        """Block until an entry completes or is freed, or ``timeout_s`` passes."""
        with self._cond:
            self._cond.wait(timeout_s)

    def get(self, tid: str) -> StagedKV | None:
        with self._cond:
            return self._entries.get(tid)

    @contextlib.contextmanager
    def reading(self, tid: str) -> Iterator[StagedKV | None]:
        """The complete entry of ``tid``, pinned while the caller reads it; None if there is
        no such entry or it is not complete."""
        with self._cond:
            entry = self._entries.get(tid)
            if entry is None or not entry.complete or not entry.layers:
                entry = None
            else:
                entry.pins += 1
        try:
            yield entry
        finally:
            if entry is not None:
                with self._cond:
                    self._unpin(entry)

    def extend(self, tid: str, deadline: float) -> None:
        """Keep an entry a decode request has started waiting for until ``deadline``."""
        with self._cond:
            entry = self._entries.get(tid)
            if entry is not None:
                entry.deadline = max(entry.deadline, deadline)

    def fail(self, tid: str, reason: str, link: int = -1) -> None:
        """Mark a transfer failed and free its memory; a tombstone keeps the reason until expiry."""
        with self._cond:
            entry = self._entries.get(tid)
            if entry is None:
                self._tombstone(tid, reason, link)
            elif entry.failure is None:
                entry.failure = reason
                self._free(entry)

    def fail_link(self, link: int, reason: str) -> list[str]:
        """Fail every unfinished transfer arriving on a link that broke."""
        with self._cond:
            hit = [e for e in self._entries.values() if e.link == link and e.completed is None and not e.failure]
            for entry in hit:
                entry.failure = reason
                self._free(entry)
            return [e.tid for e in hit]

    def release(self, tid: str) -> StagedKV | None:
        """Remove an entry (consumed, cancelled or abandoned) and free its memory."""
        with self._cond:
            entry = self._entries.pop(tid, None)
            if entry is not None:
                self._free(entry)
            return entry

    def expire(self, now: float | None = None) -> list[StagedKV]:
        """Drop entries past their deadline; returns the ones that held data nobody consumed."""
        now = time.monotonic() if now is None else now
        with self._cond:
            dead = [e for e in self._entries.values() if e.deadline <= now]
            for entry in dead:
                del self._entries[entry.tid]
                self._free(entry)
            return [e for e in dead if e.failure is None]

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def _tombstone(self, tid: str, reason: str, link: int) -> None:
        self._entries[tid] = StagedKV(tid, 0, [], time.monotonic() + self._lease_s, link, failure=reason)

    def _free(self, entry: StagedKV) -> None:
        """Give the entry's bytes back to the bound now, its buffer once nobody pins it."""
        if entry.layers:
            entry.layers = []
            self._used -= entry.nbytes
            self._cond.notify_all()
        self._recycle(entry)

    def _unpin(self, entry: StagedKV) -> None:
        entry.pins -= 1
        self._recycle(entry)

    def _recycle(self, entry: StagedKV) -> None:
        if entry.pins == 0 and not entry.layers and entry.buffer is not None:
            self._pool.release(entry.buffer)
            entry.buffer = None
