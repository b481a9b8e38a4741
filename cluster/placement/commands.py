"""``duet plan``, ``duet plan-models``, ``duet simulate`` and ``duet profile``: thin argparse
shells over the pure core.

Each handler returns an exit code. Bad input (a config, trace, SLO or plan that cannot be used)
prints one clear message to stderr and returns 2; it never shows a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from duet.cluster.placement.cluster_spec import ClusterSpec, ClusterSpecError
from duet.cluster.placement.goodput import Deployment, max_rate, plan_context, simulate
from duet.cluster.placement.latency_model import LatencyModelError
from duet.cluster.placement.models import UnknownModelError
from duet.cluster.placement.multi_model import Workloads, fit_models
from duet.cluster.placement.optimizer import MODES, InfeasibleError, optimize
from duet.cluster.placement.plan import Plan, PlanError, validate_against
from duet.cluster.placement.simulator import SimResult, Slo
from duet.cluster.placement.trace import IMAGE_MIXES, Trace, TraceError, image_counts, load_trace

EXIT_BAD_INPUT = 2
_BAD_INPUT = (
    ClusterSpecError,
    TraceError,
    PlanError,
    InfeasibleError,
    LatencyModelError,
    UnknownModelError,
    ValueError,
)


def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan``, ``plan-models``, ``simulate`` and ``profile`` to duet's CLI."""
    plan = subparsers.add_parser(
        "plan", help="choose disaggregated, conditional or colocated serving and size and place it for an SLO"
    )
    _workload_args(plan)
    plan.add_argument("--algorithm", choices=["high-affinity", "low-affinity", "both"], default="both")
    plan.add_argument("--objective", choices=["gpus", "cost", "power"], default="gpus")
    plan.add_argument("--workers", type=int, help="search processes (default: CPU count)")
    plan.add_argument("--search-requests", type=int, default=1000, help="trace prefix per probe")
    plan.add_argument(
        "--modes",
        type=_modes,
        default=MODES,
        help=f"deployment modes to compare, comma-separated (default: {','.join(MODES)})",
    )
    plan.add_argument("--out", type=Path, default=Path("plan.yaml"))
    plan.set_defaults(handler=_guarded("plan", _plan))

    fit = subparsers.add_parser(
        "plan-models", help="fit several models onto one cluster: a plan per model, and which GPUs each gets",
        description="Plan each model of --workloads (its architecture, trace, rate and SLO) with `duet plan`'s "
        "optimizer, in the order listed, each on the GPUs the models before it left; write every plan to --out "
        "and print which model goes where.",
    )
    fit.add_argument("--config", type=Path, required=True, help="cluster.yaml (its model is each workload's)")
    fit.add_argument("--workloads", type=Path, required=True, help="YAML: models: [{model, trace, ttft_s, tpot_s, ...}]")
    fit.add_argument("--objective", choices=["gpus", "cost", "power"], default="gpus")
    fit.add_argument("--workers", type=int, help="search processes (default: CPU count)")
    fit.add_argument("--search-requests", type=int, default=1000, help="trace prefix per probe")
    fit.add_argument("--out", type=Path, default=Path("plans.yaml"))
    fit.set_defaults(handler=_guarded("plan-models", _plan_models))

    sim = subparsers.add_parser("simulate", help="simulate a plan (and a colocated baseline) on a trace")
    _workload_args(sim)
    sim.add_argument("--plan", type=Path, required=True)
    sim.add_argument("--goodput", action="store_true", help="also find the highest rate meeting the SLO")
    sim.add_argument(
        "--colocated-tp", type=int, help="also simulate colocated engines of this TP on the same GPUs"
    )
    sim.set_defaults(handler=_guarded("simulate", _simulate))

    prof = subparsers.add_parser("profile", help="measure the engine here and fit the latency model")
    prof.add_argument(
        "--model", default="tiny",
        help="'tiny' (duet's built-in model), 'builtin-vl' or 'builtin-vl-large' (its vision-language models: "
        "the image encoder is profiled too) or a checkpoint path",
    )
    prof.add_argument("--out", type=Path, default=Path("profile.yaml"))
    prof.add_argument("--grid", choices=["small", "default"], default="default")
    prof.add_argument("--kv-cache-gib", type=float, default=1.0)
    prof.add_argument("--cpus", help="pin the engine to these cores, e.g. '0' (what each engine gets)")
    prof.set_defaults(handler=_guarded("profile", _profile))


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, help="cluster.yaml")
    p.add_argument(
        "--trace",
        required=True,
        help="Azure .csv, Mooncake .jsonl, or synthetic:n=2000,rate=4,lengths=sharegpt,cv=1",
    )
    p.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--rate", type=float, help="target req/s (default: the trace's own rate)")
    p.add_argument("--max-input", type=int, help="clip prompt lengths (short-context models)")
    p.add_argument("--max-output", type=int, help="clip output lengths")
    p.add_argument(
        "--images",
        help=f"images per request of a vision-language model: {', '.join(IMAGE_MIXES)} (0, 1 or 2 images: shares 0.3, 0.5, 0.2), "
        "N, or COUNT:SHARE,...; disaggregated plans are then sized with and without an encode pool (E+P+D, EP+D)",
    )


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODES)}")
    return modes


