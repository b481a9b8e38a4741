"""The host KV pool's block files: each block comes back as it was stored, or not at all.

The files and buffers here are real; the engines' side (a corrupt block computed, not served,
with the same output) is tested in tests/test_colocated.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from duet.kv_transfer import pool_blocks

BLOCK = 4096


def _stored(tmp_path: Path, count: int) -> tuple[list[str], bytearray]:
    """``count`` distinct blocks stored under ``tmp_path``, and the buffer they came from."""
    source = bytearray(os.urandom(count * BLOCK))
    paths = [str(tmp_path / "model_r0" / f"{index:03x}" / f"{index}.bin") for index in range(count)]
    pool_blocks.store_blocks(paths, memoryview(source), [index * BLOCK for index in range(count)], BLOCK)
    return paths, source


def _load(paths: list[str], start: int = 0) -> bytearray:
    """Load ``paths`` into a fresh buffer (block i at offset i), from block ``start`` on."""
    target = bytearray(len(paths) * BLOCK)
    indices = range(start, len(paths))
    pool_blocks.load_blocks([paths[i] for i in indices], memoryview(target), [i * BLOCK for i in indices], BLOCK)
    return target


def test_blocks_load_as_they_were_stored_and_a_stored_block_is_not_rewritten(tmp_path: Path):
    paths, source = _stored(tmp_path, 4)
    assert all(os.path.getsize(path) == BLOCK + 4 for path in paths)  # the block and its CRC-32
    assert _load(paths) == source
    written_at = os.stat(paths[0]).st_mtime_ns
    pool_blocks.store_blocks(paths[:1], memoryview(bytearray(BLOCK)), [0], BLOCK)  # another engine, the same key
    assert os.stat(paths[0]).st_mtime_ns == written_at and _load(paths) == source
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "lengthened", "checksum"])
def test_a_damaged_block_fails_its_load_from_it_on_and_is_deleted(tmp_path: Path, damage: str):
    paths, _ = _stored(tmp_path, 4)
    victim = Path(paths[2])
    data = bytearray(victim.read_bytes())
    if damage == "bit flip":
        data[BLOCK // 2] ^= 0x10
    elif damage == "truncated":
        data = data[:BLOCK]
    elif damage == "lengthened":
        data += b"\0"
    else:
        data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(pool_blocks.BlockLoadError) as failed:
        _load(paths)
    assert (failed.value.num_succeeded, failed.value.corrupt) == (2, 1)  # blocks 0 and 1 were loaded
    assert not victim.exists() and all(Path(path).exists() for path in paths if path != str(victim))


def test_every_corrupt_block_of_a_failed_load_is_deleted_the_sound_ones_kept(tmp_path: Path):
    """The engine recomputes every block from the first failure on, and stores them again; a
    corrupt file left behind would be kept (a store skips existing files) and fail the next load."""
    paths, _ = _stored(tmp_path, 5)
    for index in (1, 3):
        with open(paths[index], "r+b") as block:
            block.write(b"\xff\xfe")
    with pytest.raises(pool_blocks.BlockLoadError) as failed:
        _load(paths)
    assert (failed.value.num_succeeded, failed.value.corrupt) == (1, 2)
    assert [Path(path).exists() for path in paths] == [True, False, True, False, True]


def test_a_block_evicted_since_its_lookup_fails_its_load_without_counting_as_corrupt(tmp_path: Path):
    paths, source = _stored(tmp_path, 3)
    os.remove(paths[1])
    with pytest.raises(pool_blocks.BlockLoadError) as failed:
        _load(paths)
    assert (failed.value.num_succeeded, failed.value.corrupt) == (1, 0)
    assert _load(paths, start=2)[2 * BLOCK:] == source[2 * BLOCK:]
