"""What vLLM's engine front end costs per engine step and per streamed output, on this machine.

duet's router and vLLM's own API server run the same front end for each engine (``AsyncLLM``):
every engine step arrives as one ZeroMQ message, which the front end decodes, runs through its
output processor (detokenization, one delta per request), records in its Prometheus stats and
hands to each request's consumer. Part of that work is paid once per step whatever the batch,
part once per output. The serving path's CPU per streamed token is therefore roughly
``(a * engine steps + b * outputs + per-request and front-door costs) / tokens``, and two
systems that stream the same tokens differ by how many engine steps their front ends receive
(docs/benchmarks.md, "Why the CPU per token stays about 2x").

``duet bench front-end`` measures ``a`` and ``b``: one engine core of the built-in model in its
own process, its front end in this one, built by the router's own ``new_front_end``, and
batches of C concurrent greedy requests of N tokens each, so that every step carries C outputs.
This process's CPU per batch is fitted as ``a * steps + b * outputs`` by least squares. No
serving path runs here: it is the floor any front end of this vLLM pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "front_end_cost.json"


@dataclass(frozen=True)
class Batch:
    """One measured batch: C requests of N tokens, decoded together."""

    concurrency: int
    tokens_per_request: int
    cpu_s: float
    wall_s: float

    @property
    def steps(self) -> int:
        # The requests start together and decode in lock-step: one prefill step, then one step
        # per further token.
        return self.tokens_per_request

    @property
    def outputs(self) -> int:
        return self.concurrency * self.tokens_per_request


def fit_step_and_output_cost(batches: list[Batch]) -> tuple[float, float]:
    """(CPU seconds per engine step, per output) that best explain ``batches``."""
    design = np.array([[batch.steps, batch.outputs] for batch in batches], dtype=float)
    spent = np.array([batch.cpu_s for batch in batches])
    (per_step, per_output), *_ = np.linalg.lstsq(design, spent, rcond=None)
    return float(per_step), float(per_output)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


async def _request(engine: Any, request_id: str, tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    async for _ in engine.generate({"prompt_token_ids": [11, 12, 13, 14]}, params, request_id):
        pass


async def measure(concurrencies: list[int], tokens: int, repeats: int) -> list[Batch]:
    """Start the engine, warm it up, then time each concurrency ``repeats`` times."""
    from prometheus_client import CollectorRegistry
    from vllm.engine.arg_utils import AsyncEngineArgs

    from duet.config import ModelConfig
    from duet.worker_runtime.engine import apply_environment, cpu_engine_environment, engine_kwargs, is_cpu_only
    from duet.router.engine_front_end import new_front_end, shut_down

    if is_cpu_only():
        apply_environment(cpu_engine_environment(cpu_core=None))  # as in a worker
    vllm_config = AsyncEngineArgs(**engine_kwargs(ModelConfig(), kv_cache_gib=1)).create_engine_config()
    engine = new_front_end(vllm_config, CollectorRegistry())  # starting its own engine core
    try:
        await asyncio.gather(*(_request(engine, f"warm-{i}", 32) for i in range(max(concurrencies))))
        batches = []
        for repeat in range(repeats):
            for concurrency in concurrencies:
                cpu_before, wall_before = _cpu_s(), time.perf_counter()
                await asyncio.gather(*(_request(engine, f"r{repeat}-c{concurrency}-{i}", tokens) for i in range(concurrency)))
                batches.append(Batch(concurrency, tokens, _cpu_s() - cpu_before, time.perf_counter() - wall_before))
        return batches
    finally:
        shut_down(engine)


def _command(args: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    batches = asyncio.run(measure(concurrencies, args.tokens, args.repeats))
    per_step, per_output = fit_step_and_output_cost(batches)
    for batch in batches:
        print(
            f"{batch.concurrency:3d} requests x {batch.tokens_per_request} tokens: {batch.cpu_s:.3f} s CPU in "
            f"{batch.wall_s:.2f} s, {1e6 * batch.cpu_s / batch.steps:.0f} us per step, "
            f"{1e6 * batch.cpu_s / batch.outputs:.0f} us per output"
        )
    print(f"fit: {1e6 * per_step:.0f} us per engine step + {1e6 * per_output:.0f} us per output")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(
        {"per_step_us": 1e6 * per_step, "per_output_us": 1e6 * per_output, "batches": [asdict(b) for b in batches]},
        indent=2,
    ))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "front-end", help="vLLM's engine front end: CPU per engine step and per output (the floor of any serving path)"
    )
    parser.add_argument("--concurrency", default="1,4,16", help="requests decoded together, one batch each")
    parser.add_argument("--tokens", type=int, default=400, help="tokens per request (about one engine step each)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.set_defaults(handler=_command)
