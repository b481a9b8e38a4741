"""The autoscaler driving a running deployment, on the wall clock.

Every ``interval_s`` it builds an :class:`Observation` from the serving path (the requests'
load since the last interval, of the one front door or summed over every front door,
:class:`LoadSource`), the pools' states, queued prompt tokens, the decode workers' KV usage from their health
reports), asks the :class:`Autoscaler` for targets, and carries them out through the pool
managers, the same calls as ``duet scale``: growing starts workers that join rotation once their
engines are ready; shrinking drains. Metrics count as stale when a ready worker's last health
report is older than the policy allows, and a failure to read them counts as missing: either way
the autoscaler holds every pool. Each decision that changes a pool is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from duet.cluster.autoscaler.capacity import CapacityModel
from duet.cluster.autoscaler.core import Autoscaler, Decision, Observation, PoolObservation
from duet.cluster.autoscaler.encode_pool import encode_decision
from duet.cluster.autoscaler.metrics import ModelAutoscalerMetrics
from duet.cluster.autoscaler.policy import ROLES, AutoscalePolicy
from duet.cluster.autoscaler.shared_budget import BudgetShare
from duet.router.load_meter import LoadWindow
from duet.router.pools import ScaleError, WorkerPool

logger = logging.getLogger(__name__)


class PoolOperator(Protocol):
    def scale(self, role: str, replicas: int) -> list[str]: ...


def capacity_model(policy: AutoscalePolicy) -> CapacityModel | None:
    """The latency model the policy names, as engine timings for each pool's parallelism."""
    if policy.latency_model is None:
        return None
    from duet.worker_runtime.simulated_engine import simulated_perf

    prefill, _ = simulated_perf(policy.latency_model, policy.prefill.tensor_parallel, policy.prefill.pipeline_parallel)
    decode, _ = simulated_perf(policy.latency_model, policy.decode.tensor_parallel, policy.decode.pipeline_parallel)
    return CapacityModel(prefill, decode, policy.slo_profile(), policy.headroom)


class LoadSource(Protocol):
    """The serving path's load since the last interval: a front door's
    :class:`~duet.router.load_meter.LoadMeter`, or every front door's (cluster/front_doors.py)."""

    async def sample(self, waiting_longer_than_s: float) -> tuple[LoadWindow, int]: ...


