"""How fast a running deployment's engines are now, against what its latency profile says.

On this shared machine the engines' speed drifts by a quarter within a minute and once by 60%
(docs/placement.md, "Twelfth run"), so a profile made before a replay can be that far off during
it, and the simulator's error at a point then mixes the model's error with the drift. A probe
separates the two. With nothing else in flight, it sends the deployment two small fixed
workloads: prompts prefilled one at a time (``PREFILL_PROBE``), then one batch decoding together
(``DECODE_PROBE``). The simulator predicts the same requests with the same plan and profile. The
ratios of measured to predicted TTFT and TPOT say how much slower each phase runs now than the
profile says; :meth:`LatencyModel.scaled` applies them. They come from the engines' timing on
fixed work, never from a trace's attainment.

    factors = probe_speed("127.0.0.1:50051", model, cluster, plan, sim, seed=7)
    now = LatencyModel.load(profile).scaled(factors.prefill, factors.decode)
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import numpy as np

from duet.benchmarks.loadgen import replay
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.goodput import plan_context, simulate
from duet.cluster.placement.plan import Plan
from duet.cluster.placement.simulator import SimConfig, SimResult, Slo
from duet.cluster.placement.trace import Trace

# Prompts of the lengths where the slices' prefill work lies (half the Azure conversation
# prompts are longer than 1,000 tokens), 0.8 s apart: each is prefilled alone. Eight of them,
# because one prompt's time moves by several percent from the next on this machine.
PREFILL_PROBE = Trace(
    name="speed-probe-prefill",
    arrival_s=0.8 * np.arange(8, dtype=float),
    input_len=np.array([600, 1200, 1800, 1200] * 2),
    output_len=np.ones(8, dtype=np.int64),
)
# Eight requests at once, prefilled in one step and then decoded together for 63 steps.
DECODE_PROBE = Trace(
    name="speed-probe-decode",
    arrival_s=np.zeros(8),
    input_len=np.full(8, 256),
    output_len=np.full(8, 64),
)
_ANY_SLO = Slo(1.0, 1.0)  # the simulator needs one; the probe reads latencies, not attainment


@dataclass(frozen=True)
class SpeedFactors:
    """Measured over predicted time of each phase on the probe (1.0: as fast as profiled)."""

    prefill: float
    decode: float

    @staticmethod
    def between(before: SpeedFactors, after: SpeedFactors) -> SpeedFactors:
        """The speed during a replay made between two probes: their geometric mean."""
        return SpeedFactors(math.sqrt(before.prefill * after.prefill), math.sqrt(before.decode * after.decode))


def simulated(cluster: ClusterSpec, plan: Plan, trace: Trace, sim: SimConfig) -> SimResult:
    """The simulator's per-request answer for ``trace`` exactly as timed (not rescaled)."""
    ctx, deployment = plan_context(cluster, plan, trace, _ANY_SLO, sim)
    rate = trace.mean_rate if math.isfinite(trace.mean_rate) else 1.0  # at its own rate: unchanged
    return simulate(ctx, deployment, rate, None)


def median_ratio(measured: list[float], predicted: np.ndarray) -> float:
    return float(np.median(np.asarray(measured) / predicted))


@dataclass(frozen=True)
class ProbeRecords:
    """What the deployment measured (at the router) for each probe request."""

    prefill_ttft_s: list[float]
    decode_tpot_s: list[float]


def run_probes(target: str, model: str, seed: int) -> ProbeRecords:
    """Send both probes to the deployment at ``target``, one after the other, with new prompts
    from ``seed`` (the prefix cache serves none of them)."""
    prefill = asyncio.run(replay(target, PREFILL_PROBE, model=model, seed=seed))
    decode = asyncio.run(replay(target, DECODE_PROBE, model=model, seed=seed + 1_000_000))
    failed = [r.error for r in prefill + decode if r.error]
    if failed:
        raise RuntimeError(f"speed probe: {len(failed)} requests failed ({failed[0]})")
    return ProbeRecords([r.ttft_s for r in prefill], [r.tpot_s for r in decode])


def speed_factors(records: ProbeRecords, cluster: ClusterSpec, plan: Plan, sim: SimConfig) -> SpeedFactors:
    """Measured over predicted, per phase: the median over the probe's requests."""
    return SpeedFactors(
        prefill=median_ratio(records.prefill_ttft_s, simulated(cluster, plan, PREFILL_PROBE, sim).ttft_s),
        decode=median_ratio(records.decode_tpot_s, simulated(cluster, plan, DECODE_PROBE, sim).tpot_s),
    )


def probe_speed(target: str, model: str, cluster: ClusterSpec, plan: Plan, sim: SimConfig, seed: int) -> SpeedFactors:
    """How much slower than ``cluster``'s profile the deployment at ``target`` runs now."""
    return speed_factors(run_probes(target, model, seed), cluster, plan, sim)
