"""Goodput of one configuration: the highest rate at which it meets the SLO attainment target.

A configuration ("candidate") is a prefill replica, a decode replica (DistServe's algorithm 1
sizes each phase alone), a low node-affinity unit (prefill and decode segments sharing ``pp``
nodes, algorithm 2), or a colocated engine. Under conditional disaggregation (prompts shorter
than ``local_prefill_max_tokens`` prefilled on the decode side) a prefill candidate computes only
the longer prompts and a decode candidate prefills the shorter ones itself; goodputs are always
in requests of the whole trace per second, so pool sizes follow from the target rate alike. For a
trace with images, an encode worker is a candidate too (E+P+D), and so is a prefill replica whose
images an encode pool encodes (``encode_apart``), beside the one that encodes them itself (EP+D).
:func:`evaluate` finds its goodput by geometric bisection over the rate with the simulator, on
one trace rescaled to each rate.

Early stops: a probe simulation ends as soon as the SLO is lost; a candidate that cannot beat
the best found so far fails its first probe at that rate and is dropped after one simulation;
one that misses the SLO even unloaded is dropped after one. :func:`upper_bound` gives a
throughput bound used to order and prune candidates before any simulation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.latency_model import EnginePerf, LatencyModel, LatencyModelError, ServingPathCost
from duet.cluster.placement.plan import Plan, Pool
from duet.cluster.placement.simulator import (
    SimConfig,
    SimResult,
    Slo,
    simulate_colocated,
    simulate_conditional,
    simulate_disaggregated,
)
from duet.cluster.placement.trace import Trace

Kind = Literal["prefill", "decode", "unit", "colocated", "encode"]


@dataclass(frozen=True)
class Candidate:
    """One configuration to size. ``prefill``/``decode`` are (tp, replicas in the candidate); an
    encode worker's and a colocated engine's are in ``prefill``."""

    kind: Kind
    gpu_type: str
    pp: int
    prefill: tuple[int, int] = (0, 0)
    decode: tuple[int, int] = (0, 0)
    node_gpus: int = 0  # a unit is charged for whole nodes
    local_prefill_max_tokens: int = 0  # > 0: a phase of conditional disaggregation
    encode_apart: bool = False  # prefill only: its images are encoded by an encode pool (E+P+D)

    @property
    def group(self) -> tuple[Kind, int, bool]:
        """Candidates that compete for the same role (pruning and ranking compare within it)."""
        return self.kind, self.local_prefill_max_tokens, self.encode_apart

    @property
    def gpus(self) -> int:
        if self.kind == "unit":
            return self.pp * self.node_gpus
        return self.pp * (self.prefill[0] * self.prefill[1] + self.decode[0] * self.decode[1])

    def describe(self) -> str:
        if self.kind == "unit":
            (ptp, kp), (dtp, kd) = self.prefill, self.decode
            return (
                f"unit of {self.pp} {self.gpu_type} node(s): {kp} prefill x tp={ptp} + "
                f"{kd} decode x tp={dtp} per node, pp={self.pp}"
            )
        tp = self.prefill[0] or self.decode[0]
        threshold = self.local_prefill_max_tokens
        local = f", prompts < {threshold} prefilled on decode" if threshold else ""
        apart = ", images encoded by the encode pool" if self.encode_apart else ""
        return f"{self.kind} tp={tp} pp={self.pp} on {self.gpu_type}{local}{apart}"


@dataclass(frozen=True)
class SearchContext:
    """Everything a worker process needs to evaluate candidates (sent to it once)."""

    trace: Trace
    slo: Slo
    models: dict[str, LatencyModel]
    kv_bytes_per_token: int
    network_bytes_per_s: float
    nvlink_bytes_per_s: dict[str, float]
    sim: SimConfig = SimConfig()
    rel_tol: float = 0.04


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    status: Literal["ok", "infeasible", "below-best"]
    goodput_rps: float  # exact when ok; 0 when infeasible; an upper bound when below-best
    unloaded_ttft_s: float  # the attainment-quantile TTFT / TPOT with no queueing
    unloaded_tpot_s: float
    simulations: int


def phase_slo(cand: Candidate, slo: Slo) -> Slo:
    """Phase-alone candidates are judged on their own phase's target only, except a decode
    replica that prefills short prompts itself: it owns their TTFT too. An encode worker, like
    a prefill replica, is judged on the TTFT target alone: the two share it, which the whole
    plan's simulation checks, growing the pool whose wait makes up more of the misses
    (optimizer.py), as it does for prefill and decode."""
    if cand.kind == "decode" and cand.local_prefill_max_tokens:
        return slo
    return {"prefill": slo.only_ttft(), "encode": slo.only_ttft(), "decode": slo.only_tpot()}.get(cand.kind, slo)


@dataclass(frozen=True)
class Deployment:
    """Concrete engines to simulate: a candidate, or a whole plan's pools."""

    prefill: tuple[EnginePerf, ...]
    decode: tuple[EnginePerf, ...]
    transfer_bytes_per_s: float = math.inf
    colocated: bool = False
    serving_path: ServingPathCost = ServingPathCost()  # its CPU on these processors (CPU deployments)
    local_prefill_max_tokens: int = 0  # > 0: conditional disaggregation (decode prefills shorter prompts)
    encode: tuple[EnginePerf, ...] = ()  # an encode pool (E+P+D); its prefill engines then have no encoder


