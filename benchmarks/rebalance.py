"""Rebalancing a skewed decode load: TPOT with ``router.rebalance_kv_gap`` on against off.

``duet bench rebalance`` starts the default deployment (one prefill and one decode worker,
NIXL, the built-in model, float32), grows the decode pool to two workers (each engine pinned to
a core of its own while they decode), and, round after round, once per mode with the order
alternating, sends ``--streams`` greedy streams with prompts of ``--context`` tokens all to the
second decode worker: the skew a decode pool is left with when the long requests happened to
land on one worker (the benchmark routes them there; decode-0 gets none). Once every stream is
decoding:

- ``off``: nothing moves; the streams decode where they landed;
- ``on``: a :class:`Rebalancer` (router/rebalancer.py, the front door's own) runs every
  ``--interval`` seconds with ``--gap``, and moves the longest streams to decode-0 with their KV.

Reported per mode: each stream's TPOT over the rest of its stream (from the moment every stream
decodes), their p50 and p99, the p99 of the gaps between a stream's messages, the time until the
last stream ends, and the streams moved; per round, the ratio on/off. The streams must come out
identical in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from duet.benchmarks.alternating import alternating_rounds
from duet.benchmarks.arguments import write_results
from duet.benchmarks.greedy_streams import GreedyStreams
from duet.benchmarks.migration import add_stream_arguments, random_prompts, start_default_deployment, wait_settled

RESULTS = Path(__file__).resolve().parent / "results" / "rebalance.json"


class Pinned:
    """A routing policy that sends every request to one worker: a skewed decode load."""

    def __init__(self, name: str) -> None:
        self.name = name

    def choose(self, ready: list[Any], prompt: list[int], adapter: str = "") -> Any:
        return next(member for member in ready if member.name == self.name)

    def describe(self) -> str:
        return f"pinned to {self.name}"


def run_once(deployment: Any, client: Any, mode: str, skewed_to: str, prompts: list[list[int]], tokens: int,
             gap: float, interval_s: float) -> dict[str, Any]:
    """Stream ``prompts`` all on ``skewed_to``; with ``mode`` "on", rebalance once all decode."""
    from duet.router.rebalancer import Rebalancer

    streams = GreedyStreams(client, prompts, tokens)
    policy = deployment.decode.policy
    deployment.decode.policy = Pinned(skewed_to)
    try:
        streams.start(decoding_tokens=10)
    finally:
        deployment.decode.policy = policy
    decoding_at = time.monotonic()
    rebalancer = Rebalancer(deployment.service.lifecycle, gap, interval_s)
    task = asyncio.run_coroutine_threadsafe(rebalancer.run(), deployment.background.loop) if mode == "on" else None
    try:
        streams.join(mode)
    finally:
        if task is not None:
            task.cancel()
    tpots, gaps = [], []
    for messages in streams.arrivals:
        later = [(when, count) for when, count in messages if when > decoding_at]
        if len(later) >= 2:
            tpots.append((later[-1][0] - later[0][0]) / sum(count for _, count in later[1:]))
            gaps.extend(b[0] - a[0] for a, b in zip(later, later[1:]))
    return {
        "mode": mode,
        "streams_moved": rebalancer.moved,
        "tpot_s": sorted(tpots),
        "tpot_p50_s": statistics.median(tpots),
        "tpot_p99_s": _percentile(tpots, 0.99),
        "message_gap_p99_s": _percentile(gaps, 0.99),
        "last_stream_ends_s": max(messages[-1][0] for messages in streams.arrivals) - decoding_at,
        "tokens": streams.tokens,
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_benchmark(streams: int, context: tuple[int, int], tokens: int, rounds: int, gap: float, interval_s: float,
                  seed: int) -> list[dict[str, Any]]:
    from duet.router.client import DuetClient

    prompts = random_prompts(streams, context, seed)
    deployment, loop = start_default_deployment("bench rebalance")
    try:
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            client.scale("decode", 2)
            skewed_to = next(name for name in wait_settled(client, 2) if name != "decode-0")
            cores = {member.name: member.cpu_core for member in deployment.decode.members}
            print(f"decode workers on cores {cores}; every stream sent to {skewed_to}", flush=True)
            return alternating_rounds(
                rounds, ("off", "on"),
                lambda mode: run_once(deployment, client, mode, skewed_to, prompts, tokens, gap, interval_s),
                _describe, _compare, "identical_across_modes",
            )
    finally:
        loop.run(deployment.stop(), timeout=120)
        loop.close()


def _describe(result: dict[str, Any]) -> str:
    return (f"TPOT p50 {_ms(result['tpot_p50_s'])}, p99 {_ms(result['tpot_p99_s'])} ms; message gap p99 "
            f"{_ms(result['message_gap_p99_s'])} ms; last stream ends after {result['last_stream_ends_s']:.1f} s; "
            f"{result['streams_moved']} streams moved")


def _compare(pair: dict[str, dict[str, Any]]) -> str:
    on, off = pair["on"], pair["off"]
    return (f"on / off TPOT p99 {on['tpot_p99_s'] / off['tpot_p99_s']:.2f}x, p50 {on['tpot_p50_s'] / off['tpot_p50_s']:.2f}x, "
            f"last stream {on['last_stream_ends_s'] / off['last_stream_ends_s']:.2f}x")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _command(args: argparse.Namespace) -> int:
    results = run_benchmark(args.streams, args.context, args.tokens, args.rounds, args.gap, args.interval, args.seed)
    return write_results(results, args.out, RESULTS)


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "rebalance", help="a skewed decode load: TPOT with rebalancing on against off (real vLLM)"
    )
    add_stream_arguments(
        parser, "concurrent greedy streams, all sent to one decode worker", 12, "1000,2000", 400, "rounds, each once per mode", 41, RESULTS
    )
    parser.add_argument("--gap", type=float, default=0.02,
                        help="router.rebalance_kv_gap for the 'on' mode (the built-in model's KV is small: a few %% per worker)")
    parser.add_argument("--interval", type=float, default=0.5, help="router.rebalance_interval_s for the 'on' mode")
    parser.set_defaults(handler=_command)
