"""A vLLM worker's engine front end, run in the router's process.

vLLM splits an engine in two: the engine core (scheduler, model, KV cache) in a process of its
own, and a front end (``AsyncLLM``: input processing, detokenization, output processing) in the
process that serves clients. duet puts the split where vLLM's own server puts it: the worker
actor launches and owns the engine core (worker_runtime/engine_host.py), and the router runs the front
end, so every token goes from the engine core to the client's stream through this one process.
With the front end in the actor instead, each token crossed two processes (actor, then
router), which cost duet several times plain vLLM's CPU per token (docs/benchmarks/router.md).

The engine core connects to this front end's ZeroMQ sockets (tcp, so workers on other hosts can
reach the router). vLLM's front end does not watch an engine core it did not start; the health
watcher does (it pings the engine core through this front end, and keeps a watch pending on its
actor: :meth:`EngineFrontEnd.watch`), and :meth:`EngineFrontEnd.lost` ends the requests of a
worker found dead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, replace
from functools import cached_property
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, AsyncIterator, TypeVar

from prometheus_client import CollectorRegistry, generate_latest

from duet.config import KVTransferConfig
from duet.kv_transfer.config import move_out_params
from duet.worker_runtime.engine_host import WATCH_HOLD_S
from duet.worker_runtime.adapter_loads import ADAPTER_LOADS_METHOD
from duet.worker_runtime.engine_clients import READDRESS_METHOD
from duet.worker_runtime.kv_migration import CONNECT_KV_PEER_METHOD, KV_PEER_METHOD, MIGRATE_OUT_METHOD
from duet.worker_runtime.worker_api import (
    DecodeChunk, EngineAborted, EngineAddresses, EngineExit, PrefillResult, SamplingSpec, ServedAdapter, WorkerStatus,
    vllm_lora_request,
)
from duet.decode_worker.worker import decode_updates
from duet.encode_worker.worker import run_encode
from duet.prefill_worker.worker import run_prefill
from duet.router.image_inputs import EngineImagePrompts
from duet.router.engine_metrics import read_engine_metrics, registry_bound_stat_logger
from duet.router.worker_engines import EngineLost, EngineRejected, Migrated, MigrationTicket, WorkerGone

if TYPE_CHECKING:
    from duet.router.pools import PoolMember

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

# How long an engine's unexplained abort waits for its actor to say it is alive: a live actor
# answers once its current watch call returns.
_LIVENESS_TIMEOUT_S = WATCH_HOLD_S + 3.0
# The gauges a health ping reports as the worker's load.
_LOAD_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running")
# A health ping makes no round trip to an engine core that delivered a request's output this
# recently: it has just shown that it steps and answers.
_RECENT_OUTPUT_S = 1.0
# Nor to an engine core with no request of this front end in flight that answered this recently:
# a hang there delays no stream, and the first request sent to it brings back a round trip every
# health interval. Idle, a round trip a second was a third of the router's CPU (2026-11-28).
_IDLE_PING_S = 5.0
# How long ``duet status`` waits for a busy engine's adapter-load counts (one step may be longer).
_ADAPTER_LOADS_WAIT_S = 0.5


def ping_needs_round_trip(now: float, output_at: float, answered_at: float, in_flight: int) -> bool:
    """Whether a health ping at ``now`` must ask the engine core, given when it last delivered an
    output and last answered a ping, and how many requests this front end has in it."""
    if now - output_at <= _RECENT_OUTPUT_S:
        return False
    return in_flight > 0 or now - answered_at > _IDLE_PING_S


@dataclass
class FrontEndListeners:
    """A front end's two listening sockets, bound before its engine core starts, so the ports
    are this process's from the first moment (a port picked, released and bound again later
    can be taken in between, by another worker starting at the same time)."""

    addresses: EngineAddresses
    input: socket.socket
    output: socket.socket

    @classmethod
    def bind(cls, host: str) -> "FrontEndListeners":
        """Listen on two free ports of ``host`` (engine cores on other hosts connect over TCP)."""
        address = f"[{host}]" if ":" in host else host
        return cls.rebind(EngineAddresses(input=f"tcp://{address}:0", output=f"tcp://{address}:0"))

    @classmethod
    def rebind(cls, addresses: EngineAddresses) -> "FrontEndListeners":
        """Listen on ``addresses`` exactly: a replacement front door takes over its
        predecessor's, to which the running engine core reconnects (worker_runtime/engine_clients.py)."""
        input_address, requests = _listen(addresses.input)
        try:
            output_address, outputs = _listen(addresses.output)
        except BaseException:
            requests.close()
            raise
        return cls(EngineAddresses(input=input_address, output=output_address), requests, outputs)

    def close(self) -> None:
        """Release the ports of a front end that was never connected (its engine failed to start)."""
        for listener in (self.input, self.output):
            listener.close()


