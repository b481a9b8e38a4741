"""A worker's engine as the router drives it: the interface, its errors, and the SIMULATED kind.

Every pool member has an engine object the request lifecycle calls (prefill, decode, abort) and
the health watcher, status and metrics read. There are two kinds:

- :class:`~duet.router.engine_front_end.EngineFrontEnd`, for vLLM workers: the engine's front
  end runs in the router, its engine core under the worker actor;
- :class:`ActorEngine`, for SIMULATED workers, whose engine runs inside the actor: requests are
  Ray calls, and decode tokens arrive in per-step batches through the router's token receiver.

Both report failures the same way: :class:`EngineLost` (the worker or its engine is gone; the
request resumes elsewhere) or :class:`EngineRejected` (the engine refused this request; retrying
would not help).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Protocol

import ray
from ray.exceptions import RayActorError, RayTaskError

from duet.cluster.worker_api import DecodeChunk, PrefillResult, SamplingSpec, WorkerStatus
from duet.router.token_stream import StreamBroken, TokenReceiver

logger = logging.getLogger(__name__)

# vLLM errors raised inside a live actor that mean its engine is gone.
_ENGINE_DEAD = ("EngineDeadError",)
# How long after a worker's call returned its request's last tokens may still be on the way.
_LAST_TOKENS_GRACE_S = 10.0


class EngineLost(RuntimeError):
    """The worker or its engine is gone (dead, hung, or removed); the request can resume elsewhere."""


class EngineRejected(RuntimeError):
    """The engine refused or failed this request itself; another attempt would fail the same way."""


class WorkerEngine(Protocol):
    """What the router needs of a worker's engine."""

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, decode_endpoint: str | None
    ) -> PrefillResult: ...

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
        """A round trip to the engine (raises if gone; never returns if hung): (KV usage, running)."""
        ...

    async def watch(self) -> str:
        """Ends (saying why, or raising) only when the worker's actor or engine is gone."""
        ...

    async def status(self) -> WorkerStatus: ...

    def metrics_text(self) -> str:
        """The engine's vLLM metrics in Prometheus text format (called from the scrape thread)."""
        ...

    async def model_limits(self) -> tuple[int, int, int]:
        """(max_model_len, vocab_size, KV block size) as the engine resolved them."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    def lost(self, error: BaseException) -> None:
        """The worker was found dead or removed: end its requests now, with :class:`EngineLost`."""
        ...

    def close(self) -> None: ...


class ActorEngine:
    """A SIMULATED worker's engine, which runs inside its actor."""

    def __init__(self, actor: Any, tokens: TokenReceiver) -> None:
        self.actor = actor
        self.tokens = tokens

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, decode_endpoint: str | None
    ) -> PrefillResult:
        ref = self.actor.prefill.remote(request_id, prompt_token_ids, sampling, decode_endpoint)
        try:
            return await ref
        except asyncio.CancelledError:
            await self._abort(request_id, ref)
            raise
        except (RayActorError, RayTaskError) as error:
            raise _classify(error) from error

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None,
        first_text: str,
    ) -> AsyncIterator[DecodeChunk]:
        """Start the request in the actor and relay its tokens from the token receiver.

        The call's result only says whether the worker failed. Updates that queued up while the
        consumer was busy are merged into one chunk, so a loaded router sends fewer, larger
        messages instead of falling further behind.
        """
        queue = self.tokens.subscribe(request_id)
        call = self.actor.decode.remote(
            request_id, prompt_token_ids, sampling, kv_transfer_params, first_token_id, first_text
        )
        asyncio.wrap_future(call.future()).add_done_callback(lambda done: _report_call_failure(done, queue))
        finished = False
        try:
            while not finished:
                updates = [await queue.get()]
                while not queue.empty():
                    updates.append(queue.get_nowait())
                token_ids: list[int] = []
                text = ""
                for update in updates:
                    if isinstance(update, StreamBroken):
                        if token_ids or text:
                            yield DecodeChunk(token_ids, text)
                        cause = update.cause
                        raise _classify(cause) if isinstance(cause, (RayActorError, RayTaskError)) else EngineLost(str(update))
                    token_ids += update[1]
                    text += update[2]
                    if update[3] is not None:
                        finished = True
                        yield DecodeChunk(token_ids, text, update[3])
                        return
                if token_ids or text:
                    yield DecodeChunk(token_ids, text)
        finally:
            self.tokens.unsubscribe(request_id)
            if not finished:  # cancelled, timed out, failed, or the consumer stopped early
                await self._abort(request_id, call)

    async def _abort(self, request_id: str, task: object) -> None:
        """Stop the actor's task for ``request_id`` and free its engine state, whatever its state."""
        try:
            ray.cancel(task)
        except Exception:  # already finished, or not cancellable: the abort below still frees it
            pass
        try:
            await asyncio.wait_for(asyncio.shield(self.actor.abort.remote(request_id)), 10)
        except Exception as error:  # a dead worker has nothing left to free
            logger.warning("abort of %s failed: %s", request_id, error)

    async def ping(self) -> tuple[float, int]:
        return await self.actor.ping.remote()

    async def watch(self) -> str:
        return await self.actor.watch.remote()

    async def status(self) -> WorkerStatus:
        return await self.actor.status.remote()

    def metrics_text(self) -> str:
        return ""  # a SIMULATED engine has no vLLM metrics

    async def model_limits(self) -> tuple[int, int, int]:
        return await self.actor.model_limits.remote()

    async def reset_prefix_cache(self) -> None:
        await self.actor.reset_prefix_cache.remote()

    def lost(self, error: BaseException) -> None:
        """Nothing to do: calls to an actor that is killed or dead fail by themselves."""

    def close(self) -> None:
        """Nothing to do: the engine goes with its actor."""


def _classify(error: BaseException) -> BaseException:
    """A failed actor call: a dead actor or engine can be retried elsewhere, anything else not."""
    if isinstance(error, RayTaskError) and type(error.cause).__name__ not in _ENGINE_DEAD:
        return EngineRejected(str(error.cause))
    return EngineLost(type(error).__name__)


def _report_call_failure(done: asyncio.Future[Any], queue: asyncio.Queue[Any]) -> None:
    """Hand a failed actor call to the request waiting on its tokens.

    A call that succeeded has put its finish on the token socket; should that never arrive (the
    worker died right after), the request is failed after a grace period instead of waiting
    forever. A request that did finish has stopped reading its queue by then.
    """
    if done.cancelled():
        return
    if done.exception() is not None:
        queue.put_nowait(StreamBroken("the worker call failed", done.exception()))
        return
    lost = StreamBroken(f"the worker finished the request but its last tokens did not arrive in {_LAST_TOKENS_GRACE_S:.0f} s")
    asyncio.get_running_loop().call_later(_LAST_TOKENS_GRACE_S, queue.put_nowait, lost)
