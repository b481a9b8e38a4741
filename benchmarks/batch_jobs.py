"""``duet bench batch``: a batch job in prefix-tree order against the same requests sent online,
and online traffic's SLO attainment with and without a job beside it (real vLLM engines).

The job: ``--requests`` completions over ``--prefixes`` shared random prefixes of
``--prefix-tokens`` tokens (each request its prefix, then ``--suffix-tokens`` of its own), in
shuffled order, greedy with ``--output-tokens`` each. The prefill engine's KV cache holds only
a fraction of the distinct prefixes (printed), so a prefix evicted before its next request is
computed again. Each round runs, alternating which goes first, with the engines' prefix caches
emptied before each:
- ``batch``: the file uploaded to ``/v1/files`` and run by ``/v1/batches``;
- ``online``: the same requests, in the file's (shuffled) order, sent to ``/v1/completions``
  by a client keeping ``server.batches.max_inflight`` of them in flight, as a user without the
  Batch API would.
Printed per run: wall time, prompt tokens the engines computed (their own counters) against the
prefix tree's minimum, and whether every request's tokens are identical across the two.

With ``--online-rate``, a second part replays an open-loop Poisson stream (``--online-lengths``)
for ``--online-duration`` seconds, with and without a batch job running beside it (rounds
alternating), and prints the online requests' attainment of the TTFT and both TPOT targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

RESULTS = Path(__file__).resolve().parent / "results" / "batch_jobs.json"
_COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
_VOCAB = (10, 700)  # token ids the built-in model's 753-token vocabulary takes


def _deployment_config(args: argparse.Namespace, directory: str, prefill_kv_gib: float) -> Any:
    """The embedded default (one prefill worker, one decode worker), every prompt prefilled on
    the prefill worker, whose KV cache is ``prefill_kv_gib``."""
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    data["prefill"]["kv_cache_gib"] = prefill_kv_gib
    data["server"].update(metrics_port=None, port=0, http_port=0)
    data["server"]["batches"].update(directory=directory, max_inflight=args.max_inflight)
    data["router"]["local_prefill_queue_tokens"] = 0
    return parse_config(data, "bench batch")


def _workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*_VOCAB) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    prompts = [
        prefixes[index % args.prefixes] + [rng.randrange(*_VOCAB) for _ in range(args.suffix_tokens)]
        for index in range(args.requests)
    ]
    rng.shuffle(prompts)
    return prompts


def _bodies(prompts: list[list[int]], model: str, output_tokens: int) -> list[dict[str, Any]]:
    return [
        {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}
        for prompt in prompts
    ]


async def _computed(deployment: Any, role: str | None = None) -> int:
    """Prompt tokens the engines (of ``role``, or all) computed since they started."""
    members = [m for pool in (deployment.prefill, deployment.decode) if role in (None, pool.role) for m in pool.members]
    statuses = await asyncio.gather(*(member.engine.status() for member in members))
    return int(sum(status.engine_metrics.get(_COMPUTED, 0.0) for status in statuses))


async def _settled_computed(deployment: Any, at_least: int) -> int:
    """The engines' computed-token count once their metrics include the whole run: they are
    read from the engines' last statistics, a moment behind, so until it holds still."""
    deadline = time.monotonic() + 20
    count = await _computed(deployment)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.5)
        previous, count = count, await _computed(deployment)
        if count == previous and count >= at_least:
            break
    return count


async def _reset_caches(deployment: Any) -> None:
    members = deployment.prefill.members + deployment.decode.members
    await asyncio.gather(*(member.engine.reset_prefix_cache() for member in members))


async def run_batch(http: aiohttp.ClientSession, bodies: list[dict[str, Any]]) -> tuple[float, list[list[int]]]:
    """The bodies as one batch job; its wall time and each line's tokens."""
    lines = "".join(
        json.dumps({"custom_id": str(index), "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
        for index, body in enumerate(bodies)
    )
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", lines.encode(), filename="bench.jsonl")
    started = time.monotonic()
    async with http.post("/v1/files", data=form) as response:
        file_id = (await response.json())["id"]
    async with http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}) as response:
        batch = await response.json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.1)
        async with http.get(f"/v1/batches/{batch['id']}") as response:
            batch = await response.json()
    elapsed = time.monotonic() - started
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    async with http.get(f"/v1/files/{batch['output_file_id']}/content") as response:
        outputs = [json.loads(line) for line in (await response.text()).splitlines()]
    tokens = {int(out["custom_id"]): out["response"]["body"]["choices"][0]["token_ids"] for out in outputs}
    return elapsed, [tokens[index] for index in range(len(bodies))]


async def run_online(http: aiohttp.ClientSession, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, list[list[int]]]:
    """The bodies sent to ``/v1/completions`` in order, ``concurrency`` in flight."""
    tokens: list[list[int]] = [[] for _ in bodies]
    queue = iter(enumerate(bodies))

    async def client() -> None:
        for index, body in queue:
            async with http.post("/v1/completions", json=body) as response:
                reply = await response.json()
                assert response.status == 200, reply
            tokens[index] = reply["choices"][0]["token_ids"]

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.monotonic() - started, tokens


