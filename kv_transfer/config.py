"""vLLM KV-transfer settings for each worker role.

The engine sees KV transfer through two channels: ``kv_transfer_config`` (which connector, which
role, where buffers live, what to do when a load fails) and environment variables that must be in
place before vLLM spawns its engine processes (the side-channel address, and duet's own knobs read
by :mod:`duet.kv_transfer.vllm_plugin`). This module builds both from duet's config so that the
prefill and decode sides can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from duet.cluster.config import KVTransferConfig

Role = Literal["prefill", "decode"]

_CONNECTOR_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}

# Environment variables read by duet's vLLM plugin inside every engine process.
ENV_NIXL_PROGRESS_THREAD = "DUET_NIXL_PROGRESS_THREAD"
ENV_WORKER_CPU_CORE = "DUET_WORKER_CPU_CORE"


@dataclass(frozen=True)
class TransferEndpoint:
    """Where a worker's KV side channel listens; reported in ``duet status``."""

    host: str
    port: int


def kv_transfer_config(settings: KVTransferConfig, role: Role) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict for an engine of ``role``."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": _CONNECTOR_ROLE[role],
        "kv_buffer_device": settings.buffer_device,
        "kv_load_failure_policy": settings.load_failure_policy,
        "kv_connector_extra_config": {"kv_lease_duration": settings.kv_lease_s},
    }


def engine_environment(
    settings: KVTransferConfig, endpoint: TransferEndpoint, cpu_core: int | None
) -> dict[str, str]:
    """Environment a worker must set before it creates its engine."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": endpoint.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(endpoint.port),
        ENV_NIXL_PROGRESS_THREAD: "1" if settings.nixl_progress_thread else "0",
    }
    if cpu_core is not None:
        env[ENV_WORKER_CPU_CORE] = str(cpu_core)
    return env
