"""Block-level access to one layer's paged KV cache.

vLLM hands connectors each layer's cache as a ``[num_blocks, ...]`` tensor, but how tokens are
packed inside a block is the attention backend's business (the CPU backend's packing is not
token-addressable through the logical view). Whole blocks are therefore the unit moved: a
block's bytes mean the same thing in two engines running the same backend.
"""

from __future__ import annotations

import torch


def block_span(start: int, end: int, block_size: int) -> tuple[int, int]:
    """Blocks [first, last) that hold tokens [start, end) of a request."""
    return start // block_size, -(-end // block_size)


def gather_into(view: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> None:
    """Copy the given blocks into ``out`` (``[len(block_ids), *view.shape[1:]]``, contiguous)."""
    torch.index_select(view, 0, torch.tensor(block_ids, dtype=torch.int64, device=view.device), out=out)


def scatter(view: torch.Tensor, block_ids: list[int], src: torch.Tensor) -> None:
    """Write ``src`` (``[len(block_ids), ...]``) into the given blocks."""
    view[torch.tensor(block_ids, dtype=torch.int64, device=view.device)] = src