async def _job_round(deployment: Any, http: aiohttp.ClientSession, args: argparse.Namespace, round_index: int, minimum: int,
                     bodies: list[dict[str, Any]]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    order = ("batch", "online") if round_index % 2 == 0 else ("online", "batch")
    for kind in order:
        await _reset_caches(deployment)
        before, decode_before = await _computed(deployment), await _computed(deployment, "decode")
        if kind == "batch":
            elapsed, tokens = await run_batch(http, bodies)
        else:
            elapsed, tokens = await run_online(http, bodies, args.max_inflight)
        computed = await _settled_computed(deployment, before + minimum) - before
        by_decode = await _computed(deployment, "decode") - decode_before
        runs[kind] = {"seconds": elapsed, "prompt_tokens_computed": computed, "by_decode": by_decode, "tokens": tokens}
    identical = runs["batch"].pop("tokens") == runs["online"].pop("tokens")
    result = {"round": round_index, "order": list(order), **runs, "identical": identical,
              "speedup": runs["online"]["seconds"] / runs["batch"]["seconds"]}
    print(
        f"round {round_index}: batch {runs['batch']['seconds']:.1f} s, {runs['batch']['prompt_tokens_computed']:,} tokens "
        f"({runs['batch']['prompt_tokens_computed'] / minimum:.3f}x the minimum, {runs['batch']['by_decode']:,} by decode); online {runs['online']['seconds']:.1f} s, "
        f"{runs['online']['prompt_tokens_computed']:,} tokens ({runs['online']['prompt_tokens_computed'] / minimum:.2f}x); "
        f"batch {result['speedup']:.2f}x faster; outputs identical: {identical}",
        flush=True,
    )
    return result


def _attainment(records: list[Any], ttft_s: float, tpot_s: float) -> float:
    ok = sum(1 for r in records if not r.error and r.ttft_s <= ttft_s and r.tpot_s <= tpot_s)
    return ok / len(records)


async def _online_round(deployment: Any, http: aiohttp.ClientSession, args: argparse.Namespace, round_index: int,
                        bodies: list[dict[str, Any]]) -> dict[str, Any]:
    from duet.benchmarks.loadgen import replay
    from duet.cluster.placement.trace import synthetic

    trace = synthetic(int(args.online_rate * args.online_duration), args.online_rate, lengths=args.online_lengths, seed=round_index)
    result: dict[str, Any] = {"round": round_index}
    order = (True, False) if round_index % 2 == 0 else (False, True)
    for with_job in order:
        await _reset_caches(deployment)
        job = asyncio.create_task(run_batch(http, bodies)) if with_job else None
        if job is not None:
            await asyncio.sleep(2.0)  # the job validated and running before online traffic starts
        records = await replay(f"127.0.0.1:{deployment.port}", trace, seed=round_index, timeout_s=300)
        completed = 0
        if job is not None:
            async with http.get("/v1/batches?limit=1") as response:
                completed = (await response.json())["data"][0]["request_counts"]["completed"]
            await job
        key = "with_job" if with_job else "alone"
        result[key] = {
            "tight": _attainment(records, args.ttft, args.tpot_tight),
            "loose": _attainment(records, args.ttft, args.tpot_loose),
            "ttft_p50_s": statistics.median(r.ttft_s for r in records if not r.error),
            "tpot_p50_s": statistics.median(r.tpot_s for r in records if not r.error),
            "failed": sum(1 for r in records if r.error),
            "job_requests_done_meanwhile": completed,
        }
    print(
        f"online round {round_index}: attainment tight {result['alone']['tight']:.1%} alone, {result['with_job']['tight']:.1%} "
        f"with the job ({result['with_job']['job_requests_done_meanwhile']} of its requests done meanwhile); loose "
        f"{result['alone']['loose']:.1%} / {result['with_job']['loose']:.1%}",
        flush=True,
    )
    return result


def _kv_fraction(deployment: Any, prefill_kv_gib: float, args: argparse.Namespace, block_size: int) -> float:
    """The share of the job's distinct prefix blocks the prefill engine's KV cache holds."""
    from transformers import AutoConfig

    from duet.worker_runtime.engine import resolve_model_path

    model = AutoConfig.from_pretrained(str(resolve_model_path(deployment.config.model)))
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    bytes_per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * head_dim * 4  # K and V, float32
    cache_blocks = int(prefill_kv_gib * 2**30 // (bytes_per_token * block_size))
    prefix_blocks = args.prefixes * (args.prefix_tokens // block_size)
    return cache_blocks / prefix_blocks


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The job rounds on a deployment whose prefill KV cache is ``--prefill-kv-gib``, then the
    online rounds on one with ``--online-prefill-kv-gib`` (the job's prefixes fit there: under
    P/D the prefill engine holds a finished request's blocks until its decode worker's pull is
    acknowledged, and in a cache that small online prompts would wait for blocks behind the job)."""
    result: dict[str, Any] = {"rounds": [], "online_rounds": []}
    if not args.online_only:
        result.update(await _on_deployment(args, args.prefill_kv_gib, _job_rounds))
    if args.online_rate:
        result.update(await _on_deployment(args, args.online_prefill_kv_gib, _online_rounds))
    return result


async def _on_deployment(args: argparse.Namespace, prefill_kv_gib: float, rounds: Any) -> dict[str, Any]:
    import tempfile

    from duet.batch.prefix_order import minimum_prompt_tokens
    from duet.cluster.deployment import Deployment

    with tempfile.TemporaryDirectory(prefix="duet-bench-batch-") as directory:
        deployment = await Deployment(_deployment_config(args, directory, prefill_kv_gib)).start(port=0, http_port=0)
        try:
            block_size = deployment.default.service.limits.block_size
            fraction = _kv_fraction(deployment, prefill_kv_gib, args, block_size)
            print(f"prefill KV cache {prefill_kv_gib:g} GiB: {fraction:.0%} of the job's distinct prefix blocks", flush=True)
            prompts = _workload(args, seed=args.seed)
            minimum = minimum_prompt_tokens(prompts, block_size)
            bodies = _bodies(prompts, deployment.config.model.name, args.output_tokens)
            print(f"{len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, the prefix tree's minimum {minimum:,}", flush=True)
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{deployment.http_port}", timeout=timeout) as http:
                await run_online(http, bodies[:4], 4)  # warm-up
                return await rounds(deployment, http, args, minimum, bodies, fraction)
        finally:
            await deployment.stop()


async def _job_rounds(deployment: Any, http: aiohttp.ClientSession, args: argparse.Namespace, minimum: int,
                      bodies: list[dict[str, Any]], fraction: float) -> dict[str, Any]:
    rounds = [await _job_round(deployment, http, args, index, minimum, bodies) for index in range(args.rounds)]
    return {
        "prefill_kv_share_of_prefix_blocks": fraction, "minimum_prompt_tokens": minimum,
        "prompt_tokens_sent": sum(len(body["prompt"]) for body in bodies), "rounds": rounds,
    }


async def _online_rounds(deployment: Any, http: aiohttp.ClientSession, args: argparse.Namespace, minimum: int,
                         bodies: list[dict[str, Any]], fraction: float) -> dict[str, Any]:
    rounds = [await _online_round(deployment, http, args, index, bodies) for index in range(args.rounds)]
    return {"online_prefill_kv_share_of_prefix_blocks": fraction, "online_rounds": rounds}


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    rounds = result["rounds"]
    if rounds:
        minimum = result["minimum_prompt_tokens"]
        print(
            f"batch against online over {len(rounds)} rounds: median {statistics.median(r['speedup'] for r in rounds):.2f}x faster, "
            f"prompt tokens computed {statistics.median(r['batch']['prompt_tokens_computed'] for r in rounds) / minimum:.3f}x "
            f"the minimum (online {statistics.median(r['online']['prompt_tokens_computed'] for r in rounds) / minimum:.2f}x); "
            f"identical in {sum(r['identical'] for r in rounds)} of {len(rounds)}"
        )
    for slo in ("tight", "loose"):
        gaps = [r["alone"][slo] - r["with_job"][slo] for r in result["online_rounds"]]
        if gaps:
            print(f"online {slo} SLO: the job costs {statistics.median(gaps):.1%} attainment (median; worst {max(gaps):.1%})")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "handler"}, **result}, indent=2))
    print(f"results: {output}", file=sys.stderr)
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("batch", help="a batch job in prefix-tree order against the same requests online (real vLLM)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prefill-kv-gib", type=float, default=0.03, help="the prefill engine's KV cache (a fraction of the prefixes)")
    parser.add_argument("--max-inflight", type=int, default=8, help="server.batches.max_inflight, and the online client's concurrency")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--online-rate", type=float, default=0.0, help="requests/s of online traffic for the SLO part (0: skip it)")
    parser.add_argument("--online-only", action="store_true", help="only the SLO part (with --online-rate)")
    parser.add_argument("--online-prefill-kv-gib", type=float, default=1.0, help="the prefill engine's KV cache in the SLO part")
    parser.add_argument("--online-duration", type=float, default=60.0)
    parser.add_argument("--online-lengths", default="fixed:256:64", help="synthetic lengths of the online requests")
    parser.add_argument("--ttft", type=float, default=1.0)
    parser.add_argument("--tpot-tight", type=float, default=0.04)
    parser.add_argument("--tpot-loose", type=float, default=0.1)
    parser.add_argument("--output", default=str(RESULTS))
    parser.set_defaults(handler=_command)
