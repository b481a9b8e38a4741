"""Fidelity of the placement simulator: a plan run for real on this machine vs its prediction.

Profiles the real CPU engine (one core, as each engine gets in the deployment), plans a
one-node ``cpu-core`` cluster for a slice of the Azure conversation trace and an SLO, deploys the
plan once with ``duet serve --plan``, replays the same slice open-loop at three rates, and
simulates exactly the same requests at the same rates with the same plan. The simulator is good
enough to plan with if the attainments agree within 10 percentage points at every load.

A first, unrecorded replay warms the engines up and measures the serving path's CPU per streamed
token (``host_overhead.py``), which the engine profile cannot see and which on two shared cores
decides the SLO; predictions are made with it (``predicted``) and, for comparison, without it
(``predicted_engine_only``). Each load level starts only when the machine's load average is
below ``--max-load``, since other work shares these cores.

    python benchmarks/placement_fidelity.py [--quick] [--profile profile.yaml] [--out results.json]

The deployment runs in its own process (as it would in production), so the load generator does
not share the router's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from duet.benchmarks.host_overhead import measure_host_ms_per_token
from duet.benchmarks.loadgen import replay, replay_result
from duet.config import load_config
from duet.cluster.placement.cluster_spec import ClusterSpec, traces_dir
from duet.cluster.placement.commands import parse_slo
from duet.cluster.placement.goodput import plan_context, simulate
from duet.cluster.placement.latency_model import LatencyModel, ServingPathCost
from duet.cluster.placement.optimizer import optimize
from duet.cluster.placement.plan import Plan
from duet.cluster.placement.simulator import SimConfig, Slo
from duet.cluster.placement.trace import Trace, load_trace

RESULTS = Path(__file__).resolve().parent / "results" / "placement_fidelity.json"
# NIXL between two Ray actors on this machine (../shared/ENVIRONMENT.md), GB/s.
KV_LINK_GBS = 4.65
CALIBRATION_REQUESTS = 40


def run_profile(out: Path) -> Path:
    """``duet profile`` in its own process: it pins itself to core 0, which must not leak here."""
    subprocess.run(
        [sys.executable, "-m", "duet.cli", "profile", "--model", "tiny", "--cpus", "0", "--out", str(out)],
        check=True,
    )
    return out


def write_cluster(path: Path, profile: Path) -> Path:
    """This machine as the planner sees it: one node whose two "GPUs" are the two cores.

    The profile is named relative to the cluster file, so a run's work files still predict
    after the folder is copied or moved (``placement_crossval.py --repredict``)."""
    relative = os.path.relpath(profile.resolve(), path.resolve().parent)
    spec = {
        "model": "duet-tiny-llama",
        "network_gbs": KV_LINK_GBS,
        "gpu_types": {"cpu-core": {"nvlink_gbs": KV_LINK_GBS, "profile": relative}},
        "nodes": [{"gpu_type": "cpu-core", "count": 1, "gpus_per_node": 2}],
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def write_deploy_config(workdir: Path, requests: int, metrics_port: int | None = None) -> Path:
    """The default deployment with admission opened up: the simulator has no admission limit,
    so a request must never be turned away for being the 129th in flight; nor does it model
    prefilling on the decode side when the prefill queue is long, so that is off."""
    data = load_config().model_dump()
    data["router"]["local_prefill_queue_tokens"] = 0
    data["server"]["max_inflight_requests"] = max(requests, data["server"]["max_inflight_requests"])
    if metrics_port is not None:
        data["server"]["metrics_port"] = metrics_port
    path = workdir / "deploy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def serving(config: Path, plan: Path, log: Path) -> Iterator[tuple[str, int]]:
    """``duet serve --plan`` in a child process; yields its gRPC target and pid once it is ready."""
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "duet.cli", "serve", "--config", str(config), "--plan", str(plan), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                match = re.search(r"serving \S+ on (\S+:\d+)", line)
                if match:
                    yield match.group(1), proc.pid
                    break
            else:
                raise RuntimeError(f"duet serve exited with {proc.wait()} before serving; see {log}")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every fidelity run shares: lengths, SLO, profile, quiet machine, files."""
    parser.add_argument("--max-input", type=int, default=1800)
    parser.add_argument("--max-output", type=int, default=96)
    parser.add_argument("--slo", default="ttft=1,tpot=0.1")
    parser.add_argument("--profile", type=Path, help="reuse this profile.yaml instead of profiling")
    parser.add_argument("--max-load", type=float, default=2.5, help="start a run only below this load")
    parser.add_argument("--quiet-timeout", type=float, default=1800, help="seconds to wait for quiet")
    parser.add_argument("--workdir", type=Path, help="keep profile, cluster, plan and logs here")


def deployed_sim_config() -> SimConfig:
    """The simulator's per-step budgets: the deployed engines' (duet's config defaults), with
    prompts chunked to fill each step's budget, as vLLM's v1 scheduler does."""
    deployed = load_config()
    return SimConfig(
        prefill_max_batch_tokens=deployed.prefill.max_num_batched_tokens,
        max_num_seqs=deployed.decode.max_num_seqs,
        chunked_prefill=True,
    )


