"""Anthropic's Messages API (``POST /v1/messages``), as vLLM's server answers it.

vLLM serves it by converting: an Anthropic request becomes a chat completion request, and the
chat completion (whole, or its stream of chunks) becomes an Anthropic message (or its stream of
``message_start``, ``content_block_*``, ``message_delta`` and ``message_stop`` events). duet
reuses exactly those conversions, vLLM's own (``AnthropicServingMessages``), around its own
chat endpoint, so a Messages request is validated, admitted, routed, disaggregated and resumed
like any chat request, and answers what vLLM's server answers. Errors take Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``); the key may come as ``x-api-key``, as
Anthropic's SDKs send it, or as a bearer token.
"""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from duet.router.http_server import ApiError, OpenAIFrontEnd, _api_error, _json_body
from duet.router.validation import InvalidRequest


class AnthropicMessages:
    """``POST /v1/messages`` over an :class:`OpenAIFrontEnd`'s chat endpoint."""

    def __init__(self, front_end: OpenAIFrontEnd) -> None:
        self.front_end = front_end

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)

    async def messages(self, http: web.Request) -> web.StreamResponse:
        try:
            return await self._messages(http)
        except Exception as error:
            return _anthropic_error(error if isinstance(error, ApiError) else _api_error(error))

    async def _messages(self, http: web.Request) -> web.StreamResponse:
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        service = self.front_end.service
        key = http.headers.get("x-api-key")
        caller = service.authenticate(f"Bearer {key}" if key else http.headers.get("Authorization"))
        body = await _json_body(http, self.front_end.max_body_bytes)
        try:
            request = AnthropicMessagesRequest.model_validate(body)
        except Exception as error:  # pydantic's ValidationError: the first problem, naming its field
            service.cluster.reject("invalid")
            raise InvalidRequest(*_first_problem(error)) from None
        chat = AnthropicServingMessages.to_chat_completion_request(request).model_dump(
            mode="json", exclude_unset=True, exclude_none=True
        )
        chat.pop("max_tokens", None)  # vLLM sets both; max_completion_tokens is the one it uses
        for unsupported in ("watermarking", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
                            "chat_template_kwargs"):
            chat.pop(unsupported, None)
        request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        return await self.front_end.answer(
            http, chat, True, caller, request_id, whole_as=_whole_message, stream_as=_message_events,
        )


def _whole_message(chat_completion: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    response = ChatCompletionResponse.model_validate(chat_completion)
    return AnthropicServingMessages.messages_full_converter(None, response).model_dump(exclude_none=True)  # type: ignore[arg-type]


def _message_events(chat_lines: AsyncIterator[str]) -> AsyncIterator[str]:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return AnthropicServingMessages.message_stream_converter(None, chat_lines)  # type: ignore[arg-type]


def _first_problem(error: Exception) -> tuple[str, str]:
    errors = getattr(error, "errors", None)
    if not callable(errors) or not errors():
        return "body", str(error)
    first = errors()[0]
    return ".".join(str(part) for part in first["loc"]) or "body", first["msg"]


def _anthropic_error(error: ApiError) -> web.Response:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}
    response = error.response()
    body = {"type": "error", "error": {"type": kinds.get(error.status, "api_error"), "message": error.message}}
    return web.json_response(body, status=error.status, headers={k: v for k, v in response.headers.items() if k in ("Retry-After", "x-should-retry")})