def _listen(address: str) -> tuple[str, socket.socket]:
    """A listening TCP socket at ``address`` (``tcp://host:port``, port 0 for a free one) for
    ZeroMQ to adopt, and its resolved address. As vLLM's ``make_zmq_listener``, plus
    ``SO_REUSEADDR``: the connections of a killed front door linger in TIME_WAIT on its ports
    for a minute, and its replacement must listen there at once."""
    from vllm.utils.network_utils import _get_zmq_socket_buffer_size, get_tcp_uri, split_zmq_path

    _, host, port = split_zmq_path(address)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        buffer_size = _get_zmq_socket_buffer_size()
        if buffer_size >= 0:  # accepted connections inherit the listener's buffers
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_size)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_size)
        listener.bind((host, int(port)))
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return get_tcp_uri(host, listener.getsockname()[1]), listener


class EngineFrontEnd:
    """``AsyncLLM`` in the router for one worker's engine core, with duet's prefill and decode."""

    def __init__(self, name: str, actor: Any, engine: Any, registry: CollectorRegistry, transfer: KVTransferConfig) -> None:
        self.name = name
        self.actor = actor
        self.engine = engine
        self.registry = registry
        self.transfer = transfer
        self._requests: set[str] = set()
        self._served = 0
        self._lost: BaseException | None = None
        self._output_at = 0.0  # when the engine core last delivered a request's output (monotonic)
        self._answered_at = 0.0  # when it last answered a health ping's round trip (monotonic)
        self._migrated: dict[str, MigrationTicket] = {}  # given up by the engine, its stream not yet ended
        self._adapter_loads: dict[str, int] = {}  # the engine's last answer (:meth:`adapter_loads`)

    @classmethod
    async def connect(
        cls,
        name: str,
        actor: Any,
        vllm_config: Any,
        listeners: FrontEndListeners,
        transfer: KVTransferConfig,
        client: tuple[int, int] = (0, 1),
    ) -> "EngineFrontEnd":
        """The front end of an engine core that was launched to connect to ``listeners``, as
        its client ``client[0]`` of ``client[1]`` (one per front door)."""
        registry = CollectorRegistry()
        # The constructor binds the sockets and waits (blocking) for the engine core's hello,
        # which is already queued: a few milliseconds, but not on the event loop.
        engine = await asyncio.to_thread(
            new_front_end,
            vllm_config,
            registry,
            client_addresses={
                "input_address": listeners.addresses.input,
                "output_address": listeners.addresses.output,
                "input_listener": listeners.input,
                "output_listener": listeners.output,
            },
            client=client,
        )
        # vLLM starts its output handler on the first request, or at construction when that
        # runs on the event loop (here it runs in a thread). Started now: a front end that
        # sends no request (the control plane's, with front doors of their own) still takes the
        # engine core's statistics, which would otherwise pile up unread.
        engine._run_output_handler()
        return cls(name, actor, engine, registry, transfer)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """How many tokens the engine's KV cache holds, as its engine core told this front end
        when it connected (the routing policy weighs requests on their way by it)."""
        cache = self.engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None

    # ---- requests ---------------------------------------------------------------------------

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, decode_endpoint: str | None,
        pool_source: str | None = None,
    ) -> PrefillResult:
        return await self._one_output(
            request_id,
            lambda: run_prefill(
                self.engine, _vllm_params, self.transfer, self.name, request_id, prompt_token_ids, sampling,
                decode_endpoint, pool_source,
            ),
        )

    async def encode(self, request_id: str, images: tuple[bytes, ...]) -> None:
        """Encode ``images`` on this encode worker's engine, into the encoder cache."""
        prompts = self.image_prompts
        if prompts is None:
            raise EngineRejected(f"{self.name}'s model takes no images")
        await self._one_output(request_id, lambda: run_encode(self.engine, request_id, prompts.placeholder_ids, images))

    async def _one_output(self, request_id: str, run: Callable[[], Awaitable[_Result]]) -> _Result:
        """Run a request that ends in one output (a prefill, an encode) on the engine, its
        failures told apart as :meth:`decode` tells them."""
        self._check_alive()
        self._requests.add(request_id)
        try:
            result = await run()
            self._output_at = time.monotonic()
            return result
        except EngineAborted as error:
            if self._lost is None and await self._worker_gone():
                raise self._gone("its engine ended the request as it shut down") from error
            raise self._failure(error) from error
        except Exception as error:
            raise self._failure(error) from error
        finally:
            self._finished(request_id)

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None,
        first_text: str,
    ) -> AsyncIterator[DecodeChunk]:
        self._check_alive()
        self._requests.add(request_id)
        updates = decode_updates(
            self.engine, _vllm_params, request_id, prompt_token_ids, sampling, kv_transfer_params, first_token_id, first_text
        )
        try:
            async for chunk in updates:
                self._output_at = time.monotonic()
                if chunk.finish_reason == "abort" and request_id in self._migrated:
                    if chunk.token_ids or chunk.text:  # produced before the move, not yet relayed
                        yield replace(chunk, finish_reason=None)
                    raise Migrated(self._migrated.pop(request_id))
                if chunk.finish_reason == "abort" and (self._lost is not None or await self._worker_gone()):
                    raise self._gone(self._lost or "its engine ended the request as it shut down")
                yield chunk
        except (EngineLost, Migrated):
            raise
        except Exception as error:
            raise self._failure(error) from error
        finally:
            # Closing vLLM's generator early (the client left, the hand-off timed out) aborts
            # the request in the engine and frees its KV blocks.
            await updates.aclose()
            self._migrated.pop(request_id, None)
            self._finished(request_id)

    @cached_property
    def image_prompts(self) -> EngineImagePrompts | None:
        """How the engine's model takes images (None: it takes none), for validation."""
        return image_prompts_of(self.engine)

    def verify_sampling(self, sampling: SamplingSpec) -> None:
        """Refuse what this engine's own input processing would refuse (vLLM's
        ``SamplingParams.verify``: logprobs past the model's maximum, token ids outside its
        vocabulary, a structured-output constraint its backend cannot compile, bounded in
        nesting and regex compile time), raising vLLM's validation error, which names the
        parameter. Called by the front door before any worker is chosen."""
        processor = self.engine.input_processor
        sampling.to_vllm(None).verify(
            processor.model_config, processor.speculative_config, processor.structured_outputs_config, processor.tokenizer
        )

    async def migrate_out(self, request_id: str, target: PoolMember | None = None) -> MigrationTicket | None:
        """Have the engine give up ``request_id``, decoding here, with its KV kept for another
        worker to pull, or with a push transport sent to ``target``'s engine
        (worker_runtime/kv_migration.py); its :meth:`decode` stream then ends with
        :class:`Migrated`. None when it cannot move now (not decoding yet, or done)."""
        internal_ids = self.engine.output_processor.external_req_ids.get(request_id)
        if request_id not in self._requests or not internal_ids:
            return None
        params = move_out_params(self.transfer, target.kv_endpoint if target is not None else None)
        answer = await self.engine.engine_core.call_utility_async(MIGRATE_OUT_METHOD, internal_ids[0], params)
        if answer is None:
            return None
        ticket = MigrationTicket(
            self.name, list(answer["token_ids"]), answer["kv_transfer_params"],
            target.name if target is not None else None, target.engine if target is not None else None,
            given_up_at=time.perf_counter(),
        )
        self._migrated[request_id] = ticket
        # The engine core let the request go without a last output: ending it here, in the front
        # end only, ends the stream (vLLM sends the core an abort it ignores for a finished request).
        await self.engine.abort(request_id)
        return ticket

    async def kv_peer(self) -> dict[str, Any] | None:
        """Where other engines' NIXL agents reach this engine's (None without NIXL)."""
        return await self.engine.engine_core.call_utility_async(KV_PEER_METHOD)

    async def connect_kv_peer(self, peer: dict[str, Any]) -> None:
        """Have the engine start NIXL's handshake with ``peer`` (another's :meth:`kv_peer`),
        so that requests moving between them find it made (worker_runtime/kv_migration.py)."""
        await self.engine.engine_core.call_utility_async(CONNECT_KV_PEER_METHOD, peer)

    async def requests_by_client(self) -> dict[int, int]:
        """The requests the engine core holds, by client (front door) index: every front
        door's, not only this front end's (worker_runtime/engine_clients.py)."""
        return await self.engine.engine_core.call_utility_async("duet_requests_by_client")

    async def move_client(self, client_index: int, addresses: EngineAddresses) -> None:
        """Reconnect the engine core's client ``client_index`` to ``addresses``, where its
        replacement front door listens on another host; what the old one left is aborted
        (worker_runtime/engine_clients.py)."""
        await self.engine.engine_core.call_utility_async(READDRESS_METHOD, client_index, addresses.input, addresses.output)

    async def _worker_gone(self) -> bool:
        """Asked when the engine aborts a request the router did not abort. An engine core
        ends its requests that way when its worker dies (it watches its parent), often before
        the health watcher has noticed; a worker that cannot answer its actor's ping now is
        gone, and the request resumes elsewhere. One that answers aborted the request itself."""
        try:
            await asyncio.wait_for(self.actor.ping.remote(), _LIVENESS_TIMEOUT_S)
        except Exception:  # the actor is dead (RayActorError), its engine core exited, or no answer
            return True
        return False

    def _check_alive(self) -> None:
        if self._lost is not None:
            raise EngineLost(f"worker {self.name} is gone ({self._lost})")

    def _finished(self, request_id: str) -> None:
        self._requests.discard(request_id)
        self._served += 1

    def _gone(self, cause: object, crashed: bool = False) -> EngineLost:
        """The error of a request this worker held when it was found gone: crashed when its
        engine ended itself (its watch said so, here or in the control plane, or ``crashed``)."""
        crashed = crashed or (isinstance(self._lost, WorkerGone) and self._lost.crashed)
        return EngineLost(f"worker {self.name} is gone ({cause})", crashed=crashed)

    def _failure(self, error: BaseException) -> BaseException:
        """vLLM's error as duet's: a dead engine can be retried elsewhere, anything else not.
        vLLM's EngineDeadError before duet found the worker gone is the engine core's own
        report that it raised and stopped: a crash."""
        if self._lost is not None:
            return self._gone(self._lost)
        if type(error).__name__ == "EngineDeadError":
            return self._gone(error, crashed=True)
        if isinstance(error, EngineAborted):
            return EngineRejected(str(error))
        return EngineRejected(f"{type(error).__name__}: {error}")

    def lost(self, error: BaseException) -> None:
        """End every request of this worker now: vLLM finishes them as aborted, which
        :meth:`prefill` and :meth:`decode` turn into :class:`EngineLost`.

        A request can be between duet's liveness check and vLLM's registration of it (its
        inputs are processed in a thread), where no abort reaches it; it would be sent to the
        dead engine core and wait for an answer that never comes. Marking vLLM's client dead
        makes that send fail instead (vLLM's own engine monitor does the same).

        A utility call already sent (a drain asking what the engine still holds, a move, a
        status) would wait for ever too: vLLM fails no pending call when its engine dies. They
        fail now, as a call sent after would (a drain that asked in the moment between its
        engine's death and this hung with its worker listed as failed until duet stopped)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._lost is None:
            self._lost = error
        engine_core = self.engine.engine_core
        engine_core.resources.engine_dead = True
        self.engine.output_processor.abort_requests(list(self._requests), internal=False)
        for pending in engine_core.utility_results.values():  # a late answer finds them done: vLLM ignores it
            if not pending.done():
                pending.set_exception(EngineDeadError())

    # ---- state ------------------------------------------------------------------------------

    async def ping(self) -> tuple[float, int]:
        """The engine core answers: a round trip over the front end's sockets, which a hung
        engine never makes, unless it delivered a request's output in the last
        ``_RECENT_OUTPUT_S`` (under load, always), or it is idle and answered within
        ``_IDLE_PING_S``: each round trip costs the router about 1.3 ms of CPU and wakes the
        engine core. (The actor and the engine core process are watched, not pinged:
        :meth:`watch`.)"""
        if ping_needs_round_trip(time.monotonic(), self._output_at, self._answered_at, len(self._requests)):
            await self.engine.is_sleeping()
            self._answered_at = time.monotonic()
        metrics = read_engine_metrics(self.registry, _LOAD_METRICS)
        return metrics.get("vllm:kv_cache_usage_perc", 0.0), int(metrics.get("vllm:num_requests_running", 0))

    async def watch(self) -> EngineExit:
        """Why the worker's engine core exited, once it has (raises if its actor dies). Each
        actor call waits at most ``WATCH_HOLD_S`` (worker_runtime/engine_host.py); the next follows at
        once."""
        while (ended := await self.actor.watch.remote(WATCH_HOLD_S)) is None:
            pass
        return ended

    async def threads_cpu_wait(self) -> dict[int, float] | None:
        return await self.actor.threads_cpu_wait.remote()

    async def status(self) -> WorkerStatus:
        """The worker as this front end sees it: its requests here, the engine's unfinished ones
        and vLLM's metrics. The worker's actor is not asked: its main thread is held by the
        watch, so the question waited up to ``WATCH_HOLD_S`` and every ``duet status`` took 1-2 s;
        what only the actor knew (its KV endpoint) the pool keeps from the worker's start."""
        return WorkerStatus(
            name=self.name,
            role=self.name.rsplit("-", 1)[0],  # pools name their workers ROLE-INDEX
            state="ready" if self._lost is None else "failed",
            error="" if self._lost is None else f"{type(self._lost).__name__}: {self._lost}",
            requests_served=self._served,
            requests_inflight=len(self._requests),
            engine_unfinished=self.engine.output_processor.get_num_unfinished_requests(),
            engine_metrics=read_engine_metrics(self.registry),
            adapter_loads=await self._recent_adapter_loads() if self.engine.vllm_config.lora_config is not None else {},
        )

    async def adapter_loads(self) -> dict[str, int]:
        """The engine's LoRA adapter reads and slot activations since it started
        (worker_runtime/adapter_loads.py)."""
        self._adapter_loads = await self.engine.engine_core.call_utility_async(ADAPTER_LOADS_METHOD)
        return self._adapter_loads

    async def _recent_adapter_loads(self) -> dict[str, int]:
        """The counts for status: the engine answers between two steps, so a busy one is
        waited for at most ``_ADAPTER_LOADS_WAIT_S``, and its last answer shown otherwise."""
        try:
            return await asyncio.wait_for(self.adapter_loads(), _ADAPTER_LOADS_WAIT_S)
        except TimeoutError:
            return self._adapter_loads

    def metrics_text(self) -> str:
        lines = generate_latest(self.registry).decode().splitlines()
        return "\n".join(line for line in lines if "vllm:" in line) + "\n"

    async def model_limits(self) -> tuple[int, int, int]:
        model_config = self.engine.model_config
        return model_config.max_model_len, model_config.get_vocab_size(), self.engine.vllm_config.cache_config.block_size

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def add_lora(self, adapter: ServedAdapter) -> None:
        await self.engine.add_lora(vllm_lora_request(adapter.name, adapter.lora_id, adapter.path))

    def close(self) -> None:
        """Close the sockets (the engine core itself goes with its actor). A request still on
        this worker ends as lost and resumes elsewhere: vLLM's shutdown leaves its waiting
        requests waiting."""
        self.lost(RuntimeError("its engine front end was closed"))
        shut_down(self.engine)


