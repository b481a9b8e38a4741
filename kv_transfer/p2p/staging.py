"""Decode-side landing area for KV that arrived before (or while) its decode request waits.

Entries are keyed by transfer id and hold each layer's KV as the pieces it arrived in: a large
message stays in the buffer it was received into (the receiver posts a fresh one), a small one
is copied into a buffer of its own size, so landing costs the receiving thread no copy of the
bulk of the bytes and the engine copies each byte once, from the piece into its cache blocks.
Entries are bounded in bytes (their KV's size is reserved when the first piece arrives; a kept
message buffer holds at most twice its payload). Every entry has a deadline (its lease) and is
freed on consumption, cancellation, failure or expiry, so nothing staged can outlive a bounded
time. Since freed buffers are reused, the engine pins an entry while it copies from it; the
buffers go back to the pool only once the entry is freed and unpinned.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from duet.kv_transfer.p2p import kv_layout
from duet.kv_transfer.p2p.buffers import BufferPool
from duet.kv_transfer.p2p.wire import Header


@dataclass
class Piece:
    """Whole blocks ``[start_block, start_block + len(blocks))`` of one layer, as they landed."""

    start_block: int
    blocks: torch.Tensor  # [n, *block_shape], a view into ``buffer``
    buffer: torch.Tensor  # the pooled memory holding it


@dataclass
class StagedKV:
    """KV of one transfer, filled piece by piece; per layer, tokens [0, received) are in."""

    tid: str
    total_tokens: int
    deadline: float
    link: int  # index of the link it arrives on; a broken link fails it
    num_layers: int = 0
    num_blocks: int = 0
    block_shape: tuple[int, int, int] = (0, 0, 0)
    dtype: torch.dtype = torch.float32
    # Per layer, in arrival order. A step that ends mid-block sends that block again with the
    # next step's tokens, so a later piece may overlap an earlier one, and holds more of it.
    pieces: list[list[Piece]] = field(default_factory=list)
    received: list[int] = field(default_factory=list)  # per layer: tokens [0, n) landed
    nbytes: int = 0  # reserved against the staging bound
    created: float = field(default_factory=time.monotonic)
    completed: float | None = None
    failure: str | None = None
    freed: bool = False  # its bytes are back in the bound; its buffers follow once unpinned
    pins: int = 0  # threads reading ``pieces`` right now

    @property
    def complete(self) -> bool:
        return self.failure is None and all(n >= self.total_tokens for n in self.received)

    def fits(self, h: Header) -> bool:
        """Whether chunk ``h`` belongs to this transfer's layout."""
        return (
            0 <= h.layer < h.num_layers == self.num_layers
            and h.total_tokens == self.total_tokens
            and h.start_block + h.num_blocks <= self.num_blocks
            and h.block_shape == self.block_shape
            and h.dtype == self.dtype
        )

    def copy_layer_into(self, layer: int, view: torch.Tensor, block_ids: list[int], first: int, last: int) -> None:
        """Write the request's blocks [first, last) of ``layer`` into a paged cache ``view``,
        where ``block_ids[i]`` is the cache block of the request's block ``i``."""
        for piece in self.pieces[layer]:
            lo = max(piece.start_block, first)
            hi = min(piece.start_block + piece.blocks.shape[0], last)
            if lo < hi:
                kv_layout.scatter(view, block_ids[lo:hi], piece.blocks[lo - piece.start_block : hi - piece.start_block])


class Landed(enum.Enum):
    """What became of a chunk handed to :meth:`StagingArea.land`."""

    DROPPED = "dropped"  # its transfer failed or does not match: the caller keeps the buffer
    PARTIAL = "partial"
    COMPLETE = "complete"  # it was the transfer's last missing piece


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
                    entry = StagedKV(
                        h.tid, h.total_tokens, time.monotonic() + self._lease_s, link,
                        num_layers=h.num_layers, num_blocks=num_blocks, block_shape=h.block_shape, dtype=h.dtype,
                        pieces=[[] for _ in range(h.num_layers)], received=[0] * h.num_layers, nbytes=nbytes,
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

    def land(self, entry: StagedKV, h: Header, blocks: torch.Tensor, buffer: torch.Tensor) -> Landed:
        """Add chunk ``h``'s payload (``blocks``, held in pooled ``buffer``) to its entry and
        record that its layer's tokens up to ``tokens_end`` are in. On DROPPED (the entry failed
        meanwhile, or the chunk does not fit its layout, which fails it) the caller keeps
        ``buffer``; otherwise the entry owns it."""
        block_size = h.block_shape[1]
        with self._cond:
            if entry.failure is not None or entry.freed:
                return Landed.DROPPED
            if not entry.fits(h):
                entry.failure = "layout mismatch"
                self._free(entry)
                return Landed.DROPPED
            entry.pieces[h.layer].append(Piece(h.start_block, blocks, buffer))
            if h.start_block * block_size <= entry.received[h.layer]:
                entry.received[h.layer] = max(entry.received[h.layer], h.tokens_end)
            if entry.completed is None and entry.complete:
                entry.completed = time.monotonic()
                self._cond.notify_all()
                return Landed.COMPLETE
            return Landed.PARTIAL

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
            if entry is None or not entry.complete or entry.freed:
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
        self._entries[tid] = StagedKV(tid, 0, time.monotonic() + self._lease_s, link, failure=reason, freed=True)

    def _free(self, entry: StagedKV) -> None:
        """Give the entry's bytes back to the bound now, its buffers once nobody pins it."""
        if not entry.freed:
            entry.freed = True
            self._used -= entry.nbytes
            self._cond.notify_all()
        self._recycle(entry)

    def _unpin(self, entry: StagedKV) -> None:
        entry.pins -= 1
        self._recycle(entry)

    def _recycle(self, entry: StagedKV) -> None:
        if entry.pins == 0 and entry.freed:
            for layer in entry.pieces:
                for piece in layer:
                    self._pool.release(piece.buffer)
            entry.pieces = []
