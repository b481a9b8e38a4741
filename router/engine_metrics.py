"""vLLM's own metrics for each worker engine whose front end runs in the router.

vLLM's ``PrometheusStatLogger`` registers every ``vllm:*`` metric in prometheus_client's global
registry, and unregisters all of them whenever another one is created: with one ``AsyncLLM``
per worker in the router process, each new worker would wipe the others' metrics. Each front
end therefore gets a logger class whose metrics live in a registry of its own (vLLM builds its
gauges, counters and histograms, the KV connector's included, through overridable class
attributes), and the router reads and exports each worker's registry separately.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Labels every sample of one engine shares; dropped when flattening for status reports.
_ENGINE_LABELS = ("model_name", "engine")


def registry_bound_stat_logger(registry: CollectorRegistry) -> type:
    """A ``PrometheusStatLogger`` class (vLLM takes loggers as classes) recording into ``registry``."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    metric_classes: dict[str, Any] = {
        "_gauge_cls": partial(Gauge, registry=registry),
        "_counter_cls": partial(Counter, registry=registry),
        "_histogram_cls": partial(Histogram, registry=registry),
    }
    # The logger's helpers (KV connector, speculative decoding, ...) build metrics the same way.
    helpers = {
        name: type(f"Worker{base.__name__}", (base,), metric_classes)
        for name in ("_kv_connector_cls", "_spec_decoding_cls", "_ec_connector_cls", "_perf_metrics_cls")
        if (base := getattr(PrometheusStatLogger, name, None)) is not None
    }
    return type("WorkerPrometheusStatLogger", (PrometheusStatLogger,), {**metric_classes, **helpers})


def read_engine_metrics(registry: CollectorRegistry, names: tuple[str, ...] = ()) -> dict[str, float]:
    """A worker's vLLM samples, and duet's own recorded inside its engine (``duet:*``, the host KV
    pool's), without buckets, keyed ``name{label=value}``; only those of
    ``names`` if given (the health ping reads two gauges every second, and collecting every
    histogram for them is wasted work)."""
    source = registry.restricted_registry(names) if names else registry
    values: dict[str, float] = {}
    for family in source.collect():
        for sample in family.samples:
            if not sample.name.startswith(("vllm:", "duet:")) or sample.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in _ENGINE_LABELS)
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values
