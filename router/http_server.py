"""duet's OpenAI-compatible HTTP front end (aiohttp), beside the gRPC one on the same service.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent
events, or whole), ``GET /v1/models``, and ``GET /health`` (200 while every pool has a ready
worker, else 503; no key needed, for load balancers and probes). Errors use OpenAI's JSON shape,
``{"error": {"message", "type", "param", "code"}}``: 400 naming the field, 401 without a valid key,
413 for an oversized body, 429 with ``Retry-After`` over a quota or the admission limit, 503 when
the request cannot be served, 500 with ``x-should-retry: false`` for a request that crashed the
engines that held it (router/lifecycle.py). A client that disconnects cancels its request, which aborts it on
the workers and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
import math
import ssl
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from duet.router.auth import QuotaExceeded, Unauthenticated
from duet.router.lifecycle import RequestCrashesEngines, StreamEvent, Usage
from duet.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_to_validated,
    completion_to_validated,
    parse,
)
from duet.router.serving import Overloaded, RequestService, Unavailable
from duet.router.validation import InvalidRequest, ValidatedRequest

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
    if isinstance(error, InvalidRequest):
        return ApiError(400, str(error), "invalid_request_error", param=error.field)
    if isinstance(error, Unauthenticated):
        return ApiError(401, str(error), "authentication_error", code="invalid_api_key")
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


@dataclass
class _Reply:
    """Renders one request's events as an OpenAI completion or chat completion."""

    chat: bool
    model: str
    request: ValidatedRequest
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request.request_id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _token_ids(self, choice: dict[str, Any], token_ids: list[int], first: bool) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            if first:
                choice["prompt_token_ids"] = self.request.prompt_token_ids
        return choice

    def whole(self, token_ids: list[int], text: str, finish: str | None, usage: Usage | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = self._envelope(self.object, [self._token_ids(choice, token_ids, first=True)])
        body["usage"] = _usage(usage, len(self.request.prompt_token_ids), len(token_ids))
        return body

    def chunk(self, event: StreamEvent, first: bool, with_usage_field: bool) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": event.text}
            if first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason}
        body = self._envelope(self.object + (".chunk" if self.chat else ""), [self._token_ids(choice, event.token_ids, first)])
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage | None, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self.object + (".chunk" if self.chat else ""), [])
        body["usage"] = _usage(usage, len(self.request.prompt_token_ids), completion_tokens)
        return body


def _usage(usage: Usage | None, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    if usage is not None:
        prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class OpenAIFrontEnd:
    def __init__(self, service: RequestService, max_body_bytes: int, chat_template: str | None = None) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.chat_template = chat_template

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[_errors_as_json])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.service.is_ready():
            return web.Response(status=200)
        raise ApiError(503, "no ready worker in every pool", "service_unavailable_error")

    async def models(self, request: web.Request) -> web.Response:
        self.service.authenticate(request.headers.get("Authorization"))
        limits = self.service.limits
        model = {
            "id": limits.name, "object": "model", "created": 0, "owned_by": "duet",
            "root": limits.name, "parent": None, "max_model_len": limits.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, http: web.Request, chat: bool) -> web.StreamResponse:
        caller = self.service.authenticate(http.headers.get("Authorization"))
        request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        limits, tokenizer = self.service.limits, self.service.tokenizer
        try:
            body = await _json_body(http, self.max_body_bytes)
            if chat:
                parsed: Any = parse(ChatCompletionRequest, body)
                request_id = parsed.request_id or request_id
                validated = chat_to_validated(parsed, limits, tokenizer, request_id, self.chat_template)  # type: ignore[arg-type]
            else:
                parsed = parse(CompletionRequest, body)
                request_id = parsed.request_id or request_id
                validated = completion_to_validated(parsed, limits, tokenizer, request_id)
        except InvalidRequest:
            self.service.cluster.reject("invalid")
            raise
        reply = _Reply(chat, limits.name, validated, parsed.return_token_ids)
        # aclosing: however the handler ends (a write to a closed connection, too), the request
        # is aborted on its workers at once.
        async with aclosing(self.service.generate(validated, caller)) as events:
            if parsed.stream:
                include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
                return await _stream(http, reply, events, include_usage)
            token_ids: list[int] = []
            text, finish, usage = "", None, None
            async for event in events:
                token_ids += event.token_ids
                text += event.text
                finish, usage = event.finish_reason or finish, event.usage or usage
            return web.json_response(reply.whole(token_ids, text, finish, usage))


async def _stream(
    http: web.Request, reply: _Reply, events: AsyncIterator[StreamEvent], include_usage: bool
) -> web.StreamResponse:
    """Server-sent events: one chunk per event, the usage chunk if asked for, then ``[DONE]``.

    Quota and admission errors surface before the first event, so they still get their status
    code; an error after the stream has started is sent as an ``error`` event.
    """
    iterator = events.__aiter__()
    try:
        first_event: StreamEvent | None = await iterator.__anext__()
    except StopAsyncIteration:
        first_event = None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    completion_tokens, usage = 0, None
    try:
        event, first = first_event, True
        while event is not None:
            completion_tokens += len(event.token_ids)
            usage = event.usage or usage
            await _send(response, reply.chunk(event, first, include_usage))
            first = False
            try:
                event = await iterator.__anext__()
            except StopAsyncIteration:
                event = None
        if include_usage:
            await _send(response, reply.usage_chunk(usage, completion_tokens))
    except Exception as error:  # the status line is gone: report it in the stream
        await _send(response, _api_error(error).body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


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
