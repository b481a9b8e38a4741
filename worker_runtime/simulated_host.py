"""The worker actor that runs a SIMULATED engine whole inside itself.

A simulated engine (``engine: simulated``) computes no model: it exists for control-plane scale
tests and what-if planning, and says so wherever it is used. Its actor serves its requests
itself (prefill_worker/, decode_worker/), taking them from and streaming tokens back over its
channel to each front door (worker_runtime/worker_channel.py), so unlike a vLLM worker
(worker_runtime/engine_host.py) it is an async actor that many calls share.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

from duet.config import DuetConfig
from duet.worker_runtime.cpu_wait import threads_cpu_wait_s
from duet.worker_runtime.engine_host import WorkerHost
from duet.worker_runtime.worker_api import EngineExit, SamplingSpec, WorkerStatus
from duet.worker_runtime.worker_channel import RouterLink

logger = logging.getLogger(__name__)


class SimulatedHost(WorkerHost):
    """Base of the SIMULATED worker actors: hosts one whole SIMULATED engine."""

    # Calls the actor takes at once (its Ray ``max_concurrency``): a SIMULATED engine serves
    # many requests at once in its actor.
    max_concurrency = 1000

    def __init__(self, name: str, config: DuetConfig, cpu_core: int | None) -> None:
        super().__init__(name, config, cpu_core)
        self.engine: Any = None
        self.links: list[RouterLink] = []  # one per front door, in client order
        self._inflight: set[str] = set()
        self._served = 0

    async def start(self, router_channels: list[tuple[str, int]]) -> WorkerStatus:
        """Start the engine and connect to its channel in each front door, at
        ``router_channels`` (host, port) in client order (the control plane's first); returns
        the ready status, or raises with the reason it failed."""
        try:
            self._start_engine()
            self.links = [RouterLink(self) for _ in router_channels]
            await asyncio.gather(*(link.connect(tuple(address)) for link, address in zip(self.links, router_channels)))
            self._state = "ready"
        except Exception as error:
            self._failed(error)
            raise
        return self.status()

    def adoption(self) -> tuple[list[tuple[str, int] | None], None, str, int | None]:
        """What a restarted control plane needs to take this running worker over: where each
        front door's channel listens (the control plane's first: its replacement listens there
        again, and this worker's link dials it by itself), no engine config, its KV endpoint
        and its core (as worker_runtime/engine_host.py's)."""
        if self._state != "ready":
            raise RuntimeError(f"{self.name} is {self._state}, not running")
        return [link.address for link in self.links], None, self.kv_endpoint, self.cpu_core

    def _start_engine(self) -> None:
        from duet.worker_runtime.simulated_engine import SimulatedEngine, simulated_perf

        logger.warning("%s: SIMULATED engine (%s), no model is computed", self.name, self.pool.simulated_profile)
        perf, kv_bytes_per_token = simulated_perf(self.pool.simulated_profile, self.pool.tensor_parallel, self.pool.pipeline_parallel)
        max_model_len, vocab_size = simulated_model_shape(self.config)
        self.engine = SimulatedEngine(
            perf, max_model_len, vocab_size,
            max_num_seqs=self.pool.max_num_seqs,
            max_num_batched_tokens=self.pool.max_num_batched_tokens,
            kv_bytes_per_token=kv_bytes_per_token,
            output_interval_s=self.pool.output_interval_ms / 1000,
        )
        self.kv_endpoint = "simulated"

    def _params(self, sampling: SamplingSpec, kv_transfer_params: dict[str, Any] | None, delta: bool = False) -> Any:
        """The engine's request parameters."""
        from duet.worker_runtime.simulated_engine import SimulatedParams

        return SimulatedParams(sampling, kv_transfer_params)

    def simulated_engine_seconds(self) -> dict[str, float]:
        """Seconds each request spent in the engine, by request id."""
        return dict(self.engine.engine_seconds)

    def model_limits(self) -> tuple[int, int, int]:
        """(max_model_len, vocab_size, KV block size) as the engine has them."""
        model_config = self.engine.model_config
        return model_config.max_model_len, model_config.get_vocab_size(), self.engine.vllm_config.cache_config.block_size

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def ping(self) -> tuple[float, int]:
        """The engine's load (KV cache usage, requests running); raises if its scheduler died."""
        self.engine.check_scheduler()
        return self.engine.load()

    def threads_cpu_wait(self) -> dict[int, float] | None:
        """Seconds each thread of this actor, which runs the engine, has waited for a CPU so far."""
        return threads_cpu_wait_s([os.getpid()])

    async def watch(self) -> EngineExit:
        """Never returns: a SIMULATED engine lives and dies with its actor, whose death fails
        the router's pending call (see :meth:`EngineCoreHost.watch`)."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # the event is never set

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
        """Free a request's engine state; a no-op for unknown requests."""
        if self.engine is not None:
            await self.engine.abort(request_id)

    def status(self) -> WorkerStatus:
        status = self._status(
            requests_served=self._served,
            requests_inflight=len(self._inflight),
            engine_unfinished=self.engine.output_processor.get_num_unfinished_requests() if self.engine is not None else 0,
            channel_messages=sum(link.outbox.messages_sent for link in self.links),
            channel_frames=sum(link.outbox.frames_sent for link in self.links),
        )
        status.state = f"{status.state} (SIMULATED engine)"
        return status

    def shutdown(self) -> None:
        for link in self.links:
            link.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        self._state = "stopped"


def simulated_model_shape(config: DuetConfig) -> tuple[int, int]:
    """(max_model_len, vocab_size) of the configured model, read from its config.json only."""
    from duet.worker_runtime.engine import resolve_model_path

    model_config = json.loads((resolve_model_path(config.model) / "config.json").read_text())
    max_len = config.model.max_model_len or model_config.get("max_position_embeddings", 4096)
    return max_len, model_config["vocab_size"]