def deployment(ctx: SearchContext, cand: Candidate) -> Deployment:
    """KV moves over NVLink inside a unit (each TP rank sends its shard), else the network."""
    model = ctx.models[cand.gpu_type]
    (ptp, kp), (dtp, kd) = cand.prefill, cand.decode
    if cand.kind == "encode":
        return Deployment((), (), encode=(model.engine(ptp, 1),), serving_path=model.serving_path)
    if cand.kind == "unit":
        bandwidth = ctx.nvlink_bytes_per_s[cand.gpu_type] * min(ptp, dtp)
    else:
        bandwidth = ctx.network_bytes_per_s
    prefill = model.engine(ptp, cand.pp) if kp else None
    if prefill and cand.encode_apart:
        prefill = prefill.without_encoder()
    return Deployment(
        prefill=(prefill,) * kp if prefill else (),
        decode=(model.engine(dtp, cand.pp),) * kd if kd else (),
        transfer_bytes_per_s=bandwidth,
        colocated=cand.kind == "colocated",
        serving_path=model.serving_path,
        local_prefill_max_tokens=cand.local_prefill_max_tokens,
    )


def simulate(ctx: SearchContext, dep: Deployment, rate: float, slo: Slo | None) -> SimResult:
    """Run ``ctx.trace`` rescaled to ``rate`` through ``dep``."""
    trace = ctx.trace.at_rate(rate)
    if dep.colocated:
        return simulate_colocated(trace, dep.prefill, slo, ctx.sim, dep.serving_path)
    if dep.local_prefill_max_tokens:
        return simulate_conditional(
            trace,
            dep.prefill,
            dep.decode,
            ctx.kv_bytes_per_token,
            dep.local_prefill_max_tokens,
            dep.transfer_bytes_per_s,
            slo,
            ctx.sim,
            dep.serving_path,
            dep.encode,
        )
    return simulate_disaggregated(
        trace,
        dep.prefill,
        dep.decode,
        ctx.kv_bytes_per_token,
        dep.transfer_bytes_per_s,
        slo,
        ctx.sim,
        dep.serving_path,
        dep.encode,
    )


def upper_bound(ctx: SearchContext, cand: Candidate) -> float:
    """A throughput bound (req/s) that no SLO-meeting rate exceeds, up to the slack factor.

    Prefill: each request costs at least its ``b*len + c*len^2`` share of a batch, and ``pp``
    batches are in flight. Decode: mean-field continuous batching with the batch capped by KV
    room, ``max_num_seqs`` and the TPOT target. An engine that prefills some prompts and decodes
    every request pays both. Used only to order and prune; the bisection itself grows its upper
    end when a rate above the bound still passes.
    """
    dep = deployment(ctx, cand)
    pre, dec = dep.prefill, dep.decode
    inp = ctx.trace.input_len.astype(float)
    out = ctx.trace.output_len.astype(float)
    images = ctx.trace.images.astype(float) if ctx.trace.images is not None else np.zeros(len(inp))
    slack = 1.5

    def encode_ms(e: EnginePerf, prompts: np.ndarray) -> float:
        """Mean encoder ms per request of ``prompts``, the fixed cost spread over a full batch."""
        if e.encoder is None or not images[prompts].any():
            return 0.0
        a, b = e.encoder.coeffs
        mean = float(images[prompts].mean())
        per_batch = max(1.0, ctx.sim.prefill_max_batch_tokens / max(e.encoder.tokens_per_image * mean, 1.0))
        return b * mean + a / per_batch

    def prefill_rate(e: EnginePerf, prompts: np.ndarray) -> float:
        """Requests of the whole trace per second, when only ``prompts`` (a mask) cost prefill."""
        if not prompts.any():
            return math.inf
        lens = inp[prompts]
        a, b, c = e.prefill.coeffs
        per_batch = max(1.0, ctx.sim.prefill_max_batch_tokens / lens.mean())
        cost_ms = float(np.mean(b * lens + c * lens**2)) + a / per_batch + encode_ms(e, prompts)
        return slack * e.pp * 1000.0 / cost_ms / prompts.mean() if cost_ms > 0 else math.inf

    def decode_rate(e: EnginePerf) -> float:
        steps = float(np.mean(np.maximum(out - 1, 0)))
        if steps == 0:
            return math.inf
        ctx_len = float(np.mean(inp + out / 2))
        lane_cap = e.kv_capacity_tokens / float(np.mean(inp + out)) / e.pp
        n_max = max(1, int(min(lane_cap, ctx.sim.max_num_seqs / e.pp)))
        best = 0.0
        for n in range(1, n_max + 1):
            step_ms = e.decode.step_ms(n, n * ctx_len)
            if step_ms / 1000.0 > ctx.slo.tpot_s and n > 1:
                break
            best = max(best, n * 1000.0 / step_ms)
        return slack * e.pp * best / steps

    if cand.kind == "encode":
        with_images = images > 0
        cost_ms = encode_ms(dep.encode[0], with_images)
        return slack * 1000.0 / cost_ms / with_images.mean() if cost_ms > 0 else math.inf
    local = inp < (cand.local_prefill_max_tokens if cand.kind != "colocated" else math.inf)
    if cand.kind == "prefill":
        return prefill_rate(pre[0], ~local)
    if cand.kind == "decode":
        return 1.0 / (1.0 / prefill_rate(dec[0], local) + 1.0 / decode_rate(dec[0]))
    if cand.kind == "colocated":
        return 1.0 / (1.0 / prefill_rate(pre[0], local) + 1.0 / decode_rate(pre[0]))
    return min(len(pre) * prefill_rate(pre[0], ~local), len(dec) * decode_rate(dec[0]))


