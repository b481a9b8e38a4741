"""Prefix-cache affinity on real vLLM prefill workers, on and off, on the Mooncake trace.

``duet bench affinity`` starts one deployment with two prefill workers and one decode worker
and replays a slice of the Mooncake conversation trace (its ``hash_ids`` name the 512-token blocks
requests share: a common system prompt, and each conversation's history) open loop, once per
routing policy, with the prefill engines' prefix caches emptied in between. Each ``hash_id``
becomes a fixed block of ``--block-tokens`` random token ids (the trace's prompts, scaled to the
tiny model's context), so requests share exactly the prefixes the trace says they share.

Per run it reports the prefill engines' prefix-cache hit rate, prompt tokens computed, TTFT,
and how requests split across the two workers. A last pair of runs uses a skewed trace (most
requests open with one long hot prefix) with and without the load guard, to show the guard
keeps the busiest worker within its bound instead of piling the hot prefix onto one worker.

``--front-ends 1,2`` measures instead what independent front doors cost affinity: one
deployment per count (``server.front_ends``, ``prefix_affinity`` in the config), the same
Mooncake slice sent over ``--connections`` client connections that the kernel spreads over
the front doors (SO_REUSEPORT), each front door routing on its own prefix index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duet.benchmarks.arguments import positive_list

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_affinity.json"
RESULTS_FRONT_ENDS = RESULTS.with_name("prefix_affinity_front_ends.json")
_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    arrival_s: list[float]
    output_tokens: int


def mooncake_workload(path: Path, requests: int, block_tokens: int, max_blocks: int, duration_s: float, output_tokens: int) -> Workload:
    rows = [json.loads(line) for line, _ in zip(path.open(), range(requests))]
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = np.random.default_rng(hash_id).integers(3, 700, block_tokens).tolist()
        return blocks[hash_id]

    prompts = [[t for h in row["hash_ids"][:max_blocks] for t in block(h)] for row in rows]
    times = np.array([row["timestamp"] for row in rows], dtype=float) / 1000
    scale = duration_s / max(times[-1] - times[0], 1e-9)
    return Workload("mooncake", prompts, ((times - times[0]) * scale).tolist(), output_tokens)


def skewed_workload(base: Workload, hot_share: float, hot_tokens: int, seed: int = 1) -> Workload:
    """``base`` with ``hot_share`` of its requests opening with one shared ``hot_tokens`` prefix."""
    rng = np.random.default_rng(seed)
    hot = rng.integers(3, 700, hot_tokens).tolist()
    prompts = [hot + prompt if rng.random() < hot_share else prompt for prompt in base.prompts]
    return Workload("skewed", prompts, base.arrival_s, base.output_tokens)


async def prefill_metrics_by_worker(deployment: Any, keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The engine metrics ``keys`` of each of the deployment's prefill workers that has an engine."""
    found = {}
    for member in list(deployment.prefill.members):
        if member.engine is not None:
            metrics = (await member.engine.status()).engine_metrics
            found[member.name] = {key: metrics.get(key, 0.0) for key in keys}
    return found


async def prefill_totals(deployment: Any, keys: tuple[str, ...] = (_HITS, _QUERIES)) -> dict[str, float]:
    """The engine metrics ``keys`` summed over the deployment's prefill workers."""
    totals: Counter[str] = Counter()
    for metrics in (await prefill_metrics_by_worker(deployment, keys)).values():
        totals.update(metrics)
    return dict(totals)


