"""LoRA adapter affinity on real vLLM prefill workers, against least-load routing.

``duet bench lora-affinity`` starts one deployment with two prefill workers and one decode
worker serving ``--adapters`` random-weight LoRA adapters (``duet lora make``'s), each engine
holding ``--max-loras`` of them at a time (vLLM's ``max_loras`` slots, and as many in host
memory: ``max_cpu_loras``), fewer than there are adapters. It replays a slice of the Mooncake
conversation trace (the prompts' shared prefixes as in ``duet bench affinity``), each request
for one adapter drawn at random: a mixed trace over the adapters. Each round replays it once
with the prefill pool routed by least outstanding prompt tokens and once by prefix affinity,
which among workers holding equally long prefixes prefers one that recently served the
request's adapter (llm-d's LoRA affinity), within its load guard; the two alternate which goes
first, round by round, on the same engines (the machine's speed moves between runs; see
the project brief).

First, one request at a time, it times each adapter's first request (its engine loads it)
and second (held) against the base model's: what a load costs beside a prefill. Per run it
counts the prefill engines' adapter loads (reads from the adapter's directory and activations
into a slot: worker_runtime/adapter_loads.py), and the TTFT p90 the client saw.
The decode worker applies every adapter whatever the prefill routing, so its loads are
reported apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from duet.benchmarks.prefix_affinity import Workload, mooncake_workload

RESULTS = Path(__file__).resolve().parent / "results" / "lora_affinity.json"
POLICIES = ("least_prompt_tokens", "prefix_affinity")


def _deployment_config(args: argparse.Namespace, adapters: dict[str, Path]) -> Any:
    """Two prefill workers (the routing measured), one decode worker, on two cores."""
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    data["prefill"].update(replicas=2, cpu_cores=[0, 1])
    data["ray"]["num_cpus"] = 4
    data["server"].update(metrics_port=None, http_port=None)
    data["model"]["lora"] = {
        "adapters": [{"name": name, "path": str(path)} for name, path in adapters.items()],
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_loras,
    }
    # Every prompt goes to the prefill pool, whose routing is what is measured.
    data["router"].update(local_prefill_queue_tokens=0, prefill_policy="prefix_affinity")
    return parse_config(data, "bench lora-affinity")


def _adapter_per_request(count: int, names: list[str], seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [names[int(index)] for index in rng.integers(len(names), size=count)]


async def _loads(members: list[Any]) -> dict[str, dict[str, int]]:
    return {member.name: await member.engine.adapter_loads() for member in members}


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]], kind: str) -> int:
    return sum(after[name][kind] - before[name][kind] for name in after)


async def _run(deployment: Any, workload: Workload, models: list[str], policy: Any, round_index: int) -> dict[str, Any]:
    from duet.benchmarks.loadgen import connected_stubs, nearest_rank, open_loop, send_one
    from duet.cluster.placement.trace import Trace
    from duet.router.client import build_request

    await asyncio.gather(*(member.engine.reset_prefix_cache() for member in deployment.prefill.members))
    deployment.prefill.policy = policy
    prefill_before, decode_before = await _loads(deployment.prefill.members), await _loads(deployment.decode.members)
    trace = Trace(
        workload.name,
        np.array(workload.arrival_s),
        np.array([len(prompt) for prompt in workload.prompts]),
        np.full(len(workload.prompts), workload.output_tokens),
    )
    requests = [
        build_request(prompt_token_ids=prompt, max_tokens=workload.output_tokens, ignore_eos=True, model=model)
        for prompt, model in zip(workload.prompts, models)
    ]
    async with connected_stubs(f"127.0.0.1:{deployment.port}", 1) as (stub,):

        async def send(index: int, scheduled_s: float, start: float) -> Any:
            return await send_one(stub, index, requests[index], scheduled_s, start, 600.0)

        records = await open_loop(trace, send)
    prefill_after, decode_after = await _loads(deployment.prefill.members), await _loads(deployment.decode.members)
    ttft = sorted(record.client_ttft_s for record in records if not record.error)
    return {
        "round": round_index,
        "policy": policy.name,
        "requests": len(records),
        "failed": sum(1 for record in records if record.error),
        "prefill_adapter_reads": _delta(prefill_after, prefill_before, "read"),
        "prefill_adapter_activations": _delta(prefill_after, prefill_before, "activated"),
        "decode_adapter_reads": _delta(decode_after, decode_before, "read"),
        "decode_adapter_activations": _delta(decode_after, decode_before, "activated"),
        "ttft_p90_s": nearest_rank(ttft, 0.9) if ttft else float("nan"),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
    }


async def _unloaded(deployment: Any, names: list[str], block_size: int, max_loras: int) -> dict[str, Any]:
    """Requests one at a time, each prompt fresh (no prefix cached): the base model's, then
    each adapter's first (its engine loads it: none holds more than ``max_loras``) and second
    (held), at 64 and 512 prompt tokens. What a load costs beside a prefill with an adapter."""
    import time

    from duet.router.client import DuetClient, build_request

    deployment.prefill.policy = _policy("prefix_affinity", block_size, max_loras)  # the second goes where the first did
    rng = np.random.default_rng(0)
    before = await _loads(deployment.prefill.members)

    def ttft(model: str, length: int) -> float:
        prompt = rng.integers(3, 700, length).tolist()
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            sent = time.perf_counter()
            for message in client.generate(build_request(prompt_token_ids=prompt, max_tokens=2, ignore_eos=True, model=model), timeout=120):
                if message.token_ids:
                    return time.perf_counter() - sent
        raise RuntimeError("no token")

    def measure() -> dict[str, dict[str, float]]:
        result: dict[str, dict[str, float]] = {}
        for length in (64, 512):
            base = [ttft("", length) for _ in range(3)]
            first, second = [], []
            for name in names:
                first.append(ttft(name, length))
                second.append(ttft(name, length))
            result[str(length)] = {
                "base_ttft_s": statistics.median(base),
                "adapter_first_ttft_s": statistics.median(first),
                "adapter_second_ttft_s": statistics.median(second),
            }
        return result

    measured = await asyncio.to_thread(measure)
    after = await _loads(deployment.prefill.members)
    return {"ttft_by_prompt_tokens": measured, "prefill_adapter_reads": _delta(after, before, "read")}


def _policy(name: str, block_size: int, max_loras: int) -> Any:
    from duet.router.policies import LeastPromptTokens, PrefixAffinity

    return LeastPromptTokens() if name == "least_prompt_tokens" else PrefixAffinity(block_size, adapters_held=max_loras)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment
    from duet.cluster.placement.cluster_spec import traces_dir
    from duet.worker_runtime.tiny_lora import make_tiny_lora

    with tempfile.TemporaryDirectory(prefix="duet-lora-affinity-") as root:
        adapters = {f"adapter-{index}": make_tiny_lora(Path(root) / f"adapter-{index}", seed=index) for index in range(args.adapters)}
        workload = mooncake_workload(
            traces_dir() / "conversation_trace.jsonl", args.requests, args.block_tokens, args.max_blocks,
            args.duration, args.output_tokens,
        )
        models = _adapter_per_request(len(workload.prompts), list(adapters), args.seed)
        deployment = await Deployment(_deployment_config(args, adapters)).start(port=0, http_port=None)
        try:
            block_size = (await deployment.prefill.members[0].engine.model_limits())[2]
            unloaded = await _unloaded(deployment, list(adapters), block_size, args.max_loras)
            print(_unloaded_line(unloaded), flush=True)
            runs = []
            for round_index in range(args.rounds):
                order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
                for name in order:
                    result = await _run(deployment, workload, models, _policy(name, block_size, args.max_loras), round_index)
                    print(_line(result), flush=True)
                    runs.append(result)
        finally:
            await deployment.stop()
    return {"args": vars(args) | {"handler": None}, "unloaded": unloaded, "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Loads and TTFT p90 per policy, summed and round by round, and the affinity's ratios."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["policy"]] = run
    pairs = [rounds for rounds in by_round.values() if set(rounds) == set(POLICIES)]

    def loads(run: dict[str, Any]) -> int:
        return run["prefill_adapter_reads"] + run["prefill_adapter_activations"]

    least = sum(loads(pair["least_prompt_tokens"]) for pair in pairs)
    affinity = sum(loads(pair["prefix_affinity"]) for pair in pairs)
    return {
        "rounds": len(pairs),
        "prefill_loads": {"least_prompt_tokens": least, "prefix_affinity": affinity},
        "prefill_loads_ratio": affinity / least if least else float("nan"),
        "rounds_with_half_the_loads_or_fewer": sum(1 for pair in pairs if 2 * loads(pair["prefix_affinity"]) <= loads(pair["least_prompt_tokens"])),
        "rounds_ttft_p90_no_worse": sum(
            1 for pair in pairs if pair["prefix_affinity"]["ttft_p90_s"] <= pair["least_prompt_tokens"]["ttft_p90_s"]
        ),
        "ttft_p90_ratio_median": statistics.median(
            pair["prefix_affinity"]["ttft_p90_s"] / pair["least_prompt_tokens"]["ttft_p90_s"] for pair in pairs
        ) if pairs else float("nan"),
    }


def _unloaded_line(unloaded: dict[str, Any]) -> str:
    cells = [
        f"{length} tokens: base {row['base_ttft_s'] * 1000:.0f} ms, an adapter's first request "
        f"{row['adapter_first_ttft_s'] * 1000:.0f} ms, its second {row['adapter_second_ttft_s'] * 1000:.0f} ms"
        for length, row in unloaded["ttft_by_prompt_tokens"].items()
    ]
    return f"unloaded, median TTFT: {'; '.join(cells)} ({unloaded['prefill_adapter_reads']} adapter reads)"


def _line(result: dict[str, Any]) -> str:
    return (
        f"round {result['round']}, {result['policy']}: prefill adapter loads {result['prefill_adapter_reads']} read + "
        f"{result['prefill_adapter_activations']} activated (decode {result['decode_adapter_reads']} + "
        f"{result['decode_adapter_activations']}), TTFT p90 {result['ttft_p90_s'] * 1000:.0f} ms "
        f"mean {result['ttft_mean_s'] * 1000:.0f} ms, failed {result['failed']} of {result['requests']}"
    )


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(args))
    summary = result["summary"]
    print(
        f"prefill adapter loads over {summary['rounds']} rounds: least_prompt_tokens "
        f"{summary['prefill_loads']['least_prompt_tokens']}, prefix_affinity {summary['prefill_loads']['prefix_affinity']} "
        f"(ratio {summary['prefill_loads_ratio']:.2f}); half the loads or fewer in "
        f"{summary['rounds_with_half_the_loads_or_fewer']} of {summary['rounds']} rounds; TTFT p90 no worse in "
        f"{summary['rounds_ttft_p90_no_worse']} of {summary['rounds']} (median ratio {summary['ttft_p90_ratio_median']:.2f})"
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"results: {path}", file=sys.stderr)
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "lora-affinity", help="LoRA adapter affinity vs least-load routing: adapter loads and TTFT (real vLLM)"
    )
    parser.add_argument("--adapters", type=int, default=4, help="random-weight adapters the requests are spread over")
    parser.add_argument("--max-loras", type=int, default=2, help="adapters each engine holds at once (slots and host memory)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each running both policies (alternating first)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds the slice's arrivals are scaled to")
    parser.add_argument("--block-tokens", type=int, default=128, help="tokens per Mooncake hash block")
    parser.add_argument("--max-blocks", type=int, default=4, help="blocks kept per prompt (the opening ones)")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=56, help="which adapter each request asks for")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go (JSON)")
    parser.set_defaults(handler=_command)
