"""Reusable, already-touched byte buffers for messages and staged KV.

A fresh ``torch.empty`` of some MiB costs a page fault per 4 KiB page the first time it is
written, inside the very send or receive being timed: measured on the project's CPU machine, a
32 MiB transfer into fresh memory ran at 44% of a plain gloo send, into reused memory at 100%.
So both sides of the link draw their buffers from a :class:`BufferPool` that hands back memory
it has handed out before. Buffers come in size classes (eight per power of two, so at most 25%
unused) so that a freed buffer fits the next request of a similar size; the idle ones kept are
bounded in bytes.
"""

from __future__ import annotations

import collections
import threading

import torch

MIN_CLASS_BYTES = 64 << 10


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of the next power of two (at least
    :data:`MIN_CLASS_BYTES`)."""
    nbytes = max(nbytes, MIN_CLASS_BYTES)
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class BufferPool:
    """Thread-safe free lists of uint8 buffers on one device, per size class."""

    def __init__(self, device: torch.device, keep_bytes: int):
        self._device = device
        self._keep_bytes = keep_bytes
        self._idle: dict[int, collections.deque[torch.Tensor]] = collections.defaultdict(collections.deque)
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (a view of a possibly larger, reused one)."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._idle[cls]
            if free:
                self._idle_bytes -= cls
                return free.pop()[:nbytes]
        # First use of this memory: write it once here rather than in the transfer.
        return torch.zeros(cls, dtype=torch.uint8, device=self._device)[:nbytes]

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire`; kept for reuse while under the byte bound."""
        # The whole pooled buffer behind whatever view of it was handed out. (Not ``_base``:
        # views made under ``torch.inference_mode``, where vLLM's forward pass runs, have none.)
        cls = buffer.untyped_storage().nbytes()
        base = buffer.as_strided((cls,), (1,), 0)
        with self._lock:
            if self._idle_bytes + cls <= self._keep_bytes:
                self._idle[cls].append(base)
                self._idle_bytes += cls