async def _run(
    deployment: Any, workload: Workload, policy: Any, label: str, connections: int = 1
) -> dict[str, Any]:
    """Replay ``workload`` with ``policy`` routing the prefill pool (with front doors of their
    own, each routes with its own policy from the config: pass the deployment's own)."""
    from duet.benchmarks.loadgen import connected_stubs, nearest_rank, open_loop, send_one
    from duet.cluster.placement.trace import Trace
    from duet.router.client import build_request

    await asyncio.gather(*(m.engine.reset_prefix_cache() for m in deployment.prefill.members))
    deployment.prefill.policy = policy
    before = await prefill_totals(deployment)
    routed: Counter[str] = Counter()
    busiest_share: list[float] = []  # the busiest worker's share of outstanding prompt tokens
    stop = asyncio.Event()

    async def watch_load() -> None:
        while not stop.is_set():
            loads = [m.outstanding_tokens for m in deployment.prefill.members]
            if sum(loads):
                busiest_share.append(max(loads) / sum(loads))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch_load())
    trace = Trace(
        workload.name,
        np.array(workload.arrival_s),
        np.array([len(p) for p in workload.prompts]),
        np.full(len(workload.prompts), workload.output_tokens),
    )
    requests = [build_request(prompt_token_ids=p, max_tokens=workload.output_tokens, ignore_eos=True) for p in workload.prompts]
    async with connected_stubs(f"127.0.0.1:{deployment.port}", connections) as stubs:

        async def send(index: int, scheduled_s: float, start: float) -> Any:
            return await send_one(stubs[index % connections], index, requests[index], scheduled_s, start, 600.0)

        records = await open_loop(trace, send)
    stop.set()
    await watcher
    for record in records:
        routed[record.prefill_worker] += 1
    after = await prefill_totals(deployment)
    hits, queries = after[_HITS] - before[_HITS], after[_QUERIES] - before[_QUERIES]
    ttft = sorted(r.ttft_s for r in records if not r.error)
    status = await deployment.cluster.status()
    return {
        "run": label,
        "policy": policy.describe(),
        "front_ends": deployment.config.server.front_ends,
        "requests_per_front_end": [front_end.requests_served for front_end in status.front_ends],
        "requests": len(records),
        "failed": sum(1 for r in records if r.error),
        "prompt_tokens_sent": sum(len(p) for p in workload.prompts),
        # Queried minus hit: the engines' own computed-token count is kept by the front end
        # that sent each request, and with front doors of their own that is not this process.
        "prompt_tokens_computed": int(queries - hits),
        "prefix_cache_hit_rate": hits / queries if queries else math.nan,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": nearest_rank(ttft, 0.9),
        "requests_per_worker": dict(sorted(routed.items())),
        "busiest_share_of_outstanding_mean": statistics.fmean(busiest_share) if busiest_share else math.nan,
    }


def _deployment_config(args: argparse.Namespace, front_ends: int = 1) -> Any:
    """Two prefill workers (the routing measured) and one decode worker, on two cores."""
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    data["prefill"].update(replicas=2, cpu_cores=[0, 1])
    data["ray"]["num_cpus"] = 4
    data["server"].update(metrics_port=None, http_port=None, front_ends=front_ends)
    # Every prompt goes to the prefill pool, whose routing is what is measured.
    data["router"].update(local_prefill_queue_tokens=0, prefill_policy="prefix_affinity", load_factor=args.load_factor)
    return parse_config(data, "bench affinity")


def _base_workload(args: argparse.Namespace) -> Workload:
    from duet.cluster.placement.cluster_spec import traces_dir

    return mooncake_workload(
        traces_dir() / "conversation_trace.jsonl", args.requests, args.block_tokens, args.max_blocks,
        args.duration, args.output_tokens,
    )


async def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    from duet.cluster.deployment import Deployment
    from duet.router.policies import LeastPromptTokens, PrefixAffinity

    deployment = await Deployment(_deployment_config(args)).start(port=0, http_port=None)
    try:
        block_size = (await deployment.prefill.members[0].engine.model_limits())[2]
        base = _base_workload(args)
        skewed = skewed_workload(base, hot_share=0.9, hot_tokens=args.hot_tokens)
        affinity = PrefixAffinity(block_size, args.load_factor)
        runs = [
            (base, LeastPromptTokens(), "mooncake, least_prompt_tokens"),
            (base, affinity, "mooncake, prefix_affinity"),
            (skewed, PrefixAffinity(block_size, args.load_factor), "skewed, prefix_affinity with load guard"),
            (skewed, PrefixAffinity(block_size, load_factor=1e9, slack_tokens=10**9), "skewed, prefix_affinity without guard"),
        ]
        results = []
        for workload, policy, label in runs:
            result = await _run(deployment, workload, policy, label)
            print(_line(result), flush=True)
            results.append(result)
        return results
    finally:
        await deployment.stop()


async def run_front_ends(args: argparse.Namespace, counts: list[int]) -> list[dict[str, Any]]:
    """The Mooncake slice through 1, 2, ... front doors, each routing on its own prefix index.

    One deployment per count, in turn (never two at once: six engines would not fit beside
    each other on two cores); hit rates depend on routing, not on the machine's speed.
    """
    from duet.cluster.deployment import Deployment
    from duet.router.policies import LeastPromptTokens

    base = _base_workload(args)
    results = []
    for count in counts:
        deployment = await Deployment(_deployment_config(args, front_ends=count)).start(port=0, http_port=None)
        doors = f"{count} front door{'s' if count > 1 else ''}"
        # With one front door, the baseline too (after affinity, whose prefix index starts
        # empty in every run): what affinity gains over load balancing alone.
        runs = [(deployment.prefill.policy, f"mooncake, prefix_affinity, {doors}")]
        if count == 1:
            runs.append((LeastPromptTokens(), f"mooncake, least_prompt_tokens, {doors}"))
        try:
            for policy, label in runs:
                result = await _run(deployment, base, policy, label, connections=args.connections)
                print(_line(result), flush=True)
                results.append(result)
        finally:
            await deployment.stop()
    return results


def _share(share: float) -> str:
    return "n/a (front doors of their own hold the counts)" if math.isnan(share) else f"{share:.0%}"


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['run']}: hit rate {result['prefix_cache_hit_rate']:.1%}, "
        f"prompt tokens computed {result['prompt_tokens_computed']} of {result['prompt_tokens_sent']}, "
        f"TTFT mean {result['ttft_mean_s'] * 1000:.0f} ms p90 {result['ttft_p90_s'] * 1000:.0f} ms, "
        f"per worker {result['requests_per_worker']}, busiest worker's share of queued prompt tokens "
        f"{_share(result['busiest_share_of_outstanding_mean'])}, "
        f"failed {result['failed']}"
        + (f", requests per front door {result['requests_per_front_end']}" if result["front_ends"] > 1 else "")
    )


def _command(args: argparse.Namespace) -> int:
    if args.front_ends:
        results, path = asyncio.run(run_front_ends(args, args.front_ends)), RESULTS_FRONT_ENDS
    else:
        results, path = asyncio.run(run_benchmark(args)), RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args) | {"handler": None}, "runs": results}, indent=2))
    print(f"results: {path}", file=sys.stderr)
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("affinity", help="prefix-cache affinity on vs off on the Mooncake trace (real vLLM)")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument(
        "--block-tokens", type=int, default=128,
        help="tokens per Mooncake hash block (the trace's are 512; 128 is vLLM's KV block on CPU)",
    )
    parser.add_argument("--max-blocks", type=int, default=6, help="blocks kept per prompt (the opening ones)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds the slice's arrivals are scaled to")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--hot-tokens", type=int, default=512, help="skewed run: the hot prefix's length")
    parser.add_argument("--load-factor", type=float, default=1.5)
    parser.add_argument(
        "--front-ends", type=positive_list(int), default=None,
        help="comma-separated front-door counts (e.g. 1,2): prefix affinity's hit rate with each, instead of the policy runs",
    )
    parser.add_argument("--connections", type=int, default=8, help="with --front-ends: client connections the requests take turns over")
    parser.set_defaults(handler=_command)
