"""vLLM KV-transfer settings for each worker role, for each transport duet supports.

The engine sees KV transfer through two channels: ``kv_transfer_config`` (which connector, which
role, where buffers live, what to do when a load fails) and environment variables that must be in
place before vLLM spawns its engine processes (NIXL's side-channel address, and duet's own knobs
read by :mod:`duet.kv_transfer.vllm_plugin`). This module builds both from duet's config so that
the prefill and decode sides can never disagree.

Transports differ in one way the router must know (``Transport.pushes_to_decode``), for a
prefill's KV and for a running request's that moves to another decode worker alike:
- ``nixl`` (vLLM's NixlConnector) is pull-based: prefill keeps the KV and publishes where it is;
  the decode worker, chosen after prefill, reads it.
- ``nccl`` (duet's P2pConnector, torch.distributed send/recv: NCCL on GPUs, gloo on CPUs) is
  push-based and streams each layer during prefill, so the decode worker is chosen first and its
  address goes into the prefill request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import os

from duet.config import DuetConfig, KVPoolConfig, KVTransferConfig
from duet.kv_transfer.metrics import POOL_PEER_TIER_TYPE, POOL_TIER_TYPE

Role = Literal["prefill", "decode"]
# The roles whose engines read and fill the host KV pool (docs/concepts/kv-pool.md): decode
# engines get their prompts' KV from prefill workers, and live migration reads NixlConnector's
# scheduler directly (worker_runtime/kv_migration.py), which a connector beside it would hide.
POOL_ROLES = ("prefill", "colocated")
_POOL_MODULE = "duet.kv_transfer.kv_pool"
_PEER_MODULE = "duet.kv_transfer.pool_peers"
# Seconds a prefill engine waits for another host's engine to take up a fetch (the p2p handshake).
POOL_PEER_HANDSHAKE_TIMEOUT_S = 5

_CONNECTOR_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}

# Environment variables read by duet's vLLM plugin inside every engine process.
ENV_NIXL_PROGRESS_THREAD = "DUET_NIXL_PROGRESS_THREAD"
ENV_WORKER_CPU_CORE = "DUET_WORKER_CPU_CORE"


@dataclass(frozen=True)
class Transport:
    name: str
    # The decode worker must be chosen before prefill, and its address passed to prefill.
    pushes_to_decode: bool
    # Which role listens on a port (NIXL: both, for handshakes; p2p: the receiving decode side).
    listening_roles: tuple[Role, ...]


TRANSPORTS = {
    "nixl": Transport("nixl", pushes_to_decode=False, listening_roles=("prefill", "decode")),
    "nccl": Transport("nccl", pushes_to_decode=True, listening_roles=("decode",)),
}


@dataclass(frozen=True)
class TransferEndpoint:
    """Where a worker's KV channel listens; reported in ``duet status``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> "TransferEndpoint":
        """The endpoint ``str`` wrote ("host:port")."""
        host, port = text.rsplit(":", 1)
        return cls(host, int(port))


def listen_host(settings: KVTransferConfig) -> str:
    """The address a worker's KV channel listens on and peers connect to: the configured one,
    or for ``auto`` the address of the worker's own node in the Ray cluster (multi-node)."""
    if settings.side_channel_host != "auto":
        return settings.side_channel_host
    import ray

    return ray.util.get_node_ip_address()


def base_port(settings: KVTransferConfig) -> int:
    """First port a listening worker tries to reserve for its transport."""
    return settings.side_channel_base_port if settings.transport == "nixl" else settings.p2p_base_port


