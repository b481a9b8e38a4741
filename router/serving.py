"""The one serving path both front ends (gRPC and OpenAI HTTP) call.

A front end turns its wire request into a :class:`ValidatedRequest` and its credentials into a
:class:`Caller`; everything after that is shared: the caller's quota, the deployment's admission
limit (backpressure instead of an unbounded queue), the request lifecycle across the pools, and
the accounting behind ``duet status`` and the metrics. Each front end maps the exceptions below
to its own status codes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from duet.router.auth import Caller, Gatekeeper, ModelNotAllowed, QuotaExceeded, Unauthenticated
from duet.config import ImagesConfig
from duet.router.image_inputs import ImageChecker
from duet.router.lifecycle import RequestCrashesEngines, RequestFailed, RequestLifecycle, StreamEvent
from duet.router.rebalancer import Rebalancer
from duet.router.load_meter import LoadMeter
from duet.router.lora_adapters import AdapterAdmin
from duet.router.pools import NoWorkerAvailable
from duet.router.status import ClusterView
from duet.router.proto import duet_api_pb2 as pb
from duet.router.validation import InvalidRequest, ModelLimits, Tokenizer, ValidatedRequest, validate, verify_spec
from duet.worker_runtime.worker_api import SamplingSpec, ServedAdapter

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The deployment is at its admission limit (RESOURCE_EXHAUSTED / 429)."""

    retry_after_s = 1.0


class Unavailable(Exception):
    """The request could not be served: no ready worker, or every attempt failed (UNAVAILABLE / 503)."""


