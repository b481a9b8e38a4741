"""A worker's engine as the router drives it: the interface, its errors, and the SIMULATED kind.

Every pool member has an engine object the request lifecycle calls (prefill, decode, abort) and
the health watcher, status and metrics read. There are two kinds:

- :class:`~duet.router.engine_front_end.EngineFrontEnd`, for vLLM workers: the engine's front
  end runs in the router, its engine core under the worker actor;
- :class:`ActorEngine`, for SIMULATED workers, whose engine runs inside the actor: requests go
  to it and its answers (decode tokens in per-step batches) come back over the worker's channel
  (router/actor_channel.py), and Ray calls serve only health and status.

Both report failures the same way: :class:`EngineLost` (the worker or its engine is gone; the
request resumes elsewhere) or :class:`EngineRejected` (the engine refused this request; retrying
would not help). A vLLM worker's decode can also end in :class:`Migrated`: the engine gave the
request up with its KV, for another worker to pull and continue (worker_runtime/kv_migration.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from duet.worker_runtime.worker_api import DecodeChunk, EngineExit, PrefillResult, SamplingSpec, ServedAdapter, WorkerStatus
from duet.worker_runtime.worker_channel import sampling_to_wire
from duet.router.actor_channel import ActorChannel, ChannelClosed


class WorkerGone(RuntimeError):
    """A worker lost to a failure. ``crashed``: its engine ended itself (:class:`EngineExit`),
    which a request it held may have caused; a worker killed, hung or removed was not crashed."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


class EngineLost(WorkerGone):
    """The worker or its engine is gone (dead, hung, or removed); the request can resume elsewhere."""


class WorkerExited(WorkerGone):
    """A worker whose engine core process exited (its watch ended), crashed or stopped."""

    def __init__(self, ended: EngineExit) -> None:
        super().__init__(ended.reason, ended.crashed)


class EngineRejected(RuntimeError):
    """The engine refused or failed this request itself; another attempt would fail the same way."""


@dataclass(frozen=True)
class MigrationTicket:
    """A request its decode engine gave up with its KV kept for a pull, or sent to ``target``.

    ``token_ids`` are the engine's tokens of the round, as its own list has them (the KV covers
    every one but the last); ``kv_transfer_params`` are what a decode engine needs to load that
    KV, None when no connector kept it (the request then resumes by recomputing). ``target`` is
    the worker a push transport sent the KV to, and ``target_engine`` its engine then (None: any
    worker but the source may pull it). ``given_up_at`` is when the source's answer came
    (``time.perf_counter``, the router's clock): where a move's stall splits between the source
    and the target."""

    source: str
    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    target: str | None = None
    target_engine: Any = field(default=None, compare=False, repr=False)
    given_up_at: float = field(default=0.0, compare=False)

    def kv_usable_on(self, worker: str, engine: Any) -> bool:
        """Whether ``worker``, running ``engine``, can continue the request from this KV (else
        it recomputes): not the source, and with a push transport, the very engine the KV was
        sent to (a replacement under the same name never got it)."""
        if self.kv_transfer_params is None or worker == self.source:
            return False
        return self.target is None or (worker == self.target and engine is self.target_engine)


class Migrated(Exception):
    """The request's decode round ended on this worker, to continue on another."""

    def __init__(self, ticket: MigrationTicket) -> None:
        super().__init__(f"moved off {ticket.source} after {len(ticket.token_ids)} tokens")
        self.ticket = ticket