def max_rate(
    meets: Callable[[float], bool], lo: float, hi: float, rel_tol: float, max_doublings: int = 12
) -> float:
    """Largest rate in [lo, ...) with ``meets(rate)``, given ``meets(lo)`` holds.

    Geometric bisection: goodputs span orders of magnitude across configurations, so the
    tolerance is relative.
    """
    for _ in range(max_doublings):
        if not meets(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo
    while hi > lo * (1 + rel_tol):
        mid = math.sqrt(lo * hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def evaluate(ctx: SearchContext, cand: Candidate, floor_rps: float = 0.0) -> Evaluation:
    """Goodput of ``cand``; stops early once it is clear it cannot exceed ``floor_rps``."""
    slo = phase_slo(cand, ctx.slo)
    dep = deployment(ctx, cand)
    sims = 0

    def meets(rate: float) -> bool:
        nonlocal sims
        sims += 1
        return simulate(ctx, dep, rate, slo).meets(slo)

    bound = upper_bound(ctx, cand)
    lo = min(bound, 1e6) * 0.01
    unloaded = simulate(ctx, dep, lo, None)
    sims += 1
    q = slo.attainment * 100
    ttft_q = float(np.percentile(unloaded.ttft_s, q))
    tpot_q = float(np.percentile(unloaded.tpot_s, q))

    def result(status: str, goodput: float) -> Evaluation:
        return Evaluation(cand, status, goodput, ttft_q, tpot_q, sims)

    if not unloaded.meets(slo):
        return result("infeasible", 0.0)
    if floor_rps > lo:
        if not meets(floor_rps):
            return result("below-best", floor_rps)
        lo = floor_rps
    return result("ok", max_rate(meets, lo, max(bound, lo * 2), ctx.rel_tol))


def plan_deployment(plan: Plan, models: dict[str, LatencyModel]) -> Deployment:
    """The engines a plan deploys, for simulating the plan as written (``duet simulate``)."""

    def engines(pool: Pool | None, encoder: bool = True) -> tuple[EnginePerf, ...]:
        if pool is None:
            return ()
        engine = models[pool.gpu_type].engine(pool.tensor_parallel, pool.pipeline_parallel)
        return (engine if encoder else engine.without_encoder(),) * pool.replicas

    if plan.encode is not None and models[plan.encode.gpu_type].encoder is None:
        raise LatencyModelError(
            f"the plan has an encode pool, but the latency model of {plan.encode.gpu_type} has no image encoder: "
            "profile the vision-language model (`duet profile --model builtin-vl-large`, or its path)"
        )
    serving_path = ServingPathCost.heaviest([models[pool.gpu_type].serving_path for _, pool in plan.pools()])
    if plan.colocated is not None:
        return Deployment(engines(plan.colocated), (), colocated=True, serving_path=serving_path)
    assert plan.kv_transfer is not None  # the plan's own validation requires it here
    return Deployment(
        prefill=engines(plan.prefill, encoder=plan.encode is None),
        decode=engines(plan.decode),
        transfer_bytes_per_s=plan.kv_transfer.bandwidth_gbs * 1e9,
        serving_path=serving_path,
        local_prefill_max_tokens=plan.local_prefill_max_tokens,
        encode=engines(plan.encode),
    )


def plan_context(
    cluster: ClusterSpec, plan: Plan, trace: Trace, slo: Slo, sim: SimConfig = SimConfig()
) -> tuple[SearchContext, Deployment]:
    """What simulating ``plan`` as written on ``trace`` needs: its latency models, link, engines.

    ``duet simulate`` and the fidelity benchmark both predict a plan this way, so a measured run
    is compared with exactly what the command line would have said.
    """
    models = {t: cluster.latency_model(t) for t in {pool.gpu_type for _, pool in plan.pools()}}
    ctx = SearchContext(
        trace=trace,
        slo=slo,
        models=models,
        kv_bytes_per_token=cluster.model_spec.kv_bytes_per_token,
        network_bytes_per_s=cluster.network_gbs * 1e9,
        nvlink_bytes_per_s={},
        sim=sim,
    )
    return ctx, plan_deployment(plan, models)
