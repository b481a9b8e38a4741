"""One request's life: prefill, hand-off, decode, stream back, finish or cancel.

The router streams the prefill worker's first token to the client at once (that is the TTFT
disaggregation is for), then relays the decode worker's stream. Cancellation at any point aborts
the request on whichever workers hold it, so neither keeps KV blocks for a client that left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import ray

from duet.cluster.worker_api import DecodeChunk, FinishReason, PrefillResult
from duet.router.pools import PoolMember, WorkerPool
from duet.router.validation import ValidatedRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEvent:
    """One message for the client: new tokens, and on the last event the finish and usage."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: "Usage | None" = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_worker: str
    decode_worker: str


class _Clock:
    """TTFT and TPOT as the client experiences them, measured at the router."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.tokens = 0

    def tokens_sent(self, count: int) -> None:
        now = time.perf_counter()
        if count and self.first is None:
            self.first = now
        if count:
            self.last = now
        self.tokens += count

    def usage(self, prompt_tokens: int, prefill: str, decode: str) -> Usage:
        first = self.first if self.first is not None else self.last
        tpot = (self.last - first) / (self.tokens - 1) if self.tokens > 1 else 0.0
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.tokens,
            ttft_s=first - self.start,
            tpot_s=tpot,
            e2e_s=time.perf_counter() - self.start,
            prefill_worker=prefill,
            decode_worker=decode,
        )


class RequestLifecycle:
    """Runs requests across a prefill pool and a decode pool."""

    def __init__(self, prefill: WorkerPool, decode: WorkerPool) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode

    async def run(self, request: ValidatedRequest) -> AsyncIterator[StreamEvent]:
        clock = _Clock()
        prefill_worker = self.prefill_pool.pick()
        result = await self._prefill(prefill_worker, request)
        clock.tokens_sent(1)
        if result.finish_reason is not None:
            yield StreamEvent(
                [result.first_token_id],
                result.first_text,
                result.finish_reason,
                clock.usage(result.num_prompt_tokens, result.worker, ""),
            )
            return
        yield StreamEvent([result.first_token_id], result.first_text)
        decode_worker = self.decode_pool.pick()
        finish: FinishReason = "error"
        async for chunk in self._decode(decode_worker, request, result):
            clock.tokens_sent(len(chunk.token_ids))
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
                yield StreamEvent(
                    chunk.token_ids,
                    chunk.text,
                    finish,
                    clock.usage(result.num_prompt_tokens, result.worker, decode_worker.name),
                )
                return
            yield StreamEvent(chunk.token_ids, chunk.text)
        raise RuntimeError(f"decode worker {decode_worker.name} ended the stream without finishing")

    async def _prefill(self, worker: PoolMember, request: ValidatedRequest) -> PrefillResult:
        worker.inflight += 1
        ref = worker.actor.prefill.remote(request.request_id, request.prompt_token_ids, request.sampling)
        try:
            return await ref
        except asyncio.CancelledError:
            await _abort(worker, request.request_id, ref)
            raise
        finally:
            worker.inflight -= 1

    async def _decode(
        self, worker: PoolMember, request: ValidatedRequest, prefill: PrefillResult
    ) -> AsyncIterator[DecodeChunk]:
        worker.inflight += 1
        stream = worker.actor.generate.options(num_returns="streaming").remote(
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
            prefill.kv_transfer_params,
            prefill.first_token_id,
            prefill.first_text,
        )
        finished = False
        try:
            async for ref in stream:
                chunk: DecodeChunk = await ref
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            worker.inflight -= 1
            if not finished:  # cancelled, or the consumer stopped early
                await _abort(worker, request.request_id, stream)


async def _abort(worker: PoolMember, request_id: str, task: object) -> None:
    """Stop a worker's task for ``request_id`` and free its engine state, whatever state it is in."""
    try:
        ray.cancel(task)
    except Exception:  # already finished, or not cancellable: the abort below still frees it
        pass
    try:
        await asyncio.shield(worker.actor.abort.remote(request_id))
    except Exception as error:  # a dead worker has nothing left to free
        logger.warning("abort of %s on %s failed: %s", request_id, worker.name, error)
