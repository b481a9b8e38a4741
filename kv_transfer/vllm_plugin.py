"""duet's vLLM general plugin: NIXL and CPU-pinning settings vLLM does not expose.

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts (front end,
engine core, workers), which is the only place to adjust code that runs inside the engine's own
worker process. The plugin does nothing unless a duet worker asked for it through environment
variables (see :func:`duet.kv_transfer.config.engine_environment`), so plain vLLM use in the same
environment is unaffected.

Two adjustments, both measured on CPU (../shared/ENVIRONMENT.md):
- NIXL's UCX progress thread busy-polls a whole core per engine even when idle; turning it off
  cut a 1,500-token request from 639 ms to 195 ms and transfers still complete.
- With NixlConnector, vLLM pins each worker's forward-pass thread to the last core of each NUMA
  node, so two engines on one host fight over the same core. duet gives each worker its own.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

from duet.kv_transfer.config import ENV_NIXL_PROGRESS_THREAD, ENV_WORKER_CPU_CORE


def _without_progress_thread(make_config: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(make_config)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return make_config(*args, **kwargs)

    return make


def _disable_nixl_progress_thread() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    if base_worker.nixl_agent_config is not None and not getattr(
        base_worker.nixl_agent_config, "_duet_patched", False
    ):
        patched = _without_progress_thread(base_worker.nixl_agent_config)
        patched._duet_patched = True  # type: ignore[attr-defined]
        base_worker.nixl_agent_config = patched


def _pin_worker_to_core(core: int) -> None:
    from vllm.platforms.cpu import CpuPlatform

    # NixlConnector pins its worker thread to max(group) of each group this returns.
    CpuPlatform.discover_numa_topology = classmethod(lambda cls: [[core]])  # type: ignore[method-assign]


def register() -> None:
    """Entry point called by vLLM's plugin loader."""
    if os.environ.get(ENV_NIXL_PROGRESS_THREAD) == "0":
        _disable_nixl_progress_thread()
    core = os.environ.get(ENV_WORKER_CPU_CORE)
    if core is not None:
        _pin_worker_to_core(int(core))
