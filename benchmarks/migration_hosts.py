"""Live migration across hosts: ``duet bench migrate --link-gbit G``.

The same comparison as ``duet bench migrate`` (benchmarks/migration.py), with the decode
workers on hosts of their own: the three-host plan (deploy/examples/three-hosts-cpu.yaml,
prefill on one host and a decode worker on each of two others) rendered and run on virtual
hosts (deploy/virtual_cluster.py) whose links are shaped to G Gbit/s, UCX over TCP. A moved
stream's KV crosses the link from the drained decode worker's host to the other's.

Which method a drain uses is the deployment's ``router.drain_moves_kv``, so each run starts a
cluster of its own: ``kv`` (true: the drained worker's streams move with their KV) or ``replay`` (false,
drained with a timeout of 0: they resume on the other by recomputing their contexts). Runs are
interleaved round by round, the order alternating. The streams are spread over both decode
workers by the decode policy; the stall of the moved ones is the router's own measurement
(``duet_migration_stall_seconds``: last token before the move to first token after, on the
cluster's metrics endpoint), and the clients' longest pause after the drain is given for the
streams that paused longest, as many as moved.
"""

from __future__ import annotations

import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from duet.benchmarks.alternating import alternating_rounds
from duet.benchmarks.greedy_streams import GreedyStreams
from duet.benchmarks.migration import describe_split, kv_reads, mean_transfer_s, wait_settled

THREE_HOSTS_PLAN = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "three-hosts-cpu.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "migration_hosts.json"
_STALL = "duet_migration_stall_seconds"
_PHASE = "duet_migration_phase_seconds"


def admin_key_settings(directory: Path, key: str) -> dict[str, Any]:
    """Config settings that make ``key`` an admin key, through a keys file written in
    ``directory``: draining takes an admin key, which only a keys file grants (and it replaces
    the rendered Secret's keys: docs/guides/security.md)."""
    keys_file = directory / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [{"name": "admin", "key": key, "admin": True}]}))
    return {"server": {"auth": {"api_keys_file": str(keys_file)}}}


def _stall_samples(metrics_url: str) -> dict[tuple[str, str, str], float]:
    """The stall and stall-phase histograms' counts and sums, by (sample name, method, phase:
    "" for the stall)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return {
        (sample.name, sample.labels["method"], sample.labels.get("phase", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name in (_STALL, _PHASE)
        for sample in family.samples
        if sample.name.endswith(("_count", "_sum"))
    }


def run_on_hosts(method: str, prompts: list[list[int]], tokens: int, rate_mbit: float) -> dict[str, Any]:
    """A fresh three-host cluster whose drains use ``method``; stream, drain the busier decode worker, measure."""
    from duet.deploy.hosts import LinkShape
    from duet.deploy.virtual_cluster import serve_on_hosts
    from duet.router.client import DuetClient

    print(f"bench migrate: {method} over {rate_mbit / 1000:g} Gbit/s: starting the cluster ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="duet-bench-") as scratch:
        key = secrets.token_hex(16)
        settings = {"router": {"drain_moves_kv": method == "kv"}, **admin_key_settings(Path(scratch), key)}
        with serve_on_hosts(settings, LinkShape(rate_mbit=rate_mbit), plan=THREE_HOSTS_PLAN) as cluster:
            with DuetClient(cluster.targets, api_key=key) as client:
                return _drain_under_load(cluster, client, method, prompts, tokens, rate_mbit)


def _drain_under_load(
    cluster: Any, client: Any, method: str, prompts: list[list[int]], tokens: int, rate_mbit: float
) -> dict[str, Any]:
    from duet.router.client import build_request

    assert cluster.metrics_url is not None
    assert wait_settled(client, 2) == ["decode-0", "decode-1"]
    client.generate_ids(build_request(prompt_token_ids=prompts[0][:64], max_tokens=4, ignore_eos=True), timeout=300)  # warm-up
    before = _stall_samples(cluster.metrics_url)
    streams = GreedyStreams(client, prompts, tokens)
    # Drained once every stream decodes (its second token came): the prompts' prefills queue on
    # one prefill worker, so waiting longer would let the first streams finish.
    streams.start(decoding_tokens=2)
    # The decode worker with more of the streams is drained: the decode policy spreads a burst by
    # the KV use the last health pings reported, which can send all of it to one worker.
    leaving = max((w for pool in client.list_workers().pools if pool.role == "decode" for w in pool.workers),
                  key=lambda worker: worker.requests_inflight)
    on_leaving = leaving.requests_inflight
    staying = next(name for name in ("decode-0", "decode-1") if name != leaving.name)
    reads_before = kv_reads(client, staying)
    drained_at = time.monotonic()
    client.drain(leaving.name, timeout_s=0 if method == "replay" else None)
    streams.join(method)
    wait_settled(client, 1)
    time.sleep(1.0)  # the last move's stall is observed as its stream's next token leaves
    after = _stall_samples(cluster.metrics_url)

    def grew(sample: str, phase: str = "") -> float:
        return after.get((sample, method, phase), 0) - before.get((sample, method, phase), 0)

    moved = int(grew(f"{_STALL}_count"))
    phases = {phase: grew(f"{_PHASE}_sum", phase) / count for phase in ("give_up", "hand_off", "resume")
              if (count := grew(f"{_PHASE}_count", phase))}
    pauses = sorted(streams.longest_pauses_after(drained_at), reverse=True)
    longest = pauses[:moved]
    return {
        "method": method,
        "link_gbit": rate_mbit / 1000,
        "streams_on_drained_worker": on_leaving,
        "moved_streams": moved,
        "stall_mean_s": grew(f"{_STALL}_sum") / moved if moved else None,
        "phase_mean_s": phases,
        "kv_read_mean_s": mean_transfer_s(reads_before, kv_reads(client, staying)),
        "client_pause_median_s": statistics.median(longest) if longest else None,
        "client_pause_max_s": max(longest, default=None),
        "others_longest_pause_s": pauses[moved] if moved < len(pauses) else None,
        "tokens": streams.tokens,
    }


def run_benchmark_on_hosts(prompts: list[list[int]], tokens: int, rounds: int, link_gbit: float) -> list[dict[str, Any]]:
    def compare(pair: dict[str, dict[str, Any]]) -> str:
        kv, replay = pair["kv"]["stall_mean_s"], pair["replay"]["stall_mean_s"]
        return f"kv / replay mean stall {kv / replay if kv and replay else float('nan'):.2f}x"

    def describe(result: dict[str, Any]) -> str:
        return (f"{result['moved_streams']} of {result['streams_on_drained_worker']} streams on the drained worker moved; stall mean "
                f"{_ms(result['stall_mean_s'])} ms (router; {describe_split(result['phase_mean_s'], result['kv_read_mean_s'])}); "
                f"clients' longest pauses: median "
                f"{_ms(result['client_pause_median_s'])}, max {_ms(result['client_pause_max_s'])} ms, the next stream's "
                f"{_ms(result['others_longest_pause_s'])} ms")

    return alternating_rounds(
        rounds, ("kv", "replay"), lambda method: run_on_hosts(method, prompts, tokens, link_gbit * 1000), describe, compare,
        "identical_across_methods",
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"
