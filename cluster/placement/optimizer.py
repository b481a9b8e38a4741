"""SLO-driven sizing and placement: disaggregated, conditional or colocated, whichever needs least.

* High node-affinity (DistServe algorithm 1): prefill and decode are sized apart, each with a
  free choice of tensor and pipeline parallelism and, as in Splitwise, of GPU type; the best
  goodput per objective unit (GPU, $/h or W) wins per phase, and replicas follow from the target
  rate. KV moves over the inter-node network.
* Low node-affinity (algorithm 2): a unit is ``pp`` whole nodes; stage ``s`` of every prefill
  and decode segment of the unit sits on the unit's node ``s``, so KV moves over NVLink. Units
  are simulated whole and replicated.
* Conditional disaggregation: prompts shorter than a threshold are prefilled by the decode
  replica (no KV transfer, the colocated interference), longer ones by a prefill pool sized,
  like high affinity, for those prompts alone.
* Colocated: replicas of engines that run whole requests.
* Images (a vision-language model's trace): disaggregated and conditional deployments are sized
  twice, with the prefill engines encoding their prompts' images (EP+D) and with an encode pool
  of its own (E+P+D), its workers sized alone like a phase and checked with the whole plan.

Each deployment mode is sized for the target rate, and the one whose resources (GPUs, $/h or
W: the objective) are fewest wins; the explanation lists what every mode needed.

Candidates are evaluated in parallel processes, best throughput bound first; a candidate whose
bound cannot beat the best goodput found is never simulated, and one that falls below it stops
after one probe (see goodput.py). The chosen sizes are then checked by simulating the whole
plan at the target rate, and grown if the phases together miss the attainment target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

import numpy as np

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.goodput import (
    Candidate,
    Deployment,
    Evaluation,
    SearchContext,
    deployment,
    evaluate,
    max_rate,
    simulate,
    upper_bound,
)
from duet.cluster.placement.latency_model import ServingPathCost
from duet.cluster.placement.placer import Inventory, PlacementError
from duet.cluster.placement.plan import (
    Expected,
    KvTransfer,
    Mode,
    Plan,
    Pool,
    ReplicaPlacement,
    SearchStats,
    SloSpec,
)
from duet.cluster.placement.simulator import SimConfig, SimResult, Slo
from duet.cluster.placement.trace import Trace

Objective = Literal["gpus", "cost", "power"]
Algorithm = Literal["high-affinity", "low-affinity", "both"]
MODES: tuple[Mode, ...] = ("disaggregated", "colocated", "conditional")
# Conditional disaggregation's candidate thresholds (prompt tokens prefilled on the decode side):
# a few powers of two around typical chat prompts; the router takes any value.
LOCAL_PREFILL_THRESHOLDS = (128, 256, 512, 1024)


class InfeasibleError(ValueError):
    """No plan meets the request; the message says what fails and the closest feasible option.

    Callers that act on the answer read it as data: ``closest_rate_rps`` is the most req/s the
    closest option serves within the cluster (None where no rate would do, e.g. an SLO no
    configuration meets even unloaded), and ``options`` holds, when every deployment compared
    failed, each one's own error by its name ("colocated", "conditional (threshold 512)", ...).
    """

    def __init__(self, message: str, closest_rate_rps: float | None = None, options: dict[str, InfeasibleError] | None = None) -> None:
        super().__init__(message)
        self.closest_rate_rps = closest_rate_rps
        self.options = options or {}


def unit_costs(cluster: ClusterSpec, objective: Objective) -> dict[str, float]:
    """What one GPU of each type costs in the objective's unit."""
    costs = {}
    for name, gpu in cluster.gpu_types.items():
        value = {"gpus": 1.0, "cost": gpu.cost_per_hour, "power": gpu.power_watts}[objective]
        if value <= 0:
            field = {"cost": "cost_per_hour", "power": "power_watts"}[objective]
            raise InfeasibleError(
                f"objective {objective!r} needs gpu_types.{name}.{field} > 0 in the cluster config"
            )
        costs[name] = value
    return costs


def useful_thresholds(trace: Trace, thresholds: Iterable[int]) -> list[int]:
    """Thresholds that split ``trace``: with every prompt on one side, conditional is just
    colocated or disaggregated, which are sized as such."""
    return [t for t in thresholds if 0 < int((trace.input_len < t).sum()) < len(trace)]