def kv_transfer_config(
    settings: KVTransferConfig, role: Role, endpoint: TransferEndpoint | None
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict for an engine of ``role``."""
    if settings.transport == "nccl":
        from duet.kv_transfer.p2p.config import P2pConfig
        from duet.kv_transfer.p2p.params import kv_transfer_config as p2p_kv_transfer_config

        listen = endpoint or TransferEndpoint(listen_host(settings), settings.p2p_base_port)
        p2p = P2pConfig(
            host=listen.host,
            port=listen.port,
            transfer_timeout_s=settings.handoff_timeout_s,
            lease_s=float(settings.kv_lease_s),
            layerwise=settings.layerwise,
            codec=settings.codec,
        )
        return p2p_kv_transfer_config(_CONNECTOR_ROLE[role], p2p, kv_load_failure_policy=settings.load_failure_policy)
    return {
        "kv_connector": "NixlConnector",
        "kv_role": _CONNECTOR_ROLE[role],
        "kv_buffer_device": settings.buffer_device,
        "kv_load_failure_policy": settings.load_failure_policy,
        "kv_connector_extra_config": {"kv_lease_duration": settings.kv_lease_s},
    }


def pool_connector_config(pool: KVPoolConfig, peer: TransferEndpoint | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the host KV pool's connector: vLLM's OffloadingConnector
    with duet's spec and tier (kv_transfer/kv_pool.py), and where ``peer`` is given, vLLM's p2p
    tier listening there: engines on other hosts fetch this host's pool blocks through it, and
    this engine fetches theirs (a request's ``remote_kv_source``, :func:`pool_source_params`)."""
    tiers: list[dict[str, Any]] = [{
        "type": POOL_TIER_TYPE,  # the tier's class in the module
        "module_path": _POOL_MODULE,
        "root_dir": os.path.expanduser(pool.directory),
        "capacity_bytes": int(pool.capacity_gib * 2**30),
        # Copies within host memory: one thread each way is plenty, and every thread
        # is one more beside the engine's forward pass on its core.
        "n_read_threads": 1,
        "n_write_threads": 1,
    }]
    if peer is not None:
        # After the host's own pool: a block found there is never fetched from another host.
        tiers.append({
            "type": POOL_PEER_TIER_TYPE, "module_path": _PEER_MODULE,  # vLLM's p2p tier (kv_transfer/pool_peers.py)
            "host": peer.host, "port": peer.port, "backends": ["UCX"], "num_threads": 1,
        })
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HostTieringSpec",
            "spec_module_path": _POOL_MODULE,
            "cpu_bytes_to_use": pool.engine_buffer_mib * 2**20,
            "eviction_policy": "lru",
            "secondary_tiers": tiers,
        },
    }


def fetches_across_hosts(config: DuetConfig) -> bool:
    """Whether prefill engines fetch pool blocks from other hosts' engines (and serve theirs):
    only prefill workers have a KV channel whose address the router knows, and only
    ``prefix_affinity`` knows which host's pool holds a prefix (without it, the peer tier
    would run in every prefill engine for nothing)."""
    return (
        config.kv_pool.fetch_across_hosts and pool_serves(config, "prefill")
        and config.router.prefill_policy == "prefix_affinity"
    )


def pool_peer_environment(config: DuetConfig, role: str) -> dict[str, str]:
    """Environment of an engine of ``role``'s p2p pool tier: how long it waits for another
    host's engine to answer before it computes the prompt instead (vLLM's default, 30 s, is
    what every prompt sent to an unreachable source would wait)."""
    if role != "prefill" or not fetches_across_hosts(config):
        return {}
    return {"VLLM_P2P_HANDSHAKE_TIMEOUT_S": str(POOL_PEER_HANDSHAKE_TIMEOUT_S)}


def _ranks(config: DuetConfig, role: str) -> int:
    pool = getattr(config, role)
    return pool.tensor_parallel * pool.pipeline_parallel


def ports_per_worker(config: DuetConfig, role: str) -> int:
    """Consecutive ports a listening worker of ``role`` reserves: one per rank for its KV side
    channel (vLLM offsets each rank's port from the base), and after them its pool peer's."""
    return _ranks(config, role) + (1 if role == "prefill" and fetches_across_hosts(config) else 0)


