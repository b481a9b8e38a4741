"""Where conditional disaggregation pays: prompt lengths at which the KV hand-off costs more than
prefilling on the decode worker itself.

``duet bench local-prefill`` starts the default deployment and, for each prompt length, sends the
same requests one at a time disaggregated (prefill worker, KV transfer, decode worker) and with
local prefill (the decode worker computes the prompt), alternating so both see the same machine.
It reports the time to the second token (the first token that needs the KV on the decode side,
so the hand-off is inside it) and the end-to-end time of a short completion (fresh prompts for
every request, so no prefix cache helps either mode), and the break-even:
the shortest length from which disaggregation is no slower. That is the value for
``router.local_prefill_max_tokens`` on this machine, for an unloaded deployment; under load the
decode worker's own prefill also delays the other requests it is decoding, which favours a lower
threshold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "local_prefill.json"


async def _time_request(stub: Any, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to the second token, end-to-end) of one request, at the client."""
    from duet.router.client import build_request

    sent = time.perf_counter()
    tokens, second = 0, float("nan")
    async for message in stub.Generate(build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)):
        tokens += len(message.token_ids)
        if tokens >= 2 and math.isnan(second):
            second = time.perf_counter() - sent
    return second, time.perf_counter() - sent


async def run_benchmark(lengths: list[int], repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    import grpc

    from duet.config import load_config, parse_config
    from duet.cluster.deployment import Deployment
    from duet.router.proto import duet_api_pb2_grpc as pb_grpc

    data = load_config().model_dump()
    data["server"].update(metrics_port=None, http_port=None)
    deployment = await Deployment(parse_config(data, "bench local-prefill")).start(port=0, http_port=None)
    lifecycle = deployment.service.lifecycle
    rng = np.random.default_rng(0)
    rows = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
            stub = pb_grpc.DuetStub(channel)
            for length in lengths:
                times: dict[str, list[tuple[float, float]]] = {"disaggregated": [], "local": []}
                for _ in range(repeats + 1):  # the first pair warms up this length
                    for mode in ("disaggregated", "local"):
                        # A fresh prompt each time: the engines' prefix caches would otherwise
                        # make every repeat (and the second mode) skip its prefill.
                        prompt = rng.integers(3, 700, length).tolist()
                        lifecycle.local_prefill_max_tokens = 0 if mode == "disaggregated" else length + 1
                        times[mode].append(await _time_request(stub, prompt, max_tokens))
                row: dict[str, Any] = {"prompt_tokens": length}
                for mode, samples in times.items():
                    row[f"{mode}_second_token_ms"] = 1000 * statistics.median(s for s, _ in samples[1:])
                    row[f"{mode}_e2e_ms"] = 1000 * statistics.median(e for _, e in samples[1:])
                rows.append(row)
                print(
                    f"{length:>6} tokens: second token {row['disaggregated_second_token_ms']:.1f} ms disaggregated, "
                    f"{row['local_second_token_ms']:.1f} ms local; end-to-end {row['disaggregated_e2e_ms']:.1f} / "
                    f"{row['local_e2e_ms']:.1f} ms",
                    flush=True,
                )
    finally:
        await deployment.stop()
    return rows


def break_even(rows: list[dict[str, Any]]) -> int | None:
    """The shortest prompt length from which disaggregation's end-to-end time is no worse."""
    for row in rows:
        if row["disaggregated_e2e_ms"] <= row["local_e2e_ms"]:
            return int(row["prompt_tokens"])
    return None


def _command(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = asyncio.run(run_benchmark(lengths, args.repeats, args.max_tokens))
    threshold = break_even(rows)
    print(f"break-even: {threshold if threshold is not None else 'beyond the lengths measured'} prompt tokens")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "break_even_tokens": threshold}, indent=2))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("local-prefill", help="measure the prompt length where disaggregation starts to pay")
    parser.add_argument("--lengths", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.set_defaults(handler=_command)
