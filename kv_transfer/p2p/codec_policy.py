"""Whether a transfer is sent encoded: from the link's measured rate and the codec's measured cost.

The codec (codec.py) pays for itself only where the link is slow: each byte of KV costs
``1/rate`` on the wire raw, and ``1/(ratio*rate)`` plus its encoding and decoding when encoded.
A sender measures all three as it goes (:class:`LinkRate` for the wire, :class:`CodecPolicy` for
the ratio and the coding speed) and decides at each transfer's first chunk, so a link that
turns slow is followed from one transfer to the next. Encoded transfers are too small to show
the link's rate (see LinkRate), so while encoding, one transfer in :data:`PROBE_EVERY` goes raw
to measure it again: a link that turned fast is followed within that many transfers.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Literal

import torch

from duet.kv_transfer.p2p import codec

CodecMode = Literal["auto", "on", "off"]

# Encoding must save at least this share of the raw wire time to be chosen.
_MARGIN = 0.9
# Before the codec has run on real KV here: its ratio per KV element size.
_FIRST_RATIO = {4: 4.0, 2: 2.0}
_CALIBRATION_VALUES = 1 << 18  # 1 MiB of float32, coded once when a sender starts
_SMOOTHING = 0.5
PROBE_EVERY = 32


def _smoothed(previous: float | None, sample: float) -> float:
    return sample if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * sample


class LinkRate:
    """A link's rate in bytes per second, from the sender's completed sends.

    A send completes when its bytes are in the kernel's socket buffer, not on the wire, so the
    first ``buffer_bytes`` of a busy period complete at memory speed; after them each completion
    waits for the wire to drain as many bytes. A busy period (sends back to back) therefore
    yields a sample from its completions past ``buffer_bytes``, provided they carried at least
    ``sample_bytes``; shorter periods tell nothing about the link and leave the estimate as it
    was. The latest sample is the estimate (megabytes of back-to-back sends are a measurement,
    not noise to smooth, and a link that changed is followed at once). Linux's default socket
    buffer is at most 4 MiB (``net.ipv4.tcp_wmem``); a host tuned for larger buffers makes the
    rate read high, which errs towards sending raw.
    """

    def __init__(self, buffer_bytes: int = 4 << 20, sample_bytes: int = 4 << 20) -> None:
        self.bytes_per_s: float | None = None
        self._buffer_bytes = buffer_bytes
        self._sample_bytes = sample_bytes
        self._busy_bytes = 0
        self._mark: tuple[int, float] | None = None  # (busy bytes, time) when the buffer was full
        self._last = 0.0

    def busy(self) -> None:
        """A send was posted while none was in flight: a busy period starts."""
        self._busy_bytes, self._mark = 0, None

    def completed(self, wire_bytes: int, now: float) -> None:
        self._busy_bytes += wire_bytes
        self._last = now
        if self._mark is None and self._busy_bytes >= self._buffer_bytes:
            self._mark = (self._busy_bytes, now)

    def idle(self) -> None:
        """The last send in flight completed: the busy period's sample, if it has one."""
        if self._mark is None:
            return
        carried, seconds = self._busy_bytes - self._mark[0], self._last - self._mark[1]
        if carried >= self._sample_bytes and seconds > 0:
            self.bytes_per_s = carried / seconds
        self._mark = None


class CodecPolicy:
    """One sender's choice of encoding, per transfer, for one peer."""

    def __init__(self, mode: CodecMode, peer_host: str) -> None:
        self.mode = mode
        self.peer_is_local = is_local_address(peer_host)
        self.link = LinkRate()
        self._ratio: dict[int, float] = {}  # by KV element size
        self._encoded_in_a_row = 0
        # Seconds per raw byte to encode and to decode, measured here on synthetic values (the
        # decode side's host is taken to be as fast); encoding real KV then updates the first.
        self._encode_s_per_byte, self._decode_s_per_byte = 0.0, 0.0
        if mode == "auto" and not self.peer_is_local:
            self._encode_s_per_byte, self._decode_s_per_byte = _calibrate()

    def encode_transfer(self, element_size: int) -> bool:
        """Whether a transfer of KV with ``element_size``-byte values goes encoded."""
        if self.mode != "auto":
            return self.mode == "on"
        rate = self.link.bytes_per_s
        if self.peer_is_local or rate is None or element_size not in _FIRST_RATIO:
            return False
        ratio = self._ratio.get(element_size, _FIRST_RATIO[element_size])
        # Per raw byte: the wire's time raw, against the wire's time encoded plus encoding and
        # decoding (counted in full; they overlap the wire in practice, so this errs raw).
        if 1 / (ratio * rate) + self._encode_s_per_byte + self._decode_s_per_byte >= _MARGIN / rate:
            return False
        self._encoded_in_a_row = (self._encoded_in_a_row + 1) % PROBE_EVERY
        return self._encoded_in_a_row != 0  # else: a raw probe of the link

    def encoded(self, element_size: int, raw_bytes: int, wire_bytes: int, seconds: float) -> None:
        """Record one encoded chunk: its size before and after, and how long encoding took."""
        self._ratio[element_size] = _smoothed(self._ratio.get(element_size), raw_bytes / max(wire_bytes, 1))
        if seconds > 0:
            self._encode_s_per_byte = _smoothed(self._encode_s_per_byte or None, seconds / raw_bytes)


def _calibrate() -> tuple[float, float]:
    """Seconds per raw byte to encode and to decode, timed on 1 MiB of float32 (a few ms)."""
    values = torch.randn(_CALIBRATION_VALUES)
    raw_bytes = values.numel() * values.element_size()
    started = time.perf_counter()
    frame = codec.encode(values, 32)
    encoded = time.perf_counter()
    codec.decode(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 32, torch.empty_like(values))
    decoded = time.perf_counter()
    return (encoded - started) / raw_bytes, (decoded - encoded) / raw_bytes


def is_local_address(host: str) -> bool:
    """True where ``host`` is this machine (a loopback address or one of its interfaces'):
    within a host the codec costs more than it saves, so ``auto`` never encodes there."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    import psutil

    own = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
    return str(address) in own
