"""What every worker actor does around its engine: start it, report its state, shut it down.

A vLLM worker's engine is split the way vLLM's own server splits it. The engine core (scheduler,
model, KV cache, KV connector) runs in a process this actor launches and owns: its core pinning,
its KV side-channel ports and its lifetime belong to the worker. The engine's front end (input
processing, detokenization, output processing: what vLLM's API server does) runs in the router,
which connects to the engine core at the addresses it passes to :meth:`EngineHost.start`. Tokens
then go from the engine core to the client's stream through one process, as in a plain vLLM
server, instead of through a front end in the actor and a second hop to the router
(docs/benchmarks.md measures why that matters).

A SIMULATED engine (``engine: simulated``) runs whole inside the actor, which then serves its
requests itself (prefill_worker/, decode_worker/), taking them from and streaming tokens back
over its channel to the router (cluster/worker_channel.py); it exists for control-plane scale
tests, and says so wherever it is used.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Literal

from duet.cluster.config import DuetConfig, PoolConfig
from duet.cluster.engine import apply_environment, cpu_engine_environment, engine_kwargs, is_cpu_only
from duet.cluster.engine_output import ENV_OUTPUT_INTERVAL_MS
from duet.cluster.worker_api import EngineAddresses, SamplingSpec, WorkerStatus
from duet.cluster.worker_channel import RouterLink
from duet.kv_transfer.config import (
    TRANSPORTS,
    Role,
    TransferEndpoint,
    base_port,
    engine_environment,
    kv_transfer_config,
    listen_host,
)
from duet.kv_transfer.ports import PortReservation, reserve_ports

logger = logging.getLogger(__name__)


class EngineCoreExited(RuntimeError):
    """The worker's engine core process is gone (crashed, or killed)."""


