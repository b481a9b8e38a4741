"""A soak: steady load for a long time, and nothing may grow.

``duet bench soak --minutes N`` starts duet as ``duet serve --front-ends 2`` runs it (real vLLM
workers) and replays a trace at a steady rate (about half of what the default deployment
serves here) for N minutes, with a trickle of what real clients do: streams cancelled after the
first token, connections dropped mid-stream, and requests refused as invalid. Every
``--sample-s`` seconds it samples every process of the deployment (the control plane, each
front door, each worker's Ray actor and engine core): resident memory, open file descriptors
and threads, and the requests in flight at the front doors and workers.

After the warm-up (the first ``--warmup-minutes``), each process's figures at the end are
compared with those just after the warm-up: growth past 5% (and past 2 for counts) fails the
soak. When the load stops every worker and front door must drain to 0 requests in flight and
every engine's KV cache to 0 blocks in use, and the only errors allowed are those the trickle
asked for (CANCELLED, INVALID_ARGUMENT): anything else is an unexplained error and fails it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from duet.benchmarks.apart_cluster import ClusterProcesses, running_apart

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
GROWTH_LIMIT = 0.05
COUNT_SLACK = 2  # fds and threads: a couple come and go with the load
# What each request does, and how often (the rest are served normally).
TRICKLE = {"cancel": 0.04, "disconnect": 0.03, "invalid": 0.03}
EXPECTED = {"ok", "CANCELLED", "disconnected", "INVALID_ARGUMENT"}


def _one(target: str, request: Any, action: str) -> str:
    """Send one request and do ``action`` to it; what it ended with."""
    import grpc

    from duet.router.client import DuetClient

    client = DuetClient(target)
    try:
        if action == "invalid":
            request.max_tokens = 0
        if action == "serve":
            for _ in client.stream(request, timeout=300):
                pass
            return "ok"
        call = client.generate(request, timeout=300)
        for _ in call:
            if action == "cancel":
                call.cancel()
                return "CANCELLED"
            client.close()  # disconnect: the connection goes away mid-stream
            return "disconnected"
        return "ok"
    except grpc.RpcError as error:
        return error.code().name
    finally:
        client.close()


def _sample(cluster: ClusterProcesses) -> dict[str, Any]:
    sample: dict[str, Any] = {"t": time.monotonic(), "processes": {}}
    for label, pid in cluster.processes().items():
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                sample["processes"][label] = {
                    "pid": pid, "rss_mib": process.memory_info().rss / 2**20,
                    "fds": process.num_fds(), "threads": process.num_threads(),
                }
        except psutil.Error:
            continue
    status = cluster.status()
    sample["front_door_inflight"] = sum(door.requests_inflight for door in status.front_ends)
    sample["worker_inflight"] = sum(w.requests_inflight for pool in status.pools for w in pool.workers)
    return sample


def growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per process and figure: its median just after the warm-up, at the end, and whether it grew
    past the limits. A process whose pid changed (it was replaced) is compared from then on."""
    start = samples[0]["t"]
    after = [s for s in samples if s["t"] - start >= warmup_s]
    if len(after) < 4:
        raise ValueError("too few samples after the warm-up to judge growth: run longer or sample more often")
    table: dict[str, dict[str, Any]] = {}
    for label in after[-1]["processes"]:
        pid = after[-1]["processes"][label]["pid"]
        series = [s["processes"][label] for s in after if label in s["processes"] and s["processes"][label]["pid"] == pid]
        if len(series) < 4:
            continue
        window = max(2, len(series) // 5)
        row: dict[str, Any] = {"pid": pid}
        for figure in ("rss_mib", "fds", "threads"):
            first = statistics.median(point[figure] for point in series[:window])
            last = statistics.median(point[figure] for point in series[-window:])
            grew = last > first * (1 + GROWTH_LIMIT) and (figure == "rss_mib" or last - first > COUNT_SLACK)
            row[figure] = {"after_warmup": round(first, 1), "end": round(last, 1), "grew": grew}
        table[label] = row
    return table


def run_soak(target: str, cluster: ClusterProcesses, requests: list[Any], rate: float, minutes: float,
             warmup_minutes: float, sample_s: float, seed: int, log: Any = partial(print, flush=True)) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            try:
                samples.append(_sample(cluster))
            except Exception as error:  # noqa: BLE001 - counted: a sample that failed is an error
                outcomes[f"sample failed: {type(error).__name__}"] += 1
            stop.wait(sample_s)

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    started = time.monotonic()
    sent = 0
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = []
        while time.monotonic() - started < minutes * 60:
            time.sleep(rng.expovariate(rate))
            draw = rng.random()
            action = next((name for name, share in _cumulative(TRICKLE) if draw < share), "serve")
            request = type(requests[0])()
            request.CopyFrom(requests[sent % len(requests)])
            request.request_id = f"soak-{sent}"
            futures.append(pool.submit(_one, target, request, action))
            sent += 1
            if sent % 200 == 0:
                log(f"{time.monotonic() - started:7.0f} s: {sent} requests sent; {dict(outcomes)}")
            for done in [f for f in futures if f.done()]:
                outcomes[done.result()] += 1
                futures.remove(done)
        for future in futures:
            outcomes[future.result()] += 1
    idle = _drained(cluster, timeout_s=150)
    stop.set()
    sampling.join()
    samples.append(_sample(cluster))
    table = growth(samples, warmup_minutes * 60)
    unexplained = {name: count for name, count in outcomes.items() if name not in EXPECTED}
    return {
        "minutes": minutes, "rate": rate, "requests": sent, "outcomes": dict(outcomes), "unexplained_errors": unexplained,
        "idle": idle, "growth": table, "samples": samples,
        "passed": not unexplained and idle["drained"] and not any(
            row[figure]["grew"] for row in table.values() for figure in ("rss_mib", "fds", "threads")),
    }


def _cumulative(shares: dict[str, float]) -> list[tuple[str, float]]:
    total, out = 0.0, []
    for name, share in shares.items():
        total += share
        out.append((name, total))
    return out


def _drained(cluster: ClusterProcesses, timeout_s: float) -> dict[str, Any]:
    """Wait for every front door and worker to hold no request and every engine's KV cache to be
    empty. A prefill whose request was cancelled before the decode worker pulled its KV keeps
    the blocks for the KV lease (kv_transfer.kv_lease_s, 30 s), so this waits past it; blocks
    still held after ``timeout_s`` are a leak."""
    started = time.monotonic()
    while True:
        status = cluster.status()
        inflight = sum(d.requests_inflight for d in status.front_ends) + sum(
            w.requests_inflight for p in status.pools for w in p.workers)
        kv = {w.name: w.kv_cache_usage for p in status.pools for w in p.workers}
        drained = inflight == 0 and all(usage == 0 for usage in kv.values())
        if drained or time.monotonic() - started > timeout_s:
            break
        time.sleep(1.0)
    return {"drained": drained, "after_s": round(time.monotonic() - started, 1), "inflight": inflight, "kv_cache_usage": kv}


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['minutes']:g} min at {result['rate']:g} req/s: {result['requests']} requests, outcomes {result['outcomes']}; "
        f"unexplained errors: {result['unexplained_errors'] or 0}; idle at the end: {result['idle']}",
        f"{'process':<20}{'RSS MiB after warm-up -> end':>32}{'fds':>14}{'threads':>14}",
    ]
    for label, row in sorted(result["growth"].items()):
        cells = [f"{row[f]['after_warmup']:g} -> {row[f]['end']:g}{' GREW' if row[f]['grew'] else ''}" for f in ("rss_mib", "fds", "threads")]
        lines.append(f"{label:<20}{cells[0]:>32}{cells[1]:>14}{cells[2]:>14}")
    lines.append("PASSED" if result["passed"] else "FAILED")
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> int:
    from duet.benchmarks.loadgen import build_requests
    from duet.cluster.placement.cluster_spec import traces_dir
    from duet.cluster.placement.trace import load_trace
    from duet.config import load_config

    if args.warmup_minutes >= args.minutes:
        print("duet bench soak: --warmup-minutes must be below --minutes", file=sys.stderr)
        return 2
    trace = load_trace(args.trace or str(traces_dir() / "AzureLLMInferenceTrace_conv.csv"))
    requests = build_requests(trace.head(1000).capped(args.max_input, args.max_output), seed=args.seed)
    with running_apart(load_config(args.config), args.front_ends) as (control, target):
        cluster = ClusterProcesses(control, target)
        result = run_soak(target, cluster, requests, args.rate, args.minutes, args.warmup_minutes, args.sample_s, args.seed)
        # Written before Ray shuts down: its shutdown can end this process abruptly (a raylet
        # that exits first makes the core worker quit), which lost a soak's results once.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(format_report(result), flush=True)
        print(f"results: {args.out}", file=sys.stderr, flush=True)
    return 0 if result["passed"] else 1


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("soak", help="steady load for N minutes: memory, fds and threads must stay flat (real vLLM)")
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the load runs")
    parser.add_argument("--warmup-minutes", type=float, default=10.0, help="growth is judged after this")
    parser.add_argument("--rate", type=float, default=1.0, help="offered req/s (about half of what the default deployment serves here)")
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--config", help="deployment YAML (default: configs/local.yaml)")
    parser.add_argument("--front-ends", type=int, default=2, help="front doors")
    parser.add_argument("--trace", help="trace file (default: the Azure conversation trace in ../shared/traces)")
    parser.add_argument("--max-input", type=int, default=512, help="cap prompt lengths")
    parser.add_argument("--max-output", type=int, default=48, help="cap output lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result")
    parser.set_defaults(handler=_command)