def _guarded(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except _BAD_INPUT as exc:
            print(f"duet {name}: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT

    return handler


def parse_slo(text: str, attainment: float) -> Slo:
    """``ttft=0.25,tpot=0.1`` (seconds) into an :class:`Slo`."""
    values: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"--slo {text!r}: expected ttft=SECONDS,tpot=SECONDS")
        try:
            values[key] = float(value.rstrip("s"))
        except ValueError:
            raise ValueError(f"--slo {text!r}: {value!r} is not a number of seconds") from None
    missing = {"ttft", "tpot"} - set(values)
    if missing:
        raise ValueError(f"--slo {text!r}: missing {', '.join(sorted(missing))}")
    return Slo(values["ttft"], values["tpot"], attainment)


def _workload(args: argparse.Namespace) -> tuple[ClusterSpec, Trace, Slo]:
    cluster = ClusterSpec.load(args.config)
    slo = parse_slo(args.slo, args.attainment)
    trace = load_trace(args.trace).capped(args.max_input, args.max_output)
    if args.images:
        trace = with_images(trace, args.images, cluster)
    return cluster, trace, slo


def with_images(trace: Trace, mix: str, cluster: ClusterSpec) -> Trace:
    """``trace`` with images per request drawn from ``mix`` (seeded), each adding the tokens the
    cluster's profiled encoder says an image takes."""
    counts = image_counts(mix, len(trace))
    encoders = [cluster.latency_model(t).encoder for t in cluster.gpu_types if cluster.gpu_count(t)]
    if any(encoder is None for encoder in encoders):
        raise ClusterSpecError(
            "--images: the cluster's latency profile has no image encoder; profile the vision-language model "
            "(`duet profile --model builtin-vl-large`, or its path) and name that profile in gpu_types"
        )
    return trace.with_images(counts, max(encoder.tokens_per_image for encoder in encoders))


def _plan(args: argparse.Namespace) -> int:
    cluster, trace, slo = _workload(args)
    result = optimize(
        cluster,
        trace,
        slo,
        rate=args.rate,
        algorithm=args.algorithm,
        objective=args.objective,
        workers=args.workers,
        search_requests=args.search_requests,
        modes=args.modes,
    )
    plan = result.plan
    validate_against(plan, cluster)
    plan.save(args.out)
    print(f"plan: {plan.summary()}")
    s = plan.search
    print(
        f"search: {s.configs_evaluated} configurations evaluated, {s.configs_pruned} pruned, "
        f"{s.simulations} simulations, {s.wall_s:.2f} s on {s.workers} worker(s)"
    )
    for line in plan.explanation:
        print(f"  {line}")
    print(f"wrote {args.out}")
    return 0


def _plan_models(args: argparse.Namespace) -> int:
    cluster = ClusterSpec.load(args.config)
    workloads = Workloads.load(args.workloads)
    plans = fit_models(
        cluster, workloads, objective=args.objective, workers=args.workers, search_requests=args.search_requests
    )
    plans.save(args.out)
    for named, line in zip(plans.plans, plans.where()):
        print(line)
        print(f"  {named.plan.summary()}")
    used = sum(named.plan.gpus for named in plans.plans)
    print(f"{used} of the cluster's {cluster.gpu_count()} GPUs used; wrote {args.out}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    cluster, trace, slo = _workload(args)
    plan = Plan.load(args.plan)
    validate_against(plan, cluster)
    rate = trace.mean_rate if args.rate is None else args.rate
    if not math.isfinite(rate):
        raise TraceError(f"trace {trace.name!r} has no arrival rate: give --rate")
    ctx, planned = plan_context(cluster, plan, trace, slo)
    runs = [(f"{plan.mode} plan", planned, plan.gpus)]
    if args.colocated_tp:
        tp = args.colocated_tp
        model = ctx.models[plan.pools()[0][1].gpu_type]
        engines = (model.engine(tp, 1),) * (plan.gpus // tp)
        colocated = Deployment(engines, (), colocated=True, serving_path=model.serving_path)
        runs.append((f"colocated tp={tp}", colocated, plan.gpus))
    print(f"trace {trace.name}: {len(trace)} requests at {rate:.3g} req/s; SLO {args.slo} @ {slo.attainment:.0%}")
    for name, dep, gpus in runs:
        _report(name, simulate(ctx, dep, rate, None), slo)
        if args.goodput:
            lo = rate / 100
            ok = lambda r, dep=dep: simulate(ctx, dep, r, slo).meets(slo)  # noqa: E731
            goodput = max_rate(ok, lo, rate, ctx.rel_tol) if ok(lo) else 0.0
            print(f"  goodput {goodput:.3g} req/s = {goodput / gpus:.3g} req/s per GPU ({gpus} GPUs)")
    return 0


def _report(name: str, result: SimResult, slo: Slo) -> None:
    s = result.summary(slo)
    print(
        f"{name}: attainment {s['attainment']:.1%} (TTFT {s['ttft_attainment']:.1%}, "
        f"TPOT {s['tpot_attainment']:.1%})\n"
        f"  TTFT p50/p90/p99 {s['ttft_p50_s']:.3f}/{s['ttft_p90_s']:.3f}/{s['ttft_p99_s']:.3f} s, "
        f"TPOT p50/p90/p99 {s['tpot_p50_s']:.3f}/{s['tpot_p90_s']:.3f}/{s['tpot_p99_s']:.3f} s"
    )


def _profile(args: argparse.Namespace) -> int:
    from duet.cluster.placement.profiler import DEFAULT_GRID, SMALL_GRID, profile_engine

    grid = SMALL_GRID if args.grid == "small" else DEFAULT_GRID
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    model, report = profile_engine(args.model, grid, kv_cache_gib=args.kv_cache_gib, cpus=cpus)
    model.save(args.out)
    print(report)
    print(f"wrote {args.out}")
    return 0