class EngineHost:
    """Base of the worker actors: hosts one engine core (vLLM) or one whole SIMULATED engine."""

    role: Role | Literal["colocated"]

    def __init__(self, name: str, config: DuetConfig, cpu_core: int | None) -> None:
        """``cpu_core`` is the core its forward pass is pinned to on a CPU host (the
        deployment's core allocator chooses it)."""
        self.name = name
        self.config = config
        self.cpu_core = cpu_core
        self.engine: Any = None  # the SIMULATED engine
        self.vllm_config: Any = None
        self._engine_processes: Any = None  # vLLM's CoreEngineProcManager
        self._state = "starting"
        self._error = ""
        self._ports: PortReservation | None = None
        self._inflight: set[str] = set()
        self._served = 0
        self.kv_endpoint = ""
        # A SIMULATED engine's channel to the router (a vLLM engine core has its own sockets).
        self.link: RouterLink | None = None

    @property
    def pool(self) -> PoolConfig:
        return {"prefill": self.config.prefill, "decode": self.config.decode}.get(self.role, self.config.colocated)

    @property
    def simulated(self) -> bool:
        return self.pool.engine == "simulated"

    async def start(self, front_end: EngineAddresses | tuple[str, int]) -> WorkerStatus:
        """Start the engine; returns the ready status, or raises with the reason it failed.

        A vLLM engine core connects to its front end in the router at ``front_end`` (its
        addresses); this returns once the engine is loaded and its KV cache allocated. A
        SIMULATED engine connects to its channel in the router at ``front_end`` (host, port).
        """
        try:
            if self.simulated:
                self._start_simulated_engine()
                self.link = RouterLink(self)
                await self.link.connect(tuple(front_end))  # type: ignore[arg-type]
            else:
                if not isinstance(front_end, EngineAddresses):
                    raise ValueError("a vLLM worker needs the addresses of its front end in the router")
                # Launching waits for the engine core's handshake: seconds, off the event loop.
                await asyncio.to_thread(self._launch_engine_core, front_end)
            self._state = "ready"
        except Exception as error:  # reported to the launcher, which names the worker
            self._state, self._error = "failed", f"{type(error).__name__}: {error}"
            raise
        return self.status()

    def _launch_engine_core(self, front_end: EngineAddresses) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
        from vllm.v1.executor import Executor

        transfer = self.config.kv_transfer
        transfers_kv = self.role != "colocated"
        endpoint = None
        if transfers_kv and self.role in TRANSPORTS[transfer.transport].listening_roles:
            # vLLM offsets each rank's port from the base: one port per rank.
            ranks = self.pool.tensor_parallel * self.pool.pipeline_parallel
            host = listen_host(transfer)
            self._ports = reserve_ports(host, base_port(transfer), ranks)
            endpoint = TransferEndpoint(host, self._ports.base_port)
            self.kv_endpoint = str(endpoint)
        on_cpu = is_cpu_only()
        core = self.cpu_core if on_cpu else None
        env = engine_environment(transfer, endpoint, core) if transfers_kv else {}
        if on_cpu:
            env.update(cpu_engine_environment(self.pool.kv_cache_gib, core))
        env[ENV_OUTPUT_INTERVAL_MS] = str(self.pool.output_interval_ms)
        apply_environment(env)
        kwargs = engine_kwargs(
            self.config.model,
            kv_cache_gib=self.pool.kv_cache_gib,
            max_num_seqs=self.pool.max_num_seqs,
            max_num_batched_tokens=self.pool.max_num_batched_tokens,
            tensor_parallel=self.pool.tensor_parallel,
            pipeline_parallel=self.pool.pipeline_parallel,
            kv_transfer_config=kv_transfer_config(transfer, self.role, endpoint) if transfers_kv else None,
        )
        self.vllm_config = AsyncEngineArgs(**kwargs).create_engine_config()
        addresses = EngineZmqAddresses(inputs=[front_end.input], outputs=[front_end.output])
        # The same launch vLLM's own front end performs for a local engine, pointed at the
        # router's sockets; it returns when the engine core reports ready.
        with launch_core_engines(self.vllm_config, Executor.get_class(self.vllm_config), True, addresses) as launch:
            self._engine_processes = launch.engine_manager

    def _start_simulated_engine(self) -> None:
        from duet.cluster.simulated_engine import SimulatedEngine, simulated_perf

        logger.warning("%s: SIMULATED engine (%s), no model is computed", self.name, self.pool.simulated_profile)
        perf, kv_bytes_per_token = simulated_perf(self.pool.simulated_profile, self.pool.tensor_parallel, self.pool.pipeline_parallel)
        max_model_len, vocab_size = simulated_model_shape(self.config)
        self.engine = SimulatedEngine(
            perf, max_model_len, vocab_size,
            max_num_seqs=self.pool.max_num_seqs,
            max_num_batched_tokens=self.pool.max_num_batched_tokens,
            kv_bytes_per_token=kv_bytes_per_token,
        )
        self.kv_endpoint = "simulated"

    def engine_config(self) -> Any:
        """The vLLM engine's resolved ``VllmConfig``, which its front end in the router needs."""
        return self.vllm_config

    def _params(self, sampling: SamplingSpec, kv_transfer_params: dict[str, Any] | None, delta: bool = False) -> Any:
        """The SIMULATED engine's request parameters."""
        from duet.cluster.simulated_engine import SimulatedParams

        return SimulatedParams(sampling, kv_transfer_params)

    def simulated_engine_seconds(self) -> dict[str, float]:
        """SIMULATED engines only: seconds each request spent in the engine, by request id."""
        return dict(self.engine.engine_seconds)

    def model_limits(self) -> tuple[int, int, int]:
        """SIMULATED engines: (max_model_len, vocab_size, KV block size) as the engine has them."""
        model_config = self.engine.model_config
        return model_config.max_model_len, model_config.get_vocab_size(), self.engine.vllm_config.cache_config.block_size

    async def reset_prefix_cache(self) -> None:
        """SIMULATED engines: empty the engine's prefix cache."""
        await self.engine.reset_prefix_cache()

    async def ping(self) -> tuple[float, int] | None:
        """Raises if the engine is gone (never returns if it hangs). A SIMULATED engine's answer
        is its load (KV cache usage, requests running); a vLLM engine's load is read by its
        front end in the router, and its round trip made from there."""
        if self.simulated:
            self.engine.check_scheduler()
            return self.engine.load()
        exited = self._engine_processes.finished_procs() if self._engine_processes is not None else {}
        if exited:
            raise EngineCoreExited(f"engine core exited: {exited}")
        return None

    async def watch(self) -> str:
        """Returns, saying why, once this worker's engine core process has exited.

        The router keeps one such call pending per worker instead of asking on a timer: an
        engine core that exits ends it through its process sentinel, and an actor that dies
        fails it at once (Ray fails every pending call of a dead actor). A SIMULATED engine
        lives and dies with its actor, so the call only ever ends that way."""
        manager = self._engine_processes
        if manager is None:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        exited = asyncio.Event()
        for process in manager.processes:
            loop.add_reader(process.sentinel, exited.set)
        try:
            await exited.wait()
        finally:
            for process in manager.processes:
                loop.remove_reader(process.sentinel)
        return f"engine core exited: {manager.finished_procs()}"

    @contextmanager
    def _tracked(self, request_id: str) -> Iterator[None]:
        """Count a request as in flight for exactly as long as this worker is working on it."""
        self._inflight.add(request_id)
        try:
            yield
        finally:
            self._inflight.discard(request_id)
            self._served += 1

    async def abort(self, request_id: str) -> None:
        """SIMULATED engines: free a request's engine state; a no-op for unknown requests."""
        if self.engine is not None:
            await self.engine.abort(request_id)

    def status(self) -> WorkerStatus:
        """The actor's side of the worker's status (for vLLM engines the router adds the
        engine's requests and metrics, which its front end holds)."""
        return WorkerStatus(
            name=self.name,
            role=self.role,
            state=f"{self._state} (SIMULATED engine)" if self.simulated else self._state,
            kv_endpoint=self.kv_endpoint,
            requests_served=self._served,
            requests_inflight=len(self._inflight),
            engine_unfinished=self.engine.output_processor.get_num_unfinished_requests() if self.engine is not None else 0,
            error=self._error,
            channel_messages=self.link.outbox.messages_sent if self.link is not None else 0,
            channel_frames=self.link.outbox.frames_sent if self.link is not None else 0,
        )

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._engine_processes is not None:
            self._engine_processes.close()
            self._engine_processes = None
        if self._ports is not None:
            self._ports.release()
        self._state = "stopped"


def simulated_model_shape(config: DuetConfig) -> tuple[int, int]:
    """(max_model_len, vocab_size) of the configured model, read from its config.json only."""
    import json

    from duet.cluster.engine import resolve_model_path

    model_config = json.loads((resolve_model_path(config.model) / "config.json").read_text())
    max_len = config.model.max_model_len or model_config.get("max_position_embeddings", 4096)
    return max_len, model_config["vocab_size"]
