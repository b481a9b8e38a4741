"""Live migration against token replay: the pause a drained decode worker's streams see.

``duet bench migrate`` starts the default deployment (one prefill and one decode worker, NIXL,
or with ``--transport nccl`` duet's push connector, the built-in model, float32) and, round after round, grows the decode pool to two workers,
starts ``--streams`` greedy streams with prompts of ``--context`` tokens, waits until every
stream is decoding, and drains the new decode worker, once per method, the order alternating:

- ``kv``: its streams move to decode-0 with their KV (``router.drain_moves_kv``,
  worker_runtime/kv_migration.py);
- ``replay``: the drain's timeout is 0, so its streams resume on decode-0 by token replay, which
  recomputes each one's prompt and every token streamed so far (what a drain past its timeout,
  and every drain before live migration, does).

The prompts are the same every time and greedy streams must come out identical under both
methods. Reported per moved stream: the longest pause between two of its messages after the
drain (the move's stall, against a TPOT of a few milliseconds), and per round the ratio of the
two methods' median stalls.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from duet.benchmarks.alternating import alternating_rounds
from duet.benchmarks.arguments import positive_float, write_results
from duet.benchmarks.greedy_streams import GreedyStreams

RESULTS = Path(__file__).resolve().parent / "results" / "migration.json"
NCCL_RESULTS = RESULTS.with_name("migration_nccl.json")


def wait_settled(client: Any, decode_workers: int, timeout_s: float = 600) -> list[str]:
    """Wait until nothing is starting or draining and decode has ``decode_workers``; their names."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = {pool.role: pool.workers for pool in client.list_workers().pools}
        states = {w.state for workers in pools.values() for w in workers}
        if states == {"ready"} and len(pools["decode"]) == decode_workers:
            return [w.name for w in pools["decode"]]
        time.sleep(0.5)
    raise TimeoutError(f"the decode pool did not settle at {decode_workers} workers")


def kv_reads(client: Any, worker: str) -> tuple[int, float]:
    """The KV transfers ``worker`` has made since it started, and their seconds in all (its
    vLLM metrics, as ``duet status`` shows them)."""
    for pool in client.status(timeout=30).pools:
        for state in pool.workers:
            if state.name == worker:
                return state.kv_transfers, state.kv_transfer_seconds
    raise LookupError(f"no worker {worker}")


def mean_transfer_s(before: tuple[int, float], after: tuple[int, float]) -> float | None:
    """The mean duration of the transfers between two :func:`kv_reads` (None: there were none)."""
    count = after[0] - before[0]
    return (after[1] - before[1]) / count if count else None


