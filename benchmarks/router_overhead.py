"""What duet's serving path adds around the engines, with dozens of SIMULATED workers.

``duet bench router`` starts the real router, pools and gRPC server in this process with
SIMULATED engines (worker_runtime/simulated_engine.py: no model is computed, timing from DistServe's
A100 profile), and replays a Poisson load from a separate client process. For every request,
the router-added latency is the client's end-to-end latency minus the seconds the request spent
inside the two engines (each simulated engine records them): the workers' channels, the
router's event loop, the gRPC server and client. Reported: its p50 and p99, as a share of
end-to-end latency, and the router process's memory at the start and end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil

RESULTS = Path(__file__).resolve().parent / "results" / "router_overhead.json"

# The client: duet's open-loop replayer in its own process, records as JSON on stdout.
_CLIENT = (
    "import asyncio, json, sys\n"
    "from duet.benchmarks.loadgen import replay\n"
    "from duet.cluster.placement.trace import synthetic\n"
    "target, n, rate, lengths = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]\n"
    "records = asyncio.run(replay(target, synthetic(n, rate, lengths=lengths, seed=1), seed=0, timeout_s=120))\n"
    "print(json.dumps([r.to_dict() for r in records]))\n"
)


def _config(workers: int) -> Any:
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    for role in ("prefill", "decode"):
        data[role].update(engine="simulated", replicas=workers // 2, num_cpus=0.01, cpu_cores=None)
    data["ray"]["num_cpus"] = 4
    data["server"].update(metrics_port=None, http_port=None)
    return parse_config(data, "bench router")


async def run_benchmark(workers: int, rate: float, duration_s: float, lengths: str) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment

    deployment = await Deployment(_config(workers)).start(port=0, http_port=None)
    router = psutil.Process(os.getpid())
    try:
        memory_start = router.memory_info().rss
        requests = int(rate * duration_s)
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CLIENT, f"127.0.0.1:{deployment.port}", str(requests), str(rate), lengths,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        out, err = await client.communicate()
        if client.returncode != 0:
            raise RuntimeError(f"the client failed:\n{err.decode()[-3000:]}")
        records = json.loads(out)
        memory_end = router.memory_info().rss
        engine_seconds: dict[str, float] = {}
        for member in deployment.prefill.members + deployment.decode.members:
            for request_id, seconds in (await member.actor.simulated_engine_seconds.remote()).items():
                base = request_id.rsplit("-", 1)[0]  # the router suffixes client ids to make them unique
                engine_seconds[base] = engine_seconds.get(base, 0.0) + seconds
    finally:
        await deployment.stop()
    served = [r for r in records if not r["error"]]
    added = np.array([r["client_e2e_s"] - engine_seconds.get(f"loadgen-0-{r['index']}", np.nan) for r in served])
    e2e = np.array([r["client_e2e_s"] for r in served])
    return {
        "workers": workers,
        "offered_rate": rate,
        "duration_s": duration_s,
        "requests": len(records),
        "failed": len(records) - len(served),
        "achieved_rate": len(served) / max(r["sent_s"] for r in records) if records else 0.0,
        "router_added_p50_ms": float(np.nanpercentile(added, 50) * 1000),
        "router_added_p99_ms": float(np.nanpercentile(added, 99) * 1000),
        "router_added_share_of_e2e_p50": float(np.nanpercentile(added / e2e, 50)),
        "e2e_p50_ms": float(np.percentile(e2e, 50) * 1000),
        "router_rss_start_mib": memory_start / 2**20,
        "router_rss_end_mib": memory_end / 2**20,
    }


def _command(args: argparse.Namespace) -> int:
    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        result = asyncio.run(run_benchmark(args.workers, rate, args.duration, args.lengths))
        results.append(result)
        print(
            f"{args.workers} SIMULATED workers, {rate:g} req/s offered ({result['achieved_rate']:.0f} served/s, "
            f"{result['failed']} failed): router adds p50 {result['router_added_p50_ms']:.2f} ms, "
            f"p99 {result['router_added_p99_ms']:.2f} ms ({result['router_added_share_of_e2e_p50']:.1%} of e2e p50 "
            f"{result['e2e_p50_ms']:.1f} ms); router RSS {result['router_rss_start_mib']:.0f} -> "
            f"{result['router_rss_end_mib']:.0f} MiB",
            flush=True,
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "router", help="router-added latency and memory with SIMULATED workers (no model computed)"
    )
    parser.add_argument("--workers", type=int, default=32, help="simulated workers, half prefill, half decode")
    parser.add_argument("--rates", default="100,1000", help="offered request rates (req/s), one run each")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--lengths", default="fixed:128:8", help="synthetic request lengths (see `duet simulate`)")
    parser.set_defaults(handler=_command)
