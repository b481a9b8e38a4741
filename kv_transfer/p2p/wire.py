"""Message framing on a pairwise link: one uint8 message per chunk, header and payload together.

A message is :data:`HEADER_BYTES` of header (``HEADER_INTS`` int64 values that say what the
message holds) followed, for KV, by the payload. Header and payload travel in one send because
every point-to-point message costs a rendezvous with the receiving thread: sent apart, the
payload's send waited for the receiver to read the header and post a receive for the payload,
which put the 2-core machine's scheduling into every chunk (25% of a plain gloo send's
bandwidth). As one message, the receiver can keep a receive posted in advance into a buffer of
the largest message size (a gloo receive accepts a shorter message), and the sender never
waits for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

HEADER_INTS = 48
HEADER_BYTES = HEADER_INTS * 8
_MAGIC = 0x6475_6574  # "duet"
_FIXED = 15
_SENT_NS_INDEX = 13  # the header's int64 that :func:`stamp_sent` overwrites
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
    KV = 1  # a [num_blocks, *block_shape] payload of one layer follows the header
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
    sent_ns: int = 0  # time.monotonic_ns() when the message was handed to the link
    encoded_bytes: int = 0  # KV sent encoded (codec.py): the encoded payload's size; 0: raw

    def payload_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.block_shape)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.block_shape[0] * self.block_shape[1] * self.block_shape[2] * self.dtype.itemsize

    @property
    def wire_bytes(self) -> int:
        """Payload bytes on the wire: the encoded size, or the KV's own."""
        return self.encoded_bytes or self.payload_bytes

    @property
    def message_bytes(self) -> int:
        return HEADER_BYTES + self.wire_bytes

    def write_into(self, message: torch.Tensor) -> None:
        """Put the encoded header at the start of a uint8 ``message`` buffer."""
        message[:HEADER_BYTES].view(torch.int64).copy_(self.encode())

    @classmethod
    def read_from(cls, message: torch.Tensor) -> Header:
        return cls.decode(message[:HEADER_BYTES].view(torch.int64))

    def payload(self, message: torch.Tensor) -> torch.Tensor:
        """The ``[num_blocks, *block_shape]`` payload inside a raw message this header describes."""
        assert not self.encoded_bytes, "an encoded message's payload is read by codec.decode"
        raw = message[HEADER_BYTES : self.message_bytes]
        return raw.view(self.dtype).view(self.payload_shape())

    def encoded_payload(self, message: torch.Tensor) -> torch.Tensor:
        """The encoded payload (uint8) inside a message whose KV was sent encoded."""
        return message[HEADER_BYTES : self.message_bytes]

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
                self.sent_ns,
                self.encoded_bytes,
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
            sent_ns=v[_SENT_NS_INDEX],
            encoded_bytes=v[14],
        )


def stamp_sent(message: torch.Tensor, sent_ns: int) -> None:
    """Record in an encoded message when it is handed to the link, so the receiver can time the
    wire (both ends of a link share a host's monotonic clock on CPU; across hosts, see docs)."""
    start = _SENT_NS_INDEX * 8
    message[start : start + 8].view(torch.int64).fill_(sent_ns)


def control_message(header: Header, device: torch.device) -> torch.Tensor:
    """A header-only message (keepalive, abort, bye)."""
    return header.encode().view(torch.uint8).to(device)
