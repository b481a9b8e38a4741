"""duet's OpenAI-compatible HTTP front end (aiohttp), beside the gRPC one on the same service.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent
events, or whole), ``GET /v1/models`` (the model and its LoRA adapters), vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (admin calls), and ``GET /health``
(200 while every pool has a ready worker, else 503; no key needed, for load balancers and
probes). Errors use OpenAI's JSON shape,
``{"error": {"message", "type", "param", "code"}}``: 400 naming the field, 404 (vLLM's) for an
unknown model, 401 without a valid key, 403 for an admin call without an admin key,
413 for an oversized body, 429 with ``Retry-After`` over a quota or the admission limit, 503 when
the request cannot be served, 500 with ``x-should-retry: false`` for a request that crashed the
engines that held it (router/lifecycle.py). A client that disconnects cancels its request, which aborts it on
the workers and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from duet.router.auth import Caller, ModelNotAllowed, QuotaExceeded, Unauthenticated
from duet.router.lifecycle import RequestCrashesEngines, StreamEvent
from duet.router.lora_adapters import AdapterAdmin, AdapterError
from duet.router.openai_protocol import (
    ChatCompletionRequest,
    openai_name,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    chat_to_validated,
    completion_to_validated,
    detokenize,
    parse,
    read_chat_images,
    tokenize,
)
from duet.router.served_models import ServedModels
from duet.router.serving import Overloaded, RequestService, Unavailable, sequences
from duet.router.openai_replies import Reply, Sequence
from duet.router.tool_calls import ToolCalling
from duet.router.validation import InvalidRequest, UnknownModel, ValidatedRequest
from duet.worker_runtime.worker_api import BATCH_PRIORITY

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after_s = retry_after_s
        # OpenAI's SDKs read ``x-should-retry`` before their own rule (retry 408, 409, 429, 5xx).
        self.should_retry = should_retry

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.should_retry is not None:
            headers["x-should-retry"] = str(self.should_retry).lower()
        return web.json_response(self.body(), status=self.status, headers=headers)


def _api_error(error: Exception) -> ApiError:
    """The HTTP answer for an exception from parsing, authentication or serving."""
    if isinstance(error, UnknownModel):  # as vLLM's server answers it
        message = f"The model `{error.model}` does not exist. Valid aliases: {error.base}."
        return ApiError(404, message, "NotFoundError", param="model", code=404)
    if isinstance(error, InvalidRequest):
        return ApiError(400, str(error), "invalid_request_error", param=error.field)
    if isinstance(error, Unauthenticated):
        return ApiError(401, str(error), "authentication_error", code="invalid_api_key")
    if isinstance(error, ModelNotAllowed):
        return ApiError(403, str(error), "permission_error", param="model")
    if isinstance(error, QuotaExceeded):
        return ApiError(429, str(error), "rate_limit_error", code="rate_limit_exceeded", retry_after_s=error.retry_after_s)
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), "rate_limit_error", code="overloaded", retry_after_s=error.retry_after_s)
    if isinstance(error, Unavailable):
        return ApiError(503, str(error), "service_unavailable_error")
    if isinstance(error, RequestCrashesEngines):  # OpenAI's SDKs retry a 500 unless told not to
        return ApiError(500, str(error), "internal_error", code="request_crashes_engines", should_retry=False)
    logger.exception("internal error", exc_info=error)
    return ApiError(500, f"internal error: {error}", "internal_error")


class OpenAIFrontEnd:
    def __init__(self, served: ServedModels | RequestService, max_body_bytes: int) -> None:
        # More routes on the same server (the Files and Batch APIs: batch/http_api.py).
        self.more_routes: list[Callable[[web.Application], None]] = []
        self.served = served if isinstance(served, ServedModels) else ServedModels([served])
        # What every model shares (keys, admission, accounting, readiness, adapter admin) is
        # reached through the default model's service; the rest through the requested model's.
        self.service = self.served.default
        self.max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_errors_as_json])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        from duet.router.anthropic_api import AnthropicMessages  # built on this module
        from duet.router.responses_api import Responses

        AnthropicMessages(self).add_routes(app)
        Responses(self).add_routes(app)
        for add_routes in self.more_routes:
            add_routes(app)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a prompt's or chat's token ids, as the engines would get them."""
        self.service.authenticate(request.headers.get("Authorization"))
        parsed = parse(TokenizeRequest, await _json_body(request, self.max_body_bytes))
        service = self.served.for_model(parsed.model)
        limits, tokenizer = service.limits, service.tokenizer
        tokens = tokenize(parsed, limits, tokenizer, service.chat_template)  # type: ignore[arg-type]
        strings = tokenizer.convert_ids_to_tokens(tokens) if parsed.return_token_strs else None  # type: ignore[attr-defined]
        return web.json_response(
            {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens, "token_strs": strings}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        self.service.authenticate(request.headers.get("Authorization"))
        parsed = parse(DetokenizeRequest, await _json_body(request, self.max_body_bytes))
        service = self.served.for_model(parsed.model)
        return web.json_response({"prompt": detokenize(parsed, service.limits, service.tokenizer)})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/load_lora_adapter``: serve an adapter from every front door (an admin
        call: with API keys, admin keys only)."""
        parsed = parse(LoadLoraAdapterRequest, await self._admin_body(request))
        return await self._adapter_change(self._adapter_admin().load_adapter(parsed.lora_name, parsed.lora_path, parsed.base_model_name))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/unload_lora_adapter``: stop serving an adapter (an admin call)."""
        parsed = parse(UnloadLoraAdapterRequest, await self._admin_body(request))
        return await self._adapter_change(self._adapter_admin().unload_adapter(parsed.lora_name))

    async def _admin_body(self, request: web.Request) -> object:
        caller = self.service.authenticate(request.headers.get("Authorization"))
        if self.service.gatekeeper.enabled and not caller.admin:
            raise ApiError(403, f"API key {caller.name!r} is not an admin key", "permission_error")
        return await _json_body(request, self.max_body_bytes)

    def _adapter_admin(self) -> AdapterAdmin:
        assert self.service.adapter_admin is not None, "every front door is given the deployment's adapter admin"
        return self.service.adapter_admin

    @staticmethod
    async def _adapter_change(change: Awaitable[str]) -> web.Response:
        try:
            return web.Response(text=await change)
        except AdapterError as error:  # vLLM's statuses and error types for these endpoints
            if error.kind == "unavailable":
                raise ApiError(503, str(error), "service_unavailable_error") from None
            status, kind = (404, "NotFoundError") if error.kind == "not_found" else (400, "InvalidUserInput")
            raise ApiError(status, str(error), kind, code=status) from None

    async def health(self, request: web.Request) -> web.Response:
        if self.served.is_ready():
            return web.Response(status=200)
        raise ApiError(503, "no ready worker in every pool", "service_unavailable_error")

    async def models(self, request: web.Request) -> web.Response:
        caller = self.service.authenticate(request.headers.get("Authorization"))
        served = []
        for limits in (service.limits for service in self.served.services):
            base = {
                "id": limits.name, "object": "model", "created": 0, "owned_by": "duet",
                "root": limits.name, "parent": None, "max_model_len": limits.max_model_len,
            }
            # As vLLM lists its LoRA modules: the adapter's directory as root, the base as parent.
            adapters = [
                {**base, "id": adapter.name, "root": adapter.path, "parent": limits.name} for adapter in limits.adapters
            ]
            served += [model for model in (base, *adapters) if caller.may_use(model["id"])]  # a key sees what it may use
        return web.json_response({"object": "list", "data": served})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    @staticmethod
    def _tools(body: Any, parsed: ChatCompletionRequest, service: RequestService) -> ToolCalling | None:
        """The request's tools, read by vLLM's protocol and parsers (None without any)."""
        if not parsed.tools and parsed.tool_choice in (None, "none"):
            return None
        return ToolCalling(body, service.tokenizer, service.tool_parser)

    async def _serve(self, http: web.Request, chat: bool) -> web.StreamResponse:
        caller = self.service.authenticate(http.headers.get("Authorization"))
        request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await _json_body(http, self.max_body_bytes)
        except InvalidRequest:
            self.service.cluster.reject("invalid")
            raise
        return await self.answer(http, body, chat, caller, request_id)

    async def answer(
        self, http: web.Request, body: object, chat: bool, caller: Caller, request_id: str,
        whole_as: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        stream_as: Callable[[AsyncIterator[str]], AsyncIterator[str]] | None = None,
    ) -> web.StreamResponse:
        """Serve a completions (or, ``chat``, chat completions) request ``body``. Another API
        built on this one (router/anthropic_api.py) reshapes the whole answer (``whole_as``) or
        the stream's lines (``stream_as``)."""
        prepared = await self.prepare(body, chat, request_id)
        if prepared.parsed.stream:
            # aclosing: however the handler ends (a write to a closed connection, too), the
            # request is aborted on its workers at once.
            async with aclosing(prepared.service.generate_sequences(prepared.requests, caller)) as events:
                stream_options = prepared.parsed.stream_options
                include_usage = stream_options is not None and stream_options.include_usage
                return await _stream(http, prepared.reply, events, include_usage, stream_as)
        whole = await self.whole(prepared, caller)
        return web.json_response(whole_as(whole) if whole_as is not None else whole)

    async def prepare(self, body: object, chat: bool, request_id: str) -> "PreparedRequest":
        """Validate a completions (``chat``: chat completions) request ``body`` into the
        requests the engines will run; raises InvalidRequest (naming the OpenAI field) or
        UnknownModel, counted as refused, before any worker is touched. A request with images
        may wait for a ready worker to check them (Unavailable if none comes)."""
        try:
            service = self.served.for_model(body.get("model") if isinstance(body, dict) else None)
            limits, tokenizer, verify = service.limits, service.tokenizer, service.verify_sampling
            if chat:
                parsed: Any = parse(ChatCompletionRequest, body)
                request_id = parsed.request_id or request_id
                tools = self._tools(body, parsed, service)
                images = await read_chat_images(parsed.messages, service.image_check, service.image_limits)
                validated = partial(chat_to_validated, parsed, limits, tokenizer, request_id, service.chat_template, verify, tools, images)
                # Opening images takes a while: off the event loop.
                prompts = [await asyncio.to_thread(validated) if images is not None else validated()]
                top_logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
            else:
                parsed = parse(CompletionRequest, body)
                request_id = parsed.request_id or request_id
                prompts = completion_to_validated(parsed, limits, tokenizer, request_id, verify)
                top_logprobs, tools = parsed.logprobs, None
            await service.check_constraints(prompts)
        except UnknownModel:
            self.service.cluster.reject("invalid")
            raise
        except InvalidRequest as error:
            self.service.cluster.reject("invalid")
            raise InvalidRequest(openai_name(error.field), error.problem) from None
        reply = Reply(
            chat, parsed.model or limits.name, prompts, prompts[0].n, parsed.return_token_ids, tokenizer,
            echo=not chat and parsed.echo, echo_only=not chat and parsed.echo and parsed.max_tokens == 0,
            top_logprobs=top_logprobs, tools=tools if chat and tools is not None and tools.active else None,
        )
        return PreparedRequest(service, parsed, prompts, reply)

    @staticmethod
    async def whole(
        prepared: "PreparedRequest", caller: Caller, on_first_token: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Serve ``prepared`` for ``caller`` and answer it whole (not streamed);
        ``on_first_token`` is called when its first token is out (its prompt is prefilled)."""
        requests = prepared.requests
        collected: dict[int, Sequence] = {index: Sequence() for index in range(len(requests))}
        async with aclosing(prepared.service.generate_sequences(requests, caller)) as events:
            async for index, event in events:
                if on_first_token is not None and event.token_ids:
                    on_first_token()
                    on_first_token = None
                _accumulate(collected[index], event)
        return prepared.reply.whole(collected)


@dataclass
class PreparedRequest:
    """A validated completions or chat request: its model's service, the parsed body, its
    prompts, and the reply that will be built from their tokens."""

    service: RequestService
    parsed: Any
    prompts: list[ValidatedRequest]
    reply: Reply

    @property
    def requests(self) -> list[ValidatedRequest]:
        """Each prompt's sequences, each a request of its own to the engines."""
        return [sequence for prompt in self.prompts for sequence in sequences(prompt)]

    def in_background(self) -> None:
        """Make it a batch job's request (:attr:`ValidatedRequest.background`), which every
        engine serves after online ones (:data:`BATCH_PRIORITY`)."""
        self.prompts = [
            replace(prompt, background=True, sampling=replace(prompt.sampling, priority=BATCH_PRIORITY)) for prompt in self.prompts
        ]


def _accumulate(sequence: Sequence, event: StreamEvent) -> None:
    sequence.token_ids += event.token_ids
    sequence.text += event.text
    if event.logprobs is not None:
        sequence.logprobs += event.logprobs
    if event.prompt_logprobs is not None:
        sequence.prompt_logprobs = event.prompt_logprobs
    sequence.finish = event.finish_reason or sequence.finish
    sequence.stop_reason = event.stop_reason if event.finish_reason is not None else sequence.stop_reason
    sequence.usage = event.usage or sequence.usage


async def _stream(
    http: web.Request, reply: Reply, events: AsyncIterator[tuple[int, StreamEvent]], include_usage: bool,
    stream_as: Callable[[AsyncIterator[str]], AsyncIterator[str]] | None = None,
) -> web.StreamResponse:
    """Server-sent events: one chunk per event, the usage chunk if asked for, then ``[DONE]``
    (or what ``stream_as`` makes of those lines).

    Quota and admission errors surface before the first event, so they still get their status
    code; an error after the stream has started is sent as an ``error`` event.
    """
    iterator = events.__aiter__()
    try:
        first_event: tuple[int, StreamEvent] | None = await iterator.__anext__()
    except StopAsyncIteration:
        first_event = None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    lines = _event_lines(reply, first_event, iterator, include_usage)
    async with aclosing(stream_as(lines) if stream_as is not None else lines) as written:
        async for line in written:
            await response.write(line.encode())
    await response.write_eof()
    return response


async def _event_lines(
    reply: Reply, item: tuple[int, StreamEvent] | None, iterator: AsyncIterator[tuple[int, StreamEvent]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The stream's ``data:`` lines: a chat choice opens with its role alone (as vLLM's and
    OpenAI's servers do), then one chunk per event, the usage chunk, ``[DONE]``."""
    sent: dict[int, Sequence] = {}
    try:
        while item is not None:
            index, event = item
            if index not in sent and reply.chat:
                yield _line(reply.role_chunk(index, include_usage))
            sequence = sent.setdefault(index, Sequence())
            counted = Sequence(token_ids=list(event.token_ids), usage=event.usage)
            yield _line(reply.chunk(index, event, sequence, include_usage))
            sequence.token_ids += counted.token_ids
            sequence.usage = counted.usage or sequence.usage
            try:
                item = await iterator.__anext__()
            except StopAsyncIteration:
                item = None
        if include_usage:
            yield _line(reply.usage_chunk(sent))
    except Exception as error:  # the status line is gone: report it in the stream
        yield _line(_api_error(error).body())
    yield "data: [DONE]\n\n"


def _line(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


async def _json_body(http: web.Request, max_bytes: int) -> object:
    try:
        raw = await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body exceeds {max_bytes} bytes", "invalid_request_error", code="request_too_large") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest("body", f"is not valid UTF-8 (byte {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequest("body", f"is not valid JSON: {error}") from None


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes an OpenAI-shaped error, including aiohttp's own 404 and 405."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return ApiError(error.status, error.reason, "invalid_request_error" if error.status < 500 else "internal_error").response()
    except Exception as error:
        return _api_error(error).response()


async def start_http_server(
    front_end: OpenAIFrontEnd, host: str, port: int, ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False
) -> tuple[web.AppRunner, int]:
    """Serve the API on ``host:port`` (0 picks a free port); returns the runner and the port.
    ``reuse_port`` shares the port with the deployment's other front doors (SO_REUSEPORT)."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on the workers instead of generating tokens nobody will read.
    runner = web.AppRunner(front_end.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
