"""What the host KV pool costs the engines where no prefix comes back (``duet bench kv-pool-cost``).

Two colocated deployments side by side (configs/colocated.yaml: two engines, one core each), the
same but for ``kv_pool.enabled``, each sent the same distinct prompts (no two share a block, so
the pool only stores), round by round, the order reversed every other round (this machine's
speed moves within minutes). Per replay: the engine processes' CPU seconds per request (from
``/proc``, every engine process of both deployments: the idle one's, measured before the first
round, is printed as the floor), and the wall time. It isolates what the serving benchmark's
pool-on rows (benchmarks/results/serve_kv_pool_cost/) put down to the pool: the copies into the
engine's host tier, the file writes into the pool, and the connector's bookkeeping per step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "kv_pool_cost.json"
_IDLE_S = 5.0


def _config(pool: bool, directory: str) -> Any:
    from duet.config import COLOCATED_CONFIG_PATH, load_config, parse_config

    data = load_config(COLOCATED_CONFIG_PATH).model_dump()
    data["server"].update(metrics_port=None, http_port=None)
    data["ray"]["num_cpus"] = 8  # Ray's CPUs are a count of actors here: both deployments' workers fit
    data["kv_pool"].update(enabled=pool, directory=directory)
    return parse_config(data, "bench kv-pool-cost")


def _prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    """Random token ids above the built-in model's specials: no two prompts share a KV block."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(tokens)] for _ in range(count)]


def _replay(port: int, prompts: list[list[int]], output_tokens: int, concurrency: int) -> tuple[float, float]:
    """(engine CPU seconds, wall seconds) of sending ``prompts``, ``concurrency`` at a time."""
    from duet.benchmarks.engine_cores import EngineCoreSampler
    from duet.router.client import DuetClient, build_request

    requests = [build_request(prompt_token_ids=p, max_tokens=output_tokens, ignore_eos=True) for p in prompts]
    with DuetClient(f"127.0.0.1:{port}") as client, ThreadPoolExecutor(concurrency) as senders:
        with EngineCoreSampler(os.getpid()) as sampler:
            started = time.perf_counter()
            list(senders.map(lambda request: client.generate_ids(request, timeout=300), requests))
            wall = time.perf_counter() - started
    return sampler.engine_cpu_s(), wall


def _idle_cpu_s() -> float:
    from duet.benchmarks.engine_cores import EngineCoreSampler

    with EngineCoreSampler(os.getpid()) as sampler:
        time.sleep(_IDLE_S)
    return sampler.engine_cpu_s()


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment

    directories = {pool: tempfile.mkdtemp(prefix="duet-bench-kv-pool-cost-", dir="/dev/shm") for pool in (False, True)}
    deployments: dict[bool, Any] = {}
    loop = asyncio.get_running_loop()
    try:
        for pool in (False, True):
            deployments[pool] = await Deployment(_config(pool, directories[pool])).start(port=0, http_port=None)
        warm = _prompts(args.concurrency * 2, args.prompt_tokens, seed=10_000)
        for pool in (False, True):  # the first requests of an engine are slower
            await loop.run_in_executor(None, _replay, deployments[pool].port, warm, args.output_tokens, args.concurrency)
        idle = await loop.run_in_executor(None, _idle_cpu_s)
        print(f"engines idle: {idle / _IDLE_S * 1000:.1f} ms of CPU per second", flush=True)
        runs = []
        for round_index in range(args.rounds):
            prompts = _prompts(args.requests, args.prompt_tokens, seed=round_index)  # new to both pools
            for pool in (False, True) if round_index % 2 == 0 else (True, False):
                cpu, wall = await loop.run_in_executor(
                    None, _replay, deployments[pool].port, prompts, args.output_tokens, args.concurrency
                )
                run = {
                    "round": round_index, "pool": pool, "engine_cpu_s": cpu, "wall_s": wall,
                    "engine_cpu_ms_per_request": cpu / len(prompts) * 1000,
                }
                print(
                    f"round {round_index}, pool {'on' if pool else 'off'}: {run['engine_cpu_ms_per_request']:.1f} ms of "
                    f"engine CPU per request, {wall:.1f} s for {len(prompts)} requests", flush=True,
                )
                runs.append(run)
        ratios = [
            on["engine_cpu_s"] / off["engine_cpu_s"]
            for off, on in zip((r for r in runs if not r["pool"]), (r for r in runs if r["pool"]))
        ]
        print(f"pool on / off, engine CPU per request: {', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)")
        return {"idle_engine_cpu_s_per_s": idle / _IDLE_S, "runs": runs, "cpu_ratio_by_round": ratios}
    finally:
        for deployment in deployments.values():
            await deployment.stop()
        for directory in directories.values():
            shutil.rmtree(directory, ignore_errors=True)


def _command(args: argparse.Namespace) -> int:
    from duet.benchmarks.kv_pool import write_results

    write_results(RESULTS, args, asyncio.run(run_benchmark(args)))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "kv-pool-cost", help="the host KV pool's engine CPU where no prefix comes back: pool on against off (real vLLM)"
    )
    parser.add_argument("--requests", type=int, default=200, help="distinct prompts per replay")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="replays per deployment, alternating")
    parser.set_defaults(handler=_command)