def predict(cluster: ClusterSpec, plan: Plan, trace: Trace, slo: Slo, rate: float, sim: SimConfig) -> dict:
    """The simulator's summary for the plan on ``trace`` at ``rate`` (the same requests replayed)."""
    ctx, planned = plan_context(cluster, plan, trace, slo, sim)
    return simulate(ctx, planned, rate, None).summary(slo)


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait until the 1-minute load average is below ``max_load``; returns the last reading.

    Other work shares this machine's two cores; a run measured under its load says more about
    that work than about the plan, so each load level starts only once the machine is quiet.
    """
    deadline = time.monotonic() + timeout_s
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() < deadline:
        time.sleep(10)
    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 requests per rate (a smoke run)")
    parser.add_argument("--trace", default=str(traces_dir() / "AzureLLMInferenceTrace_conv.csv"))
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rates", default="3,5,8", help="req/s, comma-separated")
    parser.add_argument("--plan-rate", type=float, help="rate to plan for (default: the lowest)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_run_arguments(parser)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="duet-fidelity-"))
    workdir.mkdir(parents=True, exist_ok=True)
    requests = 60 if args.quick else args.requests
    rates = [float(r) for r in args.rates.split(",")]
    slo = parse_slo(args.slo, 0.9)
    trace = load_trace(args.trace).head(requests).capped(args.max_input, args.max_output)
    sim = deployed_sim_config()

    profile = args.profile or run_profile(workdir / "profile.yaml")
    cluster = ClusterSpec.load(write_cluster(workdir / "cluster.yaml", profile))
    # disaggregated: the prefill and decode pools whose simulation this benchmark checks
    result = optimize(
        cluster, trace, slo, rate=args.plan_rate or min(rates), workers=2, sim=sim, modes=["disaggregated"]
    )
    plan_path = workdir / "plan.yaml"
    result.plan.save(plan_path)
    print(f"plan: {result.plan.summary()}", flush=True)

    rows = []
    with serving(write_deploy_config(workdir, requests), plan_path, workdir / "serve.log") as (target, pid):
        # The first replay warms the fresh engines up (first kernels per shape, the NIXL
        # handshake: one-off costs the simulator rightly ignores) and measures the serving
        # path's CPU per token, which the engine profile cannot see.
        wait_for_quiet(args.max_load, args.quiet_timeout)
        calibration = trace.head(CALIBRATION_REQUESTS).at_rate(min(rates))
        host_ms, _ = measure_host_ms_per_token(target, pid, calibration, model=cluster.model, seed=0)
        with_host = LatencyModel.load(profile).with_serving_path(ServingPathCost(ms_per_token=host_ms))
        with_host.save(workdir / "profile-host.yaml")
        cluster_host = ClusterSpec.load(write_cluster(workdir / "cluster-host.yaml", workdir / "profile-host.yaml"))
        print(f"serving path: {host_ms:.3f} ms of CPU per streamed token", flush=True)
        for seed, rate in enumerate(rates, start=1):
            load_before = wait_for_quiet(args.max_load, args.quiet_timeout)
            started = time.perf_counter()
            # A new seed per rate: the engines cache prefixes, so repeated prompts would be free.
            records = asyncio.run(replay(target, trace.at_rate(rate), model=cluster.model, seed=seed))
            measured = replay_result(records).summary(slo)
            rows.append(
                {
                    "rate_rps": rate,
                    "measured": measured,
                    "predicted": predict(cluster_host, result.plan, trace, slo, rate, sim),
                    "predicted_engine_only": predict(cluster, result.plan, trace, slo, rate, sim),
                    "errors": sum(bool(r.error) for r in records),
                    "max_send_lag_s": max(r.sent_s - r.scheduled_s for r in records),
                    "wall_s": time.perf_counter() - started,
                    "load_average_1m": [load_before, os.getloadavg()[0]],
                    "records": [r.to_dict() for r in records],
                }
            )
            print(format_row(rows[-1]), flush=True)
            time.sleep(5)  # let the engines drain anything left before the next load level

    print(format_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "trace": f"{Path(args.trace).name}, first {requests} requests, input <= {args.max_input}, "
                f"output <= {args.max_output}",
                "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                "profile": with_host.to_dict(),
                "plan": result.plan.summary(),
                "sim_config": dataclasses.asdict(sim),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out} (work files in {workdir})")


def _points(row: dict, key: str) -> float:
    return 100 * (row["measured"][key] - row["predicted"][key])


def format_row(row: dict) -> str:
    m, p = row["measured"], row["predicted"]
    return (
        f"{row['rate_rps']:6.2f} req/s  measured {m['attainment']:6.1%} (TTFT {m['ttft_attainment']:6.1%}, "
        f"TPOT {m['tpot_attainment']:6.1%})  predicted {p['attainment']:6.1%} (TTFT {p['ttft_attainment']:6.1%}, "
        f"TPOT {p['tpot_attainment']:6.1%})  diff {_points(row, 'attainment'):+5.1f} pp  "
        f"[TTFT p50/p90 {m['ttft_p50_s']:.3f}/{m['ttft_p90_s']:.3f} vs {p['ttft_p50_s']:.3f}/{p['ttft_p90_s']:.3f} s, "
        f"TPOT p50/p90 {m['tpot_p50_s']:.4f}/{m['tpot_p90_s']:.4f} vs {p['tpot_p50_s']:.4f}/{p['tpot_p90_s']:.4f} s, "
        f"errors {row['errors']}, load {row['load_average_1m'][0]:.2f}]"
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| rate (req/s) | measured: both / TTFT / TPOT | predicted: both / TTFT / TPOT | difference (pp) "
        "| engine-only prediction: both (difference) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m, p, e = row["measured"], row["predicted"], row["predicted_engine_only"]
        lines.append(
            f"| {row['rate_rps']:g} | {m['attainment']:.1%} / {m['ttft_attainment']:.1%} / {m['tpot_attainment']:.1%} "
            f"| {p['attainment']:.1%} / {p['ttft_attainment']:.1%} / {p['tpot_attainment']:.1%} "
            f"| {_points(row, 'attainment'):+.1f} / {_points(row, 'ttft_attainment'):+.1f} / "
            f"{_points(row, 'tpot_attainment'):+.1f} "
            f"| {e['attainment']:.1%} ({100 * (m['attainment'] - e['attainment']):+.1f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
