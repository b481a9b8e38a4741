"""What every worker actor does around its vLLM engine: start it, track requests, report state.

Prefill and decode workers differ only in the request they run (see prefill_worker/ and
decode_worker/); engine start-up, KV side-channel reservation, abort, bookkeeping and metrics live
here once.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Literal

from duet.cluster.config import DuetConfig, PoolConfig
from duet.cluster.engine import apply_environment, cpu_engine_environment, engine_kwargs, is_cpu_only
from duet.cluster.token_outbox import TokenOutbox
from duet.cluster.worker_api import SamplingSpec, WorkerStatus
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

# The gauges the health ping reports as the worker's load.
_LOAD_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running")
# Labels every sample of one engine shares; dropped when flattening for status reports.
_ENGINE_LABELS = ("model_name", "engine")


class EngineHost:
    """Base of the worker actors: owns one ``AsyncLLM`` and the request bookkeeping around it."""

    role: Role | Literal["colocated"]

    def __init__(
        self, name: str, config: DuetConfig, cpu_core: int | None, token_address: tuple[str, int] | None = None
    ) -> None:
        """``cpu_core`` is the core its forward pass is pinned to on a CPU host (the
        deployment's core allocator chooses it). ``token_address`` is the router's token
        receiver (host, port), where this worker sends the tokens it streams; None for
        prefill-only workers, which stream none."""
        self.name = name
        self.config = config
        self.cpu_core = cpu_core
        self.engine: Any = None
        self._state = "starting"
        self._error = ""
        self._ports: PortReservation | None = None
        self._inflight: set[str] = set()
        self._served = 0
        self.kv_endpoint = ""
        self.outbox = TokenOutbox()
        self._token_address = token_address
        self._sender: asyncio.Task[None] | None = None

    @property
    def pool(self) -> PoolConfig:
        return {"prefill": self.config.prefill, "decode": self.config.decode}.get(self.role, self.config.colocated)

    @property
    def simulated(self) -> bool:
        return self.pool.engine == "simulated"

    async def start(self) -> WorkerStatus:
        """Create the engine; returns the ready status, or raises with the reason it failed."""
        try:
            if self.simulated:
                self._start_simulated_engine()
            else:
                self._start_engine()
            if self._token_address is not None:
                self._sender = asyncio.get_running_loop().create_task(self.outbox.run(self._token_address))
            self._state = "ready"
        except Exception as error:  # reported to the launcher, which names the worker
            self._state, self._error = "failed", f"{type(error).__name__}: {error}"
            raise
        return self.status()

    def _start_engine(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

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

    def _params(self, sampling: SamplingSpec, kv_transfer_params: dict[str, Any] | None, delta: bool = False) -> Any:
        """The engine's request parameters: vLLM's SamplingParams, or the simulated engine's."""
        if self.simulated:
            from duet.cluster.simulated_engine import SimulatedParams

            return SimulatedParams(sampling, kv_transfer_params)
        return sampling.to_vllm(kv_transfer_params=kv_transfer_params, delta=delta)

    def simulated_engine_seconds(self) -> dict[str, float]:
        """SIMULATED engines only: seconds each request spent in the engine, by request id."""
        return dict(self.engine.engine_seconds) if self.simulated else {}

    def model_limits(self) -> tuple[int, int, int]:
        """(max_model_len, vocab_size, KV block size) as the engine resolved them."""
        model_config = self.engine.model_config
        return model_config.max_model_len, model_config.get_vocab_size(), self.engine.vllm_config.cache_config.block_size

    async def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (benchmarks compare routing policies from cold)."""
        await self.engine.reset_prefix_cache()

    async def ping(self) -> tuple[float, int]:
        """A round trip to the engine (raises if it is dead; never returns if it hangs), and
        this worker's load: (KV cache usage, requests running in the engine)."""
        await self.engine.is_sleeping()
        if self.simulated:
            return self.engine.load()
        metrics = _read_engine_metrics(_LOAD_METRICS)
        return metrics.get("vllm:kv_cache_usage_perc", 0.0), int(metrics.get("vllm:num_requests_running", 0))

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
        """Free a request's engine state (and its KV blocks); a no-op for unknown requests."""
        if self.engine is not None:
            await self.engine.abort(request_id)

    def status(self) -> WorkerStatus:
        unfinished = 0
        if self.engine is not None:
            unfinished = self.engine.output_processor.get_num_unfinished_requests()
        return WorkerStatus(
            name=self.name,
            role=self.role,
            state=f"{self._state} (SIMULATED engine)" if self.simulated else self._state,
            kv_endpoint=self.kv_endpoint,
            requests_served=self._served,
            requests_inflight=len(self._inflight),
            engine_unfinished=unfinished,
            error=self._error,
            token_updates=self.outbox.updates_sent,
            token_batches=self.outbox.batches_sent,
            engine_metrics={} if self.simulated else _read_engine_metrics(),
        )

    def metrics_text(self) -> str:
        """This worker's vLLM metrics in Prometheus text format (scraped through the router)."""
        from prometheus_client import REGISTRY, generate_latest

        lines = generate_latest(REGISTRY).decode().splitlines()
        return "\n".join(line for line in lines if "vllm:" in line) + "\n"

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
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


def _read_engine_metrics(names: tuple[str, ...] = ()) -> dict[str, float]:
    """vLLM's own Prometheus samples in this process (no buckets), keyed ``name{label=value}``;
    only those of ``names`` if given (the health ping reads two gauges every second, and
    collecting every histogram of the registry for them showed in the worker's profile)."""
    from prometheus_client import REGISTRY

    registry = REGISTRY.restricted_registry(names) if names else REGISTRY
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.startswith("vllm:") or sample.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in _ENGINE_LABELS)
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values
