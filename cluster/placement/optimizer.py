"""SLO-driven sizing and placement: DistServe's two algorithms, with heterogeneous pools.

* High node-affinity (DistServe algorithm 1): prefill and decode are sized apart, each with a
  free choice of tensor and pipeline parallelism and, as in Splitwise, of GPU type; the best
  goodput per objective unit (GPU, $/h or W) wins per phase, and replicas follow from the target
  rate. KV moves over the inter-node network.
* Low node-affinity (algorithm 2): a unit is ``pp`` whole nodes; stage ``s`` of every prefill
  and decode segment of the unit sits on the unit's node ``s``, so KV moves over NVLink. Units
  are simulated whole and replicated.

Candidates are evaluated in parallel processes, best throughput bound first; a candidate whose
bound cannot beat the best goodput found is never simulated, and one that falls below it stops
after one probe (see goodput.py). The chosen sizes are then checked by simulating the whole
plan at the target rate, and grown if the phases together miss the attainment target.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

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
from duet.cluster.placement.placer import Inventory, PlacementError
from duet.cluster.placement.plan import (
    Expected,
    KvTransfer,
    Plan,
    Pool,
    SearchStats,
    SloSpec,
)
from duet.cluster.placement.simulator import SimConfig, SimResult, Slo
from duet.cluster.placement.trace import Trace

Objective = Literal["gpus", "cost", "power"]
Algorithm = Literal["high-affinity", "low-affinity", "both"]


class InfeasibleError(ValueError):
    """No plan meets the request; the message says what fails and the closest feasible option."""


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


def enumerate_candidates(
    cluster: ClusterSpec, ctx: SearchContext, algorithm: Algorithm, baseline: bool
) -> list[Candidate]:
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
        if algorithm in ("high-affinity", "both"):
            for tp, pp in shapes:
                out.append(Candidate("prefill", gpu_type, pp, prefill=(tp, 1)))
                out.append(Candidate("decode", gpu_type, pp, decode=(tp, 1)))
        if algorithm in ("low-affinity", "both"):
            out += _units(gpu_type, shapes, per_node, node_count)
        if baseline:
            out += [Candidate("colocated", gpu_type, 1, prefill=(tp, 1)) for tp, pp in shapes if pp == 1]
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
    ctx: SearchContext, candidates: list[Candidate], costs: dict[str, float], workers: int
) -> SearchOutcome:
    """Evaluate candidates, best bound first; within a kind, prune what cannot beat the best."""
    start = time.perf_counter()
    per_unit = {c: c.gpus * costs[c.gpu_type] for c in candidates}
    bound = {c: upper_bound(ctx, c) / per_unit[c] for c in candidates}
    queue = deque(sorted(candidates, key=lambda c: -bound[c]))
    best: dict[str, float] = defaultdict(float)
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
                if bound[cand] <= best[cand.kind]:
                    pruned += 1
                    continue
                floor = best[cand.kind] * per_unit[cand]
                pending[executor.submit(_evaluate_task, cand, floor)] = cand
            if not pending:
                continue
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                cand = pending.pop(future)
                ev = future.result()
                evaluations.append(ev)
                if ev.status == "ok":
                    best[cand.kind] = max(best[cand.kind], ev.goodput_rps / per_unit[cand])
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
    alternatives: list[Plan]
    baseline: Evaluation | None  # the best colocated configuration, per objective unit
    search: SearchOutcome


@dataclass(frozen=True)
class _Sizing:
    """Pools before placement: which candidate(s), how many replicas."""

    algorithm: Literal["high-affinity", "low-affinity"]
    prefill: Evaluation
    decode: Evaluation
    n_prefill: int
    n_decode: int
    units: int = 0  # low affinity only


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

    def _ranked(self, evals: list[Evaluation], kind: str) -> list[Evaluation]:
        ok = [e for e in evals if e.status == "ok" and e.candidate.kind == kind]
        return sorted(ok, key=lambda e: -e.goodput_rps / self._cost(e.candidate, 1))

    def _cost(self, cand: Candidate, count: int) -> float:
        return cand.gpus * count * self.costs[cand.gpu_type]

    def _fits(self, need: dict[str, int]) -> bool:
        return all(n <= self.cluster.gpu_count(t) for t, n in need.items())

    def _need_pools(self, p: Candidate, n_p: int, d: Candidate, n_d: int) -> dict[str, int]:
        need: dict[str, int] = defaultdict(int)
        need[p.gpu_type] += p.gpus * n_p
        need[d.gpu_type] += d.gpus * n_d
        return need

    # -- high affinity --

    def size_high_affinity(self, evals: list[Evaluation]) -> _Sizing:
        pre, dec = self._ranked(evals, "prefill"), self._ranked(evals, "decode")
        self._require_feasible(evals, pre, dec)
        options = []
        for p in pre:
            for d in dec:
                n_p, n_d = self._pool_sizes(p, d, self.rate)
                cost = self._cost(p.candidate, n_p) + self._cost(d.candidate, n_d)
                if self._fits(self._need_pools(p.candidate, n_p, d.candidate, n_d)):
                    options.append((cost, p, n_p, d, n_d))
        if not options:
            raise InfeasibleError(self._over_budget_pools(pre, dec))
        _, p, n_p, d, n_d = min(options, key=lambda o: o[0])
        return _Sizing("high-affinity", p, d, n_p, n_d)

    def _deployment(self, s: _Sizing) -> tuple[Deployment, float]:
        """What to simulate for a sizing, and at what rate: one unit at its share for low
        affinity (units are independent behind a router that keeps KV in the unit), else all."""
        if s.algorithm == "low-affinity":
            return deployment(self.verify_ctx, s.prefill.candidate), self.rate / s.units
        pc, dc = s.prefill.candidate, s.decode.candidate
        model_p, model_d = self.ctx.models[pc.gpu_type], self.ctx.models[dc.gpu_type]
        dep = Deployment(
            prefill=(model_p.engine(pc.prefill[0], pc.pp),) * s.n_prefill,
            decode=(model_d.engine(dc.decode[0], dc.pp),) * s.n_decode,
            transfer_bytes_per_s=self.ctx.network_bytes_per_s,
            host_ms_per_token=max(model_p.host_ms_per_token, model_d.host_ms_per_token),
        )
        return dep, self.rate

    def _grown(self, s: _Sizing, result: SimResult) -> _Sizing:
        """One growth step (about 10%) of the phase, or unit count, that misses more."""
        if s.algorithm == "low-affinity":
            units = s.units + math.ceil(0.1 * s.units)
            c = s.prefill.candidate
            return dataclasses.replace(s, units=units, n_prefill=c.prefill[1] * units, n_decode=c.decode[1] * units)
        summary = result.summary(self.ctx.slo)
        if summary["ttft_attainment"] <= summary["tpot_attainment"]:
            return dataclasses.replace(s, n_prefill=s.n_prefill + math.ceil(0.1 * s.n_prefill))
        return dataclasses.replace(s, n_decode=s.n_decode + math.ceil(0.1 * s.n_decode))

    def _sizing_fits(self, s: _Sizing) -> bool:
        if s.algorithm == "low-affinity":
            c = s.prefill.candidate
            nodes = sum(1 for n in self.cluster.node_list() if n.gpu_type == c.gpu_type)
            return s.units * c.pp <= nodes
        return self._fits(self._need_pools(s.prefill.candidate, s.n_prefill, s.decode.candidate, s.n_decode))

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

    def _pool_sizes(self, p: Evaluation, d: Evaluation, rate: float) -> tuple[int, int]:
        return math.ceil(rate / p.goodput_rps), math.ceil(rate / d.goodput_rps)

    def _max_rate_within_budget(self, p: Evaluation, d: Evaluation) -> float:
        """The highest rate whose pools of ``p`` and ``d`` still fit the cluster."""
        def fits_at(rate: float) -> bool:
            n_p, n_d = self._pool_sizes(p, d, rate)
            return self._fits(self._need_pools(p.candidate, n_p, d.candidate, n_d))

        lo, hi = 0.0, self.rate
        if not fits_at(min(p.goodput_rps, d.goodput_rps)):
            return 0.0
        while hi - lo > self.rate * 1e-3:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
        return lo

    def _over_budget_pools(self, pre: list[Evaluation], dec: list[Evaluation]) -> str:
        have = {t: self.cluster.gpu_count(t) for t in self.cluster.gpu_types}
        best_rate, p, d = max(((self._max_rate_within_budget(p, d), p, d) for p in pre for d in dec), key=lambda x: x[0])
        if best_rate == 0.0:
            return (
                f"even one replica of each SLO-meeting prefill and decode configuration needs more "
                f"GPUs than the cluster has ({have}); the smallest prefill is "
                f"[{min(pre, key=lambda e: e.candidate.gpus).candidate.describe()}]. Add GPUs or relax the SLO."
            )
        n_p, n_d = self._pool_sizes(p, d, self.rate)
        return (
            f"target rate {self.rate:.3g} req/s needs {n_p} x [{p.candidate.describe()}] + {n_d} x "
            f"[{d.candidate.describe()}] = {p.candidate.gpus * n_p + d.candidate.gpus * n_d} GPUs, but "
            f"the cluster has {have}. Closest feasible: --rate {best_rate:.3g} (the most these pools "
            f"serve within the budget), or add GPUs."
        )

    # -- low affinity --

    def size_low_affinity(self, evals: list[Evaluation]) -> _Sizing:
        units = self._ranked(evals, "unit")
        if not units:
            raise InfeasibleError(self._infeasible_message(evals, "unit"))
        nodes = self.cluster.node_list()
        best_fit = None
        for u in units:
            count = math.ceil(self.rate / u.goodput_rps)
            free = sum(1 for n in nodes if n.gpu_type == u.candidate.gpu_type)
            if count * u.candidate.pp <= free:
                cost = self._cost(u.candidate, count)
                if best_fit is None or cost < best_fit[0]:
                    best_fit = (cost, u, count)
        if best_fit is None:
            u = units[0]
            most = sum(1 for n in nodes if n.gpu_type == u.candidate.gpu_type) // u.candidate.pp
            raise InfeasibleError(
                f"target rate {self.rate:.3g} req/s needs {math.ceil(self.rate / u.goodput_rps)} x "
                f"[{u.candidate.describe()}], but only {most} fit. Closest feasible: --rate "
                f"{most * u.goodput_rps:.3g}, or add nodes."
            )
        _, u, count = best_fit
        c = u.candidate
        return _Sizing("low-affinity", u, u, c.prefill[1] * count, c.decode[1] * count, units=count)

    # -- shared --

    def _require_feasible(self, evals: list[Evaluation], pre: list, dec: list) -> None:
        for kind, ranked in (("prefill", pre), ("decode", dec)):
            if not ranked:
                raise InfeasibleError(self._infeasible_message(evals, kind))

    def _infeasible_message(self, evals: list[Evaluation], kind: str) -> str:
        slo = self.ctx.slo
        tried = [e for e in evals if e.candidate.kind == kind]
        if not tried:
            return f"no {kind} configuration fits the cluster's GPUs for {self.cluster.model}"
        pct = f"{slo.attainment:.0%}"
        headroom = 1.25  # the unloaded latency leaves no room for any queueing
        if kind == "prefill":
            best = min(tried, key=lambda e: e.unloaded_ttft_s)
            what = f"TTFT <= {slo.ttft_s:g} s"
            fix = f"ttft={_round_up(best.unloaded_ttft_s * headroom)},tpot={slo.tpot_s:g}"
            reach = f"TTFT {best.unloaded_ttft_s:.3g} s"
        elif kind == "decode":
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
        gpus = (
            s.prefill.candidate.gpus * s.units
            if s.algorithm == "low-affinity"
            else s.prefill.candidate.gpus * s.n_prefill + s.decode.candidate.gpus * s.n_decode
        )
        exp = Expected(
            rate_rps=self.rate,
            attainment=summary["attainment"],
            ttft_attainment=summary["ttft_attainment"],
            tpot_attainment=summary["tpot_attainment"],
            ttft_p90_s=summary["ttft_p90_s"],
            tpot_p90_s=summary["tpot_p90_s"],
            goodput_rps=goodput * scale,
            goodput_per_gpu=goodput * scale / gpus,
        )
        return exp, ("" if goodput else "warning: the simulated plan misses the attainment target at this rate")

    def build(self, s: _Sizing, evals: list[Evaluation], outcome: SearchOutcome) -> Plan:
        inv = Inventory(self.cluster)
        pc, dc = s.prefill.candidate, s.decode.candidate
        try:
            if s.algorithm == "low-affinity":
                p_place, d_place = inv.place_units(pc.gpu_type, pc.pp, pc.prefill, pc.decode, s.units)
                transfer = KvTransfer(
                    path="nvlink",
                    bandwidth_gbs=self.cluster.gpu_types[pc.gpu_type].nvlink_gbs * min(pc.prefill[0], pc.decode[0]),
                )
            else:
                order = sorted([("prefill", pc, s.n_prefill), ("decode", dc, s.n_decode)], key=lambda x: -x[1].gpus)
                placed = {
                    role: inv.place_pool(c.gpu_type, c.prefill[0] or c.decode[0], c.pp, n)
                    for role, c, n in order
                }
                p_place, d_place = placed["prefill"], placed["decode"]
                transfer = KvTransfer(path="network", bandwidth_gbs=self.cluster.network_gbs)
        except PlacementError as exc:
            raise InfeasibleError(f"{s.algorithm}: pools do not fit the nodes: {exc}") from None
        expected, warning = self.expected(s)
        plan = Plan(
            model=self.cluster.model_spec.name,
            algorithm=s.algorithm,
            objective=self.objective,
            slo=SloSpec(ttft_s=self.ctx.slo.ttft_s, tpot_s=self.ctx.slo.tpot_s, attainment=self.ctx.slo.attainment),
            kv_transfer=transfer,
            prefill=Pool(
                gpu_type=pc.gpu_type, tensor_parallel=pc.prefill[0], pipeline_parallel=pc.pp,
                replicas=s.n_prefill, placement=p_place,
            ),
            decode=Pool(
                gpu_type=dc.gpu_type, tensor_parallel=dc.decode[0], pipeline_parallel=dc.pp,
                replicas=s.n_decode, placement=d_place,
            ),
            expected=expected,
            search=SearchStats(
                configs_evaluated=len(outcome.evaluations),
                configs_pruned=outcome.pruned,
                simulations=outcome.simulations,
                wall_s=round(outcome.wall_s, 3),
                workers=outcome.workers,
            ),
        )
        lines = explain(plan, s, evals, self.ctx.slo)
        return plan.model_copy(update={"explanation": lines + ([warning] if warning else [])})


def _round_up(seconds: float) -> str:
    """A human SLO value just above ``seconds`` (two significant digits, rounded up)."""
    if seconds <= 0 or not math.isfinite(seconds):
        return f"{seconds:g}"
    scale = 10 ** (math.floor(math.log10(seconds)) - 1)
    return f"{math.ceil(seconds / scale - 1e-9) * scale:.3g}"


def explain(plan: Plan, s: _Sizing, evals: list[Evaluation], slo: Slo) -> list[str]:
    """Why these pools: per-phase numbers for the choice and its nearest alternatives."""
    lines = []
    if s.algorithm == "low-affinity":
        c = s.prefill.candidate
        lines.append(
            f"low node-affinity: {s.units} x [{c.describe()}], {s.prefill.goodput_rps:.3g} req/s "
            f"per unit ({s.prefill.goodput_rps / c.gpus:.3g} req/s per GPU); KV stays on NVLink."
        )
        others = sorted(
            (e for e in evals if e.candidate.kind == "unit" and e.status == "ok" and e is not s.prefill),
            key=lambda e: -e.goodput_rps / e.candidate.gpus,
        )[:2]
        lines += [
            f"  next: [{e.candidate.describe()}] {e.goodput_rps / e.candidate.gpus:.3g} req/s per GPU"
            for e in others
        ]
        return lines
    for role, chosen, n, target in (
        ("prefill", s.prefill, s.n_prefill, f"TTFT {slo.ttft_s:g} s"),
        ("decode", s.decode, s.n_decode, f"TPOT {slo.tpot_s:g} s"),
    ):
        c = chosen.candidate
        alts = sorted(
            (e for e in evals if e.candidate.kind == role and e.status == "ok" and e is not chosen),
            key=lambda e: -e.goodput_rps / e.candidate.gpus,
        )[:3]
        lat = "ttft" if role == "prefill" else "tpot"

        def fmt(e: Evaluation) -> str:
            unloaded = getattr(e, f"unloaded_{lat}_s") * 1000
            return (
                f"tp={e.candidate.prefill[0] or e.candidate.decode[0]} pp={e.candidate.pp}"
                f"{'' if len(plan_gpu_types(evals)) == 1 else ' on ' + e.candidate.gpu_type}: "
                f"{e.goodput_rps / e.candidate.gpus:.3g} req/s per GPU, unloaded p{slo.attainment * 100:.0f} "
                f"{lat.upper()} {unloaded:.0f} ms"
            )

        lines.append(f"{role}: {n} x {fmt(chosen)} (target {target}).")
        lines += [f"  vs {fmt(e)}" for e in alts]
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


def plan_gpu_types(evals: list[Evaluation]) -> set[str]:
    return {e.candidate.gpu_type for e in evals}


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
    baseline: bool = True,
    sim: SimConfig = SimConfig(),
) -> OptimizeResult:
    """Size and place prefill and decode pools for ``trace`` at ``rate`` (default: its own)."""
    rate = trace.mean_rate if rate is None else rate
    if not math.isfinite(rate) or rate <= 0:
        raise InfeasibleError(
            f"trace {trace.name!r} has no usable arrival rate (all requests at one instant?): give --rate"
        )
    models = {t: cluster.latency_model(t) for t in cluster.gpu_types if cluster.gpu_count(t) > 0}
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
    candidates = enumerate_candidates(cluster, ctx, algorithm, baseline)
    workers = workers or min(os.cpu_count() or 1, 8)
    outcome = run_search(ctx, candidates, costs, workers)
    evals = outcome.evaluations
    planner = _Planner(cluster, ctx, trace.head(verify_requests), rate, objective, costs)

    plans, errors = [], []
    sizers = {"high-affinity": planner.size_high_affinity, "low-affinity": planner.size_low_affinity}
    for name, sizer in sizers.items():
        if algorithm not in (name, "both"):
            continue
        try:
            plans.append(planner.build(planner.grow_until_met(sizer(evals)), evals, outcome))
        except InfeasibleError as exc:
            errors.append(f"{name}: {exc}")
    if not plans:
        raise InfeasibleError(" | ".join(errors))
    cost = {id(p): sum(pool.gpus * costs[pool.gpu_type] for pool in (p.prefill, p.decode)) for p in plans}
    plans.sort(key=lambda p: (cost[id(p)], -p.expected.goodput_per_gpu))
    chosen, alternatives = plans[0], plans[1:]
    notes = [
        f"chosen over {a.algorithm} ({a.gpus} GPUs, {a.expected.goodput_per_gpu:.3g} req/s per GPU)"
        for a in alternatives
    ] + [f"not possible: {e}" for e in errors]
    colocated = [e for e in evals if e.candidate.kind == "colocated" and e.status == "ok"]
    best_colocated = max(colocated, key=lambda e: e.goodput_rps / (e.candidate.gpus * costs[e.candidate.gpu_type]), default=None)
    if best_colocated is not None:
        notes.append(
            f"colocated baseline: best is [{best_colocated.candidate.describe()}] at "
            f"{best_colocated.goodput_rps / best_colocated.candidate.gpus:.3g} req/s per GPU "
            f"(this plan: {chosen.expected.goodput_per_gpu:.3g})"
        )
    chosen = chosen.model_copy(update={"explanation": chosen.explanation + notes})
    return OptimizeResult(chosen, alternatives, best_colocated, outcome)
