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
from typing import Literal

CodecMode = Literal["auto", "on", "off"]
CODEC_MODES: tuple[CodecMode, ...] = ("auto", "on", "off")

# Encoding must save at least this share of the raw wire time to be chosen.
_MARGIN = 0.9
# Before the codec has run here: its ratio per KV element size, and bytes coded per second.
_FIRST_RATIO = {4: 4.0, 2: 2.0}
_FIRST_CODING_RATE = 300e6
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
    was. Linux's default socket buffer is at most 4 MiB (``net.ipv4.tcp_wmem``); a host tuned
    for larger buffers makes the rate read high, which errs towards sending raw.
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
            self.bytes_per_s = _smoothed(self.bytes_per_s, carried / seconds)
        self._mark = None


class CodecPolicy:
    """One sender's choice of encoding, per transfer, for one peer."""

    def __init__(self, mode: CodecMode, peer_host: str) -> None:
        self.mode = mode
        self.peer_is_local = is_local_address(peer_host)
        self.link = LinkRate()
        self._ratio: dict[int, float] = {}  # by KV element size
        self._coding_rate: float | None = None  # raw bytes encoded per second
        self._encoded_in_a_row = 0

    def encode_transfer(self, element_size: int) -> bool:
        """Whether a transfer of KV with ``element_size``-byte values goes encoded."""
        if self.mode != "auto":
            return self.mode == "on"
        rate = self.link.bytes_per_s
        if self.peer_is_local or rate is None or element_size not in _FIRST_RATIO:
            return False
        ratio = self._ratio.get(element_size, _FIRST_RATIO[element_size])
        coding = self._coding_rate or _FIRST_CODING_RATE
        # Per raw byte: the wire's time raw, against the wire's time encoded plus encoding and
        # decoding (taken as equally fast; they overlap the wire in practice, so this errs raw).
        if 1 / (ratio * rate) + 2 / coding >= _MARGIN / rate:
            return False
        self._encoded_in_a_row = (self._encoded_in_a_row + 1) % PROBE_EVERY
        return self._encoded_in_a_row != 0  # else: a raw probe of the link

    def encoded(self, element_size: int, raw_bytes: int, wire_bytes: int, seconds: float) -> None:
        """Record one encoded chunk: its size before and after, and how long encoding took."""
        self._ratio[element_size] = _smoothed(self._ratio.get(element_size), raw_bytes / max(wire_bytes, 1))
        if seconds > 0:
            self._coding_rate = _smoothed(self._coding_rate, raw_bytes / seconds)


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