def pool_peer_endpoint(config: DuetConfig, role: str, kv_endpoint: TransferEndpoint | str | None) -> TransferEndpoint | None:
    """Where a worker's p2p pool tier listens, from where its KV channel does (the port after its
    ranks'); None where its role does not fetch across hosts."""
    if role != "prefill" or not kv_endpoint or not fetches_across_hosts(config):
        return None
    if isinstance(kv_endpoint, str):
        kv_endpoint = TransferEndpoint.parse(kv_endpoint)
    return TransferEndpoint(kv_endpoint.host, kv_endpoint.port + _ranks(config, role))


def pool_source_params(source: str, request_id: str) -> dict[str, Any]:
    """``kv_transfer_params`` that make a prefill engine fetch, through its p2p tier, the prompt's
    blocks that the engine at ``source`` ("host:port") reaches (its host's pool, its own host
    tier) and its own host's pool lacks. Blocks the source lacks are computed."""
    peer = TransferEndpoint.parse(source)
    return {"remote_kv_source": {"remote_host": peer.host, "remote_port": peer.port, "kv_request_id": request_id}}


def pool_serves(config: DuetConfig, role: str) -> bool:
    """Whether engines of ``role`` read and fill the host KV pool (``kv_pool``)."""
    hands_off = role in _CONNECTOR_ROLE
    return config.kv_pool.enabled and role in POOL_ROLES and (not hands_off or config.kv_transfer.transport == "nixl")


def engine_kv_transfer_config(config: DuetConfig, role: str, endpoint: TransferEndpoint | None) -> dict[str, Any] | None:
    """An engine's whole ``kv_transfer_config``: its role's P/D connector, the host KV pool's,
    both (vLLM's MultiConnector, the P/D connector first: a prompt's KV comes from the first
    that has it), or None."""
    hand_off = kv_transfer_config(config.kv_transfer, role, endpoint) if role in _CONNECTOR_ROLE else None  # type: ignore[arg-type]
    if not pool_serves(config, role):
        return hand_off
    pool = pool_connector_config(config.kv_pool, pool_peer_endpoint(config, role, endpoint))
    if hand_off is None:
        return pool
    return {
        "kv_connector": "MultiConnector",
        "kv_role": hand_off["kv_role"],
        "kv_load_failure_policy": hand_off["kv_load_failure_policy"],
        "kv_connector_extra_config": {"connectors": [hand_off, pool]},
    }


def engine_environment(
    settings: KVTransferConfig, endpoint: TransferEndpoint | None, cpu_core: int | None
) -> dict[str, str]:
    """Environment a worker must set before it creates its engine."""
    if settings.transport != "nixl":
        return {}
    env = {ENV_NIXL_PROGRESS_THREAD: settings.nixl_progress_thread}
    if endpoint is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = endpoint.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(endpoint.port)
    if cpu_core is not None:
        env[ENV_WORKER_CPU_CORE] = str(cpu_core)
    return env


def move_out_params(settings: KVTransferConfig, target_endpoint: str | None) -> dict[str, Any]:
    """``kv_transfer_params`` with which a decode engine gives up a running request and keeps
    (nixl: for the target's pull) or sends (nccl: to ``target_endpoint``) its KV."""
    if settings.transport == "nccl":
        from duet.kv_transfer.p2p.params import move_out_params as p2p_move_out_params

        return p2p_move_out_params(_peer(target_endpoint, "moving a request"))
    return {"do_remote_decode": True}


def _peer(endpoint: str | None, what: str) -> Any:
    """The p2p peer listening at ``endpoint`` ("host:port")."""
    from duet.kv_transfer.p2p.params import PeerAddress

    if not endpoint:
        raise ValueError(f"the nccl transport needs the receiving decode worker's address before {what}")
    peer = TransferEndpoint.parse(endpoint)
    return PeerAddress(peer.host, peer.port)


def prefill_request_params(settings: KVTransferConfig, decode_endpoint: str | None) -> dict[str, Any]:
    """``kv_transfer_params`` that make a prefill request keep (nixl) or send (nccl) its KV."""
    if settings.transport == "nccl":
        from duet.kv_transfer.p2p.params import prefill_request_params as p2p_params

        return p2p_params(_peer(decode_endpoint, "prefill"))
    return {"do_remote_decode": True}