def enumerate_candidates(
    cluster: ClusterSpec,
    ctx: SearchContext,
    algorithm: Algorithm,
    modes: Collection[Mode] = MODES,
    thresholds: Iterable[int] = (),
    encode_pool: bool = False,
) -> list[Candidate]:
    """Every configuration the modes may use. Engines that prefill and decode (colocated, and
    conditional's decode side) are pp=1 only: that is what the simulator models. With
    ``encode_pool`` (a trace with images), also encode workers (tp=1, as duet runs them) and
    prefill replicas whose images they encode."""
    nodes = cluster.node_list()
    out: list[Candidate] = []
    for gpu_type, model in ctx.models.items():
        per_node = cluster.gpus_per_node(gpu_type)
        node_count = sum(1 for n in nodes if n.gpu_type == gpu_type)
        shapes = [
            (tp, pp)
            for tp, pp in model.parallelisms(cluster.gpu_count(gpu_type))
            if tp <= per_node and pp <= node_count * per_node // tp
        ]
        tps = [tp for tp, pp in shapes if pp == 1]
        apart = (False, True) if encode_pool else (False,)
        if encode_pool and 1 in tps:
            out.append(Candidate("encode", gpu_type, 1, prefill=(1, 1)))
        if "disaggregated" in modes and algorithm in ("high-affinity", "both"):
            for tp, pp in shapes:
                out += [Candidate("prefill", gpu_type, pp, prefill=(tp, 1), encode_apart=a) for a in apart]
                out.append(Candidate("decode", gpu_type, pp, decode=(tp, 1)))
        if "disaggregated" in modes and algorithm in ("low-affinity", "both"):
            out += _units(gpu_type, shapes, per_node, node_count)
        if "colocated" in modes:
            out += [Candidate("colocated", gpu_type, 1, prefill=(tp, 1)) for tp in tps]
        if "conditional" in modes:
            for t in thresholds:
                out += [
                    Candidate("prefill", gpu_type, pp, prefill=(tp, 1), local_prefill_max_tokens=t, encode_apart=a)
                    for tp, pp in shapes for a in apart
                ]
                out += [Candidate("decode", gpu_type, 1, decode=(tp, 1), local_prefill_max_tokens=t) for tp in tps]
    return out


def _units(
    gpu_type: str, shapes: list[tuple[int, int]], per_node: int, node_count: int
) -> Iterable[Candidate]:
    """Node fillings with k_p prefill and k_d decode segments that leave no room for another."""
    for pp in sorted({pp for _, pp in shapes if pp <= node_count}):
        tps = sorted(tp for tp, p in shapes if p == pp)
        for ptp in tps:
            for dtp in tps:
                for kp in range(1, per_node // ptp + 1):
                    kd = (per_node - kp * ptp) // dtp
                    if kd < 1 or (per_node - kp * ptp - kd * dtp) >= ptp:
                        continue
                    yield Candidate("unit", gpu_type, pp, (ptp, kp), (dtp, kd), node_gpus=per_node)


# ---- parallel search with pruning ----

_WORKER_CTX: SearchContext | None = None


def _init_worker(ctx: SearchContext) -> None:
    global _WORKER_CTX
    _WORKER_CTX = ctx


def _evaluate_task(cand: Candidate, floor: float) -> Evaluation:
    assert _WORKER_CTX is not None
    return evaluate(_WORKER_CTX, cand, floor)


class _InlineExecutor:
    """The executor interface, run in this process: for one worker, tests and debugging."""

    def __init__(self, ctx: SearchContext) -> None:
        _init_worker(ctx)

    def submit(self, fn: Callable, *args: object) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self) -> _InlineExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class SearchOutcome:
    evaluations: list[Evaluation]
    pruned: int
    simulations: int
    wall_s: float
    workers: int


def run_search(
    ctx: SearchContext, candidates: list[Candidate], costs: dict[str, float], workers: int, rate: float
) -> SearchOutcome:
    """Evaluate candidates, cheapest possible first; within a group, prune what cannot serve
    ``rate`` at most as cheaply as the best found so far.

    A configuration serving ``rate`` costs whole replicas, ``ceil(rate / goodput)`` of them, so at
    a low rate a small one with less goodput per GPU can still need the fewest GPUs: pruning by
    goodput per GPU alone would discard it.
    """
    start = time.perf_counter()
    per_unit = {c: c.gpus * costs[c.gpu_type] for c in candidates}

    def cost_at(cand: Candidate, goodput: float) -> float:
        return per_unit[cand] * max(1, math.ceil(rate / goodput)) if goodput > 0 else math.inf

    bound = {c: upper_bound(ctx, c) for c in candidates}
    queue = deque(sorted(candidates, key=lambda c: (cost_at(c, bound[c]), -bound[c] / per_unit[c])))
    best: dict[tuple[str, int], float] = defaultdict(lambda: math.inf)
    evaluations: list[Evaluation] = []
    pruned = 0
    executor = (
        ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(ctx,))
        if workers > 1
        else _InlineExecutor(ctx)
    )
    with executor:
        pending: dict[Future, Candidate] = {}
        while queue or pending:
            while queue and len(pending) < workers:
                cand = queue.popleft()
                least = best[cand.group]
                if cost_at(cand, bound[cand]) > least:
                    pruned += 1
                    continue
                # to cost no more than the best, serve the rate with the replicas it affords
                floor = 0.0 if math.isinf(least) else rate / math.floor(least / per_unit[cand] + 1e-9)
                pending[executor.submit(_evaluate_task, cand, floor)] = cand
            if not pending:
                continue
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                cand = pending.pop(future)
                ev = future.result()
                evaluations.append(ev)
                if ev.status == "ok":
                    best[cand.group] = min(best[cand.group], cost_at(cand, ev.goodput_rps))
    return SearchOutcome(
        evaluations=evaluations,
        pruned=pruned,
        simulations=sum(e.simulations for e in evaluations),
        wall_s=time.perf_counter() - start,
        workers=workers,
    )


# ---- from evaluations to plans ----


@dataclass(frozen=True)
class OptimizeResult:
    plan: Plan
    alternatives: list[Plan]  # what the other modes and algorithms would deploy, cheapest first
    search: SearchOutcome


