"""The host KV pool against prefix affinity alone, on the Mooncake conversation trace (real vLLM).

``duet bench kv-pool`` starts two deployments side by side, the same but for ``kv_pool.enabled``:
two prefill workers routed by ``prefix_affinity`` (no prompt prefilled on the decode worker),
their engines' KV caches a fraction of the slice's distinct prefix blocks (``--cache-share``),
and one decode worker. It replays a slice of the Mooncake conversation trace (the workload of
``duet bench affinity``: each ``hash_id`` a fixed block of token ids, so requests share exactly
the prefixes the trace says they share) on each deployment in turn, round by round, the order
reversed every other round (this machine's speed moves within minutes). Every replay starts with
empty engine caches and an empty pool.

Per replay it reports the prompt tokens the prefill engines computed against the infinite-cache
bound (from the trace's ``hash_ids``: a prefix block computed once is never computed again,
while vLLM computes at least a prompt's last block), the tokens loaded from the pool, and TTFT.

Then, once per deployment (``--scale-in``), a prefill worker joins mid-run: the slice's first
half on the two workers, a third started between the halves, the second half on the three. The
new worker's hit rate (the share of its prompt tokens it did not compute) over its first
``--first-requests`` requests is set against the old workers' over the same seconds: with the
pool it should be warm from its first request, without it cold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from duet.benchmarks.prefix_affinity import Workload, mooncake_workload, prefill_metrics_by_worker, prefill_totals

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pool.json"
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The prefill engines' prompt tokens by where their KV came from.
_BY_SOURCE = {source: f"vllm:prompt_tokens_by_source_total{{source={source}}}" for source in _SOURCES}
_ENGINE_BLOCK = 128  # vLLM's KV block on CPU
_STATS_LAG_S = 2.0  # a prefill's counts reach the front end with a later step's stats


def infinite_cache_bound(prompts: list[list[int]], block: int = _ENGINE_BLOCK) -> int:
    """Prompt tokens computed with an unbounded cache: a whole block whose prefix came before is
    loaded, and at least a prompt's last token is computed (a KV connector may load up to it;
    vLLM's own prefix cache stops a block short)."""
    seen: set[tuple[int, ...]] = set()
    computed = 0
    for prompt in prompts:
        blocks = [tuple(prompt[start : start + block]) for start in range(0, len(prompt) - block + 1, block)]
        prefixes = [tuple(blocks[: i + 1]) for i in range(len(blocks))]
        hit = 0
        while hit < len(prefixes) and prefixes[hit] in seen:
            hit += 1
        computed += len(prompt) - min(hit * block, len(prompt) - 1)
        seen.update(prefixes)
    return computed


def distinct_blocks(prompts: list[list[int]], block: int = _ENGINE_BLOCK) -> int:
    return len({tuple(p[: end]) for p in prompts for end in range(block, len(p) + 1, block)})


def _block_bytes(config: Any) -> int:
    """KV bytes of one engine block of the deployment's model (K and V, every layer)."""
    from transformers import AutoConfig

    from duet.worker_runtime.engine import resolve_model_path

    model = AutoConfig.from_pretrained(str(resolve_model_path(config.model)))
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    return 2 * model.num_hidden_layers * model.num_key_value_heads * head_dim * 4 * _ENGINE_BLOCK  # float32


def _deployment_config(pool: bool, kv_cache_gib: float, directory: str) -> Any:
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    data["prefill"].update(replicas=2, cpu_cores=[0, 1], kv_cache_gib=kv_cache_gib)
    data["ray"]["num_cpus"] = 8
    data["server"].update(metrics_port=None, http_port=None)
    data["router"].update(local_prefill_queue_tokens=0, prefill_policy="prefix_affinity")
    data["kv_pool"].update(enabled=pool, directory=directory)
    return parse_config(data, "bench kv-pool")


async def _empty(deployment: Any, directory: str) -> None:
    """Empty engine caches, an empty pool and an empty routing index: a replay starts cold."""
    from duet.router.policies import PrefixAffinity

    await asyncio.gather(*(member.engine.reset_prefix_cache() for member in deployment.prefill.members))
    for path in Path(directory).glob("*"):  # an empty pool (vLLM's tier keeps its folders' config)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    old = deployment.prefill.policy
    deployment.prefill.policy = PrefixAffinity(old.block_size, old.load_factor, shared_pool=old.shared_pool)  # empty index


async def _send(deployment: Any, workload: Workload, finished: Callable[[Any], None] = lambda record: None) -> list[Any]:
    """Replay ``workload`` open-loop on ``deployment`` (``finished`` called with each request's
    record as it ends)."""
    from duet.benchmarks.loadgen import connected_stubs, open_loop, send_one
    from duet.cluster.placement.trace import Trace
    from duet.router.client import build_request

    trace = Trace(
        workload.name, np.array(workload.arrival_s), np.array([len(p) for p in workload.prompts]),
        np.full(len(workload.prompts), workload.output_tokens),
    )
    requests = [build_request(prompt_token_ids=p, max_tokens=workload.output_tokens, ignore_eos=True) for p in workload.prompts]

    async def send(stub: Any, index: int, scheduled_s: float, start: float) -> Any:
        record = await send_one(stub, index, requests[index], scheduled_s, start, 600.0)
        finished(record)
        return record

    async with connected_stubs(f"127.0.0.1:{deployment.port}", 1) as (stub,):
        return await open_loop(trace, lambda i, s, start: send(stub, i, s, start))


