"""What duet's serving path adds around the engines, with dozens of SIMULATED workers.

``duet bench router`` starts the real control plane, front doors, router, pools and gRPC
servers with SIMULATED engines (worker_runtime/simulated_engine.py: no model is computed,
timing from DistServe's A100 profile), and replays a Poisson load from a separate client
process. For every request, the router-added latency is the client's end-to-end latency minus
the seconds the request spent inside the two engines (each simulated engine records them):
the workers' channels, the router's event loop, the gRPC server and client. Reported: its p50
and p99, as a share of end-to-end latency, the rate served, the front doors' CPU per request,
and the router process's memory at the start and end of the run.

``--front-ends 1,2`` starts one deployment per count side by side and measures them in
interleaved rounds (``--rounds``, order rotated), since this machine's speed changes within
minutes. With one front door the front door is this process (it is also the control plane);
with several, each is a process of its own and the CPU counted is theirs. The client's
connections (``--connections``) are spread over the front doors by the kernel (SO_REUSEPORT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from duet.benchmarks.arguments import positive_list

RESULTS = Path(__file__).resolve().parent / "results" / "router_overhead.json"
RESULTS_FRONT_ENDS = RESULTS.with_name("router_front_ends.json")

# The client: duet's open-loop replayer in its own process, records as JSON on stdout.
_CLIENT = (
    "import asyncio, json, sys\n"
    "from duet.benchmarks.loadgen import replay\n"
    "from duet.cluster.placement.trace import synthetic\n"
    "target, n, rate, lengths, seed, connections = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])\n"
    "trace = synthetic(n, rate, lengths=lengths, seed=seed + 1)\n"
    "records = asyncio.run(replay(target, trace, seed=seed, timeout_s=120, connections=connections))\n"
    "print(json.dumps([r.to_dict() for r in records]))\n"
)


def _config(workers: int, front_ends: int = 1) -> Any:
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    for role in ("prefill", "decode"):
        data[role].update(engine="simulated", replicas=workers // 2, num_cpus=0.01, cpu_cores=None)
    data["ray"]["num_cpus"] = 4
    data["server"].update(metrics_port=None, http_port=None, front_ends=front_ends)
    return parse_config(data, "bench router")


async def _front_door_processes(deployment: Any) -> list[psutil.Process]:
    """The processes that serve the APIs: this one with one front door, else the front doors'."""
    doors = (await deployment.cluster.status()).front_ends
    return [psutil.Process(door.pid) for door in doors] if doors else [psutil.Process(os.getpid())]


def _cpu_s(processes: list[psutil.Process]) -> list[float]:
    return [sum(process.cpu_times()[:2]) for process in processes]


async def measure(
    deployment: Any, rate: float, duration_s: float, lengths: str, seed: int = 0, connections: int = 1
) -> dict[str, Any]:
    """One replay at ``rate`` against a started deployment."""
    router = psutil.Process(os.getpid())
    memory_start = router.memory_info().rss
    processes = await _front_door_processes(deployment)
    cpu_start = _cpu_s(processes)
    requests = int(rate * duration_s)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLIENT, f"127.0.0.1:{deployment.port}", str(requests), str(rate), lengths,
        str(seed), str(connections), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await client.communicate()
    if client.returncode != 0:
        raise RuntimeError(f"the client failed:\n{err.decode()[-3000:]}")
    records = json.loads(out)
    cpu = [end - start for start, end in zip(cpu_start, _cpu_s(processes))]
    memory_end = router.memory_info().rss
    engine_seconds: dict[str, float] = {}
    for member in deployment.prefill.members + deployment.decode.members:
        for request_id, seconds in (await member.actor.simulated_engine_seconds.remote()).items():
            base = request_id.rsplit("-", 1)[0]  # the router suffixes client ids to make them unique
            engine_seconds[base] = engine_seconds.get(base, 0.0) + seconds
    served = [r for r in records if not r["error"]]
    added = np.array([r["client_e2e_s"] - engine_seconds.get(f"loadgen-{seed}-{r['index']}", np.nan) for r in served])
    e2e = np.array([r["client_e2e_s"] for r in served])
    return {
        "workers": len(deployment.prefill.members) + len(deployment.decode.members),
        "front_ends": deployment.config.server.front_ends,
        "offered_rate": rate,
        "duration_s": duration_s,
        "requests": len(records),
        "failed": len(records) - len(served),
        # Why, by gRPC status (RESOURCE_EXHAUSTED: refused by admission control, backpressure).
        "failures": dict(Counter(r["error"].split(":")[0] for r in records if r["error"])),
        "achieved_rate": len(served) / max(r["sent_s"] for r in records) if records else 0.0,
        "router_added_p50_ms": float(np.nanpercentile(added, 50) * 1000) if served else float("nan"),
        "router_added_p99_ms": float(np.nanpercentile(added, 99) * 1000) if served else float("nan"),
        "router_added_share_of_e2e_p50": float(np.nanpercentile(added / e2e, 50)) if served else float("nan"),
        "e2e_p50_ms": float(np.percentile(e2e, 50) * 1000) if served else float("nan"),
        "front_door_cpu_ms_per_request": sum(cpu) / max(len(served), 1) * 1000,
        "front_door_cpu_share": [round(c / sum(cpu), 3) if sum(cpu) else 0.0 for c in cpu],
        "router_rss_start_mib": memory_start / 2**20,
        "router_rss_end_mib": memory_end / 2**20,
    }


