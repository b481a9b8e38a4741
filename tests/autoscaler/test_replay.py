"""The autoscaler against the simulated cluster on a simulated clock (SIMULATED engines:
DistServe's OPT-13B A100 profile; no model is computed)."""

from __future__ import annotations

import numpy as np
import pytest

from duet.cluster.autoscaler.capacity import CapacityModel
from duet.cluster.autoscaler.core import Autoscaler
from duet.cluster.autoscaler.policy import AutoscalePolicy
from duet.cluster.autoscaler.replay import replay
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import Trace
from duet.worker_runtime.simulated_engine import simulated_perf


def step_trace(rates: list[tuple[float, float]], seed: int = 0) -> Trace:
    """Poisson arrivals at each (rate, seconds) in turn; 800-token prompts, 100-token outputs."""
    rng = np.random.default_rng(seed)
    arrivals, start = [], 0.0
    for rate, seconds in rates:
        times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.5)))
        arrivals.append(start + times[times < seconds])
        start += seconds
    arrival = np.concatenate(arrivals)
    n = len(arrival)
    return Trace("step", arrival, np.full(n, 800), np.full(n, 100))


@pytest.fixture(scope="module")
def engine():
    return simulated_perf("distserve:opt-13b", 1, 1)


def test_a_load_step_is_followed_up_and_back_down_without_flapping(engine) -> None:
    perf, kv_bytes = engine
    policy = AutoscalePolicy.model_validate(
        dict(slo="chat", interval_s=10, prefill={"min": 1, "max": 32}, decode={"min": 1, "max": 32},
             startup_s=30, scale_down={"delay_s": 120, "step": 1})
    )
    trace = step_trace([(4, 300), (24, 300), (4, 900)])
    capacity = CapacityModel(perf, perf, policy.slo_profile(), policy.headroom)
    outage = (1000.0, 1300.0)
    result = replay(trace, Autoscaler(policy, capacity), perf, perf, int(kv_bytes), outage=outage)

    def active(t: float) -> int:
        return next(tick.active["prefill"] + tick.active["decode"] for tick in result.ticks if tick.time_s >= t)

    assert active(550) > active(250), "the step did not grow the cluster"
    assert active(1500) < active(550), "the cluster did not shrink after the step"
    slo = Slo(0.25, 0.1)
    assert result.result.attainment(slo) >= 0.9
    # No pool reverses direction more than twice for one step up and down.
    assert result.direction_changes("prefill") <= 2 and result.direction_changes("decode") <= 2
    # Nothing shrinks while the metrics are out, though the load is low.
    for role in ("prefill", "decode"):
        assert result.min_active_during(role, *outage) >= result.min_active_during(role, outage[0] - 10, outage[0])
    # Held units are paid for: more than the minimum, less than the peak throughout.
    peak = max(t.units_held for t in result.ticks)
    assert 2 * trace.duration_s < result.unit_seconds < peak * (trace.duration_s + 300)
