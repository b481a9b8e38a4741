"""Tool calls on the chat endpoint, as vLLM's OpenAI server makes them.

A chat request's ``tools`` and ``tool_choice`` do two things, and vLLM's own code does both:

- **before generation**, a named tool choice or ``"required"`` constrains the output to the
  tools' JSON schema (vLLM's ``get_json_schema_from_tools``: the named function's parameters,
  or an array of ``{name, parameters}``), which becomes the request's structured-output
  constraint, compiled and enforced by the engines like any other (prefill samples the first
  token under it, decode continues it);
- **after**, the output is read back as tool calls: a named choice's output is that function's
  arguments, a required choice's is parsed as the array, and ``"auto"`` hands the text to the
  tool-call parser named in the config (``api.tool_call_parser``, one of vLLM's, as its
  ``--tool-call-parser``). Streamed, each delta goes through vLLM's streaming helpers or the
  parser's ``extract_tool_calls_streaming``.

The tools are validated by vLLM's ``ChatCompletionRequest``, which the parsers also read.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from duet.router.validation import InvalidRequest

# OpenAI's finish reason when the model called a tool ("auto" or "required"); a named choice
# ends with "stop", as in OpenAI's API and vLLM's.
TOOL_CALLS_FINISH = "tool_calls"


def tool_parser_class(name: str | None) -> Any:
    """vLLM's tool-call parser class registered as ``name`` (None: none configured); raises
    ValueError naming the known ones."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(ToolParserManager.list_registered())
        raise ValueError(f"api.tool_call_parser: unknown parser {name!r}; vLLM has {known}") from None


class ToolCalling:
    """The tools of one chat request: their constraint, and the output read back as calls."""

    def __init__(self, body: dict[str, Any], tokenizer: Any, parser_class: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = {key: body[key] for key in ("messages", "tools", "tool_choice", "parallel_tool_calls") if key in body}
        try:
            self.request = ChatCompletionRequest.model_validate({**fields, "model": body.get("model") or ""})
        except Exception as error:  # pydantic's ValidationError, vLLM's own checks
            raise InvalidRequest("tools", _first_line(error)) from None
        choice = self.request.tool_choice
        if choice is None:  # OpenAI's default: "auto" when tools are given
            choice = "auto" if self.request.tools else "none"
        self.mode = choice if isinstance(choice, str) else "named"
        if self.mode == "auto" and parser_class is None:
            raise InvalidRequest(
                "tool_choice", '"auto" needs a tool-call parser: set api.tool_call_parser in the config (vLLM: --tool-call-parser)'
            )
        self.function_name = choice.function.name if self.mode == "named" else None
        self.tokenizer, self.parser_class = tokenizer, parser_class
        self.parser = parser_class(tokenizer) if self.mode == "auto" else None
        if self.parser is not None:
            self.request = self.parser.adjust_request(self.request)
        self._name_sent = False
        self.called = False  # a streamed call was announced
        self._previous_ids: list[int] = []

    def for_sequence(self) -> "ToolCalling":
        """The same tools with streaming state of its own (one per choice: parsers keep state)."""
        sequence = copy.copy(self)
        sequence.parser = self.parser_class(self.tokenizer) if self.mode == "auto" else None
        sequence._name_sent, sequence.called, sequence._previous_ids = False, False, []
        return sequence

    @property
    def active(self) -> bool:
        return self.mode in ("named", "required", "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (vLLM passes each tool's dump)."""
        return [tool.model_dump() for tool in self.request.tools] if self.request.tools else None

    def json_schema(self) -> str | None:
        """The constraint a named or required choice puts on the output (None: none)."""
        if self.mode not in ("named", "required"):
            return None
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        try:
            schema = get_json_schema_from_tools(self.request.tool_choice, self.request.tools, self.request.parallel_tool_calls)
        except ValueError as error:
            raise InvalidRequest("tool_choice", str(error)) from None
        return schema if isinstance(schema, str) else json.dumps(schema)

    @property
    def skip_special_tokens(self) -> bool:
        """Some parsers need the special tokens that delimit a call (vLLM's adjust_request)."""
        return self.request.skip_special_tokens

    def whole(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a whole ``text``, and the finish reason to report."""
        from vllm.renderers.chat_utils import make_tool_call_id

        if self.mode == "named":
            calls = [_call(make_tool_call_id(), self.function_name or "", text)] if text.strip() else []
            return {"role": "assistant", "content": "", "tool_calls": calls}, finish
        if self.mode == "required":
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = []
            calls = [
                _call(make_tool_call_id(), item.get("name", ""), json.dumps(item.get("parameters", {}), ensure_ascii=False))
                for item in parsed if isinstance(item, dict)
            ] if isinstance(parsed, list) else []
            return {"role": "assistant", "content": "", "tool_calls": calls}, TOOL_CALLS_FINISH if finish == "stop" else finish
        assert self.parser is not None
        info = self.parser.extract_tool_calls(text, request=self.request)
        if not info.tools_called:
            return {"role": "assistant", "content": text}, finish
        calls = [_call(call.id, call.function.name, call.function.arguments) for call in info.tool_calls]
        content = info.content if info.content and info.content.strip() else None
        return {"role": "assistant", "content": content, "tool_calls": calls}, TOOL_CALLS_FINISH

    def delta(self, previous_text: str, delta_text: str, delta_ids: list[int]) -> dict[str, Any] | None:
        """The streamed delta for ``delta_text`` after ``previous_text`` (None: nothing to send
        yet), through vLLM's streaming helpers and parsers."""
        from vllm.tool_parsers.streaming import extract_named_tool_call_streaming, extract_required_tool_call_streaming

        current_text = previous_text + delta_text
        if self.mode == "named":
            message, self._name_sent = extract_named_tool_call_streaming(
                delta_text=delta_text, function_name=self.function_name or "", function_name_returned=self._name_sent,
                tool_call_idx=0, tool_call_id_type="random", tokenizer=self.tokenizer,
            )
        elif self.mode == "required":
            message, _ = extract_required_tool_call_streaming(
                previous_text=previous_text, current_text=current_text, tool_call_idx=0, tool_call_id_type="random",
            )
        else:
            assert self.parser is not None
            current_ids = self._previous_ids + delta_ids
            message = self.parser.extract_tool_calls_streaming(
                previous_text, current_text, delta_text, self._previous_ids, current_ids, delta_ids, self.request,
            )
            self._previous_ids = current_ids
        if message is None:
            return None
        delta = message.model_dump(exclude_none=True)
        self.called = self.called or bool(delta.get("tool_calls"))
        return delta

    def finish_reason(self, finish: str | None) -> str | None:
        """A stream's finish reason: "tool_calls" once a required or auto call was streamed."""
        if finish is not None and self.called and self.mode in ("required", "auto"):
            return TOOL_CALLS_FINISH if finish == "stop" or self.mode == "auto" else finish
        return finish


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