async def run_benchmark(workers: int, rate: float, duration_s: float, lengths: str) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment

    deployment = await Deployment(_config(workers)).start(port=0, http_port=None)
    try:
        return await measure(deployment, rate, duration_s, lengths)
    finally:
        await deployment.stop()


async def run_front_ends(
    workers: int, counts: list[int], rates: list[float], duration_s: float, lengths: str, rounds: int, connections: int
) -> list[dict[str, Any]]:
    """Every count's deployment started together, measured in interleaved rounds at each rate."""
    from duet.cluster.deployment import Deployment

    deployments = [await Deployment(_config(workers, count)).start(port=0, http_port=None) for count in counts]
    results = []
    try:
        for rate in rates:
            for round_index in range(rounds):
                order = deployments[round_index % len(deployments):] + deployments[: round_index % len(deployments)]
                for deployment in order:
                    seed = len(results)  # fresh request ids (and prompts) every run
                    result = await measure(deployment, rate, duration_s, lengths, seed, connections)
                    result["round"] = round_index
                    print(_line(result), flush=True)
                    results.append(result)
                print(_ratios(results[-len(deployments):], counts[0]), flush=True)
    finally:
        for deployment in deployments:
            await deployment.stop()
    return results


def _ratios(round_results: list[dict[str, Any]], base_count: int) -> str:
    """One round's served rate and front-door CPU per request of each count against ``base_count``'s."""
    base = next(r for r in round_results if r["front_ends"] == base_count)
    return "  round {}: {}".format(
        base["round"],
        ", ".join(
            f"{r['front_ends']} vs {base_count} front door(s): served {r['achieved_rate'] / base['achieved_rate']:.2f}x, "
            f"CPU per request {r['front_door_cpu_ms_per_request'] / base['front_door_cpu_ms_per_request']:.2f}x"
            for r in sorted(round_results, key=lambda r: r["front_ends"])
            if r is not base
        ),
    )


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['workers']} SIMULATED workers, {result['front_ends']} front door(s), {result['offered_rate']:g} req/s "
        f"offered ({result['achieved_rate']:.0f} served/s, {result['failed']} failed {result['failures']}): router adds p50 "
        f"{result['router_added_p50_ms']:.2f} ms, p99 {result['router_added_p99_ms']:.2f} ms "
        f"({result['router_added_share_of_e2e_p50']:.1%} of e2e p50 {result['e2e_p50_ms']:.1f} ms); "
        f"front-door CPU {result['front_door_cpu_ms_per_request']:.2f} ms/request "
        f"(shares {result['front_door_cpu_share']}); router RSS {result['router_rss_start_mib']:.0f} -> "
        f"{result['router_rss_end_mib']:.0f} MiB"
    )


def _command(args: argparse.Namespace) -> int:
    if args.front_ends:
        results = asyncio.run(
            run_front_ends(args.workers, args.front_ends, args.rates, args.duration, args.lengths, args.rounds, args.connections)
        )
        path = RESULTS_FRONT_ENDS
    else:
        results = []
        for rate in args.rates:
            result = asyncio.run(run_benchmark(args.workers, rate, args.duration, args.lengths))
            print(_line(result), flush=True)
            results.append(result)
        path = RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}", file=sys.stderr)
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "router", help="router-added latency and memory with SIMULATED workers (no model computed)"
    )
    parser.add_argument("--workers", type=int, default=32, help="simulated workers, half prefill, half decode")
    parser.add_argument(
        "--rates", type=positive_list(float), default="100,1000", help="offered request rates (req/s), one run each"
    )
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--lengths", default="fixed:128:8", help="synthetic request lengths (see `duet simulate`)")
    parser.add_argument(
        "--front-ends", type=positive_list(int), default=None,
        help="comma-separated front-door counts (e.g. 1,2): one deployment each, measured in interleaved rounds",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --front-ends: rounds per rate")
    parser.add_argument("--connections", type=int, default=8, help="with --front-ends: the client's connections")
    parser.set_defaults(handler=_command)
