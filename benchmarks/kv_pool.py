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
from pathlib import Path
from typing import Any

import numpy as np

from duet.benchmarks.prefix_affinity import Workload, mooncake_workload, prefill_totals

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pool.json"
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The prefill engines' prompt tokens by where their KV came from.
_BY_SOURCE = {source: f"vllm:prompt_tokens_by_source_total{{source={source}}}" for source in _SOURCES}
_ENGINE_BLOCK = 128  # vLLM's KV block on CPU


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


async def _replay(deployment: Any, workload: Workload, label: str, directory: str, bound: int) -> dict[str, Any]:
    from duet.benchmarks.loadgen import connected_stubs, nearest_rank, open_loop, send_one
    from duet.cluster.placement.trace import Trace
    from duet.router.client import build_request
    from duet.router.policies import PrefixAffinity

    await asyncio.gather(*(member.engine.reset_prefix_cache() for member in deployment.prefill.members))
    for path in Path(directory).glob("*"):  # an empty pool (vLLM's tier keeps its folders' config)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    old = deployment.prefill.policy
    deployment.prefill.policy = PrefixAffinity(old.block_size, old.load_factor, shared_pool=old.shared_pool)  # empty index
    before = await prefill_totals(deployment, tuple(_BY_SOURCE.values()))
    trace = Trace(
        workload.name, np.array(workload.arrival_s), np.array([len(p) for p in workload.prompts]),
        np.full(len(workload.prompts), workload.output_tokens),
    )
    requests = [build_request(prompt_token_ids=p, max_tokens=workload.output_tokens, ignore_eos=True) for p in workload.prompts]
    async with connected_stubs(f"127.0.0.1:{deployment.port}", 1) as (stub,):
        records = await open_loop(trace, lambda i, s, start: send_one(stub, i, requests[i], s, start, 600.0))
    await asyncio.sleep(2.0)  # the last prefills' counts reach the front end with the next stats
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
        return {"distinct_prefix_blocks": distinct, "block_bytes": block_bytes, "kv_cache_gib_per_engine": kv_cache_gib, "runs": runs}
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


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args) | {"handler": None}, **result}, indent=2))
    print(f"results: {RESULTS}", file=sys.stderr)
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
    parser.set_defaults(handler=_command)