class WorkerEngine(Protocol):
    """What the router needs of a worker's engine."""

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, decode_endpoint: str | None,
        pool_source: str | None = None,
    ) -> PrefillResult:
        """The prompt's first token, its KV kept for (or, with ``decode_endpoint``, pushed to) a
        decode worker; ``pool_source`` ("host:port") is an engine on another host whose pool
        holds the prompt's prefix (vLLM's p2p tier fetches it from there)."""
        ...

    def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None,
        first_text: str,
    ) -> AsyncIterator[DecodeChunk]:
        """New tokens as they come; closing the iterator early aborts the request."""
        ...

    async def ping(self) -> tuple[float, int]:
        """Proof the engine steps, by a round trip (raises if gone; never returns if hung) or by
        output it just delivered: (KV usage, running)."""
        ...

    async def watch(self) -> EngineExit:
        """Ends (saying why, or raising) only when the worker's actor or engine is gone."""
        ...

    async def threads_cpu_wait(self) -> dict[int, float] | None:
        """Seconds each thread of the engine has waited for a CPU so far, by thread id (None
        where the kernel does not say): read on the worker's host, by its actor."""
        ...

    async def status(self) -> WorkerStatus: ...

    def metrics_text(self) -> str:
        """The engine's vLLM metrics in Prometheus text format (called from the scrape thread)."""
        ...

    async def model_limits(self) -> tuple[int, int, int]:
        """(max_model_len, vocab_size, KV block size) as the engine resolved them."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def add_lora(self, adapter: ServedAdapter) -> None:
        """Load ``adapter`` into the engine ahead of its first request (raises if it cannot be loaded)."""
        ...

    def lost(self, error: BaseException) -> None:
        """The worker was found dead or removed: end its requests now, with :class:`EngineLost`."""
        ...

    def close(self) -> None: ...


class ActorEngine:
    """A SIMULATED worker's engine, which runs inside its actor and takes requests over the
    worker's channel."""

    def __init__(self, actor: Any, channel: ActorChannel) -> None:
        self.actor = actor
        self.channel = channel

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, decode_endpoint: str | None,
        pool_source: str | None = None,
    ) -> PrefillResult:
        # A SIMULATED engine has no KV pool: ``pool_source`` has nothing to fetch into.
        queue = self.channel.subscribe(request_id)
        try:
            self._send(["prefill", request_id, prompt_token_ids, sampling_to_wire(sampling), decode_endpoint])
            answer = await queue.get()
        except asyncio.CancelledError:
            self._abort(request_id)
            raise
        finally:
            self.channel.unsubscribe(request_id)
        if answer[1] != "prefilled":
            raise _failure(answer)
        return PrefillResult(*answer[2:])

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None,
        first_text: str,
    ) -> AsyncIterator[DecodeChunk]:
        """Start the request on the worker and relay its tokens as they come.

        Answers that queued up while the consumer was busy are merged into one chunk, so a
        loaded router sends fewer, larger messages instead of falling further behind.
        """
        queue = self.channel.subscribe(request_id)
        finished = False
        try:
            self._send([
                "decode", request_id, prompt_token_ids, sampling_to_wire(sampling),
                kv_transfer_params, first_token_id, first_text,
            ])
            while True:
                answers = [await queue.get()]
                while not queue.empty():
                    answers.append(queue.get_nowait())
                token_ids: list[int] = []
                text = ""
                for answer in answers:
                    if answer[1] != "tokens":
                        if token_ids or text:
                            yield DecodeChunk(token_ids, text)
                        raise _failure(answer)
                    token_ids += answer[2]
                    text += answer[3]
                    if answer[4] is not None:
                        finished = True
                        yield DecodeChunk(token_ids, text, answer[4])
                        return
                if token_ids or text:
                    yield DecodeChunk(token_ids, text)
        finally:
            self.channel.unsubscribe(request_id)
            if not finished:  # cancelled, timed out, failed, or the consumer stopped early
                self._abort(request_id)

    def _send(self, message: list[Any]) -> None:
        try:
            self.channel.send(message)
        except ChannelClosed as closed:
            raise EngineLost(str(closed)) from None

    def _abort(self, request_id: str) -> None:
        """Stop ``request_id`` on the worker and free its engine state, whatever its state."""
        try:
            self.channel.send(["abort", request_id])
        except ChannelClosed:  # a worker that is gone has nothing left to free
            pass

    async def ping(self) -> tuple[float, int]:
        return await self.actor.ping.remote()

    async def watch(self) -> EngineExit:
        return await self.actor.watch.remote()

    async def threads_cpu_wait(self) -> dict[int, float] | None:
        return await self.actor.threads_cpu_wait.remote()

    async def status(self) -> WorkerStatus:
        return await self.actor.status.remote()

    def metrics_text(self) -> str:
        return ""  # a SIMULATED engine has no vLLM metrics

    async def model_limits(self) -> tuple[int, int, int]:
        return await self.actor.model_limits.remote()

    async def reset_prefix_cache(self) -> None:
        await self.actor.reset_prefix_cache.remote()

    async def add_lora(self, adapter: ServedAdapter) -> None:
        """Nothing to load: a SIMULATED engine computes no model (requests with an adapter are
        timed as the base model's)."""

    def lost(self, error: BaseException) -> None:
        self.channel.fail_all(f"the worker was found dead ({type(error).__name__}: {error})")

    def close(self) -> None:
        self.channel.close()


def _failure(answer: list[Any]) -> BaseException:
    """The error a worker's ``failed`` or ``lost`` answer stands for."""
    return EngineRejected(answer[2]) if answer[1] == "failed" else EngineLost(answer[2])