def new_front_end(
    vllm_config: Any,
    registry: CollectorRegistry,
    client_addresses: dict[str, Any] | None = None,
    client: tuple[int, int] = (0, 1),
) -> Any:
    """An ``AsyncLLM`` as duet runs one per worker: vLLM's metrics in ``registry``, no request
    logging. With ``client_addresses`` it connects to an engine core launched elsewhere (a
    worker's) as its client ``client[0]`` of ``client[1]``; without, it starts its own
    (``duet bench front-end``)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    return AsyncLLM(
        vllm_config,
        Executor.get_class(vllm_config),
        log_stats=False,
        log_requests=False,
        stat_loggers=[registry_bound_stat_logger(registry)],
        client_addresses=client_addresses,
        client_index=client[0],
        client_count=client[1],
    )


def image_prompts_of(engine: Any) -> EngineImagePrompts | None:
    """How the model of ``engine`` (from :func:`new_front_end`) takes images; None: it takes
    none (``duet profile`` times a vision model's encoder with it)."""
    return EngineImagePrompts.of(engine)


def shut_down(engine: Any) -> None:
    """Shut an ``AsyncLLM`` down, once.

    AsyncLLM's finalizer shuts down again; when that runs at interpreter exit (the object can
    outlive its user), vLLM's module globals are gone and it raises. Once closed there is
    nothing left to shut down."""
    engine.shutdown()
    engine.shutdown = lambda timeout=None: None


def _vllm_params(sampling: SamplingSpec, kv_transfer_params: dict[str, Any] | None, delta: bool) -> Any:
    return sampling.to_vllm(kv_transfer_params=kv_transfer_params, delta=delta)
