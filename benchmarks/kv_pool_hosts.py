"""The host KV pool across hosts: a prefix fetched from another host's pool against computed
(``duet bench kv-pool-hosts``).

The two-prefill-host plan (deploy/examples/two-prefill-hosts-cpu.yaml: a prefill worker on each
of two virtual hosts, each host with its own /dev/shm and so its own pool, the decode worker on
a third) runs with the pool and its fetches across hosts on and ``prefix_affinity``, twice per
link speed: with ``kv_pool.fetch_when: always`` (every planned fetch made: what fetching costs)
and ``faster`` (the default: the router fetches only where its timings say fetching is faster
than computing, router/pool_fetch.py). Each round makes two trials, in alternating order (this
machine's speed moves within minutes):

- **fetched**: a prompt is computed on one prefill worker, then sent again while that worker
  is busy with a longer prompt that shares it (affinity sends that one there), so the router
  sends it to the other host's worker, which fetches its whole blocks from the first host;
- **computed**: a new prompt of the same length, sent while one worker is busy with a new
  prompt as long as the fetched trial's extra tokens: the other host's worker computes it.

Each trial's figure is the second request's TTFT (the router's, prefill and first token); a
trial whose second request went to the busy worker after all is made again. The fetched
trial's tokens must equal its first request's (the prefix computed on one host, loaded on the
other or computed again), and with ``always`` the hosts' pools must count every block fetched.
With ``faster``, each fetched trial records whether the router fetched (the hosts' pools'
fetched blocks before and after it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLAN = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "two-prefill-hosts-cpu.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "kv_pool_hosts.json"
SETTINGS = {
    "kv_transfer": {"transport": "nixl"},
    "kv_pool": {"enabled": True, "fetch_across_hosts": True, "fetch_when": "always"},
    "router": {"prefill_policy": "prefix_affinity"},
}
BLOCK = 128  # vLLM's KV block on CPU: the pool keeps whole blocks
MAX_TOKENS = 8
# Before the busy request's prompt is sent again: its blocks reach the first host's pool in the
# background once it is done.
_STORED_S = 1.0
# Between the busy request and the measured one: time for the router to route the first.
_ROUTED_S = 0.05


@dataclass
class Trial:
    busy_worker: str  # the prefill worker the longer prompt kept busy
    worker: str  # the one the measured request went to
    ttft_s: float
    token_ids: list[int]
    expected: list[int] | None  # the fetched trial: the first request's tokens
    blocks_fetched: int = 0  # by the hosts' pools during the trial


def _send(client: Any, tokens: list[int]) -> tuple[list[int], Any]:
    from duet.router.client import build_request

    return client.generate_ids(build_request(prompt_token_ids=tokens, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120)


def fetch_trial(client: Any, prompt: list[int], busy_tokens: list[int], fetched: bool) -> Trial:
    """One trial (see the module's docstring). ``fetched``: ``prompt`` is computed first and
    the busy prompt is ``prompt + busy_tokens``; otherwise the busy prompt is ``busy_tokens``
    alone and ``prompt`` is new to every worker."""
    expected = None
    busy_prompt = busy_tokens
    if fetched:
        expected, _ = _send(client, prompt)
        time.sleep(_STORED_S)
        busy_prompt = prompt + busy_tokens
    busy: dict[str, Any] = {}
    sender = threading.Thread(target=lambda: busy.update(last=_send(client, busy_prompt)[1]))
    sender.start()
    time.sleep(_ROUTED_S)
    ids, last = _send(client, prompt)
    sender.join()
    return Trial(busy["last"].usage.prefill_worker, last.usage.prefill_worker, last.usage.ttft_s, ids, expected)


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return rng.choices(range(3, 700), k=tokens)  # above the built-in model's specials


def _measured_trial(client: Any, rng: random.Random, args: argparse.Namespace, fetched: bool) -> Trial:
    """A trial whose measured request went to the other worker (up to five tries)."""
    for _ in range(5):
        fetched_before = _fetched_blocks(client)
        trial = fetch_trial(client, _prompt(rng, args.prompt_tokens), _prompt(rng, args.busy_tokens), fetched)
        trial.blocks_fetched = _fetched_blocks(client) - fetched_before
        if trial.worker != trial.busy_worker:
            if trial.expected is not None and trial.token_ids != trial.expected:
                raise AssertionError("a prefix fetched from another host gave other tokens than computing it")
            return trial
    raise RuntimeError("the measured request went to the busy worker five times over: raise --busy-tokens")


def _fetched_blocks(client: Any) -> int:
    return sum(kv_pool.fetched for kv_pool in client.status().kv_pools)


def measure_link(rate_mbit: float, fetch_when: str, args: argparse.Namespace) -> dict[str, Any]:
    """One cluster at ``rate_mbit`` with ``kv_pool.fetch_when: fetch_when``: ``args.rounds``
    rounds of a fetched and a computed trial."""
    from duet.deploy.hosts import LinkShape
    from duet.deploy.virtual_cluster import serve_on_hosts

    rng = random.Random(int(rate_mbit))
    settings = {**SETTINGS, "kv_pool": {**SETTINGS["kv_pool"], "fetch_when": fetch_when}}
    trials: dict[str, list[Trial]] = {"fetched": [], "computed": []}
    with serve_on_hosts(settings, LinkShape(rate_mbit=rate_mbit), plan=PLAN) as cluster, cluster.client() as client:
        fetch_trial(client, _prompt(rng, args.prompt_tokens), _prompt(rng, args.busy_tokens), fetched=False)  # warm-up
        for round_index in range(args.rounds):
            for kind in ("fetched", "computed") if round_index % 2 == 0 else ("computed", "fetched"):
                trial = _measured_trial(client, rng, args, fetched=kind == "fetched")
                trials[kind].append(trial)
                print(
                    f"{rate_mbit:g} Mbit/s, {fetch_when}, round {round_index}, {kind}: TTFT {trial.ttft_s * 1000:.0f} ms, "
                    f"{trial.blocks_fetched} blocks fetched", flush=True,
                )
    blocks_per_trial = args.prompt_tokens // BLOCK
    fetches_made = sum(trial.blocks_fetched >= blocks_per_trial for trial in trials["fetched"])
    if fetch_when == "always" and fetches_made < args.rounds:
        raise AssertionError(f"{fetches_made} of {args.rounds} fetched trials fetched their {blocks_per_trial} blocks from the other host")
    ttft = {kind: [trial.ttft_s for trial in kind_trials] for kind, kind_trials in trials.items()}
    fetched_p50, computed_p50 = statistics.median(ttft["fetched"]), statistics.median(ttft["computed"])
    return {
        "link_mbit": rate_mbit, "fetch_when": fetch_when, "fetches_made": fetches_made,
        "blocks_fetched": sum(trial.blocks_fetched for kind_trials in trials.values() for trial in kind_trials), "ttft_s": ttft,
        "ttft_p50_fetched_s": fetched_p50, "ttft_p50_computed_s": computed_p50, "computed_over_fetched": computed_p50 / fetched_p50,
    }


def _command(args: argparse.Namespace) -> int:
    from duet.benchmarks.kv_pool import write_results

    links = [measure_link(float(rate), fetch_when, args) for rate in args.links.split(",") for fetch_when in ("always", "faster")]
    for link in links:
        print(
            f"{link['link_mbit']:g} Mbit/s, fetch_when {link['fetch_when']}: TTFT p50 of a prefix on the other host "
            f"{link['ttft_p50_fetched_s'] * 1000:.0f} ms ({link['fetches_made']} of {args.rounds} fetched), of one computed "
            f"{link['ttft_p50_computed_s'] * 1000:.0f} ms: computed / other host {link['computed_over_fetched']:.2f}x"
        )
    write_results(RESULTS, args, {"links": links})
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "kv-pool-hosts", help="a prefix fetched from another host's KV pool against computed, over shaped links (virtual hosts, needs root)"
    )
    parser.add_argument("--links", default="1000,100", help="link speeds in Mbit/s, two clusters each: fetch_when always, then faster (default 1000,100)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per link, each one fetched and one computed trial")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="the measured prompt (whole 128-token blocks are fetched)")
    parser.add_argument("--busy-tokens", type=int, default=2000, help="what keeps the first worker busy meanwhile")
    parser.set_defaults(handler=_command)
