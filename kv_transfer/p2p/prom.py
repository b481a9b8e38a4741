"""Prometheus metrics of the p2p connector, recorded through vLLM's connector-metrics path.

vLLM hands each engine step's :class:`P2pKVConnectorStats` to the front end's Prometheus logger,
which calls :meth:`P2pPromMetrics.observe`; the metrics then live beside vLLM's own (and
NixlConnector's ``vllm:nixl_*``) in the worker process, with the same names' shape so that
duet reads both transports the same way (:mod:`duet.kv_transfer.metrics`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB .. 8 GiB, as NIXL's


class P2pPromMetrics(KVConnectorPromMetrics):
    """Per-transfer duration and bytes (both directions), and failures."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = [*labelnames, "direction"]
        self._seconds = self._histogram_cls(
            name="vllm:p2p_xfer_time_seconds",
            documentation="Duration of p2p KV transfers: first chunk to last (send) or load start to loaded (recv).",
            buckets=_SECONDS_BUCKETS,
            labelnames=labels,
        )
        self._bytes = self._histogram_cls(
            name="vllm:p2p_bytes_transferred",
            documentation="Bytes per p2p KV transfer.",
            buckets=_BYTES_BUCKETS,
            labelnames=labels,
        )
        # A transfer's duration also holds waits for layers still being computed, so the wire's
        # own share (decode side: each message from its send, or the previous arrival, to its
        # arrival) and the part left after the prefill forward ended (send side: what
        # layer-wise streaming did not hide) are kept apart.
        self._recv_wire = self._engine_histogram(
            "vllm:p2p_recv_wire_seconds",
            "Per p2p KV transfer, decode side: time the link was carrying its messages.",
        )
        self._send_exposed = self._engine_histogram(
            "vllm:p2p_send_exposed_seconds",
            "Per p2p KV transfer: from the end of the prefill forward to the last chunk sent.",
        )
        failed = self._counter_cls(
            name="vllm:p2p_num_failed_transfers",
            documentation="p2p KV transfers that failed (send error, timeout, dropped, expired lease).",
            labelnames=labelnames,
        )
        self._failed = create_metric_per_engine(failed, per_engine_labelvalues)
        # The codec's effect (codec.py): KV bytes sent (vllm:p2p_bytes_transferred, direction
        # send) against the bytes that went on the wire for them.
        self._wire_bytes = self._engine_counter(
            "vllm:p2p_sent_wire_bytes", "Bytes p2p KV transfers put on the wire (fewer than their KV where encoded)."
        )
        self._encoded = self._engine_counter("vllm:p2p_encoded_transfers", "p2p KV transfers sent encoded (codec.py).")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        # Sender-side and lease failures arrive as names; failed loads only as records.
        failures = len(transfer_stats_data.get("failures", []))
        for record in transfer_stats_data.get("records", []):
            direction = record["side"]
            if direction == "landed":
                self._recv_wire[engine_idx].observe(record["wire_s"])
                continue
            if direction == "recv" and record.get("outcome") != "loaded":
                failures += 1
            if record.get("failure") is not None or (direction == "recv" and record.get("outcome") != "loaded"):
                continue
            self._seconds.labels(*engine_labels, direction).observe(record.get("duration_s", 0.0))
            self._bytes.labels(*engine_labels, direction).observe(record["bytes"])
            if direction == "send":
                self._send_exposed[engine_idx].observe(record.get("tail_after_forward_s", 0.0))
                self._wire_bytes[engine_idx].inc(record["wire_bytes"])
                if record["wire_bytes"] < record["bytes"]:
                    self._encoded[engine_idx].inc()
        if failures:
            self._failed[engine_idx].inc(failures)

    def _engine_counter(self, name: str, documentation: str) -> dict:
        """A per-engine counter."""
        counter = self._counter_cls(name=name, documentation=documentation, labelnames=self._labelnames)
        return create_metric_per_engine(counter, self.per_engine_labelvalues)

    def _engine_histogram(self, name: str, documentation: str) -> dict:
        """A per-engine seconds histogram of transfers."""
        histogram = self._histogram_cls(
            name=name, documentation=documentation, buckets=_SECONDS_BUCKETS, labelnames=self._labelnames
        )
        return create_metric_per_engine(histogram, self.per_engine_labelvalues)
