"""The host KV pool's capacity: the oldest blocks evicted once the pool's directory outgrows it.

vLLM's file-system tier writes one file per KV block and never deletes one; a missing file is a
miss (its lookup says so, and a load that finds it gone fails that block, which the engine
computes), so deleting files is always safe. Every engine on a host writes to the same directory,
so the capacity is the host's: whichever engine has written its share since its last sweep
sweeps the whole directory, under a lock the others skip rather than wait for (a pool at
capacity evicts; it never blocks a store). Loads touch the files they read, so the oldest
modification time is the least recently used block.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass

# A sweep brings the pool down to this share of its capacity, so the next is not due at once.
_LOW_WATER = 0.9
_BLOCK_SUFFIX = ".bin"
# A store writes a temporary file and renames it; one older than this was left by an engine that
# died mid-store, and is deleted.
_STALE_TEMPORARY_S = 60.0
_LOCK_NAME = ".sweep.lock"


@dataclass(frozen=True)
class Sweep:
    """One pass over a pool's directory: what it held after, and what it evicted."""

    bytes_held: int
    blocks_held: int
    blocks_evicted: int


def _blocks(root: str) -> list[tuple[float, int, str]]:
    """(modification time, size, path) of every block file under ``root``; files that vanish
    while being listed (another engine's sweep) are left out, and stale temporary files of a
    store that never finished are deleted."""
    found = []
    now = time.time()
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                if name.endswith(_BLOCK_SUFFIX):
                    status = os.stat(path)
                    found.append((status.st_mtime, status.st_size, path))
                elif name.endswith(".tmp") and now - os.stat(path).st_mtime > _STALE_TEMPORARY_S:
                    os.remove(path)
    return found


def sweep(root: str, capacity_bytes: int) -> Sweep | None:
    """Evict the least recently used blocks under ``root`` until it holds at most
    ``_LOW_WATER`` x ``capacity_bytes``, if it holds more than ``capacity_bytes``. None if another
    process is sweeping it now."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, _LOCK_NAME), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        blocks = _blocks(root)
        held = sum(size for _, size, _ in blocks)
        evicted = 0
        if held > capacity_bytes:
            blocks.sort()
            for _, size, path in blocks:
                if held <= _LOW_WATER * capacity_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                held -= size
                evicted += 1
        return Sweep(bytes_held=held, blocks_held=len(blocks) - evicted, blocks_evicted=evicted)


def touch(paths: list[str]) -> None:
    """Mark blocks as used now (a load hit): the sweep evicts by modification time."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
