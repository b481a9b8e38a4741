"""Tool calls on the chat endpoint, as vLLM's OpenAI server makes them.

A chat request's ``tools`` and ``tool_choice`` do two things, and vLLM's own code does both:

- **before generation**, the output is constrained: with a tool-call parser configured
  (``api.tool_call_parser``, one of vLLM's, as its ``--tool-call-parser``), vLLM's ``Parser``
  adjusts the request as its server does (a structural tag in the parser's format for
  ``auto``, ``required`` and a named choice); without one, a named choice or ``required``
  constrains the output to the tools' JSON schema (vLLM's ``get_json_schema_from_tools``). The
  constraint becomes the request's structured output, compiled and enforced by the engines
  like any other: prefill samples the first token under it, decode continues it;
- **after**, the output is read back as tool calls: by the parser (``parse``, and
  ``parse_delta`` per streamed delta), or without one by vLLM's helpers for the JSON forms.

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


def tool_parser_class(name: str | None, tokenizer: Any = None) -> Any:
    """vLLM's parser class (tool calls, no reasoning) for the tool-call parser ``name`` (None:
    none configured); raises ValueError naming the known ones."""
    if name is None:
        return None
    from vllm.parser import ParserManager
    from vllm.tool_parsers import ToolParserManager

    if name not in ToolParserManager.list_registered():
        known = ", ".join(ToolParserManager.list_registered())
        raise ValueError(f"api.tool_call_parser: unknown parser {name!r}; vLLM has {known}")
    return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer)


class ToolCalling:
    """The tools of one chat request: their constraint, and the output read back as calls."""

    def __init__(self, body: dict[str, Any], tokenizer: Any, parser_class: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = {key: body[key] for key in ("messages", "tools", "tool_choice", "parallel_tool_calls") if key in body}
        try:
            self.request = ChatCompletionRequest.model_validate({**fields, "model": body.get("model") or ""})
        except Exception as error:  # pydantic's ValidationError, vLLM's own checks
            message = _first_line(error)
            raise InvalidRequest("tool_choice" if "tool_choice" in message else "tools", message) from None
        choice = self.request.tool_choice
        if choice is None:  # OpenAI's default: "auto" when tools are given
            choice = "auto" if self.request.tools else "none"
        self.mode = choice if isinstance(choice, str) else "named"
        if self.mode == "auto" and parser_class is None:
            raise InvalidRequest(
                "tool_choice", '"auto" needs a tool-call parser: set api.tool_call_parser in the config (vLLM: --tool-call-parser)'
            )
        self.function_name = choice.function.name if self.mode == "named" else None
        if self.function_name is not None and self.function_name not in {tool.function.name for tool in self.request.tools or []}:
            raise InvalidRequest("tool_choice", f"the tool {self.function_name!r} is not among the request's tools")
        self.tokenizer, self.parser_class = tokenizer, parser_class
        self.parser = self._new_parser()
        if self.parser is not None and (self.mode != "none" or self.parser.always_adjust_request):
            self.request = self.parser.adjust_request(self.request)
        self.called = False  # a streamed call was announced
        self._name_sent = False
        self._previous_text = ""

    def _new_parser(self) -> Any:
        if self.parser_class is None:
            return None
        return self.parser_class(self.tokenizer, self.request.tools, chat_template_kwargs={}, model_config=None)

    def for_sequence(self) -> "ToolCalling":
        """The same tools with streaming state of its own (one per choice: parsers keep state)."""
        sequence = copy.copy(self)
        sequence.parser = self._new_parser()
        sequence.called, sequence._name_sent, sequence._previous_text = False, False, ""
        return sequence

    @property
    def active(self) -> bool:
        """Whether the output is read back as tool calls."""
        return self.mode != "none" or self.parser is not None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (vLLM passes each tool's dump)."""
        return [tool.model_dump() for tool in self.request.tools] if self.request.tools else None

    def constraint(self) -> tuple[str, str] | None:
        """The structured-output constraint the tools put on the output, as (kind, text) of
        ``StructuredOutput`` (None: they put none, and the request's own applies)."""
        constraint = self.request.structured_outputs
        if constraint is not None and constraint.structural_tag is not None:
            return "structural_tag", constraint.structural_tag
        if self.parser is None and self.mode in ("named", "required"):
            from vllm.tool_parsers.utils import get_json_schema_from_tools

            schema = get_json_schema_from_tools(self.request.tool_choice, self.request.tools, self.request.parallel_tool_calls)
            return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
        if constraint is not None and constraint.json is not None:
            return "json_schema", constraint.json if isinstance(constraint.json, str) else json.dumps(constraint.json)
        return None

    @property
    def skip_special_tokens(self) -> bool:
        """Some parsers need the special tokens that delimit a call (vLLM's adjust_request)."""
        return self.request.skip_special_tokens

    def whole(self, text: str, token_ids: list[int], finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for a whole output, and the finish reason to report (vLLM's
        ``chat_completion_full_generator``)."""
        from vllm.renderers.chat_utils import make_tool_call_id

        if self.parser is not None:
            _, content, parsed = self.parser.parse(text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids)
            calls = [_call(call.id or make_tool_call_id(), call.name, call.arguments) for call in parsed or []]
        else:
            content, calls = self._parse_json_forms(text, make_tool_call_id)
        if self.mode in ("named", "required"):
            message = {"role": "assistant", "content": content or "", "tool_calls": calls}
        elif self.mode == "auto" and calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
        else:
            message = {"role": "assistant", "content": content}
        called = (self.mode == "auto" and bool(calls)) or (self.mode == "required" and finish == "stop")
        return message, TOOL_CALLS_FINISH if called else finish

    def _parse_json_forms(self, text: str, make_id: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """Without a parser: a named choice's output is the function's arguments, a required
        choice's the array of ``{name, parameters}`` its schema allows."""
        if self.mode == "named":
            return None, [_call(make_id(), self.function_name or "", text)] if text.strip() else []
        if self.mode == "required":
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = []
            items = parsed if isinstance(parsed, list) else []
            return None, [
                _call(make_id(), item.get("name", ""), json.dumps(item.get("parameters", {}), ensure_ascii=False))
                for item in items if isinstance(item, dict)
            ]
        return text, []

    def delta(self, delta_text: str, delta_ids: list[int], prompt_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """The streamed delta for ``delta_text`` (None: nothing to send yet)."""
        if self.parser is not None:
            message = self.parser.parse_delta(delta_text, delta_ids, self.request, prompt_ids, finished=finished)
        elif self.mode == "named":
            from vllm.tool_parsers.streaming import extract_named_tool_call_streaming

            message, self._name_sent = extract_named_tool_call_streaming(
                delta_text=delta_text, function_name=self.function_name or "", function_name_returned=self._name_sent,
                tool_call_idx=0, tool_call_id_type="random", tokenizer=self.tokenizer,
            )
        elif self.mode == "required":
            from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

            message, _ = extract_required_tool_call_streaming(
                previous_text=self._previous_text, current_text=self._previous_text + delta_text,
                tool_call_idx=0, tool_call_id_type="random",
            )
        else:
            return {"content": delta_text}
        self._previous_text += delta_text
        if message is None:
            return None
        delta = message.model_dump(exclude_none=True)
        self.called = self.called or bool(delta.get("tool_calls"))
        return delta

    def finish_reason(self, finish: str | None) -> str | None:
        """A stream's finish reason: "tool_calls" once a call was streamed (not a named one)."""
        if finish == "stop" and self.called and self.mode != "named":
            return TOOL_CALLS_FINISH
        return finish


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