@dataclass
class RequestService:
    lifecycle: RequestLifecycle
    limits: ModelLimits
    tokenizer: Tokenizer
    cluster: ClusterView
    gatekeeper: Gatekeeper
    max_inflight: int
    # What the autoscaler reads: arrivals, first tokens and completions as they happen.
    load: LoadMeter = field(default_factory=LoadMeter)
    # Moves requests off an overfull decode worker while the front door serves (router.rebalance_kv_gap).
    rebalancer: Rebalancer | None = None
    # vLLM's tool-call parser class for chat requests with tool_choice "auto" (api.tool_call_parser).
    tool_parser: Any = None
    # Loads and unloads LoRA adapters for the whole deployment: the control plane itself, or
    # this front door's channel to it (router/lora_adapters.py).
    adapter_admin: AdapterAdmin | None = None
    # The model's chat template for /v1/chat/completions (model.chat_template; None: the tokenizer's).
    chat_template: str | None = None
    # Set when its model is removed from a running deployment: a request that chose this
    # service a moment before is refused rather than started on workers about to go.
    retired: bool = False
    # The config's api.images: bounds on a request's images (router/image_inputs.py).
    image_limits: ImagesConfig = field(default_factory=ImagesConfig)

    def set_adapters(self, adapters: tuple[ServedAdapter, ...]) -> None:
        """Serve exactly these LoRA adapters from now on (the control plane's list)."""
        self.limits = replace(self.limits, adapters=adapters)
        self.cluster.adapters_by_model[self.limits.name] = tuple(adapter.name for adapter in adapters)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header (or gRPC metadata) value names; raises
        Unauthenticated (counted) without a valid key."""
        try:
            return self.gatekeeper.authenticate_header(authorization)
        except Unauthenticated:
            self.cluster.reject("unauthenticated")
            raise

    def verify_sampling(self, sampling: SamplingSpec) -> None:
        """vLLM's own checks of ``sampling``, made by a worker's engine front end in this
        process (router/engine_front_end.py), all but the structured-output constraint's
        compilation (:meth:`check_constraints`); nothing where no vLLM engine serves (SIMULATED)."""
        self._engine_verify(replace(sampling, structured_kind="", structured_value=""))

    async def validate(self, request: pb.GenerateRequest) -> ValidatedRequest:
        """A gRPC ``request`` checked (router/validation.py); one with images off the event
        loop, as opening them takes a while."""
        if not request.images:
            return validate(request, self.limits, self.tokenizer, self.verify_sampling)
        check = await self.image_check()
        return await asyncio.to_thread(validate, request, self.limits, self.tokenizer, self.verify_sampling, check)

    async def image_check(self) -> ImageChecker | None:
        """Validation's check of a prompt's images, by a worker's engine front end in this
        process; None if the model takes no images (or no vLLM engine serves it).

        It takes a worker's engine, so while every worker is being replaced (a crash, an engine
        killed for memory) it waits for one as a request waits for a worker, rather than take
        the model for one without images; Unavailable (503 / UNAVAILABLE) if none comes."""
        pool = self.lifecycle.decode_pool
        engine = next((member.engine for member in pool.ready() if member.engine is not None), None)
        if engine is None:
            try:
                engine = (await pool.acquire(self.lifecycle.policy.worker_wait_s)).engine
            except NoWorkerAvailable as error:
                raise Unavailable(f"no worker can check the request's images: {error}") from None
            if engine is None:  # removed since it was picked
                raise Unavailable("no worker can check the request's images: its worker was just removed")
        prompts = getattr(engine, "image_prompts", None)  # SIMULATED engines have none
        return None if prompts is None else ImageChecker(prompts, self.image_limits)

    def _engine_verify(self, sampling: SamplingSpec) -> None:
        for member in self.lifecycle.decode_pool.members:
            verify = getattr(member.engine, "verify_sampling", None)
            if verify is not None:
                verify(sampling)
                return

    async def check_constraints(self, requests: list[ValidatedRequest]) -> None:
        """Compile each distinct structured-output constraint of ``requests`` as the engine's
        backend will, in a thread and within ``limits.structured_output_timeout_s``, so that a
        constraint that does not compile, or is slow to, is refused (InvalidRequest) before
        any worker is touched and without stalling this front door's other streams."""
        seen: set[tuple[str, str]] = set()
        for request in requests:
            key = (request.sampling.structured_kind, request.sampling.structured_value)
            if not key[0] or key in seen:
                continue
            seen.add(key)
            check = asyncio.to_thread(verify_spec, request.sampling, self._engine_verify)
            try:
                await asyncio.wait_for(check, self.limits.structured_output_timeout_s)
            except TimeoutError:
                raise InvalidRequest(
                    "sampling.structured_output",
                    f"did not compile within {self.limits.structured_output_timeout_s:g} s (api.structured_output_timeout_s)",
                ) from None

    def model_name(self, request: ValidatedRequest) -> str:
        """The model name ``request`` asked for: one of the LoRA adapters', or the model's."""
        return request.sampling.lora_name or self.limits.name

    def is_ready(self) -> bool:
        """Whether each of this model's pools has a ready worker, so a request would be served now."""
        pools = [pool for pool in (self.lifecycle.prefill_pool, self.lifecycle.decode_pool) if pool is not None]
        return all(any(m.state == "ready" for m in pool.members) for pool in pools)

    async def generate(self, request: ValidatedRequest, caller: Caller) -> AsyncIterator[StreamEvent]:
        """Serve ``request`` for ``caller``, streaming its events.

        Raises ModelNotAllowed, QuotaExceeded or Overloaded before any worker is touched, Unavailable when it
        cannot be served, RequestCrashesEngines when it must not be retried; a consumer that stops early (client gone) aborts it on the workers.
        """
        model = self.model_name(request)
        if self.retired:
            raise Unavailable(f"model {self.limits.name!r} was removed from this deployment")
        try:
            caller.check_model(model)
        except ModelNotAllowed:
            self.cluster.reject("forbidden", model)
            raise
        try:
            caller.acquire(model)
        except QuotaExceeded:
            self.cluster.reject("quota", model)
            raise
        try:
            if self.cluster.inflight >= self.max_inflight:
                self.cluster.reject("overloaded", model)
                raise Overloaded(f"{self.cluster.inflight} requests in flight (limit {self.max_inflight}); retry later")
            self.cluster.admit(model)
            handle = self.load.arrived(len(request.engine_prompt_ids))
            outcome, usage, first = "failed", None, True
            try:
                # aclosing: a consumer that stops early aborts the request on its workers now,
                # not whenever the garbage collector finalizes the generator.
                async with aclosing(self.lifecycle.run(request)) as events:
                    async for event in events:
                        if first and event.token_ids:
                            self.load.first_token(handle)
                            first = False
                        usage = event.usage or usage
                        yield event
                outcome = "served"
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            except (RequestFailed, NoWorkerAvailable) as error:
                logger.warning("request %s failed: %s", request.request_id, error)
                raise Unavailable(f"request {request.request_id} failed: {error}") from error
            except RequestCrashesEngines as error:
                logger.error("request %s failed, not retried: %s", request.request_id, error)
                raise
            finally:
                self.cluster.finish(outcome, usage, model)
                self.load.left(handle, usage if outcome == "served" else None)
        finally:
            caller.release(model)

    async def generate_sequences(
        self, requests: list[ValidatedRequest], caller: Caller
    ) -> AsyncIterator[tuple[int, StreamEvent]]:
        """Serve several requests at once (a batch of prompts, each with its ``n`` sequences:
        :func:`sequences`), streaming ``(index, event)`` as each sequence produces them.

        Each sequence is a request of its own to admission and quotas: the whole call is refused
        up front when they cannot all be admitted, and a failure of one fails the call (the
        others are aborted on their workers), as one request would."""
        if len(requests) == 1:
            async with aclosing(self.generate(requests[0], caller)) as events:
                async for event in events:
                    yield 0, event
            return
        self._check_room(len(requests), caller, self.model_name(requests[0]))
        queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()
        # A prompt's sequences share its token list (:func:`sequences`): the first is prefilled
        # alone, and the others start once its first token is out, when the prompt's KV blocks
        # are in the prefill worker's prefix cache (prefix affinity sends them there), so the
        # prompt is computed once (but for its last, partial block) rather than n times.
        leaders: dict[int, int] = {}
        for index, request in enumerate(requests):
            leaders.setdefault(id(request.prompt_token_ids), index)
        prompt_done = {key: asyncio.Event() for key in leaders}

        async def run(index: int, request: ValidatedRequest) -> None:
            done = prompt_done[id(request.prompt_token_ids)]
            try:
                if leaders[id(request.prompt_token_ids)] != index:
                    await done.wait()
                async with aclosing(self.generate(request, caller)) as events:
                    async for event in events:
                        done.set()
                        queue.put_nowait((index, event))
                queue.put_nowait((index, None))
            except Exception as error:
                queue.put_nowait((index, error))
            finally:
                done.set()

        tasks = [asyncio.create_task(run(index, request)) for index, request in enumerate(requests)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _check_room(self, count: int, caller: Caller, model: str) -> None:
        """Refuse ``count`` requests together (for ``model``) unless the caller's quota and the admission limit
        hold them all (so none starts only to be failed by the next's refusal)."""
        try:
            caller.check_room(model, count)
        except QuotaExceeded:
            self.cluster.reject("quota", model)
            raise
        if self.cluster.inflight + count > self.max_inflight:
            self.cluster.reject("overloaded", model)
            raise Overloaded(
                f"{self.cluster.inflight} requests in flight and this call asks for {count} "
                f"(limit {self.max_inflight}); retry later"
            )


def sequences(request: ValidatedRequest) -> list[ValidatedRequest]:
    """A request's ``n`` sequences, each a request of its own: sequence ``i`` samples with
    ``seed + i``, as vLLM's parallel sampling does (router/validation.py gave every sampled
    request a seed), so each is reproducible and continues exactly after a move."""
    if request.n == 1:
        return [request]
    return [
        replace(
            request,
            request_id=f"{request.request_id}-{index}",
            n=1,
            sampling=_with_seed(request.sampling, index),
        )
        for index in range(request.n)
    ]


def _with_seed(sampling: SamplingSpec, index: int) -> SamplingSpec:
    return sampling if sampling.seed is None else replace(sampling, seed=(sampling.seed + index) % 2**64)
