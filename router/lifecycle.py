"""One request's life: prefill, hand-off, decode, stream back, finish or cancel, survive failures.

The router streams the prefill worker's first token to the client at once (that is the TTFT
disaggregation is for), then relays the decode worker's stream.

Failures end in a defined outcome within a bound, never a hang:
- a worker that dies (its actor or its engine) is replaced by the pool, and the request resumes
  on a ready worker from where the client's stream stands: the tokens already sent become part
  of the prompt of a new prefill/decode round, so the client sees one uninterrupted stream;
- a KV hand-off that does not produce the decode worker's first tokens within
  ``transfer_timeout_s`` is abandoned and the decode worker recomputes the prompt itself;
- after ``max_attempts`` failed rounds the client gets UNAVAILABLE with the reason;
- a request held by ``max_engine_crashes`` engines as they crashed (raised, or died of a fault
  signal: what a request can cause; a kill from outside is not counted) is not retried again:
  most likely it crashes them (a query of death), and each retry would take another engine,
  and its other requests' progress, down with it. The client gets INTERNAL, which clients do
  not retry (:class:`RequestCrashesEngines`).
Cancellation at any point aborts the request on whichever worker holds it, so neither keeps KV
blocks for a client that left.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from duet.worker_runtime.worker_api import DecodeChunk, FinishReason, PositionLogprobs, PrefillResult, SamplingSpec
from duet.router.encoding import EncodeStep
from duet.router.local_prefill import LocalPrefillGuard
from duet.router.pool_fetch import FetchChoice, FetchWhen, PlannedFetch
from duet.router.policies import PrefixAffinity
from duet.router.pools import NoWorkerAvailable, PoolMember, WorkerPool
from duet.router.validation import ValidatedRequest
from duet.router.worker_engines import EngineLost, EngineRejected, Migrated, MigrationTicket

logger = logging.getLogger(__name__)

# Suffixes that make the engines' request ids unique (clients choose theirs, and two may choose
# the same): this process's random prefix, then a count, so no two front doors collide and no
# request pays for a random draw.
_ID_PREFIX = secrets.token_hex(3)
_internal_ids = (f"{_ID_PREFIX}{n:x}" for n in itertools.count())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_worker: str
    decode_worker: str


@dataclass(frozen=True)
class StreamEvent:
    """One message for the client: new tokens, and on the last event the finish and usage."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # One entry per token of ``token_ids`` when the request asked for logprobs (None for a
    # token whose logprobs were lost: one an engine produced as it gave the request up).
    logprobs: list[PositionLogprobs | None] | None = None
    # On the first event, when the request asked for prompt logprobs.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # On the last event: the stop string or stop token that ended the stream (None: EOS, length).
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Move:
    """A request that left decode worker ``source`` (drained, scaled away, or dead) and
    continued on ``target``: with its KV pulled (``method`` "kv") or by recomputing its context
    there ("replay"); ``stall_s`` is the gap it left in the client's stream, from the last token
    before the move to the first after it. A move its source gave up (a drain, a rebalance; not
    a death) splits the stall into ``phases``: ``give_up`` (to the source's answer, which comes
    between two of its steps), ``hand_off`` (the router sending the request on) and ``resume``
    (to the target's first token: its KV pull or recomputation, and its next step)."""

    source: str
    target: str
    method: str
    stall_s: float
    phases: dict[str, float] = field(default_factory=dict)


class WorkerFailed(RuntimeError):
    """A worker died or lost its engine while serving a round; the round can be retried.
    ``crashed``: its engine ended itself while it held the round (router/worker_engines.py)."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


class RequestFailed(RuntimeError):
    """The request cannot be completed; the message says why (sent as UNAVAILABLE)."""


class RequestCrashesEngines(RuntimeError):
    """The request was held by ``max_engine_crashes`` engines as they crashed; it is not
    retried (sent as INTERNAL, HTTP 500 that asks not to be retried)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    # Engine crashes with the request aboard after which it is failed, not retried (0: never).
    max_engine_crashes: int = 2
    # How long a round waits for a ready worker (covers a replacement engine starting).
    worker_wait_s: float = 600.0
    # Bound on the KV hand-off: from launching decode to its first chunk.
    transfer_timeout_s: float = 30.0


