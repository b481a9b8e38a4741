"""``duet bench multinode``: duet on virtual hosts (deploy/hosts.py), KV across a shaped link.

For each link speed (default 1 and 10 Gbit/s) and transport (nixl = NIXL/UCX over TCP, nccl =
gloo on CPU), the two-host plan (deploy/examples/two-hosts-cpu.yaml) is rendered and run with the
manifests' own commands (deploy/virtual_cluster.py), and measured from outside the hosts:

- **KV bandwidth** across the link, from the decode worker's per-transfer metrics scraped at the
  head's ``/metrics`` (NIXL: ``vllm:nixl_xfer_time_seconds``, post to completion; nccl:
  ``vllm:p2p_recv_wire_seconds``, the time the link carried each transfer), as a share of the
  shaped rate. nccl sends after prefill here (``layerwise: false``), so the wire time is not
  stretched by the prefill computing the next layer.
- **TTFT** (the client's time to the first token, which duet streams from the prefill host) and
  **TT2T** (to the second token, the decode host's first: prefill plus the KV hand-off).

``--codec`` measures KV sent encoded against raw instead (benchmarks/kv_codec.py).

``--faults link,kill`` adds fault runs (nixl, first speed): a load of requests, during which the
decode host goes away for ``--outage-s`` seconds, its link down (``link``) or its Ray node killed
(``kill``). Every request must end with all its tokens or an explicit error; ``lost`` (neither,
within the client's deadline) must be 0. When the host is back, its node is restarted if it is
not running (its ``ray start`` exited, as a pod's container would, and Kubernetes would restart
it), and the time until a fresh request is served again is recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duet.deploy.hosts import LinkShape
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "multinode.json"
PROMPT_TOKENS = 3968  # the built-in model's 4,096-token context, less room for the output
MAX_TOKENS = 4
# The decode side's transfer metrics: (seconds histogram sum, bytes histogram sum).
_TRANSFER_METRICS = {
    "nixl": ("vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum"),
    "nccl": ("vllm:p2p_recv_wire_seconds_sum", "vllm:p2p_bytes_transferred_sum"),
}


def distinct_prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    """Token ids in 3..699 (above the tiny model's specials); distinct per seed, so no request
    finds another's prefix in a cache."""
    return [3 + (seed * 7919 + i * 104729) % 697 for i in range(tokens)]


def _decode_totals(cluster: VirtualCluster, transport: str) -> tuple[float, float]:
    """(transfer seconds, bytes) the decode worker has recorded, from the head's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    assert cluster.metrics_url is not None
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    seconds_name, bytes_name = _TRANSFER_METRICS[transport]
    totals = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("role") != "decode" or sample.labels.get("direction") == "send":
                continue
            if sample.name in (seconds_name, bytes_name):
                totals[sample.name] += sample.value
    return totals[seconds_name], totals[bytes_name]


@dataclass(frozen=True)
class LinkRun:
    transport: str
    rate_mbit: float
    transfers: int
    kv_bytes: float
    transfer_s: float
    ttft_s: list[float]
    tt2t_s: list[float]

    def result(self) -> dict[str, Any]:
        gbit_per_s = self.kv_bytes * 8 / self.transfer_s / 1e9 if self.transfer_s else 0.0
        return {
            "transport": self.transport,
            "link_gbit_per_s": self.rate_mbit / 1000,
            "transfers": self.transfers,
            "kv_mib_per_transfer": self.kv_bytes / max(self.transfers, 1) / 2**20,
            "kv_gbit_per_s": gbit_per_s,
            "share_of_link": gbit_per_s / (self.rate_mbit / 1000),
            "ttft_median_s": statistics.median(self.ttft_s),
            "tt2t_median_s": statistics.median(self.tt2t_s),
        }


def timed_request(
    client: Any, prompt: list[int], max_tokens: int = MAX_TOKENS, timeout_s: float = 120
) -> tuple[float, float, list[int]]:
    """Seconds to the first and to the second token at the client, and the tokens."""
    from duet.router.client import build_request

    start = time.perf_counter()
    arrivals: list[float] = []
    tokens: list[int] = []
    request = build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    for message in client.generate(request, timeout=timeout_s):
        arrivals += [time.perf_counter() - start] * len(message.token_ids)
        tokens += list(message.token_ids)
    return arrivals[0], arrivals[1], tokens


def measure_link(transport: str, rate_mbit: float, requests: int) -> LinkRun:
    settings = {"kv_transfer": {"transport": transport, "layerwise": False}}
    print(f"bench multinode: {transport} over {rate_mbit / 1000:g} Gbit/s ...", file=sys.stderr, flush=True)
    with serve_on_hosts(settings, LinkShape(rate_mbit=rate_mbit)) as cluster, cluster.client() as client:
        timed_request(client, distinct_prompt(seed=10_000))  # warm-up: first kernels and the engines' handshake
        before = _decode_totals(cluster, transport)
        timings = [timed_request(client, distinct_prompt(seed))[:2] for seed in range(requests)]
        time.sleep(1.0)  # the decode side records a transfer's metrics at its next engine step
        after = _decode_totals(cluster, transport)
    return LinkRun(
        transport, rate_mbit, requests, after[1] - before[1], after[0] - before[0],
        [first for first, _ in timings], [second for _, second in timings],
    )


def _load_outcomes(cluster: VirtualCluster, requests: int, concurrency: int, deadline_s: float, outcomes: Counter) -> None:
    """Run ``requests`` requests, ``concurrency`` at a time, counting how each one ends."""
    import grpc

    from duet.router.client import build_request

    prompts = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        with cluster.client() as client:
            while True:
                with lock:
                    seed = next(prompts, None)
                if seed is None:
                    return
                request = build_request(prompt_token_ids=distinct_prompt(seed, 1024), max_tokens=32, ignore_eos=True)
                try:
                    ids, _ = client.generate_ids(request, timeout=deadline_s)
                    outcome = "tokens" if len(ids) == 32 else "short"
                except grpc.RpcError as error:
                    # The client's own deadline is no answer from duet: the request was lost.
                    outcome = "lost" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"error:{error.code().name}"
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def measure_fault(kind: str, rate_mbit: float, requests: int, outage_s: float, deadline_s: float) -> dict[str, Any]:
    """During a load, the decode host goes away for ``outage_s``: its link down (``link``) or
    its Ray node killed (``kill``, every process on the host). Outcomes, and recovery."""
    print(f"bench multinode: fault run, decode host {kind} for {outage_s:g} s ...", file=sys.stderr, flush=True)
    outcomes: Counter = Counter()
    host = "decode-0"
    with serve_on_hosts({}, LinkShape(rate_mbit=rate_mbit)) as cluster:
        load = threading.Thread(target=_load_outcomes, args=(cluster, requests, 4, deadline_s, outcomes))
        load.start()
        time.sleep(3.0)
        if kind == "link":
            cluster.network.set_link(host, up=False)
        else:
            cluster.network.kill_all(host)
        time.sleep(outage_s)
        if kind == "link":
            cluster.network.set_link(host, up=True)
        back = time.monotonic()
        restarts: list[float] = []
        recovered = _serving_again(cluster, deadline=back + 600, supervise=lambda: restart_if_gone(cluster, host, restarts))
        load.join()
        load_done = time.monotonic()
    return {
        "fault": kind,
        "link_gbit_per_s": rate_mbit / 1000,
        "requests": requests,
        "outage_s": outage_s,
        "client_deadline_s": deadline_s,
        "outcomes": dict(outcomes),
        "lost": outcomes.get("lost", 0) + outcomes.get("short", 0),
        "decode_node_restarted_after_return_s": [round(t - back, 1) for t in restarts],
        "serving_again_after_return_s": recovered - back if recovered else None,
        "load_done_after_return_s": load_done - back,
    }


def restart_if_gone(cluster: VirtualCluster, host: str, restarts: list[float]) -> None:
    """Kubernetes' restart policy for ``host``'s node: once its command has exited (Ray gave
    the node up while it was unreachable, or it was killed), start it again."""
    if all(process.poll() is not None for process in cluster.network[host].processes):
        cluster.network.kill_all(host)  # whatever the dead node left behind
        cluster.start_node(host)
        restarts.append(time.monotonic())


def _serving_again(cluster: VirtualCluster, deadline: float, supervise: Callable[[], None]) -> float | None:
    """When a fresh request first completes on the re-formed cluster (None: not by
    ``deadline``); ``supervise`` runs between attempts."""
    from duet.router.client import build_request

    with cluster.client() as client:
        while time.monotonic() < deadline:
            supervise()
            try:
                ids, _ = client.generate_ids(build_request(prompt_token_ids=distinct_prompt(99, 64), max_tokens=4, ignore_eos=True), timeout=30)
                if len(ids) == 4:
                    return time.monotonic()
            except Exception:  # still re-forming: the next try will tell
                pass
            time.sleep(1.0)
    return None


def format_table(links: list[dict[str, Any]]) -> str:
    rows = ["| link | transport | KV per transfer | KV bandwidth | share of link | TTFT | TT2T |", "|---|---|---|---|---|---|---|"]
    for r in links:
        rows.append(
            f"| {r['link_gbit_per_s']:g} Gbit/s | {r['transport']} | {r['kv_mib_per_transfer']:.1f} MiB | "
            f"{r['kv_gbit_per_s']:.2f} Gbit/s | {r['share_of_link']:.0%} | {r['ttft_median_s'] * 1000:.0f} ms | "
            f"{r['tt2t_median_s'] * 1000:.0f} ms |"
        )
    return "\n".join(rows)


def _bench_multinode(args: argparse.Namespace) -> int:
    if args.codec:
        from duet.benchmarks import kv_codec

        return kv_codec.run(args)
    args.out = args.out or DEFAULT_OUT
    rates = [float(rate) * 1000 for rate in args.links.split(",")]
    transports = args.transports.split(",")
    bad = [t for t in transports if t not in _TRANSFER_METRICS]
    bad += [f for f in filter(None, args.faults.split(",")) if f not in ("link", "kill")]
    if bad or any(rate <= 0 for rate in rates):
        print(f"duet bench multinode: error: --transports takes nixl,nccl, --faults link,kill and --links positive Gbit/s (got {bad or rates})", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "duet bench multinode", "prompt_tokens": PROMPT_TOKENS, "links": []}
    for rate in rates:
        for transport in transports:
            result["links"].append(measure_link(transport, rate, args.requests).result())
    result["faults"] = [
        measure_fault(kind, rates[0], args.fault_requests, args.outage_s, deadline_s=args.deadline_s)
        for kind in filter(None, args.faults.split(","))
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result["links"]))
    for fault in result["faults"]:
        print(json.dumps(fault))
    print(f"wrote {args.out}")
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    """Add ``bench multinode`` to duet's CLI."""
    parser = benches.add_parser("multinode", help="duet on virtual hosts: KV bandwidth and TTFT over shaped links, faults")
    parser.add_argument("--links", default="1,10", help="link speeds in Gbit/s (default 1,10)")
    parser.add_argument("--transports", default="nixl,nccl", help="KV transports (default nixl,nccl)")
    parser.add_argument("--requests", type=int, default=5, help=f"measured {PROMPT_TOKENS}-token requests per link and transport")
    parser.add_argument("--faults", default="", help="fault runs to add: link (decode host's link down), kill (its Ray node killed)")
    parser.add_argument("--fault-requests", type=int, default=40, help="requests in the fault run's load")
    parser.add_argument("--outage-s", type=float, default=15.0, help="how long the decode host's link stays down")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="each fault-run request's client deadline")
    parser.add_argument("--codec", action="store_true", help="measure KV sent encoded against raw (kv_transfer.codec auto vs off) and the codec's accuracy")
    parser.add_argument("--rounds", type=int, default=2, help="--codec: rounds, each starting both settings' deployments in turn")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON result (default {DEFAULT_OUT.name}; --codec: kv_codec.json)")
    parser.set_defaults(handler=_bench_multinode)
