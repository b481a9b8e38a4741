"""The worker actor that hosts a vLLM engine core: start it, report its state, shut it down.

A vLLM worker's engine is split the way vLLM's own server splits it. The engine core (scheduler,
model, KV cache, KV connector) runs in a process this actor launches and owns: its core pinning,
its KV side-channel ports and its lifetime belong to the worker. The engine's front end (input
processing, detokenization, output processing: what vLLM's API server does) runs in the router,
which connects to the engine core at the addresses it passes to :meth:`EngineCoreHost.start`.
Tokens then go from the engine core to the client's stream through one process, as in a plain
vLLM server, instead of through a front end in the actor and a second hop to the router
(docs/benchmarks/serving.md measures why that matters).

Once the engine core runs, the actor has nothing to do but notice that it exited, and it is
built to cost nothing while it waits. Every Ray actor's main thread wakes every 10 ms to check
for signals (a period hard-coded in Ray's task execution loop), about 0.45-0.85 s of CPU a minute
per actor, a tenth of a millisecond per streamed token on a CPU host. The loop cannot run while
an actor method is running on that thread, so this actor is a plain (not async, not threaded)
one whose :meth:`EngineCoreHost.watch` holds the main thread, waiting on the engine core's
process, for a few seconds per call; the router calls it again as soon as it returns.

A SIMULATED engine runs whole inside its actor instead (worker_runtime/simulated_host.py).
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import wait as wait_for_exit
from typing import Any, Literal

from duet.config import DuetConfig, PoolConfig
from duet.logs import configure_logging
from duet.worker_runtime.engine import apply_environment, cpu_engine_environment, engine_kwargs, is_cpu_only
from duet.worker_runtime.engine_clients import ENV_CLIENT_RECONNECT
from duet.worker_runtime.cpu_wait import threads_cpu_wait_s
from duet.worker_runtime.engine_output import ENV_OUTPUT_INTERVAL_MS
from duet.worker_runtime.worker_api import EngineAddresses, EngineExit, WorkerStatus
from duet.kv_transfer.config import (
    ENV_WORKER_CPU_CORE,
    TRANSPORTS,
    Role,
    TransferEndpoint,
    base_port,
    engine_environment,
    engine_kv_transfer_config,
    listen_host,
    pool_peer_environment,
    pool_serves,
    ports_per_worker,
)
from duet.kv_transfer.encoder_cache import engine_ec_config
from duet.kv_transfer.ports import PortReservation, reserve_ports

logger = logging.getLogger(__name__)

# How long one :meth:`EngineCoreHost.watch` call holds the actor's main thread. Calls queue
# behind it (a status, a shutdown wait at most this long); each return costs one actor call,
# about 2 ms of CPU, where Ray's signal check costs about 15 ms a second.
WATCH_HOLD_S = 2.0
# How long the watch waits for an exited engine core's exit status, which tells a crash.
_EXIT_STATUS_WAIT_S = 5.0


class EngineCoreExited(RuntimeError):
    """The worker's engine core process is gone (crashed, or killed)."""


class WorkerHost:
    """What every worker actor has: its name, role, pool configuration and reported state."""

    role: Role | Literal["colocated", "encode"]
    max_concurrency: int  # the actor's Ray ``max_concurrency``: each kind of host says why

    def __init__(self, name: str, config: DuetConfig, cpu_core: int | None) -> None:
        """``cpu_core`` is the core its forward pass is pinned to on a CPU host (the
        deployment's core allocator chooses it)."""
        configure_logging()
        self.name = name
        self.config = config
        self.cpu_core = cpu_core
        self._state = "starting"
        self._error = ""
        self.kv_endpoint = ""

    @property
    def pool(self) -> PoolConfig:
        pools = {"prefill": self.config.prefill, "decode": self.config.decode, "encode": self.config.encode}
        return pools.get(self.role, self.config.colocated)

    def _failed(self, error: Exception) -> None:
        """Record why the engine did not start (reported to the launcher, which names the worker)."""
        self._state, self._error = "failed", f"{type(error).__name__}: {error}"

    def _status(self, **engine_fields: Any) -> WorkerStatus:
        return WorkerStatus(
            name=self.name, role=self.role, state=self._state, kv_endpoint=self.kv_endpoint, error=self._error,
            **engine_fields,
        )


