"""The autoscaler's Prometheus metrics, on the router's endpoint next to the request metrics.

Targets and decisions per pool (with the reason as a label, so a dashboard can say why a pool
grew), the forecast it planned for, whether it is holding for want of metrics, and the SLO it
keeps, so latency panels can draw the target lines and compute attainment:
``duet_slo_requests_total{model, phase, result}`` counts each first token against the TTFT
target and each finished request against the TPOT target. Every family is labelled by the
served model whose autoscaler it is (a deployment may serve several).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from duet.cluster.autoscaler.core import Decision
from duet.cluster.autoscaler.policy import SloProfile


class AutoscalerMetrics:
    """The metric families, one set per registry; each served model's autoscaler records under
    its own ``model`` label (:meth:`for_model`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.target = Gauge("duet_autoscaler_target_workers", "Workers the autoscaler wants per pool.", ["model", "role"], registry=registry)
        self.current = Gauge(
            "duet_autoscaler_current_workers", "Workers serving or starting per pool, as the autoscaler saw them.", ["model", "role"], registry=registry
        )
        self.decisions = Counter(
            "duet_autoscaler_decisions", "Resizes by pool, direction (up, down) and reason.", ["model", "role", "direction", "reason"], registry=registry
        )
        self.forecast = Gauge("duet_autoscaler_forecast_requests_per_second", "Arrival rate the autoscaler planned for.", ["model"], registry=registry)
        self.holding = Gauge("duet_autoscaler_holding", "1 while metrics are missing or stale and every pool is held.", ["model"], registry=registry)
        self.slo_target = Gauge("duet_slo_target_seconds", "The SLO's latency targets.", ["model", "metric"], registry=registry)
        self.slo_attainment_target = Gauge("duet_slo_attainment_target", "Share of requests that must meet the SLO.", ["model"], registry=registry)
        self.slo_requests = Counter(
            "duet_slo_requests", "First tokens against the TTFT target and finished requests against the TPOT target.",
            ["model", "phase", "result"], registry=registry,
        )

    def for_model(self, model: str, slo: SloProfile) -> "ModelAutoscalerMetrics":
        """What one model's autoscaler records, with its SLO's targets set."""
        self.slo_target.labels(model, "ttft").set(slo.ttft_s)
        self.slo_target.labels(model, "tpot").set(slo.tpot_s)
        self.slo_attainment_target.labels(model).set(slo.attainment)
        return ModelAutoscalerMetrics(self, model)


class ModelAutoscalerMetrics:
    def __init__(self, families: AutoscalerMetrics, model: str) -> None:
        self.families = families
        self.model = model

    def record(self, decisions: list[Decision], forecast: float, holding: bool) -> None:
        metrics, model = self.families, self.model
        metrics.forecast.labels(model).set(forecast)
        metrics.holding.labels(model).set(1 if holding else 0)
        for decision in decisions:
            metrics.target.labels(model, decision.role).set(decision.target)
            metrics.current.labels(model, decision.role).set(decision.current)
            if decision.direction != "hold":
                metrics.decisions.labels(model, decision.role, decision.direction, reason_kind(decision.reason)).inc()

    def slo_outcomes(self, phase: str, met: int, total: int) -> None:
        self.families.slo_requests.labels(self.model, phase, "met").inc(met)
        self.families.slo_requests.labels(self.model, phase, "missed").inc(total - met)


def reason_kind(reason: str) -> str:
    """A low-cardinality label for a decision's reason (the full text goes to the log)."""
    for kind in ("attainment", "waiting", "KV", "forecast", "no traffic", "budget", "encode"):
        if kind in reason:
            return {
                "attainment": "slo_missed", "waiting": "queue", "KV": "kv_full", "no traffic": "idle", "encode": "encode_load",
            }.get(kind, kind)
    return "other"
