"""Message framing on a pairwise link: a fixed-size int64 header, then (for KV) one payload.

Point-to-point receives need the size up front, so every message starts with a header of
:data:`HEADER_INTS` int64 values that says what (if anything) follows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

HEADER_INTS = 48
_MAGIC = 0x6475_6574  # "duet"
_FIXED = 13
MAX_TID_BYTES = (HEADER_INTS - _FIXED) * 8

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


class Kind(enum.IntEnum):
    """What a header announces."""

    KEEPALIVE = 0  # nothing follows; proves the sender is alive
    KV = 1  # a [num_blocks, *block_shape] payload of one layer follows
    ABORT = 2  # the sender dropped data of this transfer: fail it now instead of timing out
    BYE = 3  # the sender closes the link


@dataclass(frozen=True)
class Header:
    """One decoded header; KV fields are zero for other kinds."""

    kind: Kind
    tid: str = ""
    layer: int = 0
    num_layers: int = 0
    start_block: int = 0  # index of the payload's first block within the request
    num_blocks: int = 0
    tokens_end: int = 0  # the request's tokens [0, tokens_end) are complete once this lands
    total_tokens: int = 0
    block_shape: tuple[int, int, int] = (0, 0, 0)
    dtype: torch.dtype = torch.float32

    def payload_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.block_shape)

    def encode(self) -> torch.Tensor:
        raw = self.tid.encode()
        if len(raw) > MAX_TID_BYTES:
            raise ValueError(f"transfer id longer than {MAX_TID_BYTES} bytes: {self.tid!r}")
        out = torch.zeros(HEADER_INTS, dtype=torch.int64)
        out[:_FIXED] = torch.tensor(
            [
                _MAGIC,
                int(self.kind),
                self.layer,
                self.num_layers,
                self.start_block,
                self.num_blocks,
                self.tokens_end,
                self.total_tokens,
                *self.block_shape,
                _DTYPES.index(self.dtype),
                len(raw),
            ],
            dtype=torch.int64,
        )
        padded = raw.ljust(MAX_TID_BYTES, b"\0")
        out[_FIXED:] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
        return out

    @classmethod
    def decode(cls, t: torch.Tensor) -> Header:
        v = t.cpu().tolist()
        if v[0] != _MAGIC:
            raise ValueError("bad header magic: the link is out of step")
        raw = t[_FIXED:].cpu().numpy().tobytes()[: v[12]]
        return cls(
            kind=Kind(v[1]),
            tid=raw.decode(),
            layer=v[2],
            num_layers=v[3],
            start_block=v[4],
            num_blocks=v[5],
            tokens_end=v[6],
            total_tokens=v[7],
            block_shape=(v[8], v[9], v[10]),
            dtype=_DTYPES[v[11]],
        )


def empty_header(device: torch.device) -> torch.Tensor:
    """A receive buffer for one header."""
    return torch.empty(HEADER_INTS, dtype=torch.int64, device=device)