class LiveAutoscaler:
    def __init__(
        self,
        policy: AutoscalePolicy,
        pools: dict[str, WorkerPool],
        load: LoadSource,
        operator: PoolOperator,
        metrics: ModelAutoscalerMetrics | None = None,
        budget_left: Callable[[], BudgetShare] | None = None,
    ) -> None:
        """``budget_left``: the units this model's pools may hold now, when several models
        share a budget (cluster/deployment.py, shared_budget.py); None: the policy's budget alone."""
        self.autoscaler = Autoscaler(policy, capacity_model(policy))
        self.policy = policy
        self.pools = pools
        self.load = load
        self.operator = operator
        self.metrics = metrics
        self.budget_left = budget_left
        self.last: list[Decision] = []
        self._task: asyncio.Task[None] | None = None
        self._started = time.monotonic()
        self._last_tick = self._started

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="autoscaler")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                window, overdue = await self.load.sample(self.autoscaler.slo.ttft_s)
                self.tick(window, overdue)
            except Exception:  # the autoscaler must outlive any one bad interval
                logger.exception("autoscaler interval failed; pools left as they are")

    def tick(self, window: LoadWindow, ttft_overdue: int) -> list[Decision]:
        """One interval: observe (the serving path's ``window`` and its requests waiting past
        the TTFT target), decide, act. Returns the decisions."""
        now = time.monotonic()
        observation = self.observe(now, window, ttft_overdue)
        self._last_tick = now
        decisions = self.autoscaler.decide(observation)
        holding = not observation.fresh or observation.metrics_age_s > self.policy.stale_after_s
        if "encode" in self.pools and not holding:
            decisions.append(self._encode_decision(window, observation, decisions))
        for decision in decisions:
            if decision.direction != "hold":
                self._apply(decision)
        if self.metrics is not None:
            self.metrics.record(decisions, self.autoscaler.rate.predict(self.policy.startup_s), holding)
        self.last = decisions
        return decisions

    def observe(self, now: float, window: LoadWindow, ttft_overdue: int) -> Observation:
        slo = self.autoscaler.slo
        ttft_met = sum(1 for ttft in window.ttfts_s if ttft <= slo.ttft_s)
        tpot_met = sum(1 for tpot, _ in window.finished if tpot <= slo.tpot_s)
        share = self.budget_left() if self.budget_left is not None else None
        if self.metrics is not None:
            self.metrics.slo_outcomes("ttft", ttft_met, len(window.ttfts_s))
            self.metrics.slo_outcomes("tpot", tpot_met, len(window.finished))
        return Observation(
            time_s=now - self._started,
            window_s=max(now - self._last_tick, 1e-3),
            arrivals=window.arrivals,
            prompt_tokens=window.prompt_tokens,
            prompt_tokens_sq=window.prompt_tokens_sq,
            first_tokens=len(window.ttfts_s),
            ttft_met=ttft_met,
            finished=len(window.finished),
            output_tokens=sum(tokens for _, tokens in window.finished),
            tpot_met=tpot_met,
            ttft_overdue=ttft_overdue,
            pools={role: _pool_observation(self.pools[role]) for role in ROLES},  # the encode pool is sized apart
            metrics_age_s=self._metrics_age(now),
            budget_units=None if share is None else max(0, share.units),
            budget_to="" if share is None else share.to_model,
            other_units=len(self.pools["encode"].active()) if "encode" in self.pools else 0,
        )

    def _encode_decision(self, window: LoadWindow, observation: Observation, decisions: list[Decision]) -> Decision:
        """The encode pool's size, within what the budgets leave once prefill and decode have
        the sizes just decided and the units they wanted beyond them (``Autoscaler.asked``: they
        were sized within the budget less the encode workers, which give them back)."""
        active = len(self.pools["encode"].active())
        budgets = [b for b in (self.policy.budget, observation.budget_units) if b is not None]
        room = None
        if budgets:
            wanted = sum(d.target * self.policy.limits(d.role).units for d in decisions) + self.autoscaler.asked
            room = min(budgets) - wanted
        return encode_decision(
            self.policy.encode, active, window.encode_wait_s, window.image_fallbacks, observation.window_s, room
        )

    def _metrics_age(self, now: float) -> float:
        """Age of the oldest health report among ready workers (their KV usage and load)."""
        ages = [
            now - (member.reported_at if member.reported_at is not None else now)
            for pool in self.pools.values()
            for member in pool.members
            if member.state == "ready"
        ]
        return max(ages, default=0.0)

    def _apply(self, decision: Decision) -> None:
        try:
            done = self.operator.scale(decision.role, decision.target)
        except ScaleError as error:
            logger.warning("autoscaler: %s %d -> %d not done: %s", decision.role, decision.current, decision.target, error)
            return
        logger.info(
            "autoscaler: %s %d -> %d (%s): %s", decision.role, decision.current, decision.target, decision.reason, "; ".join(done)
        )


def _pool_observation(pool: WorkerPool) -> PoolObservation:
    ready = pool.ready()
    return PoolObservation(
        ready=len(ready),
        starting=sum(1 for m in pool.members if m.state in ("starting", "restarting")),
        draining=sum(1 for m in pool.members if m.state == "draining"),
        # Prefill: prompt tokens routed and not yet done. Decode: requests the router handed a
        # worker that its engine is not running yet (waiting for KV room or the hand-off).
        queued=sum(m.outstanding_tokens if pool.role == "prefill" else max(m.inflight - m.running, 0) for m in ready),
        kv_usage=sum(m.kv_usage for m in ready) / len(ready) if ready else 0.0,
    )
