"""OpenAI's Responses API (``POST /v1/responses``), stateless, over duet's chat endpoint.

Agent SDKs now default to the Responses API. duet serves it the way vLLM's server serves it
for a chat model: the request (validated by vLLM's ``ResponsesRequest``) becomes chat messages
(vLLM's ``construct_input_messages``: ``instructions`` as the system message, then ``input``,
a string or a list of messages and function-call items), its function tools become chat tools,
``text.format`` a ``response_format``; the chat completion becomes a response: a ``message``
item with its ``output_text`` and one ``function_call`` item per tool call; streamed, the events
OpenAI's SDK reads (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). So a Responses request is validated, admitted, routed and
disaggregated like any chat request.

Stateless: nothing is stored, so ``previous_response_id`` and ``background`` are refused (400),
and the retrieval endpoints are not served; a client sends the whole conversation as ``input``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from duet.router.http_server import OpenAIFrontEnd, _json_body
from duet.router.validation import InvalidRequest

# Responses fields that map onto chat fields of the same meaning.
_SAME = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
         "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
         "parallel_tool_calls", "user", "structured_outputs")


class Responses:
    """``POST /v1/responses`` over an :class:`OpenAIFrontEnd`'s chat endpoint."""

    def __init__(self, front_end: OpenAIFrontEnd) -> None:
        self.front_end = front_end

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.responses)

    async def responses(self, http: web.Request) -> web.StreamResponse:
        service = self.front_end.service
        caller = service.authenticate(http.headers.get("Authorization"))
        body = await _json_body(http, self.front_end.max_body_bytes)
        try:
            chat, request = _chat_request(body)
        except InvalidRequest:
            service.cluster.reject("invalid")
            raise
        response_id = "resp_" + (http.headers.get("X-Request-Id") or uuid.uuid4().hex)
        shell = _Shell(response_id, request)
        return await self.front_end.answer(
            http, chat, True, caller, response_id, whole_as=shell.whole, stream_as=shell.events,
        )


def _chat_request(body: object) -> tuple[dict[str, Any], Any]:
    """The chat body for a Responses request, and the request as vLLM's model parsed it."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    if not isinstance(body, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
    for stateful in ("previous_response_id", "background", "conversation"):
        if body.get(stateful):
            raise InvalidRequest(stateful, "is not supported: duet's Responses API keeps no state; send the conversation as input")
    try:
        request = ResponsesRequest.model_validate(body)
    except Exception as error:  # pydantic's ValidationError, vLLM's own checks
        errors = error.errors() if hasattr(error, "errors") else []
        field = ".".join(str(part) for part in errors[0]["loc"]) if errors else "body"
        raise InvalidRequest(field or "body", errors[0]["msg"] if errors else str(error)) from None
    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    chat: dict[str, Any] = {key: body[key] for key in _SAME if key in body}
    chat["messages"] = [_plain(message) for message in messages]
    if request.max_output_tokens is not None:
        chat["max_completion_tokens"] = request.max_output_tokens
    if body.get("stream"):
        chat.update(stream=True, stream_options={"include_usage": True})
    tools = construct_tool_dicts(request.tools, request.tool_choice) if request.tools else None
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
    format_ = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(format_, dict) and format_.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": format_.get("name", "schema"),
                                                                           "schema": format_.get("schema", {})}}
    elif isinstance(format_, dict) and format_.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.get("top_logprobs"):
        chat.update(logprobs=True, top_logprobs=body["top_logprobs"])
    return chat, request


def _plain(message: Any) -> dict[str, Any]:
    """A chat message as plain JSON (vLLM's helpers may return typed parts)."""
    return json.loads(json.dumps(message, default=lambda value: value.model_dump() if hasattr(value, "model_dump") else str(value)))


class _Shell:
    """A response's envelope and its items, from a chat completion or its chunks."""

    def __init__(self, response_id: str, request: Any) -> None:
        self.id = response_id
        self.request = request
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, model: str) -> dict[str, Any]:
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": model,
            "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "parallel_tool_calls": request.parallel_tool_calls, "temperature": request.temperature,
            "top_p": request.top_p, "tool_choice": request.tool_choice if isinstance(request.tool_choice, str) else "auto",
            "tools": [tool.model_dump() if hasattr(tool, "model_dump") else tool for tool in request.tools or []],
            "metadata": request.metadata, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        }

    def _message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        message = chat["choices"][0]["message"]
        output: list[dict[str, Any]] = []
        if message.get("content"):
            output.append(self._message(message["content"]))
        for call in message.get("tool_calls") or []:
            output.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"})
        if not output:
            output.append(self._message(""))
        status = "incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed"
        response = self._response(status, output, _usage(chat.get("usage")), chat["model"])
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        return response

    async def events(self, chat_lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """The streamed response's events, from the chat stream's lines (text output)."""
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            sequence += 1
            return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": sequence - 1, **fields}) + "\n\n"

        model, text, finish, usage = self.request.model or "", "", None, None
        yield event("response.created", response=self._response("in_progress", [], None, model))
        yield event("response.in_progress", response=self._response("in_progress", [], None, model))
        yield event("response.output_item.added", output_index=0, item=self._message("", "in_progress"))
        yield event("response.content_part.added", output_index=0, content_index=0, item_id=self.message_id,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        async for line in chat_lines:
            data = line[len("data: "):].strip() if line.startswith("data: ") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                yield event("error", code=chunk["error"].get("code"), message=chunk["error"]["message"], param=chunk["error"].get("param"))
                return
            model, usage = chunk.get("model", model), chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
                if delta:
                    text += delta
                    yield event("response.output_text.delta", output_index=0, content_index=0, item_id=self.message_id,
                                delta=delta, logprobs=[])
        yield event("response.output_text.done", output_index=0, content_index=0, item_id=self.message_id, text=text, logprobs=[])
        yield event("response.content_part.done", output_index=0, content_index=0, item_id=self.message_id,
                    part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        yield event("response.output_item.done", output_index=0, item=self._message(text))
        status = "incomplete" if finish == "length" else "completed"
        final = self._response(status, [self._message(text)], _usage(usage), model)
        if status == "incomplete":
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }
