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

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_affinity.json"
_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
_COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"


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


async def _prefill_totals(deployment: Any) -> dict[str, float]:
    totals: Counter[str] = Counter()
    for member in deployment.prefill.members:
        metrics = (await member.engine.status()).engine_metrics
        for key in (_HITS, _QUERIES, _COMPUTED):
            totals[key] += metrics.get(key, 0.0)
    return dict(totals)


async def _run(deployment: Any, workload: Workload, policy: Any, label: str) -> dict[str, Any]:
    import grpc

    from duet.benchmarks.loadgen import open_loop, send_one
    from duet.cluster.placement.trace import Trace
    from duet.router.client import build_request

    await asyncio.gather(*(m.engine.reset_prefix_cache() for m in deployment.prefill.members))
    deployment.prefill.policy = policy
    before = await _prefill_totals(deployment)
    routed: Counter[str] = Counter()
    busiest_share: list[float] = []  # the busiest worker's share of outstanding prompt tokens
    stop = asyncio.Event()

    async def watch_load() -> None:
        while not stop.is_set():
            loads = [m.outstanding_tokens for m in deployment.prefill.members]
            if sum(loads):
                busiest_share.append(max(loads) / sum(loads))
            await asyncio.sleep(0.05)

    from duet.router.proto import duet_api_pb2_grpc as pb_grpc

    watcher = asyncio.create_task(watch_load())
    trace = Trace(
        workload.name,
        np.array(workload.arrival_s),
        np.array([len(p) for p in workload.prompts]),
        np.full(len(workload.prompts), workload.output_tokens),
    )
    requests = [build_request(prompt_token_ids=p, max_tokens=workload.output_tokens, ignore_eos=True) for p in workload.prompts]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = pb_grpc.DuetStub(channel)

        async def send(index: int, scheduled_s: float, start: float) -> Any:
            return await send_one(stub, index, requests[index], scheduled_s, start, 600.0)

        records = await open_loop(trace, send)
    stop.set()
    await watcher
    for record in records:
        routed[record.prefill_worker] += 1
    after = await _prefill_totals(deployment)
    hits, queries = after[_HITS] - before[_HITS], after[_QUERIES] - before[_QUERIES]
    ttft = sorted(r.ttft_s for r in records if not r.error)
    return {
        "run": label,
        "policy": policy.describe(),
        "requests": len(records),
        "failed": sum(1 for r in records if r.error),
        "prompt_tokens_sent": sum(len(p) for p in workload.prompts),
        "prompt_tokens_computed": int(after[_COMPUTED] - before[_COMPUTED]),
        "prefix_cache_hit_rate": hits / queries if queries else math.nan,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "requests_per_worker": dict(sorted(routed.items())),
        "busiest_share_of_outstanding_mean": statistics.fmean(busiest_share) if busiest_share else math.nan,
    }


async def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    from duet.config import load_config, parse_config
    from duet.cluster.deployment import Deployment
    from duet.cluster.placement.cluster_spec import traces_dir
    from duet.router.policies import LeastPromptTokens, PrefixAffinity

    data = load_config().model_dump()
    data["prefill"].update(replicas=2, cpu_cores=[0, 1])
    data["ray"]["num_cpus"] = 4
    data["server"].update(metrics_port=None, http_port=None)
    # Every prompt goes to the prefill pool, whose routing is what is measured.
    data["router"]["local_prefill_queue_tokens"] = 0
    deployment = await Deployment(parse_config(data, "bench affinity")).start(port=0, http_port=None)
    try:
        block_size = (await deployment.prefill.members[0].engine.model_limits())[2]
        base = mooncake_workload(
            traces_dir() / "conversation_trace.jsonl", args.requests, args.block_tokens, args.max_blocks,
            args.duration, args.output_tokens,
        )
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


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['run']}: hit rate {result['prefix_cache_hit_rate']:.1%}, "
        f"prompt tokens computed {result['prompt_tokens_computed']} of {result['prompt_tokens_sent']}, "
        f"TTFT mean {result['ttft_mean_s'] * 1000:.0f} ms p90 {result['ttft_p90_s'] * 1000:.0f} ms, "
        f"per worker {result['requests_per_worker']}, busiest worker's share of queued prompt tokens "
        f"{result['busiest_share_of_outstanding_mean']:.0%}, "
        f"failed {result['failed']}"
    )


def _command(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args) | {"handler": None}, "runs": results}, indent=2))
    print(f"results: {RESULTS}", file=sys.stderr)
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
    parser.set_defaults(handler=_command)