class _Clock:
    """TTFT and TPOT as the client experiences them, measured at the router."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.tokens = 0

    def tokens_sent(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += count

    def usage(self, prompt_tokens: int, prefill: str, decode: str) -> Usage:
        first = self.first if self.first is not None else self.last
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=self.tokens,
            ttft_s=first - self.start,
            tpot_s=(self.last - first) / (self.tokens - 1) if self.tokens > 1 else 0.0,
            e2e_s=time.perf_counter() - self.start,
            prefill_worker=prefill,
            decode_worker=decode,
        )


@dataclass
class _Round:
    """One prefill/decode attempt at the part of the request not yet streamed."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_worker: str = ""
    decode_worker: str = ""
    # A round that continues a request its decode worker gave up with its KV: no prefill; a
    # decode worker loads that KV (every token but the last streamed one, which it computes).
    moved: MigrationTicket | None = None
    # Its KV hand-off timed out, so its decode worker computed the context itself.
    recomputed: bool = False
    # When its decode worker was sent the request to continue from another engine's KV.
    handed_off_at: float = 0.0
    # A batch job's request: prefilled on the prefill pool whatever its queue (ValidatedRequest.background).
    background: bool = False
    # Tokens its images add to its prompt in the engine (each placeholder expanded).
    image_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """Its prompt's length as the engine computes it: what it costs a worker."""
        return len(self.prompt_token_ids) + self.image_tokens


@dataclass(frozen=True)
class Decoding:
    """A decode round in flight: its engine request id, where it runs, its context's length
    when it started there (its prompt, and any tokens a resumed or moved round carries), and,
    for a round that arrived by a move, when (rebalancing leaves it there a while)."""

    request_id: str
    worker: PoolMember
    engine: Any
    context_tokens: int
    moved_in_at: float | None = None


@dataclass
class _Departure:
    """A stream that left decode worker ``source`` (moved off it, or it failed), from its last
    token there (``left_at``) to its first token after (``resumed_at``)."""

    source: str
    left_at: float
    resumed_at: float | None = None

    @staticmethod
    def off(round_: _Round, clock: _Clock) -> _Departure | None:
        """The departure from ``round_``'s decode worker; None if the round had none yet (its
        prefill failed: the stream never reached a decode worker)."""
        return _Departure(round_.decode_worker, clock.last) if round_.decode_worker else None


def _phases(departure: _Departure, round_: _Round) -> dict[str, float]:
    """Where a move's stall went (:class:`Move`), for a round that continues a request its source
    gave up; none for one that resumes after a failure."""
    if round_.moved is None or departure.resumed_at is None:
        return {}
    # Tokens the source produced before giving the request up may be relayed after its answer;
    # the round is handed on only after both.
    given_up = max(round_.moved.given_up_at, departure.left_at)
    return {
        "give_up": given_up - departure.left_at,
        "hand_off": round_.handed_off_at - given_up,
        "resume": departure.resumed_at - round_.handed_off_at,
    }


