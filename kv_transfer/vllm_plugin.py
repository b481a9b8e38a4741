"""duet's vLLM general plugin: NIXL and CPU-pinning settings vLLM does not expose.

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts (front end,
engine core, workers), which is the only place to adjust code that runs inside the engine's own
worker process. The plugin does nothing unless a duet worker asked for it through environment
variables (:func:`duet.kv_transfer.config.engine_environment` for NIXL and pinning,
:func:`duet.worker_runtime.engine.cpu_engine_environment` for the shared gloo device, the engine host
for the output interval), so plain vLLM use in the same environment is unaffected.

Eight adjustments, the first four measured on CPU (docs/concepts/kv-transfer.md, docs/benchmarks/serving.md,
../shared/ENVIRONMENT.md):
- NIXL's UCX progress thread. NIXL's Python API always asks for a poll timeout of 0, so the
  thread busy-polls a whole core per engine even when idle (a 1,500-token request took 639 ms
  instead of 195 ms). Without the thread, UCX only progresses between engine steps, and a KV
  pull from a prefill engine that has started its next long prompt waits out that whole step
  (0.5-0.7 s on CPU). ``wait`` keeps the thread but gives it a timeout, so it sleeps in
  ``poll()`` on UCX's event descriptors and wakes when a transfer needs it.
- With NixlConnector, vLLM pins each worker's forward-pass thread to the last core of each NUMA
  node, so two engines on one host fight over the same core. duet gives each worker its own.
- The engine core sends its outputs to the router at most once per interval, merged
  (worker_runtime/engine_output.py): each message costs the router about 2 ms of CPU.
- The engine's single-rank gloo groups share one transport device (worker_runtime/gloo_device.py):
  each device's loop thread wakes 100 times a second, and vLLM makes 13 groups per engine.
- The engine core serves front doors that die and are replaced while it runs: it aborts a
  dropped front door's requests and greets a reconnected one (worker_runtime/engine_clients.py).
- The engine core can give up a running request with its KV, for another worker to pull and
  continue (live migration, worker_runtime/kv_migration.py).
- A seeded request whose prompt takes several steps no longer kills a CPU engine
  (worker_runtime/seeded_sampling.py).
- The engine counts its LoRA adapter reads and slot activations, which vLLM does not export
  (worker_runtime/adapter_loads.py).
"""

from __future__ import annotations

import multiprocessing
import os

from duet.logs import configure_logging
from duet.worker_runtime.adapter_loads import install as install_adapter_load_counts
from duet.worker_runtime.engine_clients import ENV_CLIENT_RECONNECT
from duet.worker_runtime.engine_clients import install as install_client_reconnect
from duet.worker_runtime.engine_output import ENV_OUTPUT_INTERVAL_MS
from duet.worker_runtime.engine_output import install as install_output_coalescing
from duet.worker_runtime.kv_migration import install as install_kv_migration
from duet.worker_runtime.resumed_requests import install as install_resumed_requests
from duet.worker_runtime.seeded_sampling import install as install_seeded_sampling
from duet.worker_runtime.gloo_device import ENV_SHARED_GLOO_DEVICE, share_single_rank_device
from duet.kv_transfer.config import ENV_NIXL_PROGRESS_THREAD, ENV_WORKER_CPU_CORE

# The progress thread's poll() timeout in "wait" mode. UCX wakes it through event descriptors
# when a transfer needs progress; the timeout only bounds the wait for an event UCX does not
# signal, and costs 50 wakeups a second per engine.
PROGRESS_THREAD_WAKEUP_US = 20_000


def _set_progress_thread(mode: str) -> None:
    """Make every NIXL agent of this process run its progress thread as ``mode`` says.

    ``nixl_agent`` builds its bound ``nixlAgentConfig`` from ``nixl_agent_config`` (thread on by
    default, as vLLM leaves it) and then sets a poll timeout of 0, with no way to choose
    either from outside. So the bound class is replaced by a subclass whose setters decide:
    ``off`` turns the thread off, ``wait`` turns the zero timeout into
    ``PROGRESS_THREAD_WAKEUP_US``. Patching at NIXL's layer keeps duet independent of where
    vLLM builds its agent. A NIXL release that renames the class fails here, loudly, at engine
    start (and in tests/kv_transfer/test_nixl_progress.py).
    """
    import nixl._api as nixl_api

    base = nixl_api.nixlBind.nixlAgentConfig
    base = getattr(base, "_duet_base", base)  # patched before (the plugin loads in every process)

    class DuetProgressThreadConfig(base):  # type: ignore[misc,valid-type]
        _duet_base = base

        @property
        def useProgThread(self) -> bool:
            return base.useProgThread.__get__(self)

        @useProgThread.setter
        def useProgThread(self, enabled: bool) -> None:
            base.useProgThread.__set__(self, enabled and mode != "off")

        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, delay_us: int) -> None:
            base.pthrDelay.__set__(self, delay_us or (PROGRESS_THREAD_WAKEUP_US if mode == "wait" else 0))

    nixl_api.nixlBind.nixlAgentConfig = DuetProgressThreadConfig


def _pin_worker_to_core(core: int) -> None:
    """Keep the engine's forward pass on ``core``. NixlConnector pins its worker thread to
    max(group) of each group ``discover_numa_topology`` returns, so that answers ``core``. And
    vLLM binds OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) only in the worker processes of
    its multiprocess executor: with the one-process executor nothing pinned an engine without
    a NIXL connector (a colocated worker's two engines each ran on both cores, 60-70% on one,
    as ``duet bench serve`` showed). So the engine core process pins its own thread, before it
    starts the executor's threads, which inherit it. (duet sets the core for NIXL and colocated
    engines; with the nccl transport its engines stay unpinned, as they were: pinning them with
    their gloo threads failed the drain test.)"""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.discover_numa_topology = classmethod(lambda cls: [[core]])  # type: ignore[method-assign]
    if multiprocessing.current_process().name.startswith("EngineCore"):
        os.sched_setaffinity(0, {core})


def register() -> None:
    """Entry point called by vLLM's plugin loader."""
    configure_logging()
    progress_thread = os.environ.get(ENV_NIXL_PROGRESS_THREAD)
    if progress_thread in ("off", "wait"):  # "poll" is NIXL's own behaviour
        _set_progress_thread(progress_thread)
    core = os.environ.get(ENV_WORKER_CPU_CORE)
    if core is not None:
        _pin_worker_to_core(int(core))
    interval_ms = float(os.environ.get(ENV_OUTPUT_INTERVAL_MS) or 0)
    if interval_ms > 0:
        install_output_coalescing(interval_ms / 1000.0)
    if os.environ.get(ENV_SHARED_GLOO_DEVICE) == "1":
        share_single_rank_device()
    if os.environ.get(ENV_CLIENT_RECONNECT) == "1":
        install_client_reconnect()
        install_kv_migration()
        install_seeded_sampling()
        install_resumed_requests()
        install_adapter_load_counts()
