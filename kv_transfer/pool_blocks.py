"""The host KV pool's block files: a block's bytes followed by their CRC-32.

vLLM's file-system tier stores a block's bytes alone and trusts them when it loads them back, so
a block that changed in between (a bit flip in host memory, a file another process wrote over,
a partial copy) would be served as the prefix's KV and silently alter the output. duet's pool
writes each block with its checksum and checks it on every load: a block that fails is deleted
and reported as not loaded, and the engine computes it (vLLM treats a failed load as a miss for
that block and the ones after it). A missing file fails the same way: another engine's sweep may
evict a block between the lookup that found it and the load.

CRC-32 from zlib: about 70 us per 512 KiB block here (zlib's folded CRC uses the CPU's carry-less
multiply), against the block's own copy of about the same; a cryptographic hash would cost 5x and
guards against nothing a pool on the host's own memory faces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib

logger = logging.getLogger(__name__)

_CHECKSUM = struct.Struct("<I")


class BlockLoadError(OSError):
    """A block could not be loaded; ``num_succeeded`` blocks before it were (vLLM's tier keeps
    those and recomputes the rest); ``corrupt`` of the job's blocks failed their check."""

    def __init__(self, message: str, num_succeeded: int, corrupt: int) -> None:
        super().__init__(message)
        self.num_succeeded = num_succeeded
        self.corrupt = corrupt


class CorruptBlock(ValueError):
    """A block file whose bytes do not match their checksum, or of the wrong length."""


def store_blocks(paths: list[str], view: memoryview, offsets: list[int], block_size: int) -> None:
    """Write ``view[offset:offset + block_size]`` to each path with its checksum, atomically (a
    temporary file renamed into place, so a reader sees a whole block or none). A block already
    in the pool is left as it is: another engine wrote the same prefix's KV."""
    data = view.cast("B")
    for path, offset in zip(paths, offsets):
        if os.path.exists(path):
            continue
        block = data[offset:offset + block_size]
        temporary = f"{path}_{os.getpid()}_{threading.get_native_id()}.tmp"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            descriptor = os.open(temporary, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                written = os.writev(descriptor, [block, _CHECKSUM.pack(zlib.crc32(block))])
            finally:
                os.close(descriptor)
            if written != block_size + _CHECKSUM.size:
                raise OSError(f"short write of {path}: {written} of {block_size + _CHECKSUM.size} bytes")
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise


def load_blocks(paths: list[str], view: memoryview, offsets: list[int], block_size: int) -> None:
    """Read each path's block into ``view[offset:offset + block_size]`` and check it; stop at
    the first that is missing or corrupt with :class:`BlockLoadError`. A corrupt block is
    deleted, and so is every other corrupt one of the job (the rest are read and checked then:
    a rare path): the engine recomputes them all, and its stores would otherwise skip the
    files that are still there."""
    data = view.cast("B")
    for index, (path, offset) in enumerate(zip(paths, offsets)):
        try:
            read_block(path, data[offset:offset + block_size])
        except CorruptBlock as error:
            # This block and the job's later ones, read again and deleted where they fail.
            corrupt = sum(_delete_if_corrupt(later, data[at:at + block_size]) for later, at in zip(paths[index:], offsets[index:]))
            logger.warning("KV pool: %s (%d corrupt block(s) in this load, deleted: the engine computes them)", error, corrupt)
            raise BlockLoadError(str(error), index, corrupt) from error
        except OSError as error:  # gone since its lookup (evicted), or unreadable
            raise BlockLoadError(f"{path}: {error}", index, corrupt=0) from error


def _delete_if_corrupt(path: str, block: memoryview) -> bool:
    """Check one block file (read into ``block``, which the engine does not use); delete it if
    it fails."""
    try:
        read_block(path, block)
    except CorruptBlock:
        with contextlib.suppress(OSError):
            os.remove(path)
        return True
    except OSError:
        return False
    return False


def read_block(path: str, block: memoryview) -> None:
    """Read one block file into ``block`` (exactly its length), checking its checksum."""
    checksum = bytearray(_CHECKSUM.size + 1)  # one byte more: a longer file is caught too
    descriptor = os.open(path, os.O_RDONLY)
    try:
        read = os.readv(descriptor, [block, checksum])
    finally:
        os.close(descriptor)
    if read != len(block) + _CHECKSUM.size:
        raise CorruptBlock(f"{path} holds {read} bytes, a block with its checksum is {len(block) + _CHECKSUM.size}")
    if _CHECKSUM.unpack_from(checksum)[0] != zlib.crc32(block):
        raise CorruptBlock(f"{path} does not match its checksum")