def run_once(deployment: Any, client: Any, method: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Grow decode to two workers, stream, drain the new one by ``method``; the moved streams'
    pauses, the router's split of their stalls, and decode-0's KV reads meanwhile."""
    client.scale("decode", 2)
    grown = next(name for name in wait_settled(client, 2) if name != "decode-0")
    leaving = deployment.decode.find(grown)
    streams = GreedyStreams(client, prompts, tokens)
    streams.start(decoding_tokens=10)
    lifecycle = deployment.service.lifecycle
    moving = {round_.request_id.split("-", 1)[0] for round_ in lifecycle.decoding() if round_.worker is leaving}
    hooks, observe = list(deployment.decode.on_draining), lifecycle.on_move
    moves: list[Any] = []

    def record(move: Any) -> None:
        moves.append(move)
        if observe is not None:
            observe(move)

    lifecycle.on_move = record
    if method == "replay":
        deployment.decode.on_draining.clear()
    reads_before = kv_reads(client, "decode-0")
    try:
        drained_at = time.monotonic()
        client.drain(grown, timeout_s=0 if method == "replay" else None)
        streams.join(method)
    finally:
        deployment.decode.on_draining[:] = hooks
        lifecycle.on_move = observe
    wait_settled(client, 1)
    stalls = {f"s{i}": pause for i, pause in enumerate(streams.longest_pauses_after(drained_at))}
    moved = sorted(stalls[name] for name in moving)
    # decode-0's step time while the moved streams resumed there, from the streams it kept.
    staying = [i for i in range(len(prompts)) if f"s{i}" not in moving]
    step = streams.time_per_token_in(drained_at, drained_at + max(moved, default=0.0), staying)
    return {
        "method": method,
        "moved_streams": len(moving),
        "stall_s": moved,
        "stall_median_s": statistics.median(moved) if moved else None,
        "stall_max_s": max(moved, default=None),
        "phase_median_s": median_phases(moves),
        "kv_read_mean_s": mean_transfer_s(reads_before, kv_reads(client, "decode-0")),
        "target_step_s": step,
        "others_longest_pause_s": max((v for k, v in stalls.items() if k not in moving), default=None),
        "tokens": streams.tokens,
    }


def median_phases(moves: list[Any]) -> dict[str, float]:
    """Per phase of the router's split of a stall (router/lifecycle.py ``Move``), its median over ``moves``."""
    phases = sorted({phase for move in moves for phase in move.phases})
    return {phase: statistics.median(move.phases[phase] for move in moves if phase in move.phases) for phase in phases}


def random_prompts(streams: int, context: tuple[int, int], seed: int) -> list[list[int]]:
    """``streams`` prompts of random token ids, their lengths drawn from ``context`` (LOW, HIGH)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 700) for _ in range(rng.randint(*context))] for _ in range(streams)]


def start_default_deployment(source: str, transport: str = "nixl") -> tuple[Any, Any]:
    """The default deployment over ``transport``, started in-process on a background loop (its
    ``background``), with room for a second decode worker; returns it and the loop."""
    from duet.background_loop import BackgroundLoop
    from duet.cluster.deployment import Deployment
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    data["server"].update(metrics_port=None)  # beside another deployment: no fixed port of its own
    data["ray"]["num_cpus"] = 3  # room for the second decode worker (two engines share a core)
    data["kv_transfer"]["transport"] = transport
    loop = BackgroundLoop()
    deployment = loop.run(Deployment(parse_config(data, source)).start(port=0, http_port=None), timeout=900)
    deployment.background = loop
    return deployment, loop


def run_benchmark(
    streams: int, context: tuple[int, int], tokens: int, rounds: int, seed: int, transport: str = "nixl"
) -> list[dict[str, Any]]:
    from duet.router.client import DuetClient

    prompts = random_prompts(streams, context, seed)
    deployment, loop = start_default_deployment("bench migrate", transport)
    try:
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            return alternating_rounds(
                rounds, ("kv", "replay"), lambda method: run_once(deployment, client, method, prompts, tokens),
                _describe, _compare, "identical_across_methods",
            )
    finally:
        loop.run(deployment.stop(), timeout=120)
        loop.close()


def _describe(result: dict[str, Any]) -> str:
    return (f"{result['moved_streams']} streams moved; stall median {_ms(result['stall_median_s'])}, max "
            f"{_ms(result['stall_max_s'])} ms ({describe_split(result['phase_median_s'], result['kv_read_mean_s'], result['target_step_s'])}); "
            f"other streams' longest pause {_ms(result['others_longest_pause_s'])} ms")


def describe_split(phases: dict[str, float], kv_read_s: float | None, target_step_s: float | None = None) -> str:
    """The router's split of a stall by phase, the target's mean KV read and, where known, its
    step time, in milliseconds."""
    split = ", ".join(f"{phase} {_ms(seconds)}" for phase, seconds in phases.items())
    return (f"{split or 'no split'}; KV reads on the target {_ms(kv_read_s)} ms each"
            + (f"; its step {_ms(target_step_s)} ms meanwhile" if target_step_s is not None else ""))


def _compare(pair: dict[str, dict[str, Any]]) -> str:
    kv, replay = pair["kv"]["stall_median_s"], pair["replay"]["stall_median_s"]
    return f"kv / replay median stall {kv / replay if kv and replay else float('nan'):.2f}x"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def context_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"LOW,HIGH prompt lengths in tokens, e.g. 1500,3000 (got {text!r})") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH (got {text!r})")
    return low, high


def _command(args: argparse.Namespace) -> int:
    if args.link_gbit is not None and args.transport != "nixl":
        raise SystemExit("duet bench migrate: --transport nccl runs on one machine; drop --link-gbit or the transport")
    if args.link_gbit is not None:
        from duet.benchmarks.migration_hosts import RESULTS as HOSTS_RESULTS, run_benchmark_on_hosts

        prompts = random_prompts(args.streams, args.context, args.seed)
        return write_results(run_benchmark_on_hosts(prompts, args.tokens, args.rounds, args.link_gbit), args.out, HOSTS_RESULTS)
    results = run_benchmark(args.streams, args.context, args.tokens, args.rounds, args.seed, args.transport)
    return write_results(results, args.out, NCCL_RESULTS if args.transport == "nccl" else RESULTS)


def add_stream_arguments(
    parser: argparse.ArgumentParser, streams_help: str, streams: int, context: str, tokens: int, rounds_help: str,
    seed: int, results: Path,
) -> None:
    """The options of a benchmark of concurrent greedy streams over rounds."""
    parser.add_argument("--streams", type=int, default=streams, help=streams_help)
    parser.add_argument("--context", type=context_range, default=context, help="LOW,HIGH prompt tokens")
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=2, help=rounds_help)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--out", help=f"results file (default {results.relative_to(results.parents[2])})")


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "migrate", help="a drained decode worker's streams: moved with their KV against token replay (real vLLM)"
    )
    add_stream_arguments(parser, "concurrent greedy streams", 16, "1500,3000", 300, "rounds, each draining once per method", 37, RESULTS)
    parser.add_argument(
        "--link-gbit", type=positive_float, default=None,
        help="run on virtual hosts instead (prefill, decode-0 and decode-1 each a host, a cluster per run; "
             "benchmarks/migration_hosts.py) with links shaped to this many Gbit/s; results default to migration_hosts.json",
    )
    parser.add_argument(
        "--transport", choices=("nixl", "nccl"), default="nixl",
        help="the KV transport on one machine (nccl: duet's push connector, gloo on CPU; results default to "
             "migration_nccl.json); not with --link-gbit",
    )
    parser.set_defaults(handler=_command)
