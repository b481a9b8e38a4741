"""The host KV pool across hosts: a prefix one host's pool holds, fetched by another host's
prefill worker over the network (vLLM's p2p tier, kv_pool.fetch_across_hosts).

Virtual hosts on one machine (deploy/hosts.py), each with its own /dev/shm and so its own pool:
the two-prefill-host plan (deploy/examples/two-prefill-hosts-cpu.yaml) puts a prefill worker on
each of two hosts. A prompt computed on one host is sent again while that host's worker is busy
with a longer prompt (so the router sends it to the other); the other must load the prefix's
seven blocks from the first host and generate exactly what a colocated engine does.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duet.deploy.hosts import HostsUnavailable, LinkShape
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts
from duet.router.client import build_request

PLAN = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "two-prefill-hosts-cpu.yaml"
BLOCK = 128  # vLLM's KV block on CPU: the pool keeps whole blocks
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[VirtualCluster]:
    settings = {
        "kv_transfer": {"transport": "nixl"},
        "kv_pool": {"enabled": True},
        "router": {"prefill_policy": "prefix_affinity"},
    }
    try:
        with serve_on_hosts(settings, LinkShape(rate_mbit=1000), plan=PLAN) as running:
            yield running
    except HostsUnavailable as error:
        pytest.skip(f"network namespaces cannot be created here: {error}")


def _transferred(client: Any) -> dict[str, int]:
    """Prompt tokens each prefill worker has loaded instead of computing (pool or peer)."""
    return {
        worker.name: worker.prompt_tokens_transferred
        for pool in client.status().pools if pool.role == "prefill" for worker in pool.workers
    }


def test_a_prefix_pooled_on_one_host_is_fetched_by_the_other(cluster: VirtualCluster, reference) -> None:
    with cluster.client() as client:
        workers = [w for pool in client.status().pools if pool.role == "prefill" for w in pool.workers]
        hosts = {worker.name: cluster.network.host_at(worker.kv_endpoint) for worker in workers}
        assert len(set(hosts.values())) == 2, f"the prefill workers are not on two hosts: {hosts}"
        for attempt in range(5):  # the busy worker's prompt may be done before the second one arrives
            rng = random.Random(700 + attempt)
            prompt = rng.choices(range(3, 700), k=7 * BLOCK + 40)  # seven whole blocks
            longer = prompt + rng.choices(range(3, 700), k=2000)  # its prefix: routed to the same worker
            expected = reference.greedy([prompt], MAX_TOKENS, ignore_eos=True)[0]

            def send(tokens: list[int]) -> tuple[list[int], Any]:
                return client.generate_ids(build_request(prompt_token_ids=tokens, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120)

            ids, first = send(prompt)
            assert ids == expected
            computed_on = first.usage.prefill_worker
            time.sleep(1.0)  # its blocks reach its host's pool in the background
            before = _transferred(client)
            busy = threading.Thread(target=send, args=(longer,))
            busy.start()
            time.sleep(0.15)
            ids, second = send(prompt)
            busy.join()
            assert ids == expected, "the fetched prefix gave other tokens than a colocated engine"
            if second.usage.prefill_worker != computed_on:
                break
        else:
            pytest.fail(f"the prompt was sent again to {computed_on} five times over: no fetch to test")
        after = _transferred(client)
    fetched_by = second.usage.prefill_worker
    assert after[fetched_by] - before[fetched_by] == 7 * BLOCK, (
        f"{fetched_by} on {hosts[fetched_by]} did not load the prefix {computed_on} computed on {hosts[computed_on]}"
    )
