"""The Grafana dashboard queries only metrics duet actually exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from duet.cluster.autoscaler.metrics import AutoscalerMetrics
from duet.cluster.autoscaler.policy import load_slo
from duet.router.metrics import RouterMetrics, WorkerMetricsCollector

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "duet.json"


def exported_samples() -> set[str]:
    registry = CollectorRegistry()
    RouterMetrics(registry)
    AutoscalerMetrics(registry).for_model("duet-tiny-llama", load_slo("chat"))
    registry.register(WorkerMetricsCollector([]))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    # Families with labels have no samples until a label set is used: name them by type.
    return {family.name + suffix for family in registry.collect() for suffix in suffixes.get(family.type, ("",))}


def test_every_duet_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 15
    queried = {name for expr in exprs for name in re.findall(r"\bduet_[a-z_]+", expr)}
    missing = queried - exported_samples()
    assert not missing, f"the dashboard queries metrics duet does not export: {sorted(missing)}"
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for topic in ("Load", "TTFT", "TPOT", "attainment", "Pool sizes", "Scaling decisions"):
        assert topic in titles
