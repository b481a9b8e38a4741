"""Transfer bookkeeping: per-transfer bytes, timing and outcome, plus failure counters.

:class:`TransferStats` is the plain-Python view (``snapshot()``), safe to update from the
sender/receiver threads. :class:`P2pKVConnectorStats` carries the records finished in one
interval through vLLM's stats path (worker -> scheduler -> stat loggers).
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "sent_transfers",
    "sent_bytes",
    "sent_wire_bytes",
    "encoded_transfers",
    "send_failures",
    "received_transfers",
    "received_bytes",
    "loaded_transfers",
    "load_failures",
    "handshakes",
    "handshake_failures",
    "link_failures",
    "staging_drops",
    "expired",
)


@dataclass
class SendRecord:
    """One prefill request's KV stream to one decode worker (times: ``time.monotonic()``)."""

    tid: str
    peer: str
    bytes: int = 0
    wire_bytes: int = 0  # bytes on the wire: fewer than ``bytes`` where chunks went encoded
    chunks: int = 0
    send_start: float | None = None  # first chunk handed to the backend
    send_end: float | None = None  # last chunk's send completed
    forward_end: float | None = None  # end of the prefill forward that computed the last chunk
    failure: str | None = None

    def finished(self) -> bool:
        return self.failure is not None or (self.send_end is not None and self.forward_end is not None)

    def summary(self) -> dict[str, Any]:
        """The record plus derived duration, bandwidth and overlap with the prefill forward."""
        out = asdict(self)
        if self.send_start is not None and self.send_end is not None:
            duration = max(self.send_end - self.send_start, 1e-9)
            out["duration_s"] = duration
            out["gib_per_s"] = self.bytes / duration / 2**30
            if self.forward_end is not None:
                overlap = max(0.0, min(self.send_end, self.forward_end) - self.send_start)
                out["overlap_s"] = overlap
                out["overlap_fraction"] = overlap / duration
                out["tail_after_forward_s"] = max(0.0, self.send_end - self.forward_end)
        return out


@dataclass
class TransferStats:
    """Counters and recent per-transfer records of one worker's connector."""

    max_records: int = 4096
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    _open: dict[str, SendRecord] = field(default_factory=dict)
    _landing: dict[str, list[float]] = field(default_factory=dict)  # tid -> [bytes, wire seconds]
    _records: collections.deque = field(default_factory=collections.deque)
    _interval: list[dict[str, Any]] = field(default_factory=list)
    _interval_failures: list[str] = field(default_factory=list)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n
            if name.endswith("failures") or name in ("staging_drops", "expired"):
                self._interval_failures.extend([name] * n)

    def chunk_sent(self, tid: str, peer: str, nbytes: int, wire_bytes: int, start: float, end: float, last: bool) -> None:
        """A chunk of ``nbytes`` of KV left as ``wire_bytes`` (fewer: it went encoded)."""
        with self._lock:
            rec = self._open.setdefault(tid, SendRecord(tid, peer))
            rec.bytes += nbytes
            rec.wire_bytes += wire_bytes
            rec.chunks += 1
            rec.send_start = start if rec.send_start is None else rec.send_start
            if last:
                rec.send_end = end
                self._counters["sent_transfers"] += 1
                self._counters["encoded_transfers"] += rec.wire_bytes < rec.bytes
            self._counters["sent_bytes"] += nbytes
            self._counters["sent_wire_bytes"] += wire_bytes
            self._maybe_close(rec)

    def forward_ended(self, tid: str, peer: str, when: float) -> None:
        with self._lock:
            rec = self._open.setdefault(tid, SendRecord(tid, peer))
            rec.forward_end = when
            self._maybe_close(rec)

    def send_failed(self, tid: str, peer: str, reason: str) -> None:
        with self._lock:
            rec = self._open.setdefault(tid, SendRecord(tid, peer))
            if rec.failure is None:
                rec.failure = reason
                self._counters["send_failures"] += 1
                self._interval_failures.append("send_failures")
            self._maybe_close(rec)

    def chunk_landed(self, tid: str, nbytes: int, wire_s: float, complete: bool) -> None:
        """Decode side: a message of ``tid`` arrived after ``wire_s`` on the link; the record
        (side ``landed``) is pushed when the transfer's last message is in."""
        with self._lock:
            self._counters["received_bytes"] += nbytes
            acc = self._landing.setdefault(tid, [0.0, 0.0])
            acc[0] += nbytes
            acc[1] += wire_s
            if complete:
                del self._landing[tid]
                self._push({"tid": tid, "side": "landed", "bytes": int(acc[0]), "wire_s": acc[1]})
            while len(self._landing) > self.max_records:  # transfers that failed midway
                del self._landing[next(iter(self._landing))]

    def received(self, tid: str, nbytes: int, duration_s: float, outcome: str) -> None:
        """A decode-side transfer ended: ``outcome`` is 'loaded' or the failure reason."""
        with self._lock:
            record = {"tid": tid, "side": "recv", "bytes": nbytes, "duration_s": duration_s, "outcome": outcome}
            self._push(record)

    def _maybe_close(self, rec: SendRecord) -> None:
        if rec.finished():
            del self._open[rec.tid]
            self._push({"side": "send", **rec.summary()})

    def _push(self, record: dict[str, Any]) -> None:
        self._records.append(record)
        while len(self._records) > self.max_records:
            self._records.popleft()
        self._interval.append(record)

    def drain_interval(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Records and failure names since the previous call (for vLLM's per-step stats)."""
        with self._lock:
            out = (self._interval, self._interval_failures)
            self._interval, self._interval_failures = [], []
            return out

    def snapshot(self) -> dict[str, Any]:
        """Counters, transfers still open, and the most recent finished records."""
        with self._lock:
            return {
                **self._counters,
                "open_transfers": len(self._open),
                "records": list(self._records),
                "time": time.monotonic(),
            }


@dataclass
class P2pKVConnectorStats(KVConnectorStats):
    """vLLM-side container: lists of finished transfer records and failure names."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"records": [], "failures": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in ("records", "failures"):
            self.data[key].extend(other.data.get(key, []))
        return self

    def is_empty(self) -> bool:
        return not self.data["records"] and not self.data["failures"]

    def clone_and_reset(self) -> P2pKVConnectorStats:
        old = copy.deepcopy(self)
        self.reset()
        return old

    def reduce(self) -> dict[str, int | float]:
        sends = [r for r in self.data["records"] if r["side"] == "send" and r.get("failure") is None]
        recvs = [r for r in self.data["records"] if r["side"] == "recv"]
        sent_bytes = sum(r["bytes"] for r in sends)
        send_time = sum(r.get("duration_s", 0.0) for r in sends)
        return {
            "Num sent transfers": len(sends),
            "Sent MiB": sent_bytes / 2**20,
            "Send throughput (MiB/s)": sent_bytes / 2**20 / send_time if send_time else 0.0,
            "Num loaded transfers": sum(r["outcome"] == "loaded" for r in recvs),
            "Num failed loads": sum(r["outcome"] != "loaded" for r in recvs),
            "Num failures": len(self.data["failures"]),
        }
