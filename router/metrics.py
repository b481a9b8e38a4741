"""duet's Prometheus endpoint: the router's request metrics plus every worker's vLLM metrics.

One scrape target per deployment: request outcomes and latencies as the client sees them
(``duet_*``, labelled with the model name each request asked for), and each worker's engine and
KV-transfer metrics (``vllm:*``, including ``vllm:nixl_*`` / ``vllm:p2p_*`` per-transfer
duration, bytes and failures), which each worker's engine front end in the router records,
labelled with ``worker`` and ``role``. With front doors apart, each front door records its own
requests' metrics and the control plane's endpoint gathers them at scrape time, labelled with
``front_door`` (a door's counters start again from zero when its process is replaced, which
Prometheus' ``rate`` reads as a reset).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from duet.router.pools import WORKER_STATES, WorkerPool

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Each front door's metrics text by its index (cluster/front_doors.py); a door that does not
# answer in time is left out of that scrape.
FrontDoorTexts = Callable[[], list[tuple[int, str]]]


class RouterMetrics:
    """Request-level metrics, recorded by the serving path of each front door. ``model_name``
    is the model name a request asked for: the model's, or one of its LoRA adapters' (empty for
    a request refused before its model was read)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "duet_requests",
            "Requests by outcome and model: served, failed, cancelled, invalid, overloaded, quota, unauthenticated, "
            "forbidden (a model the key may not use).",
            ["outcome", "model_name"],
            registry=registry,
        )
        self.inflight = Gauge("duet_requests_inflight", "Requests being served, by model.", ["model_name"], registry=registry)
        self.prefills = Counter(
            "duet_prefills",
            "Served requests by where their prompt was computed: prefill_pool, or decode_worker (conditional "
            "disaggregation, colocated serving). A hand-off that fell back to recomputing on the decode worker "
            "counts as prefill_pool: the prompt was computed there first.",
            ["where", "model_name"],
            registry=registry,
        )
        self.ttft = Histogram(
            "duet_ttft_seconds", "Time to first token at the router.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.tpot = Histogram(
            "duet_tpot_seconds", "Mean time per output token after the first.", ["model_name"], buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "duet_e2e_seconds", "Request latency, arrival to last token.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.images = Counter(
            "duet_images",
            "Images of requests to a model with an encode pool (E+P+D), by outcome: encoded (by the encode pool), "
            "cache_hit (its encoder output already in the encoder cache, or being written for another request), "
            "fallback (left to the prefill engine's encoder: no encode worker was ready, or it failed).",
            ["outcome", "model_name"],
            registry=registry,
        )
        self.migrations = Counter(
            "duet_migrations",
            "Requests that moved between decode workers (a drain, a scale-down, a death), by worker, direction "
            "(out: left it; in: continued on it) and method (kv: its KV pulled by the new worker; replay: its "
            "context recomputed there).",
            ["worker", "direction", "method"],
            registry=registry,
        )
        self.migration_stall = Histogram(
            "duet_migration_stall_seconds",
            "The gap each move left in its client's stream, from the last token before it to the first after, by method.",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.migration_phase = Histogram(
            "duet_migration_phase_seconds",
            "Where the stall of a move its source gave up went, by method and phase: give_up (from the last token "
            "to the source's answer), hand_off (the router sending the request on), resume (to the target's first "
            "token: its KV pull or recomputation, and its next step).",
            ["method", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


    def text(self) -> str:
        """These metrics in Prometheus' text format (a front door's answer to the control plane's scrape)."""
        return generate_latest(self.registry).decode()


class WorkerMetricsCollector(Collector):
    """Collects each ready worker's vLLM metrics when Prometheus scrapes."""

    def __init__(self, pools: list[WorkerPool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        yield self._worker_states()
        yield from merge_texts(self._texts())

    def _texts(self) -> Iterator[tuple[str, dict[str, str]]]:
        for pool in self.pools:
            for member in pool.members:
                if member.state != "ready":
                    continue
                try:
                    yield member.engine.metrics_text(), {"worker": member.name, "role": pool.role}
                except Exception as error:  # a dying worker must not break the scrape
                    logger.debug("no metrics from %s: %s", member.name, error)

    def _worker_states(self) -> Metric:
        """``duet_workers{role, state}``: how many workers of each pool are in each state."""
        family = Metric("duet_workers", "Workers by pool and state (starting, ready, draining, restarting, failed).", "gauge")
        for pool in self.pools:
            for state in WORKER_STATES:
                count = sum(1 for member in pool.members if member.state == state)
                family.add_sample("duet_workers", {"role": pool.role, "state": state}, count)
        return family


class FrontDoorMetricsCollector(Collector):
    """Collects every front door's request metrics when Prometheus scrapes, each sample
    labelled with its ``front_door`` index (front doors apart from the control plane)."""

    def __init__(self, front_doors: FrontDoorTexts) -> None:
        self.front_doors = front_doors

    def collect(self) -> Iterator[Metric]:
        yield from merge_texts((text, {"front_door": str(index)}) for index, text in self.front_doors())


def merge_texts(texts: Iterable[tuple[str, dict[str, str]]]) -> Iterator[Metric]:
    """Metric families from several processes' Prometheus texts, one family per name, each
    text's samples given its extra labels."""
    merged: dict[str, Metric] = {}
    for text, extra in texts:
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, **extra}, sample.value, sample.timestamp)
    yield from merged.values()


def start_metrics_server(
    host: str, port: int, pools: list[WorkerPool], front_doors: FrontDoorTexts | None = None
) -> tuple[CollectorRegistry, RouterMetrics | None, int, object]:
    """Serve ``/metrics``; returns the registry (for the autoscaler's metrics), this process's
    request metrics (None with ``front_doors``: the doors serve and record the requests, and
    their metrics are gathered from them), the bound port and the server."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry) if front_doors is None else None
    registry.register(WorkerMetricsCollector(pools))
    if front_doors is not None:
        registry.register(FrontDoorMetricsCollector(front_doors))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return registry, metrics, server.server_port, server
