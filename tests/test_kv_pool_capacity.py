"""The host KV pool's capacity: the least recently used blocks go first, and a sweep never waits."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from duet.kv_transfer import pool_capacity


def _block(root: Path, name: str, size: int, used_at: float) -> Path:
    path = root / "model_r0" / name[:3] / f"{name}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    os.utime(path, (used_at, used_at))
    return path


def test_a_pool_past_its_capacity_evicts_its_least_recently_used_blocks(tmp_path: Path):
    blocks = [_block(tmp_path, f"b{i:03d}", 1000, used_at=1_000_000 + i) for i in range(10)]
    (tmp_path / "model_r0" / "config.json").write_text("{}")  # not a block: never counted or evicted
    stale, storing = tmp_path / "model_r0" / "b000.bin_123.tmp", tmp_path / "model_r0" / "b001.bin_456.tmp"
    stale.write_bytes(b"k" * 1000)  # left by an engine that died mid-store
    os.utime(stale, (1_000_000, 1_000_000))
    storing.write_bytes(b"k" * 1000)  # a store under way
    swept = pool_capacity.sweep(str(tmp_path), capacity_bytes=10_000)
    assert swept == pool_capacity.Sweep(bytes_held=10_000, blocks_held=10, blocks_evicted=0)  # at capacity: kept
    swept = pool_capacity.sweep(str(tmp_path), capacity_bytes=6_000)
    # Down to 90% of 6,000 bytes: the 5 oldest go, the 5 newest stay.
    assert swept == pool_capacity.Sweep(bytes_held=5_000, blocks_held=5, blocks_evicted=5)
    assert [block.exists() for block in blocks] == [False] * 5 + [True] * 5
    assert (tmp_path / "model_r0" / "config.json").exists()
    assert storing.exists() and not stale.exists()


def test_a_block_read_lately_outlives_older_writes(tmp_path: Path):
    first = _block(tmp_path, "first", 1000, used_at=1_000_000)
    second = _block(tmp_path, "second", 1000, used_at=1_000_001)
    pool_capacity.touch([str(first), str(tmp_path / "gone.bin")])  # a missing block is no error
    pool_capacity.sweep(str(tmp_path), capacity_bytes=1_500)
    assert first.exists() and not second.exists()


def test_a_sweep_under_way_elsewhere_is_skipped_not_waited_for(tmp_path: Path):
    _block(tmp_path, "b", 1000, used_at=1_000_000)
    with open(tmp_path / ".sweep.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine's sweep
        assert pool_capacity.sweep(str(tmp_path), capacity_bytes=10) is None
    assert pool_capacity.sweep(str(tmp_path), capacity_bytes=10).blocks_evicted == 1