async def _replay(deployment: Any, workload: Workload, label: str, directory: str, bound: int) -> dict[str, Any]:
    from duet.benchmarks.loadgen import nearest_rank

    await _empty(deployment, directory)
    before = await prefill_totals(deployment, tuple(_BY_SOURCE.values()))
    records = await _send(deployment, workload)
    await asyncio.sleep(_STATS_LAG_S)
    after = await prefill_totals(deployment, tuple(_BY_SOURCE.values()))
    counted = {source: int(after[key] - before[key]) for source, key in _BY_SOURCE.items()}
    ttft = sorted(r.ttft_s for r in records if not r.error)
    return {
        "run": label,
        "requests": len(records),
        "failed": sum(1 for r in records if r.error),
        "prompt_tokens_sent": sum(len(p) for p in workload.prompts),
        "prompt_tokens_computed": counted["local_compute"],
        "prompt_tokens_from_engine_cache": counted["local_cache_hit"],
        "prompt_tokens_from_pool": counted["external_kv_transfer"],
        "infinite_cache_bound": bound,
        "computed_over_bound": counted["local_compute"] / bound,
        "ttft_p50_s": statistics.median(ttft) if ttft else math.nan,
        "ttft_p90_s": nearest_rank(ttft, 0.9) if ttft else math.nan,
    }


async def _tokens_by_worker(deployment: Any) -> dict[str, dict[str, float]]:
    """Each prefill worker's prompt tokens so far, by where their KV came from (keyed by metric)."""
    return await prefill_metrics_by_worker(deployment, tuple(_BY_SOURCE.values()))


def _hit_rate(start: dict[str, dict[str, float]], end: dict[str, dict[str, float]], workers: list[str]) -> float:
    """The share of ``workers``' prompt tokens between two samples not computed (found in the
    engine's own cache or loaded from the pool)."""
    tokens = {
        source: sum(end[w][key] - start.get(w, {}).get(key, 0.0) for w in workers) for source, key in _BY_SOURCE.items()
    }
    total = sum(tokens.values())
    return (total - tokens["local_compute"]) / total if total else math.nan