@dataclass(frozen=True)
class _Sizing:
    """Pools before placement: which candidate(s), how many replicas.

    Colocated: ``prefill`` is the engine and ``n_prefill`` its replicas (``decode`` repeats it
    with ``n_decode`` 0), so costs and GPU needs add up alike for every mode.
    """

    algorithm: Literal["high-affinity", "low-affinity", "colocated"]
    prefill: Evaluation
    decode: Evaluation
    n_prefill: int
    n_decode: int
    units: int = 0  # low affinity only
    local_prefill_max_tokens: int = 0  # conditional only
    encode: Evaluation | None = None  # E+P+D only: the encode worker, and how many
    n_encode: int = 0

    @property
    def mode(self) -> Mode:
        if self.algorithm == "colocated":
            return "colocated"
        return "conditional" if self.local_prefill_max_tokens else "disaggregated"

    @property
    def gpus(self) -> int:
        if self.algorithm == "low-affinity":
            return self.prefill.candidate.gpus * self.units
        encode = self.encode.candidate.gpus * self.n_encode if self.encode else 0
        return self.prefill.candidate.gpus * self.n_prefill + self.decode.candidate.gpus * self.n_decode + encode


class _Planner:
    def __init__(
        self,
        cluster: ClusterSpec,
        ctx: SearchContext,
        verify_trace: Trace,
        rate: float,
        objective: Objective,
        costs: dict[str, float],
    ) -> None:
        self.cluster, self.ctx, self.rate, self.objective, self.costs = (
            cluster, ctx, rate, objective, costs
        )
        self.verify_ctx = dataclasses.replace(ctx, trace=verify_trace)

    def _ranked(self, evals: list[Evaluation], group: tuple[str, int, bool]) -> list[Evaluation]:
        ok = [e for e in evals if e.status == "ok" and e.candidate.group == group]
        return sorted(ok, key=lambda e: -e.goodput_rps / self._cost(e.candidate, 1))

    def _cost(self, cand: Candidate, count: int) -> float:
        return cand.gpus * count * self.costs[cand.gpu_type]

    def _fits(self, need: dict[str, int]) -> bool:
        return all(n <= self.cluster.gpu_count(t) for t, n in need.items())

    def _need(self, pools: list[Evaluation], counts: list[int]) -> dict[str, int]:
        """GPUs of each type that ``counts[i]`` replicas of each of ``pools`` take."""
        need: dict[str, int] = defaultdict(int)
        for pool, count in zip(pools, counts):
            need[pool.candidate.gpu_type] += pool.candidate.gpus * count
        return need

    def _nodes_of(self, gpu_type: str) -> int:
        return sum(1 for n in self.cluster.node_list() if n.gpu_type == gpu_type)

    # -- high affinity (and conditional, which sizes its two pools the same way) --

    def size_high_affinity(self, evals: list[Evaluation], threshold: int = 0, encode_apart: bool = False) -> _Sizing:
        """Pools sized apart; with ``threshold`` > 0, conditional disaggregation's pools (prefill
        serving the prompts of ``threshold`` tokens or more, decode prefilling the others); with
        ``encode_apart``, an encode pool for the prefill pool's images (E+P+D)."""
        pre = self._ranked(evals, ("prefill", threshold, encode_apart))
        dec = self._ranked(evals, ("decode", threshold, False))
        self._require_feasible(evals, threshold, encode_apart, pre, dec)
        encode = [self._encode_pool(evals)] if encode_apart else []
        options = []
        for p in pre:
            for d in dec:
                pools = [p, d, *encode]
                counts = self._pool_sizes(pools, self.rate)
                if self._fits(self._need(pools, counts)):
                    options.append((sum(self._cost(e.candidate, n) for e, n in zip(pools, counts)), counts, p, d))
        if not options:
            raise self._over_budget_pools(pre, dec, encode)
        _, counts, p, d = min(options, key=lambda o: o[0])
        e, n_e = (encode[0], counts[2]) if encode else (None, 0)
        return _Sizing("high-affinity", p, d, counts[0], counts[1], local_prefill_max_tokens=threshold, encode=e, n_encode=n_e)

    def _encode_pool(self, evals: list[Evaluation]) -> Evaluation:
        """The encode worker that serves the target rate's images at the least cost."""
        ranked = self._ranked(evals, ("encode", 0, False))
        if not ranked:
            raise InfeasibleError(self._infeasible_message(evals, ("encode", 0, False)))
        return min(ranked, key=lambda e: self._cost(e.candidate, math.ceil(self.rate / e.goodput_rps)))

    def _deployment(self, s: _Sizing) -> tuple[Deployment, float]:
        """What to simulate for a sizing, and at what rate: one unit at its share for low
        affinity (units are independent behind a router that keeps KV in the unit), else all."""
        if s.algorithm == "low-affinity":
            return deployment(self.verify_ctx, s.prefill.candidate), self.rate / s.units
        pc, dc = s.prefill.candidate, s.decode.candidate
        model_p, model_d = self.ctx.models[pc.gpu_type], self.ctx.models[dc.gpu_type]
        if s.algorithm == "colocated":
            engines = (model_p.engine(pc.prefill[0], 1),) * s.n_prefill
            return Deployment(engines, (), colocated=True, serving_path=model_p.serving_path), self.rate
        prefill = model_p.engine(pc.prefill[0], pc.pp)
        encode: tuple = ()
        if s.encode is not None:
            prefill = prefill.without_encoder()
            encode = (self.ctx.models[s.encode.candidate.gpu_type].engine(1, 1),) * s.n_encode
        dep = Deployment(
            prefill=(prefill,) * s.n_prefill,
            decode=(model_d.engine(dc.decode[0], dc.pp),) * s.n_decode,
            transfer_bytes_per_s=self.ctx.network_bytes_per_s,
            serving_path=ServingPathCost.heaviest([model_p.serving_path, model_d.serving_path]),
            local_prefill_max_tokens=s.local_prefill_max_tokens,
            encode=encode,
        )
        return dep, self.rate

    def _grown(self, s: _Sizing, result: SimResult) -> _Sizing:
        """One growth step (about 10%) of the pool, or unit count, that misses more."""
        if s.algorithm == "low-affinity":
            units = s.units + math.ceil(0.1 * s.units)
            c = s.prefill.candidate
            return dataclasses.replace(s, units=units, n_prefill=c.prefill[1] * units, n_decode=c.decode[1] * units)
        if s.encode is not None and self._encode_misses_more(result):
            return dataclasses.replace(s, n_encode=s.n_encode + math.ceil(0.1 * s.n_encode))
        if s.algorithm == "colocated" or self._prefill_misses_more(s, result):
            return dataclasses.replace(s, n_prefill=s.n_prefill + math.ceil(0.1 * s.n_prefill))
        return dataclasses.replace(s, n_decode=s.n_decode + math.ceil(0.1 * s.n_decode))

    def _encode_misses_more(self, result: SimResult) -> bool:
        """Whether the requests over the TTFT target spent most of their TTFT waiting on the
        encode pool (so it, not prefill, is what to grow)."""
        late = result.ttft_s > self.ctx.slo.ttft_s
        if result.encode_wait_s is None or not late.any():
            return False
        wait = result.encode_wait_s[late]
        return float(np.mean(np.minimum(wait, result.ttft_s[late]))) > 0.5 * float(np.mean(result.ttft_s[late]))

    def _prefill_misses_more(self, s: _Sizing, result: SimResult) -> bool:
        """Whether the prefill pool meets its part of the SLO (TTFT of the prompts it computes)
        no better than the decode pool meets its own (every TPOT, and under conditional
        disaggregation the TTFT of the prompts the decode replicas compute themselves)."""
        slo = self.ctx.slo
        ttft_ok = result.ttft_s <= slo.ttft_s
        remote = self.verify_ctx.trace.input_len >= s.local_prefill_max_tokens
        decode_ok = (result.tpot_s <= slo.tpot_s) & (ttft_ok | remote)
        prefill_attainment = float(ttft_ok[remote].mean()) if remote.any() else 1.0
        return prefill_attainment <= float(decode_ok.mean())

    def _sizing_fits(self, s: _Sizing) -> bool:
        if s.algorithm == "low-affinity":
            c = s.prefill.candidate
            return s.units * c.pp <= self._nodes_of(c.gpu_type)
        pools = [s.prefill, s.decode, *([s.encode] if s.encode else [])]
        return self._fits(self._need(pools, [s.n_prefill, s.n_decode, s.n_encode]))

    def grow_until_met(self, s: _Sizing, rounds: int = 8) -> _Sizing:
        """Sizes from a short search trace can miss on the long verification trace (queues
        build slowly), and phases sized apart can miss the joint target: grow while they do."""
        for _ in range(rounds):
            dep, rate = self._deployment(s)
            result = simulate(self.verify_ctx, dep, rate, None)
            if result.attainment(self.ctx.slo) >= self.ctx.slo.attainment:
                break
            grown = self._grown(s, result)
            if not self._sizing_fits(grown):
                break
            s = grown
        return s

    def _pool_sizes(self, pools: list[Evaluation], rate: float) -> list[int]:
        return [math.ceil(rate / e.goodput_rps) for e in pools]

    def _max_rate_within_budget(self, pools: list[Evaluation]) -> float:
        """The highest rate whose pools of these configurations still fit the cluster."""
        def fits_at(rate: float) -> bool:
            return self._fits(self._need(pools, self._pool_sizes(pools, rate)))

        lo, hi = 0.0, self.rate
        if not fits_at(min(e.goodput_rps for e in pools)):
            return 0.0
        while hi - lo > self.rate * 1e-3:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
        return lo

    def _over_budget_pools(self, pre: list[Evaluation], dec: list[Evaluation], encode: list[Evaluation]) -> InfeasibleError:
        have = {t: self.cluster.gpu_count(t) for t in self.cluster.gpu_types}
        best_rate, pools = max(
            ((self._max_rate_within_budget(pools), pools) for p in pre for d in dec for pools in [[p, d, *encode]]),
            key=lambda x: x[0],
        )
        if best_rate == 0.0:
            phases = "prefill, decode and encode" if encode else "prefill and decode"
            return InfeasibleError(
                f"even one replica of each SLO-meeting {phases} configuration needs more "
                f"GPUs than the cluster has ({have}); the smallest prefill is "
                f"[{min(pre, key=lambda e: e.candidate.gpus).candidate.describe()}]. Add GPUs or relax the SLO."
            )
        counts = self._pool_sizes(pools, self.rate)
        needs = " + ".join(f"{n} x [{e.candidate.describe()}]" for e, n in zip(pools, counts))
        return InfeasibleError(
            f"target rate {self.rate:.3g} req/s needs {needs} = {sum(self._need(pools, counts).values())} GPUs, but "
            f"the cluster has {have}. Closest feasible: --rate {best_rate:.3g} (the most these pools "
            f"serve within the budget), or add GPUs.",
            closest_rate_rps=best_rate,
        )

    # -- replicated configurations: low affinity units, colocated engines --

    def size_low_affinity(self, evals: list[Evaluation]) -> _Sizing:
        units = self._ranked(evals, ("unit", 0, False))
        if not units:
            raise InfeasibleError(self._infeasible_message(evals, ("unit", 0, False)))
        u, count = self._cheapest_replicated(units, lambda c: self._nodes_of(c.gpu_type) // c.pp)
        c = u.candidate
        return _Sizing("low-affinity", u, u, c.prefill[1] * count, c.decode[1] * count, units=count)

    def size_colocated(self, evals: list[Evaluation]) -> _Sizing:
        engines = self._ranked(evals, ("colocated", 0, False))
        if not engines:
            raise InfeasibleError(self._infeasible_message(evals, ("colocated", 0, False)))
        e, count = self._cheapest_replicated(engines, lambda c: self.cluster.gpu_count(c.gpu_type) // c.gpus)
        return _Sizing("colocated", e, e, count, 0)

    def _cheapest_replicated(
        self, ranked: list[Evaluation], most: Callable[[Candidate], int]
    ) -> tuple[Evaluation, int]:
        """The cheapest of ``ranked`` replicated to the target rate, with at most
        ``most(candidate)`` copies in the cluster; else an error naming the closest rate."""
        options = []
        for e in ranked:
            count = math.ceil(self.rate / e.goodput_rps)
            if count <= most(e.candidate):
                options.append((self._cost(e.candidate, count), e, count))
        if not options:
            e = ranked[0]
            closest = most(e.candidate) * e.goodput_rps
            raise InfeasibleError(
                f"target rate {self.rate:.3g} req/s needs {math.ceil(self.rate / e.goodput_rps)} x "
                f"[{e.candidate.describe()}], but only {most(e.candidate)} fit. Closest feasible: --rate "
                f"{closest:.3g}, or add GPUs.",
                closest_rate_rps=closest,
            )
        _, e, count = min(options, key=lambda o: o[0])
        return e, count

    # -- shared --

    def _require_feasible(self, evals: list[Evaluation], threshold: int, encode_apart: bool, pre: list, dec: list) -> None:
        for group, ranked in ((("prefill", threshold, encode_apart), pre), (("decode", threshold, False), dec)):
            if not ranked:
                raise InfeasibleError(self._infeasible_message(evals, group))

    def _infeasible_message(self, evals: list[Evaluation], group: tuple[str, int, bool]) -> str:
        slo = self.ctx.slo
        kind, threshold, _ = group
        tried = [e for e in evals if e.candidate.group == group]
        if not tried:
            return f"no {kind} configuration fits the cluster's GPUs for {self.cluster.model}"
        pct = f"{slo.attainment:.0%}"
        headroom = 1.25  # the unloaded latency leaves no room for any queueing
        if kind in ("prefill", "encode"):
            best = min(tried, key=lambda e: e.unloaded_ttft_s)
            what = f"TTFT <= {slo.ttft_s:g} s"
            fix = f"ttft={_round_up(best.unloaded_ttft_s * headroom)},tpot={slo.tpot_s:g}"
            reach = f"TTFT {best.unloaded_ttft_s:.3g} s"
        elif kind == "decode" and not threshold:
            best = min(tried, key=lambda e: e.unloaded_tpot_s)
            what = f"TPOT <= {slo.tpot_s:g} s"
            fix = f"ttft={slo.ttft_s:g},tpot={_round_up(best.unloaded_tpot_s * headroom)}"
            reach = f"TPOT {best.unloaded_tpot_s:.3g} s"
        else:
            best = min(tried, key=lambda e: max(e.unloaded_ttft_s / slo.ttft_s, e.unloaded_tpot_s / slo.tpot_s))
            what = f"TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s"
            fix = (
                f"ttft={_round_up(max(best.unloaded_ttft_s * headroom, slo.ttft_s))},"
                f"tpot={_round_up(max(best.unloaded_tpot_s * headroom, slo.tpot_s))}"
            )
            reach = f"TTFT {best.unloaded_ttft_s:.3g} s, TPOT {best.unloaded_tpot_s:.3g} s"
        return (
            f"SLO infeasible: no {kind} configuration meets {what} for {pct} of requests even with "
            f"no queueing. The closest, [{best.candidate.describe()}], reaches {reach} at {pct}. "
            f"Closest feasible option (with {headroom - 1:.0%} headroom for queueing): "
            f"--slo {fix} --attainment {slo.attainment:g}"
        )

    def expected(self, s: _Sizing) -> tuple[Expected, str]:
        """Simulated outcome of the sized plan at the target rate, and its goodput."""
        slo = self.ctx.slo
        dep, per_rate = self._deployment(s)
        scale = s.units if s.algorithm == "low-affinity" else 1
        result: SimResult = simulate(self.verify_ctx, dep, per_rate, None)
        summary = result.summary(slo)

        def meets(rate: float) -> bool:
            return simulate(self.verify_ctx, dep, rate, slo).meets(slo)

        goodput = max_rate(meets, per_rate, per_rate * 1.25, self.ctx.rel_tol) if meets(per_rate) else 0.0
        exp = Expected(
            rate_rps=self.rate,
            attainment=summary["attainment"],
            ttft_attainment=summary["ttft_attainment"],
            tpot_attainment=summary["tpot_attainment"],
            ttft_p90_s=summary["ttft_p90_s"],
            tpot_p90_s=summary["tpot_p90_s"],
            goodput_rps=goodput * scale,
            goodput_per_gpu=goodput * scale / s.gpus,
        )
        return exp, ("" if goodput else "warning: the simulated plan misses the attainment target at this rate")

    def _placed(self, s: _Sizing) -> dict[str, Pool | KvTransfer]:
        """The plan's pools (and KV path) for a sizing, on concrete nodes and GPUs."""
        inv = Inventory(self.cluster)
        pc, dc = s.prefill.candidate, s.decode.candidate
        if s.algorithm == "colocated":
            return {"colocated": _pool(pc, pc.prefill[0], inv.place_pool(pc.gpu_type, pc.prefill[0], 1, s.n_prefill))}
        if s.algorithm == "low-affinity":
            p_place, d_place = inv.place_units(pc.gpu_type, pc.pp, pc.prefill, pc.decode, s.units)
            transfer = KvTransfer(
                path="nvlink",
                bandwidth_gbs=self.cluster.gpu_types[pc.gpu_type].nvlink_gbs * min(pc.prefill[0], pc.decode[0]),
            )
        else:
            pools = [("prefill", pc, s.n_prefill), ("decode", dc, s.n_decode)]
            if s.encode is not None:
                pools.append(("encode", s.encode.candidate, s.n_encode))
            order = sorted(pools, key=lambda x: -x[1].gpus)
            placed = {
                role: inv.place_pool(c.gpu_type, c.prefill[0] or c.decode[0], c.pp, n)
                for role, c, n in order
            }
            p_place, d_place = placed["prefill"], placed["decode"]
            transfer = KvTransfer(path="network", bandwidth_gbs=self.cluster.network_gbs)
        pools: dict[str, Pool | KvTransfer] = {
            "kv_transfer": transfer,
            "prefill": _pool(pc, pc.prefill[0], p_place),
            "decode": _pool(dc, dc.decode[0], d_place),
        }
        if s.encode is not None:
            pools["encode"] = _pool(s.encode.candidate, 1, placed["encode"])
        return pools

    def build(self, s: _Sizing, evals: list[Evaluation], outcome: SearchOutcome) -> Plan:
        try:
            placed = self._placed(s)
        except PlacementError as exc:
            raise InfeasibleError(f"pools do not fit the nodes: {exc}") from None
        expected, warning = self.expected(s)
        plan = Plan(
            model=self.cluster.model_spec.name,
            mode=s.mode,
            local_prefill_max_tokens=s.local_prefill_max_tokens,
            algorithm=None if s.algorithm == "colocated" else s.algorithm,
            objective=self.objective,
            slo=SloSpec(ttft_s=self.ctx.slo.ttft_s, tpot_s=self.ctx.slo.tpot_s, attainment=self.ctx.slo.attainment),
            **placed,
            expected=expected,
            search=SearchStats(
                configs_evaluated=len(outcome.evaluations),
                configs_pruned=outcome.pruned,
                simulations=outcome.simulations,
                wall_s=round(outcome.wall_s, 3),
                workers=outcome.workers,
            ),
        )
        lines = explain(s, evals, self.ctx.slo, self.verify_ctx.trace)
        return plan.model_copy(update={"explanation": lines + ([warning] if warning else [])})


def _pool(cand: Candidate, tp: int, placement: list[ReplicaPlacement]) -> Pool:
    return Pool(
        gpu_type=cand.gpu_type, tensor_parallel=tp, pipeline_parallel=cand.pp,
        replicas=len(placement), placement=placement,
    )


def _round_up(seconds: float) -> str:
    """A human SLO value just above ``seconds`` (two significant digits, rounded up)."""
    if seconds <= 0 or not math.isfinite(seconds):
        return f"{seconds:g}"
    scale = 10 ** (math.floor(math.log10(seconds)) - 1)
    return f"{math.ceil(seconds / scale - 1e-9) * scale:.3g}"


def explain(s: _Sizing, evals: list[Evaluation], slo: Slo, trace: Trace) -> list[str]:
    """Why these pools: per-phase numbers for the choice and its nearest alternatives."""
    if s.algorithm == "low-affinity":
        return _explain_units(s, evals)
    if s.algorithm == "colocated":
        return [
            f"colocated: {s.n_prefill} x {_describe(s.prefill, evals, slo, ('ttft', 'tpot'))}.",
            *(f"  vs {_describe(e, evals, slo, ('ttft', 'tpot'))}" for e in _alternatives(s.prefill, evals)),
        ]
    lines = _explain_threshold(s.local_prefill_max_tokens, trace) if s.local_prefill_max_tokens else []
    for role, chosen, n, target in (
        ("prefill", s.prefill, s.n_prefill, f"TTFT {slo.ttft_s:g} s"),
        ("decode", s.decode, s.n_decode, f"TPOT {slo.tpot_s:g} s"),
    ):
        lat = ("ttft",) if role == "prefill" else ("tpot",)
        lines.append(f"{role}: {n} x {_describe(chosen, evals, slo, lat)} (target {target}).")
        lines += [f"  vs {_describe(e, evals, slo, lat)}" for e in _alternatives(chosen, evals)]
    if s.encode is not None:
        lines.append(
            f"encode: {s.n_encode} x {_describe(s.encode, evals, slo, ('ttft',))} (target TTFT {slo.ttft_s:g} s, "
            "shared with its prompts' prefill)."
        )
    elif trace.has_images:
        lines.append("encode: in the prefill engines (EP+D): each encodes its prompts' images in the step that starts them.")
    pg, dg = s.prefill.candidate.gpus, s.decode.candidate.gpus
    if pg != dg:
        more, less = ("prefill", "decode") if pg > dg else ("decode", "prefill")
        lines.append(
            f"{more} got more parallelism per replica ({max(pg, dg)} GPUs vs {min(pg, dg)}): "
            f"with fewer GPUs its unloaded latency uses more of the SLO budget, leaving less room "
            f"for queueing, so goodput per GPU is lower (numbers above); {less} meets its target "
            f"with batching on fewer GPUs."
        )
    else:
        lines.append(f"both phases use {pg} GPU(s) per replica; the ratio {s.n_prefill}:{s.n_decode} balances their goodputs.")
    return lines


def _explain_units(s: _Sizing, evals: list[Evaluation]) -> list[str]:
    c = s.prefill.candidate
    return [
        f"low node-affinity: {s.units} x [{c.describe()}], {s.prefill.goodput_rps:.3g} req/s "
        f"per unit ({s.prefill.goodput_rps / c.gpus:.3g} req/s per GPU); KV stays on NVLink.",
        *(
            f"  next: [{e.candidate.describe()}] {e.goodput_rps / e.candidate.gpus:.3g} req/s per GPU"
            for e in _alternatives(s.prefill, evals, 2)
        ),
    ]


def _explain_threshold(threshold: int, trace: Trace) -> list[str]:
    local = trace.input_len < threshold
    tokens = trace.input_len[local].sum() / trace.input_len.sum()
    return [
        f"conditional: prompts under {threshold} tokens ({local.mean():.0%} of requests, {tokens:.0%} of "
        f"prompt tokens) are prefilled by the decode replica that serves them, with no KV transfer; "
        f"the prefill pool computes the rest."
    ]


def _alternatives(chosen: Evaluation, evals: list[Evaluation], n: int = 3) -> list[Evaluation]:
    """The best other configurations for the same role, per GPU."""
    return sorted(
        (e for e in evals if e.candidate.group == chosen.candidate.group and e.status == "ok" and e is not chosen),
        key=lambda e: -e.goodput_rps / e.candidate.gpus,
    )[:n]


def _describe(e: Evaluation, evals: list[Evaluation], slo: Slo, latencies: tuple[str, ...]) -> str:
    """One configuration's goodput per GPU and unloaded latencies at the attainment quantile."""
    c = e.candidate
    where = "" if len(plan_gpu_types(evals)) == 1 else " on " + c.gpu_type
    unloaded = ", ".join(f"{lat.upper()} {getattr(e, f'unloaded_{lat}_s') * 1000:.0f} ms" for lat in latencies)
    return (
        f"tp={c.prefill[0] or c.decode[0]} pp={c.pp}{where}: {e.goodput_rps / c.gpus:.3g} req/s per GPU, "
        f"unloaded p{slo.attainment * 100:.0f} {unloaded}"
    )


def plan_gpu_types(evals: list[Evaluation]) -> set[str]:
    return {e.candidate.gpu_type for e in evals}


def _amount(value: float, objective: Objective) -> str:
    if objective == "gpus":
        return f"{value:g} GPU{'' if value == 1 else 's'}"
    return f"${value:.3g}/h" if objective == "cost" else f"{value:.4g} W"


_WHY = {
    "colocated": (
        "engines that run whole requests stall their decodes while they prefill, yet at this rate "
        "they hold the SLO; splitting the phases rounds each pool up to whole replicas and pays "
        "for a hand-off that this load does not need"
    ),
    "disaggregated": (
        "prefills stall the decodes of engines that do both, and holding the SLO against that "
        "interference takes more resources than separate prefill and decode pools"
    ),
    "conditional": (
        "short prompts cost little to prefill where they are decoded (no KV transfer, brief "
        "stalls), while the long ones, whose stalls would break TPOT, go to the prefill pool"
    ),
}


_WHY_ENCODE = {
    True: (
        "an encode pool keeps the image encoder out of the prefill steps, where it delays every "
        "prompt batched with an image, and costs less than the prefill replicas it saves"
    ),
    False: (
        "the prefill engines encode their prompts' images in less than an encode pool would cost "
        "(whole workers) at this rate"
    ),
}


def compare_modes(
    chosen: Plan,
    others: list[Plan],
    errors: list[str],
    cost: Callable[[Plan], float],
    objective: Objective,
    modes: Collection[Mode],
    images: bool = False,
    encode_compared: bool = False,
) -> list[str]:
    """The deployment choice in words: what each mode needs at the target rate, and why (the
    mechanism is only claimed when the other modes were compared); for a trace with images,
    whether the images get an encode pool (why, only when a plan with one was sized:
    ``encode_compared``)."""
    e = chosen.expected
    lines = [
        f"deployment: {chosen.describe_mode()} meets the SLO at {e.rate_rps:.3g} req/s with "
        f"{_amount(cost(chosen), objective)} (simulated attainment {e.attainment:.1%}, "
        f"{e.goodput_per_gpu:.3g} req/s per GPU at most)"
    ]
    lines += [
        f"  {p.describe_mode()} needs {_amount(cost(p), objective)} ({p.expected.goodput_per_gpu:.3g} req/s per GPU at most)"
        for p in others
    ]
    lines += [f"  {error}" for error in errors]
    least = {"gpus": "the fewest GPUs", "cost": "the lowest cost", "power": "the least power"}[objective]
    why = f": {_WHY[chosen.mode]}" if len(set(modes)) > 1 else ""
    lines.append(f"-> {chosen.mode}, {least} (ties: the higher goodput per GPU){why}.")
    if images and chosen.mode != "colocated":
        why_encode = _WHY_ENCODE[chosen.encode is not None] if encode_compared else "no plan with an encode pool was possible (above)"
        lines.append(f"-> {'E+P+D' if chosen.encode else 'EP+D'}: {why_encode}.")
    return lines


def _sizers(
    planner: _Planner, modes: Collection[Mode], algorithm: Algorithm, thresholds: list[int], encode_pool: bool = False
) -> list[tuple[str, Callable[[list[Evaluation]], _Sizing]]]:
    """(name, sizing function) for every deployment to compare; with ``encode_pool``, the
    disaggregated and conditional ones both with and without an encode pool (E+P+D, EP+D)."""
    out: list[tuple[str, Callable[[list[Evaluation]], _Sizing]]] = []
    apart = (False, True) if encode_pool else (False,)
    name = {False: "", True: ", E+P+D"}
    if "disaggregated" in modes and algorithm in ("high-affinity", "both"):
        out += [
            (f"disaggregated, high-affinity{name[a]}", functools.partial(planner.size_high_affinity, encode_apart=a)) for a in apart
        ]
    if "disaggregated" in modes and algorithm in ("low-affinity", "both"):
        out.append(("disaggregated, low-affinity", planner.size_low_affinity))
    if "colocated" in modes:
        out.append(("colocated", planner.size_colocated))
    if "conditional" in modes:
        out += [
            (f"conditional (threshold {t}){name[a]}", functools.partial(planner.size_high_affinity, threshold=t, encode_apart=a))
            for t in thresholds
            for a in apart
        ]
    return out


def optimize(
    cluster: ClusterSpec,
    trace: Trace,
    slo: Slo,
    rate: float | None = None,
    algorithm: Algorithm = "both",
    objective: Objective = "gpus",
    workers: int | None = None,
    search_requests: int = 1000,
    verify_requests: int = 4000,
    modes: Collection[Mode] = MODES,
    thresholds: Collection[int] = LOCAL_PREFILL_THRESHOLDS,
    sim: SimConfig = SimConfig(),
) -> OptimizeResult:
    """The deployment (mode, pools, placement) that meets ``slo`` on ``trace`` at ``rate``
    (default: its own) with the least of the objective; ``modes`` limits what is compared."""
    rate = trace.mean_rate if rate is None else rate
    if not math.isfinite(rate) or rate <= 0:
        raise InfeasibleError(
            f"trace {trace.name!r} has no usable arrival rate (all requests at one instant?): give --rate"
        )
    models = {t: cluster.latency_model(t) for t in cluster.gpu_types if cluster.gpu_count(t) > 0}
    images = trace.has_images
    blind = [t for t, model in models.items() if images and model.encoder is None]
    if blind:
        raise InfeasibleError(
            f"the trace has images, but the latency model of {', '.join(blind)} has no image encoder: "
            "profile the vision-language model (`duet profile --model builtin-vl-large`, or its path)"
        )
    ctx = SearchContext(
        trace=trace.head(search_requests),
        slo=slo,
        models=models,
        kv_bytes_per_token=cluster.model_spec.kv_bytes_per_token,
        network_bytes_per_s=cluster.network_gbs * 1e9,
        nvlink_bytes_per_s={t: g.nvlink_gbs * 1e9 for t, g in cluster.gpu_types.items()},
        sim=sim,
    )
    costs = unit_costs(cluster, objective)
    splits = useful_thresholds(ctx.trace, thresholds) if "conditional" in modes else []
    candidates = enumerate_candidates(cluster, ctx, algorithm, modes, splits, encode_pool=images)
    workers = workers or min(os.cpu_count() or 1, 8)
    outcome = run_search(ctx, candidates, costs, workers, rate)
    evals = outcome.evaluations
    planner = _Planner(cluster, ctx, trace.head(verify_requests), rate, objective, costs)

    plans, failed = [], {}
    for name, sizer in _sizers(planner, modes, algorithm, splits, encode_pool=images):
        try:
            plans.append(planner.build(planner.grow_until_met(sizer(evals)), evals, outcome))
        except InfeasibleError as exc:
            failed[name] = exc
    if "conditional" in modes and not splits:
        failed["conditional"] = InfeasibleError(f"no threshold of {tuple(thresholds)} tokens splits this trace's prompts")
    errors = [f"{name}: {exc}" for name, exc in failed.items()]
    if not plans:
        raise InfeasibleError(" | ".join(errors), options=failed)

    def cost(p: Plan) -> float:
        return sum(pool.gpus * costs[pool.gpu_type] for _, pool in p.pools())

    plans.sort(key=lambda p: (cost(p), -p.expected.goodput_per_gpu))
    chosen, alternatives = plans[0], plans[1:]
    notes = compare_modes(
        chosen, alternatives, [f"not possible: {e}" for e in errors], cost, objective, modes, images,
        encode_compared=any(plan.encode is not None for plan in plans),
    )
    chosen = chosen.model_copy(update={"explanation": chosen.explanation + notes})
    return OptimizeResult(chosen, alternatives, outcome)
