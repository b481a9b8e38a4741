"""The host KV pool across hosts (kv_pool.fetch_across_hosts): where each prefill engine's peer
tier goes and listens, and when there is none.

The fetch itself, on virtual hosts, is `duet bench kv-pool-hosts` (benchmarks/kv_pool_hosts.py:
it checks the tokens and the blocks fetched in every trial). It is not in the suite: in one
fresh-clone CI run, both requests of a trial, the busy one on the source host and the fetching
one, got no reply within 120 s. Its cause is not known (the same trial passed in eight other
runs); docs/concepts/kv-pool.md says so.
"""

from __future__ import annotations

from typing import Any

from duet.config import load_config, parse_config
from duet.kv_transfer.config import (
    TransferEndpoint, engine_kv_transfer_config, pool_peer_endpoint, pool_peer_environment, ports_per_worker,
)


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