async def _scale_in(deployment: Any, workload: Workload, label: str, directory: str, first_requests: int) -> dict[str, Any]:
    """The first half of the slice on the deployment's prefill workers, then one more worker
    (started between the halves), then the second half: the new worker's prompt-token hit rate
    over its first ``first_requests`` requests against the old workers' over the same time.
    The pool is scaled back afterwards."""
    await _empty(deployment, directory)
    half = len(workload.prompts) // 2
    arrivals = workload.arrival_s
    first = Workload(workload.name, workload.prompts[:half], arrivals[:half], workload.output_tokens)
    second = Workload(workload.name, workload.prompts[half:], [t - arrivals[half] for t in arrivals[half:]], workload.output_tokens)
    await _send(deployment, first)
    old = [member.name for member in deployment.prefill.members]
    deployment.scale("prefill", len(old) + 1)
    (new,) = [member for member in deployment.prefill.members if member.name not in old]
    deadline = time.monotonic() + 300
    while new.state != "ready":
        if time.monotonic() > deadline or new.state == "failed":
            raise RuntimeError(f"bench kv-pool: the added prefill worker {new.name} is {new.state}")
        await asyncio.sleep(0.5)
    samples: list[tuple[float, dict[str, dict[str, float]]]] = [(time.perf_counter(), await _tokens_by_worker(deployment))]
    new_done: list[float] = []  # when each of the new worker's requests ended

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.5)
            samples.append((time.perf_counter(), await _tokens_by_worker(deployment)))

    sampler = asyncio.create_task(sample())
    try:
        records = await _send(deployment, second, lambda r: new_done.append(time.perf_counter()) if r.prefill_worker == new.name else None)
        await asyncio.sleep(_STATS_LAG_S)
    finally:
        sampler.cancel()
    samples.append((time.perf_counter(), await _tokens_by_worker(deployment)))
    # The window: from the new worker's start to the first sample that has its first
    # ``first_requests`` requests' counts (stats reach the front end a step or so late).
    reached = new_done[min(first_requests, len(new_done)) - 1] + _STATS_LAG_S if new_done else samples[-1][0]
    end_at, end = next(((t, s) for t, s in samples if t >= reached), samples[-1])
    start = samples[0][1]
    deployment.scale("prefill", len(old))
    while any(member.name == new.name for member in deployment.prefill.members):
        await asyncio.sleep(0.5)
    return {
        "run": label,
        "failed": sum(1 for r in records if r.error),
        "new_worker": new.name,
        "new_worker_requests": len(new_done),
        "new_worker_requests_in_window": sum(1 for t in new_done if t <= end_at),
        "new_worker_hit_rate": _hit_rate(start, end, [new.name]),
        "old_workers_hit_rate": _hit_rate(start, end, old),
        "new_worker_hit_rate_after": _hit_rate(end, samples[-1][1], [new.name]),
        "old_workers_hit_rate_after": _hit_rate(end, samples[-1][1], old),
    }


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment
    from duet.cluster.placement.cluster_spec import traces_dir
    from duet.config import load_config

    workload = mooncake_workload(
        traces_dir() / "conversation_trace.jsonl", args.requests, _ENGINE_BLOCK, args.max_blocks, args.duration, args.output_tokens
    )
    bound, distinct = infinite_cache_bound(workload.prompts), distinct_blocks(workload.prompts)
    block_bytes = _block_bytes(load_config())
    kv_cache_gib = args.cache_share * distinct * block_bytes / 2 / 2**30  # per engine: two share it
    print(
        f"{len(workload.prompts)} requests, {distinct} distinct prefix blocks ({distinct * block_bytes / 2**30:.2f} GiB); "
        f"each prefill engine's KV cache {kv_cache_gib:.3f} GiB: both together {args.cache_share:.0%} of them; "
        f"infinite-cache bound {bound} of {sum(map(len, workload.prompts))} prompt tokens",
        flush=True,
    )
    directories = {pool: tempfile.mkdtemp(prefix="duet-bench-kv-pool-", dir="/dev/shm") for pool in (False, True)}
    deployments: dict[bool, Any] = {}
    try:
        for pool in (False, True):
            deployments[pool] = await Deployment(_deployment_config(pool, kv_cache_gib, directories[pool])).start(port=0, http_port=None)
        runs = []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for pool in order:
                label = "host KV pool" if pool else "prefix affinity alone"
                result = await _replay(deployments[pool], workload, label, directories[pool], bound) | {"round": round_index}
                print(_line(result), flush=True)
                runs.append(result)
        scale_in = []
        for pool in (False, True) if args.scale_in else ():
            label = "host KV pool" if pool else "prefix affinity alone"
            result = await _scale_in(deployments[pool], workload, label, directories[pool], args.first_requests)
            print(_scale_in_line(result), flush=True)
            scale_in.append(result)
        return {
            "distinct_prefix_blocks": distinct, "block_bytes": block_bytes, "kv_cache_gib_per_engine": kv_cache_gib,
            "runs": runs, "scale_in": scale_in,
        }
    finally:
        for deployment in deployments.values():
            await deployment.stop()
        for directory in directories.values():
            shutil.rmtree(directory, ignore_errors=True)


def _line(result: dict[str, Any]) -> str:
    return (
        f"round {result['round']}, {result['run']}: computed {result['prompt_tokens_computed']} prompt tokens "
        f"({result['computed_over_bound']:.2f}x the infinite-cache bound), {result['prompt_tokens_from_engine_cache']} "
        f"from the engines' caches, {result['prompt_tokens_from_pool']} from the pool; TTFT p50 "
        f"{result['ttft_p50_s'] * 1000:.0f} ms, p90 {result['ttft_p90_s'] * 1000:.0f} ms; failed {result['failed']}"
    )


def _scale_in_line(result: dict[str, Any]) -> str:
    return (
        f"scale-in, {result['run']}: {result['new_worker']}'s first {result['new_worker_requests_in_window']} requests "
        f"found {result['new_worker_hit_rate']:.0%} of their prompt tokens cached, the old workers "
        f"{result['old_workers_hit_rate']:.0%} meanwhile; after that {result['new_worker_hit_rate_after']:.0%} against "
        f"{result['old_workers_hit_rate_after']:.0%} ({result['new_worker_requests']} requests on it; failed {result['failed']})"
    )


def write_results(path: Path, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """A run's results with the arguments that made it, at ``path`` (benchmarks/results/)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args) | {"handler": None}, **result}, indent=2))
    print(f"results: {path}", file=sys.stderr)


def _command(args: argparse.Namespace) -> int:
    write_results(RESULTS, args, asyncio.run(run_benchmark(args)))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("kv-pool", help="the host KV pool against prefix affinity alone on the Mooncake trace (real vLLM)")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-blocks", type=int, default=6, help="128-token blocks kept per prompt (the opening ones)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds the slice's arrivals are scaled to")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument(
        "--cache-share", type=float, default=0.25,
        help="the prefill engines' KV caches together, as a share of the slice's distinct prefix blocks",
    )
    parser.add_argument("--rounds", type=int, default=2, help="replays per deployment, alternating")
    parser.add_argument(
        "--scale-in", action=argparse.BooleanOptionalAction, default=True,
        help="then, on each deployment, a prefill worker added between the slice's halves: its hit rate against the old workers'",
    )
    parser.add_argument("--first-requests", type=int, default=50, help="the added worker's requests its hit rate is measured over")
    parser.set_defaults(handler=_command)