class RequestLifecycle:
    """Runs requests across a prefill pool and a decode pool.

    Without a prefill pool the deployment is colocated: each request runs whole on one worker
    of ``decode`` (the baseline disaggregation is measured against, on the same hardware).
    """

    def __init__(
        self,
        prefill: WorkerPool | None,
        decode: WorkerPool,
        policy: RetryPolicy | None = None,
        prefill_pushes_kv: bool = False,
        local_prefill_max_tokens: int = 0,
        local_prefill_queue_tokens: int = 0,
        local_prefill_tpot_s: float | None = None,
        fetch_when: FetchWhen = "faster",
    ) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.policy = policy or RetryPolicy()
        # Push transports stream KV during prefill, so prefill is told the decode worker.
        self.prefill_pushes_kv = prefill_pushes_kv
        # Conditional disaggregation: shorter prompts are prefilled on the decode worker, and so
        # is any prompt while the prefill pool's queues are longer than the threshold.
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.local_prefill_queue_tokens = local_prefill_queue_tokens
        # ... and then only while the decode worker's streams stay inside this TPOT target.
        self.local_prefill_guard = LocalPrefillGuard(local_prefill_tpot_s)
        # Whether a prefix another host's KV pool holds is fetched or computed, per request.
        self.pool_fetches = FetchChoice(fetch_when, self.local_prefill_guard.prompt_cost)
        # The decode rounds in flight, by the engines' request id: where each runs, to move them.
        self._decoding: dict[str, Decoding] = {}
        # Told of every request that continued on another decode worker (status, metrics).
        self.on_move: Callable[[Move], None] | None = None
        # E+P+D: encodes a prompt's images on the encode pool before its prefill.
        self.encoder: EncodeStep | None = None

    async def run(self, request: ValidatedRequest) -> AsyncIterator[StreamEvent]:
        clock = _Clock()
        # Tokens the stream has produced: a client resuming a broken stream sent some already.
        sent: list[int] = list(request.resume_after)
        last_failure: WorkerFailed | None = None
        # Clients choose request ids and two may choose the same one; the engines and the token
        # socket key on this one, which is unique.
        internal_id = f"{request.request_id}-{next(_internal_ids)}"
        attempt = moves = crashes = 0
        moved: MigrationTicket | None = None
        prefill_worker = ""
        departure: _Departure | None = None  # the decode worker the stream left, until it continues
        while attempt < self.policy.max_attempts:
            round_ = self._next_round(request, internal_id, attempt, moves, sent, moved)
            round_.prefill_worker = prefill_worker if moved else ""
            moved = None
            try:
                chunks = await self._start_round(round_)
                try:
                    async for chunk in chunks:
                        if departure is not None and self._arrived(departure, round_):
                            departure = None
                        sent.extend(chunk.token_ids)
                        clock.tokens_sent(len(chunk.token_ids))
                        if chunk.finish_reason is None:
                            yield StreamEvent(chunk.token_ids, chunk.text, None, None, chunk.logprobs, chunk.prompt_logprobs)
                            continue
                        usage = clock.usage(len(request.engine_prompt_ids), round_.prefill_worker, round_.decode_worker)
                        yield StreamEvent(
                            chunk.token_ids, chunk.text, chunk.finish_reason, usage, chunk.logprobs, chunk.prompt_logprobs,
                            chunk.stop_reason,
                        )
                        return
                finally:
                    await chunks.aclose()  # runs the worker side's abort if the client left early
            except WorkerFailed as failure:
                crashes += failure.crashed
                if crashes and crashes == self.policy.max_engine_crashes:
                    raise RequestCrashesEngines(
                        f"{crashes} engines crashed while they held this request (the last: {failure}); "
                        "not retried, as it most likely crashes them"
                    ) from failure
                logger.warning("request %s: %s; resuming after %d tokens", request.request_id, failure, len(sent))
                last_failure = failure
                attempt += 1
                departure = departure or _Departure.off(round_, clock)
            except Migrated as migrated:
                moved, moves, prefill_worker = migrated.ticket, moves + 1, round_.prefill_worker
                # The engine's own list is where the stream stands: the round's tokens after
                # those the round's prompt already held.
                stream = round_.prompt_token_ids[len(request.prompt_token_ids):] + moved.token_ids
                if stream[: len(sent)] != sent:
                    raise RequestFailed(f"moving off {moved.source}: its tokens disagree with the stream's") from migrated
                # The stall runs from the last token relayed as it came, not from those the move
                # hands over below, which the client got late (as part of the stall).
                departure = departure or _Departure.off(round_, clock)
                if len(stream) > len(sent):  # produced, but not relayed before the move (never seen so far)
                    logger.warning("request %s: %d tokens relayed without text", request.request_id, len(stream) - len(sent))
                    lost = len(stream) - len(sent)
                    yield StreamEvent(stream[len(sent):], "", logprobs=[None] * lost if request.sampling.logprobs is not None else None)
                    clock.tokens_sent(len(stream) - len(sent))
                    sent = stream
                if moved.kv_transfer_params is None:
                    moved = None  # nothing kept its KV: the next round recomputes it
        raise RequestFailed(f"gave up after {self.policy.max_attempts} attempts: {last_failure}")

    def _arrived(self, departure: _Departure, round_: _Round) -> bool:
        """A chunk of ``round_`` arrived for a stream that left a decode worker: the stall ends
        at the first; ``on_move`` is told once the round's decode worker is known (a prefill
        worker's first token comes before). True once told."""
        if departure.resumed_at is None:
            departure.resumed_at = time.perf_counter()
        if not round_.decode_worker:
            return False
        if self.on_move is not None:
            method = "kv" if round_.moved is not None and not round_.recomputed else "replay"
            stall = departure.resumed_at - departure.left_at
            self.on_move(Move(departure.source, round_.decode_worker, method, stall, _phases(departure, round_)))
        return True

    def _next_round(
        self, request: ValidatedRequest, internal_id: str, attempt: int, moves: int, sent: list[int],
        moved: MigrationTicket | None,
    ) -> _Round:
        """The round that serves what is left of ``request`` after ``sent``: its prompt is the
        request's and everything streamed; a moved round (``moved`` kept the KV of all of it
        but the last token) computes only that last token, any other computes it all."""
        suffix = "".join((f"-retry{attempt}" if attempt else "", f"-moved{moves}" if moves else ""))
        return _Round(
            request_id=internal_id + suffix,
            prompt_token_ids=request.prompt_token_ids + sent,
            sampling=_rest_of(request.sampling, len(sent)) if sent else request.sampling,
            moved=moved,
            background=request.background,
            image_tokens=len(request.engine_prompt_ids) - len(request.prompt_token_ids),
        )

    def decoding(self) -> list[Decoding]:
        """The decode rounds this front door has in flight."""
        return list(self._decoding.values())

    async def migrate(self, worker: PoolMember, request_ids: list[str] | None = None) -> int:
        """Move the requests decoding on ``worker`` (all, or those of ``request_ids``) to other
        decode workers with their KV (a drain, or rebalancing); returns how many began to move.
        A worker whose engine cannot give requests up (SIMULATED, or no KV connector) keeps them."""
        wanted = None if request_ids is None else set(request_ids)
        # Asked together: the engine core takes every queued call between two of its steps.
        calls = [
            self._move_out(round_)
            for round_ in self.decoding()
            if round_.worker is worker and hasattr(round_.engine, "migrate_out")
            and (wanted is None or round_.request_id in wanted)
        ]
        tickets = await asyncio.gather(*calls, return_exceptions=True)
        for ticket in tickets:
            if isinstance(ticket, BaseException):  # the engine is gone: its requests resume by replay
                logger.warning("moving a request off %s failed: %s", worker.name, ticket)
        return sum(1 for ticket in tickets if isinstance(ticket, MigrationTicket))

    async def _move_out(self, round_: Decoding) -> MigrationTicket | None:
        """Have ``round_``'s engine give its request up with its KV: kept for whichever worker
        continues it to pull, or with a push transport sent to the worker chosen for it now, as
        a prefill's is (None, and the request stays, when no other decode worker is ready)."""
        if not self.prefill_pushes_kv:
            return await round_.engine.migrate_out(round_.request_id)
        try:
            target = self.decode_pool.pick(avoid=round_.worker.name)
        except NoWorkerAvailable:
            return None
        if target is round_.worker:
            return None
        # Counted as the target's meanwhile, so that the next request moving now is spread by the
        # policy instead of following this one.
        with target.assign(round_.context_tokens):
            return await round_.engine.migrate_out(round_.request_id, target)

    def _moved_target(self, ticket: MigrationTicket | None) -> PoolMember | None:
        """The decode worker a push transport sent a moved request's KV to, if still ready."""
        if ticket is None or ticket.target is None:
            return None
        member = self.decode_pool.find(ticket.target)
        return member if member is not None and member.state == "ready" and ticket.kv_usable_on(member.name, member.engine) else None

    async def _start_round(self, round_: _Round) -> AsyncIterator[DecodeChunk]:
        """The round's token chunks: colocated, one worker computes the prompt and streams every
        token; disaggregated, prefill's first token, then the decode worker's.

        The decode worker is chosen first: a prompt is only computed when a decode worker can
        take its KV (otherwise the prefill worker would hold that KV for a request that fails,
        until its lease runs out), and push transports need its address."""
        prompt = round_.prompt_token_ids
        source = round_.moved.source if round_.moved is not None else None
        decode_worker = self._moved_target(round_.moved) or await self.decode_pool.acquire(
            self.policy.worker_wait_s, prompt, avoid=source, adapter=round_.sampling.lora_name
        )
        if round_.moved is not None:
            return self._moved_round(round_, decode_worker, round_.moved)
        if self.prefill_pool is None or not (round_.background or self._prefill_remotely(decode_worker, round_.context_tokens)):
            round_.prefill_worker = round_.decode_worker = decode_worker.name
            return self._decode(decode_worker, round_, None, kv_transfer_params=None)
        return self._disaggregated_round(round_, decode_worker)

    def _prefill_remotely(self, decode_worker: PoolMember, prompt_tokens: int) -> bool:
        """Conditional disaggregation: False where the decode worker should compute the prompt
        itself. A short prompt's hand-off costs more than it saves; and while every prefill
        worker's queue is past the threshold, a decode worker whose own queue of prompts is
        shorter answers sooner, at the cost of one longer step for the sequences it decodes."""
        assert self.prefill_pool is not None
        if prompt_tokens < self.local_prefill_max_tokens:
            return False
        ready = self.prefill_pool.ready()
        if not self.local_prefill_queue_tokens or not ready:
            return True
        backlog = min(member.outstanding_tokens for member in ready)
        if backlog <= self.local_prefill_queue_tokens or decode_worker.local_prefill_tokens >= backlog:
            return True
        return not self.local_prefill_guard.allows(decode_worker.name, prompt_tokens, decode_worker.local_prefill_tokens)

    async def _disaggregated_round(self, round_: _Round, decode_worker: PoolMember) -> AsyncIterator[DecodeChunk]:
        assert self.prefill_pool is not None
        prompt = round_.prompt_token_ids
        # The TPOT guard counts the request on its decode worker from now: its first token (and
        # so its TPOT) comes before its KV is pulled there.
        guard, assigned_to, request_id = self.local_prefill_guard, decode_worker.name, round_.request_id
        guard.stream_assigned(assigned_to, request_id, round_.sampling.max_tokens)
        try:
            with decode_worker.assign(round_.context_tokens):  # counted there from now, not once its KV arrives
                async with self._images_encoded(round_):
                    prefill_worker = await self.prefill_pool.acquire(
                        self.policy.worker_wait_s, prompt, adapter=round_.sampling.lora_name
                    )
                    round_.prefill_worker = prefill_worker.name
                    guard.queued_behind(assigned_to, request_id, prefill_worker.outstanding_tokens)
                    result = await self._prefill(
                        prefill_worker, round_, decode_worker.kv_endpoint if self.prefill_pushes_kv else None,
                        self._pool_fetch(prefill_worker, round_),
                    )
            guard.first_token(assigned_to, request_id)
            yield DecodeChunk(
                [result.first_token_id], result.first_text, result.finish_reason, result.first_logprobs, result.prompt_logprobs,
                result.stop_reason,
            )
            if result.finish_reason is not None:
                return
            decode_worker = await self._still_ready(decode_worker, round_)  # the prompt took a while
            async for chunk in self._pull_and_decode(decode_worker, round_, result.kv_transfer_params, result):
                yield chunk
        finally:
            guard.stream_ended(assigned_to, request_id)

    def _images_encoded(self, round_: _Round) -> AbstractAsyncContextManager[None]:
        """E+P+D: the round's images in the encoder cache, for its prefill engine to load
        (router/encoding.py); nothing to do without images or an encode pool."""
        if self.encoder is None or not round_.sampling.images:
            return nullcontext()
        return self.encoder.encoded(round_.request_id, round_.sampling.images)

    async def _moved_round(
        self, round_: _Round, decode_worker: PoolMember, ticket: MigrationTicket
    ) -> AsyncIterator[DecodeChunk]:
        """Continue on ``decode_worker`` a request that ``ticket.source`` gave up with its KV.
        (The source's engine counts the request as its own until the pull is done, so a drain
        does not remove it while its KV is being read: cluster/pool_manager.py.)"""
        round_.decode_worker = decode_worker.name
        # Only the source was ready (rebalancing: the others left meanwhile), or the worker the
        # KV was sent to is gone: it recomputes the request, as after a pull that timed out.
        kv_transfer_params = ticket.kv_transfer_params if ticket.kv_usable_on(decode_worker.name, decode_worker.engine) else None
        round_.recomputed = kv_transfer_params is None
        async for chunk in self._pull_and_decode(decode_worker, round_, kv_transfer_params):
            yield chunk

    async def _pull_and_decode(
        self, decode_worker: PoolMember, round_: _Round, kv_transfer_params: dict[str, Any] | None,
        handoff: PrefillResult | None = None,
    ) -> AsyncIterator[DecodeChunk]:
        """Decode on ``decode_worker`` from KV another engine holds: a prefill's (``handoff``,
        whose first token the stream has: the decode engine re-derives it, and it is skipped)
        or a moved request's; past the transfer timeout, recompute it."""
        round_.handed_off_at = time.perf_counter()
        chunks = self._decode(decode_worker, round_, handoff, kv_transfer_params)
        try:
            first = await asyncio.wait_for(anext(chunks), self.policy.transfer_timeout_s)
        except TimeoutError:
            await chunks.aclose()
            logger.warning(
                "request %s: KV hand-off to %s exceeded %.1f s; recomputing the prompt on the decode side",
                round_.request_id, decode_worker.name, self.policy.transfer_timeout_s,
            )
            decode_worker = await self._still_ready(decode_worker, round_)  # it may have hung by dying
            round_.request_id += "-recompute"
            round_.recomputed = True
            chunks = self._decode(decode_worker, round_, handoff, kv_transfer_params=None)
            first = await anext(chunks)
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def _still_ready(self, decode_worker: PoolMember, round_: _Round) -> PoolMember:
        """``decode_worker``, or another ready one if it failed or began draining meanwhile;
        recorded as the round's decode worker."""
        if decode_worker.state != "ready":
            decode_worker = await self.decode_pool.acquire(
                self.policy.worker_wait_s, round_.prompt_token_ids, adapter=round_.sampling.lora_name
            )
        round_.decode_worker = decode_worker.name
        return decode_worker

    def _pool_fetch(self, worker: PoolMember, round_: _Round) -> PlannedFetch | None:
        """The prefix ``worker`` fetches for the round from another host's pool, where one is
        planned (router/policies.py: PrefixAffinity.kv_source) and fetching it is chosen over
        computing it (router/pool_fetch.py); None: the worker computes what its host lacks."""
        assert self.prefill_pool is not None
        policy = self.prefill_pool.policy
        if not isinstance(policy, PrefixAffinity):
            return None
        plan = policy.kv_source(worker, round_.prompt_token_ids, round_.sampling.lora_name)
        if plan is None or self.pool_fetches.take(plan, round_.context_tokens):
            return plan
        policy.computed_instead(worker, round_.prompt_token_ids, round_.sampling.lora_name)
        return None

    async def _prefill(
        self, worker: PoolMember, round_: _Round, decode_endpoint: str | None, fetch: PlannedFetch | None = None
    ) -> PrefillResult:
        assert self.prefill_pool is not None
        engine = _engine_of(self.prefill_pool, worker)
        alone, started = worker.outstanding_tokens == 0, time.perf_counter()
        worker.inflight += 1
        worker.outstanding_tokens += round_.context_tokens
        try:
            result = await engine.prefill(
                round_.request_id, round_.prompt_token_ids, round_.sampling, decode_endpoint,
                str(fetch.source) if fetch is not None else None,
            )
            if alone:  # nothing queued with it: what computing a prompt costs (the guard's estimate), or fetching one
                seconds, computed = time.perf_counter() - started, round_.context_tokens - result.cached_tokens
                if fetch is None:
                    self.local_prefill_guard.prefilled(round_.context_tokens, seconds, computed)
                else:
                    self.pool_fetches.timed(fetch, result.cached_tokens - fetch.reached_tokens, computed, seconds)
            return result
        except (EngineLost, EngineRejected) as error:
            raise self._worker_failure(self.prefill_pool, worker, engine, error) from error
        finally:
            worker.inflight -= 1
            worker.outstanding_tokens -= round_.context_tokens

    async def _decode(
        self,
        worker: PoolMember,
        round_: _Round,
        prefill: PrefillResult | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> AsyncIterator[DecodeChunk]:
        """Start the request on ``worker`` and relay its tokens as they arrive from it."""
        engine = _engine_of(self.decode_pool, worker)
        worker.inflight += 1
        worker.outstanding_tokens += round_.context_tokens
        self._decoding[round_.request_id] = Decoding(
            round_.request_id, worker, engine, round_.context_tokens,
            moved_in_at=time.monotonic() if round_.moved is not None else None,
        )
        # Without transfer parameters the worker computes the prompt itself, until its first token.
        prefilling = round_.context_tokens if kv_transfer_params is None else 0
        worker.local_prefill_tokens += prefilling
        chunks = engine.decode(
            round_.request_id,
            round_.prompt_token_ids,
            round_.sampling,
            kv_transfer_params,
            prefill.first_token_id if prefill else None,
            prefill.first_text if prefill else "",
        )
        guard, last_at = self.local_prefill_guard, None
        guard.stream_assigned(worker.name, round_.request_id, round_.sampling.max_tokens)  # from now, not its first chunk
        try:
            async for chunk in chunks:
                if prefilling:
                    worker.local_prefill_tokens -= prefilling
                    prefilling = 0
                now = time.perf_counter()
                if last_at is None:  # after the prompt or the KV pull: the worker's pace from here
                    guard.stream_started(worker.name, round_.request_id, len(chunk.token_ids), round_.sampling.max_tokens, now)
                else:
                    guard.streamed(worker.name, round_.request_id, len(chunk.token_ids), now - last_at)
                last_at = now
                yield chunk
        except (EngineLost, EngineRejected) as error:
            raise self._worker_failure(self.decode_pool, worker, engine, error) from error
        finally:
            self._decoding.pop(round_.request_id, None)
            guard.stream_ended(worker.name, round_.request_id)
            worker.inflight -= 1
            worker.outstanding_tokens -= round_.context_tokens
            worker.local_prefill_tokens -= prefilling
            await chunks.aclose()  # aborts the request in the engine unless it finished

    @staticmethod
    def _worker_failure(
        pool: WorkerPool, worker: PoolMember, engine: Any, error: EngineLost | EngineRejected
    ) -> BaseException:
        """A worker that is gone is taken out of rotation and the round retried; a request its
        engine refused is not."""
        if isinstance(error, EngineRejected):
            return RequestFailed(f"{pool.role} worker {worker.name}: {error}")
        pool.mark_failed(worker, error, engine)
        return WorkerFailed(f"{pool.role} worker {worker.name} failed ({error})", crashed=error.crashed)


def _rest_of(sampling: SamplingSpec, sent: int) -> SamplingSpec:
    """The sampling of a round that continues a request after ``sent`` tokens, which follow its
    prompt: what is left of ``max_tokens`` and ``min_tokens``, and the engines told that those
    tokens were generated, so that penalties, a grammar and a seeded generator continue as in
    one unbroken round (worker_runtime/resumed_requests.py). The stream's prompt logprobs went
    out with its first event."""
    return replace(
        sampling, max_tokens=sampling.max_tokens - sent, min_tokens=max(0, sampling.min_tokens - sent),
        prompt_logprobs=None, resumed_tokens=sent,
    )


def _engine_of(pool: WorkerPool, worker: PoolMember) -> Any:
    """What ``worker``'s requests go through; a worker whose engine was closed after it was
    chosen (removed, or replaced after a failure) fails the round, which resumes elsewhere."""
    if worker.engine is None:
        raise WorkerFailed(f"{pool.role} worker {worker.name} left rotation before the request reached it")
    return worker.engine