class EngineCoreHost(WorkerHost):
    """Base of the vLLM worker actors (one per role): hosts one engine core process.

    A plain actor on purpose, with no ``async`` method and one call at a time: its methods run
    on the actor's main thread, which :meth:`watch` holds (see the module's docstring).
    """

    # Calls the actor takes at once (its Ray ``max_concurrency``): one, on the main thread. A
    # threaded actor would leave Ray's 10 ms timer free to run there.
    max_concurrency = 1

    def __init__(self, name: str, config: DuetConfig, cpu_core: int | None) -> None:
        super().__init__(name, config, cpu_core)
        self.vllm_config: Any = None
        self._engine_processes: Any = None  # vLLM's CoreEngineProcManager
        self._ports: PortReservation | None = None
        self.front_ends: list[EngineAddresses] = []  # where each client of the engine core listens

    def start(self, front_ends: list[EngineAddresses]) -> WorkerStatus:
        """Launch the engine core, connected to one front end per front door at ``front_ends``
        (client ``i`` of the engine core is ``front_ends[i]``); returns once the engine is
        loaded and its KV cache allocated, or raises why it failed. A front door need not listen
        yet: the engine core connects when it does (worker_runtime/engine_clients.py)."""
        try:
            self._launch_engine_core(front_ends)
            self.front_ends = list(front_ends)
            self._state = "ready"
        except Exception as error:
            self._failed(error)
            raise
        return self.status()

    def _launch_engine_core(self, front_ends: list[EngineAddresses]) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
        from vllm.v1.executor import Executor

        transfer = self.config.kv_transfer
        transfers_kv = self.role not in ("colocated", "encode")
        endpoint = None
        if transfers_kv and self.role in TRANSPORTS[transfer.transport].listening_roles:
            host = listen_host(transfer)
            self._ports = reserve_ports(host, base_port(transfer), ports_per_worker(self.config, self.role))
            endpoint = TransferEndpoint(host, self._ports.base_port)
            self.kv_endpoint = str(endpoint)
        on_cpu = is_cpu_only()
        core = self.cpu_core if on_cpu else None
        env = engine_environment(transfer, endpoint, core) if transfers_kv else {}
        env.update(pool_peer_environment(self.config, self.role))
        if not transfers_kv and core is not None:
            # Without a KV connector nothing else pins a one-process engine: duet's plugin does
            # (kv_transfer/vllm_plugin.py).
            env[ENV_WORKER_CPU_CORE] = str(core)
        if on_cpu:
            env.update(cpu_engine_environment(core))
        env[ENV_OUTPUT_INTERVAL_MS] = str(self.pool.output_interval_ms)
        env[ENV_CLIENT_RECONNECT] = "1"
        apply_environment(env)
        kwargs = engine_kwargs(
            self.config.model,
            kv_cache_gib=self.pool.kv_cache_gib,
            max_num_seqs=self.pool.max_num_seqs,
            max_num_batched_tokens=self.pool.max_num_batched_tokens,
            tensor_parallel=self.pool.tensor_parallel,
            pipeline_parallel=self.pool.pipeline_parallel,
            kv_transfer_config=engine_kv_transfer_config(self.config, self.role, endpoint),
            ec_transfer_config=engine_ec_config(self.role, self.config, on_cpu),
        )
        self.vllm_config = AsyncEngineArgs(**kwargs).create_engine_config()
        addresses = EngineZmqAddresses(
            inputs=[front_end.input for front_end in front_ends], outputs=[front_end.output for front_end in front_ends]
        )
        # The same launch vLLM's own front end performs for a local engine, pointed at the
        # router's sockets; it returns when the engine core reports ready.
        with launch_core_engines(self.vllm_config, Executor.get_class(self.vllm_config), True, addresses) as launch:
            self._engine_processes = launch.engine_manager
        if pool_serves(self.config, self.role):
            from duet.kv_transfer.kv_pool import forget_engine_buffer

            forget_engine_buffer(self.vllm_config.kv_transfer_config.engine_id)

    def engine_config(self) -> Any:
        """The vLLM engine's resolved ``VllmConfig``, which its front end in the router needs."""
        return self.vllm_config

    def adoption(self) -> tuple[list[EngineAddresses], Any, str, int | None]:
        """What a restarted control plane needs to take this running worker over without
        restarting it: where each client of its engine core listens (the control plane's own
        first), its engine's config, its KV endpoint and its core."""
        if self._state != "ready":
            raise EngineCoreExited(f"{self.name} is {self._state}, not running")
        return self.front_ends, self.vllm_config, self.kv_endpoint, self.cpu_core

    def ping(self) -> None:
        """Raises if the engine core process has exited. (The router pings the engine itself
        over its front end's sockets, which a hung engine never answers.)"""
        exited = self._engine_processes.finished_procs() if self._engine_processes is not None else {}
        if exited:
            raise EngineCoreExited(f"engine core exited: {exited}")

    def threads_cpu_wait(self) -> dict[int, float] | None:
        """Seconds each thread of the engine's processes has waited for a CPU so far: the
        health watcher's evidence that an unanswered ping was starvation, not a hang
        (worker_runtime/cpu_wait.py)."""
        manager = self._engine_processes
        return threads_cpu_wait_s([process.pid for process in manager.processes]) if manager is not None else None

    def watch(self, hold_s: float = WATCH_HOLD_S) -> EngineExit | None:
        """Why the engine core process exited, once it has; None if it still runs after
        ``hold_s`` seconds.

        The router keeps one such call pending per worker, calling again whenever one returns
        None: an engine core that exits ends it through its process sentinel, and an actor that
        dies fails it at once (Ray fails every pending call of a dead actor). Waiting here, on
        the main thread, is also what keeps Ray's 10 ms signal check from running meanwhile.
        """
        manager = self._engine_processes
        if manager is None:
            time.sleep(hold_s)
            return EngineExit("engine core stopped") if self._state == "stopped" else None
        ended = wait_for_exit([process.sentinel for process in manager.processes], timeout=hold_s)
        if not ended:
            return None
        for process in manager.processes:
            if process.sentinel in ended:
                # The sentinel fires as the process exits, a moment before the kernel has its
                # exit status to give: without the join, its status could read as not yet known.
                process.join(_EXIT_STATUS_WAIT_S)
        return EngineExit.of_processes(manager.finished_procs())

    def status(self) -> WorkerStatus:
        """The actor's side of the worker's status; the router adds the engine's requests and
        metrics, which its front end holds."""
        return self._status()

    def shutdown(self) -> None:
        if self._engine_processes is not None:
            self._engine_processes.shutdown()
            self._engine_processes = None
        if self._ports is not None:
            self._ports.release()
        self._state = "stopped"
