"""``duet bench autoscale``: an hour of a real trace, autoscaled versus the smallest static cluster.

Everything here is SIMULATED (the placement simulator's engines, timed by DistServe's A100
profile for OPT-13B; no model is computed): it replays a whole trace on a simulated clock with
the autoscaler of :mod:`duet.cluster.autoscaler` in charge, the same object the live cluster
runs. For comparison it searches the smallest static deployment (prefill + decode workers) that
keeps the SLO attainment over the same trace, and reports GPU-hours for both, the attainment,
how often each pool reversed direction, and whether a metrics outage in the middle shrank any
pool. A PNG plots load, pool sizes and attainment per minute, the static deployment alongside.

The traces' own arrival times are kept; ``--load`` serves that many users' worth of the trace
(each request repeated, each copy arriving within half a minute of the original, so the
minute-scale shape of the load is the trace's), because at its native rate the Azure conversation trace fits
in three A100s and there would be little to scale.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duet.cluster.autoscaler.capacity import CapacityModel
from duet.cluster.autoscaler.core import Autoscaler
from duet.cluster.autoscaler.policy import AutoscalePolicy, load_policy
from duet.cluster.autoscaler.replay import replay
from duet.cluster.placement.latency_model import EnginePerf
from duet.cluster.placement.simulator import SimResult, Slo, simulate_disaggregated
from duet.cluster.placement.trace import Trace, load_trace

RESULTS = Path(__file__).resolve().parent / "results"
# NVLink-class KV link inside a node; transfer is not what this benchmark studies.
_LINK_BYTES_PER_S = 100e9
_MAX_INPUT, _MAX_OUTPUT = 1800, 240  # OPT-13B's context is 2048 tokens


@dataclass(frozen=True)
class Scenario:
    name: str
    trace_file: str
    policy: str  # under configs/autoscale


SCENARIOS = {
    "azure-code": Scenario("azure-code", "AzureLLMInferenceTrace_code.csv", "replay-code"),
    "azure-conv": Scenario("azure-conv", "AzureLLMInferenceTrace_conv.csv", "replay-chat"),
}


def heavier(trace: Trace, load: int, seed: int = 0) -> Trace:
    """``load`` copies of every request, each within half a minute of the original: the
    same minute-scale load shape with ``load`` times the users (copies a second apart would
    arrive as clumps no real population of users sends)."""
    if load == 1:
        return trace
    rng = np.random.default_rng(seed)
    arrivals = np.concatenate([trace.arrival_s + (rng.uniform(-30, 30, len(trace)) if k else 0.0) for k in range(load)])
    arrivals = np.maximum(arrivals, 0.0)
    order = np.argsort(arrivals, kind="stable")
    return Trace(
        f"{trace.name}x{load}",
        arrivals[order],
        np.tile(trace.input_len, load)[order],
        np.tile(trace.output_len, load)[order],
    )


def smallest_static(trace: Trace, engine: EnginePerf, kv_bytes: int, slo: Slo, limit: int) -> tuple[int, int]:
    """The static (prefill, decode) with the fewest workers that keeps ``slo`` on ``trace``.

    Each phase's floor is found with the other pool large (so only that phase can miss), then
    the pair grows from the floors, one worker at a time where it helps most, until it meets.
    """

    def meets(prefill: int, decode: int) -> bool:
        result = simulate_disaggregated(trace, [engine] * prefill, [engine] * decode, kv_bytes, _LINK_BYTES_PER_S, slo)
        return result.meets(slo)

    def floor(check: Any) -> int:
        low, high = 1, limit
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if check(middle) else (middle + 1, high)
        return low

    prefill = floor(lambda n: meets(n, limit))
    decode = floor(lambda n: meets(limit, n))
    frontier = [(prefill, decode)]
    while frontier:
        frontier.sort(key=lambda pair: (sum(pair), pair))
        pair = frontier.pop(0)
        if meets(*pair):
            return pair
        frontier += [grown for grown in ((pair[0] + 1, pair[1]), (pair[0], pair[1] + 1)) if grown not in frontier]
    raise RuntimeError("unreachable")


def opening_sizes(trace: Trace, capacity: CapacityModel, policy: AutoscalePolicy) -> dict[str, int]:
    """What an operator would start with: the model's sizes for the trace's first minute."""
    first = trace.arrival_s < 60
    inputs = trace.input_len[first].astype(float)
    rate = first.sum() / 60
    share = (1 - capacity.slo.attainment) / 2
    sizes = {
        "prefill": capacity.prefill_workers(rate, inputs.mean(), (inputs**2).mean(), share).workers,
        "decode": capacity.decode_workers(rate, inputs.mean(), trace.output_len[first].mean(), share).workers,
    }
    return {role: min(max(n, policy.limits(role).min), policy.limits(role).max) for role, n in sizes.items()}


def per_minute_attainment(trace: Trace, result: SimResult, slo: Slo) -> np.ndarray:
    """SLO attainment of the requests arriving in each minute (NaN for an empty minute)."""
    met = (result.ttft_s <= slo.ttft_s) & (result.tpot_s <= slo.tpot_s)
    minute = (trace.arrival_s // 60).astype(int)
    counts = np.bincount(minute)
    with np.errstate(invalid="ignore"):
        return np.bincount(minute, weights=met, minlength=len(counts)) / counts


def run_scenario(scenario: Scenario, load: int, engine: EnginePerf, kv_bytes: int, outage_s: float) -> dict[str, Any]:
    policy = load_policy(scenario.policy)
    profile = policy.slo_profile()
    slo = Slo(profile.ttft_s, profile.tpot_s, profile.attainment)
    base = load_trace(str(_traces_dir() / scenario.trace_file)).capped(_MAX_INPUT, _MAX_OUTPUT)
    trace = heavier(base, load)
    middle = trace.duration_s / 2
    outage = (middle - outage_s / 2, middle + outage_s / 2)
    capacity = CapacityModel(engine, engine, profile, policy.headroom)
    initial = opening_sizes(trace, capacity, policy)
    scaled = replay(
        trace, Autoscaler(policy, capacity), engine, engine, kv_bytes, _LINK_BYTES_PER_S, initial=initial, outage=outage
    )
    limit = max(policy.prefill.max, policy.decode.max)
    static = smallest_static(trace, engine, kv_bytes, slo, limit)
    static_result = simulate_disaggregated(trace, [engine] * static[0], [engine] * static[1], kv_bytes, _LINK_BYTES_PER_S)
    static_hours = sum(static) * engine.gpus * trace.duration_s / 3600
    scaled_hours = scaled.unit_seconds / 3600
    before = {role: scaled.min_active_during(role, outage[0] - policy.interval_s, outage[0]) for role in ("prefill", "decode")}
    during = {role: scaled.min_active_during(role, outage[0], outage[1]) for role in ("prefill", "decode")}
    return {
        "scenario": scenario.name,
        "trace": trace.name,
        "requests": len(trace),
        "duration_s": round(trace.duration_s, 1),
        "mean_rate": round(trace.mean_rate, 2),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "policy": scenario.policy,
        "autoscaled": {
            "initial": initial,
            "attainment": round(scaled.result.attainment(slo), 4),
            "gpu_hours": round(scaled_hours, 2),
            "resizes": {role: scaled.resizes(role) for role in ("prefill", "decode")},
            "direction_changes": {role: scaled.direction_changes(role) for role in ("prefill", "decode")},
            "outage_s": [round(t) for t in outage],
            "smallest_pool_before_outage": before,
            "smallest_pool_during_outage": during,
            "shrank_during_outage": any(during[r] < before[r] for r in before),
        },
        "static": {
            "prefill": static[0],
            "decode": static[1],
            "attainment": round(static_result.attainment(slo), 4),
            "gpu_hours": round(static_hours, 2),
        },
        "gpu_hours_saved": round(1 - scaled_hours / static_hours, 3),
        "_plot": (trace, scaled, static, static_result, slo),
    }


def plot(reports: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, len(reports), figsize=(7 * len(reports), 9), sharex="col", squeeze=False)
    for column, report in enumerate(reports):
        trace, scaled, static, static_result, slo = report["_plot"]
        minutes = np.arange(int(trace.duration_s // 60) + 1)
        load_axis, size_axis, slo_axis = axes[:, column]
        load_axis.plot(minutes, np.bincount((trace.arrival_s // 60).astype(int), minlength=len(minutes)) / 60)
        load_axis.set_title(f"{report['scenario']} ({report['requests']} requests, SLO {slo.ttft_s:g} s / {slo.tpot_s:g} s)")
        load_axis.set_ylabel("arrivals (req/s)")
        times = np.array([t.time_s for t in scaled.ticks]) / 60
        for role, style in (("prefill", "-"), ("decode", "--")):
            size_axis.plot(times, [t.active[role] for t in scaled.ticks], style, label=f"autoscaled {role}")
        size_axis.axhline(static[0], color="grey", linestyle="-", linewidth=0.8, label=f"static prefill ({static[0]})")
        size_axis.axhline(static[1], color="grey", linestyle="--", linewidth=0.8, label=f"static decode ({static[1]})")
        start, end = report["autoscaled"]["outage_s"]
        for axis in (size_axis, slo_axis):
            axis.axvspan(start / 60, end / 60, color="red", alpha=0.1, label="metrics outage" if axis is size_axis else None)
        size_axis.set_ylabel("workers (1 GPU each)")
        size_axis.legend(fontsize=7, loc="upper right")
        for name, result in (("autoscaled", scaled.result), ("static", static_result)):
            slo_axis.plot(minutes[: len(per := per_minute_attainment(trace, result, slo))], per, label=name)
        slo_axis.axhline(slo.attainment, color="black", linewidth=0.8, linestyle=":")
        slo_axis.set_ylabel("SLO attainment (per minute)")
        slo_axis.set_xlabel("minute of the trace")
        slo_axis.set_ylim(0, 1.05)
        slo_axis.legend(fontsize=7, loc="lower right")
    figure.suptitle("duet autoscaler vs the smallest static deployment (SIMULATED, OPT-13B on A100, DistServe profile)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def _traces_dir() -> Path:
    from duet.cluster.placement.cluster_spec import traces_dir

    return traces_dir()


def _command(args: argparse.Namespace) -> int:
    from duet.worker_runtime.simulated_engine import simulated_perf

    engine, kv_bytes = simulated_perf("distserve:opt-13b", 1, 1)
    reports = [run_scenario(SCENARIOS[name], args.load, engine, int(kv_bytes), args.outage) for name in args.scenarios.split(",")]
    for report in reports:
        auto, static = report["autoscaled"], report["static"]
        print(
            f"{report['scenario']} x{args.load} ({report['requests']} requests, {report['mean_rate']} req/s mean; SIMULATED): "
            f"autoscaled {auto['gpu_hours']} GPU-h at {auto['attainment']:.1%} | static {static['prefill']}+{static['decode']} "
            f"{static['gpu_hours']} GPU-h at {static['attainment']:.1%} | saved {report['gpu_hours_saved']:.0%} | "
            f"direction changes prefill {auto['direction_changes']['prefill']} decode {auto['direction_changes']['decode']} | "
            f"shrank during outage: {auto['shrank_during_outage']}"
        )
    if args.plot:
        plot(reports, Path(args.plot))
        print(f"plot: {args.plot}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "_plot"} for r in reports], indent=2) + "\n")
    print(f"results: {out}")
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "autoscale", help="an hour of Azure traces, autoscaled vs the smallest static cluster (SIMULATED engines)"
    )
    parser.add_argument("--scenarios", default="azure-code,azure-conv", help=f"comma-separated: {', '.join(SCENARIOS)}")
    parser.add_argument("--load", type=int, default=8, help="users' worth of each trace (its requests repeated)")
    parser.add_argument("--outage", type=float, default=300.0, help="seconds of metrics outage mid-trace")
    parser.add_argument("--plot", default="docs/autoscaling.png", help="PNG path ('' for none)")
    parser.add_argument("--out", default=str(RESULTS / "autoscale_replay.json"))
    parser.set_defaults(handler=_command)
