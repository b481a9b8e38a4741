"""The host KV pool across hosts (kv_pool.fetch_across_hosts): a prefix one host's pool holds,
fetched by another host's prefill worker over the network (vLLM's p2p tier); where each prefill
engine's peer tier goes and listens, and when there is none.

Virtual hosts on one machine (deploy/hosts.py), each with its own /dev/shm and so its own pool:
the two-prefill-host plan (deploy/examples/two-prefill-hosts-cpu.yaml) puts a prefill worker on
each of two hosts. A prompt computed on one host is sent again while that host's worker is busy
with a longer prompt (so the router sends it to the other: benchmarks/kv_pool_hosts.py's
trial); the other must load the prefix's seven blocks from the first host and generate exactly
what a colocated engine does. (This test hung in one CI run and was out of the suite for a
while: the decode engine, sharing a core with a prefill engine, got no CPU for seconds, because
each virtual host was an autogroup of its own; deploy/hosts.py says how that was mended.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from duet.benchmarks.kv_pool_hosts import BLOCK, MAX_TOKENS, PLAN, SETTINGS, fetch_trial
from duet.config import load_config, parse_config
from duet.deploy.hosts import HostsUnavailable, LinkShape
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts
from duet.kv_transfer.config import (
    TransferEndpoint, engine_kv_transfer_config, pool_peer_endpoint, pool_peer_environment, ports_per_worker,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[VirtualCluster]:
    try:
        with serve_on_hosts(SETTINGS, LinkShape(rate_mbit=1000), plan=PLAN) as running:
            yield running
    except HostsUnavailable as error:
        pytest.skip(f"network namespaces cannot be created here: {error}")


def _loaded(client: Any) -> tuple[dict[str, int], int]:
    """Prompt tokens each prefill worker has loaded instead of computing (pool or peer), and the
    blocks every host's pool fetched from another's."""
    status = client.status()
    loaded = {worker.name: worker.prompt_tokens_transferred for pool in status.pools if pool.role == "prefill" for worker in pool.workers}
    return loaded, sum(kv_pool.fetched for kv_pool in status.kv_pools)


def test_a_prefix_pooled_on_one_host_is_fetched_by_the_other(cluster: VirtualCluster, reference) -> None:
    with cluster.client() as client:
        workers = [w for pool in client.status().pools if pool.role == "prefill" for w in pool.workers]
        hosts = {worker.name: cluster.network.host_at(worker.kv_endpoint) for worker in workers}
        assert len(set(hosts.values())) == 2, f"the prefill workers are not on two hosts: {hosts}"
        for attempt in range(5):  # the busy worker's prompt may be done before the second one arrives
            rng = random.Random(700 + attempt)
            prompt = rng.choices(range(3, 700), k=7 * BLOCK + 40)  # seven whole blocks
            loaded_before, fetched_before = _loaded(client)
            trial = fetch_trial(client, prompt, rng.choices(range(3, 700), k=2000), fetched=True)
            if trial.worker != trial.busy_worker:
                break
        else:
            pytest.fail("the prompt was sent again to the worker that computed it five times over: no fetch to test")
        loaded_after, fetched_after = _loaded(client)
    if trial.token_ids != trial.expected:
        pytest.fail(f"the fetched prefix gave other tokens than computing it; the hosts logged:\n{cluster.warnings()}")
    expected = reference.greedy([prompt], MAX_TOKENS, ignore_eos=True)[0]
    assert trial.expected == expected
    assert loaded_after[trial.worker] - loaded_before[trial.worker] == 7 * BLOCK, (
        f"{trial.worker} on {hosts[trial.worker]} did not load the prefix {trial.busy_worker} computed on {hosts[trial.busy_worker]}"
    )
    assert fetched_after - fetched_before == 7  # duet status: "7 fetched from other hosts"


def _config(**kv_pool: Any) -> Any:
    data = load_config().model_dump()
    data["kv_pool"].update({"enabled": True, "fetch_across_hosts": True, **kv_pool})
    data["router"]["prefill_policy"] = "prefix_affinity"
    data["prefill"]["tensor_parallel"] = 2
    return parse_config(data)


def test_a_prefill_engine_listens_for_other_hosts_after_its_kv_channel():
    """The p2p tier comes after the host's pool (a block found on the host is never fetched) and
    listens on the port after the engine's ranks' side-channel ports, which the worker reserves
    with them; the router finds it from the worker's KV endpoint the same way."""
    config = _config()
    assert ports_per_worker(config, "prefill") == 3  # two ranks, then the peer
    assert ports_per_worker(config, "decode") == 1
    assert pool_peer_environment(config, "prefill") == {"VLLM_P2P_HANDSHAKE_TIMEOUT_S": "5"}
    assert pool_peer_environment(config, "decode") == {}
    endpoint = TransferEndpoint("10.0.0.7", 5600)
    assert pool_peer_endpoint(config, "prefill", "10.0.0.7:5600") == TransferEndpoint("10.0.0.7", 5602)
    engine = engine_kv_transfer_config(config, "prefill", endpoint)
    assert engine is not None
    pool = engine["kv_connector_extra_config"]["connectors"][1]
    tiers = pool["kv_connector_extra_config"]["secondary_tiers"]
    assert [tier["type"] for tier in tiers] == ["HostPoolTier", "HostPeerTier"]
    assert (tiers[1]["host"], tiers[1]["port"]) == ("10.0.0.7", 5602)


def test_without_fetches_across_hosts_there_is_no_peer_tier():
    """Off, or on without prefix_affinity (the only policy that knows where a prefix is)."""
    data = _config().model_dump()
    data["router"]["prefill_policy"] = "least_prompt_tokens"
    assert ports_per_worker(parse_config(data), "prefill") == 2
    assert pool_peer_environment(parse_config(data), "prefill") == {}
    config = _config(fetch_across_hosts=False)
    assert ports_per_worker(config, "prefill") == 2
    assert pool_peer_endpoint(config, "prefill", "10.0.0.7:5600") is None
    engine = engine_kv_transfer_config(config, "prefill", TransferEndpoint("10.0.0.7", 5600))
    assert engine is not None
    tiers = engine["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["secondary_tiers"]
    assert [tier["type"] for tier in tiers] == ["HostPoolTier"]
