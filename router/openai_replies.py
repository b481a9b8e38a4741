"""OpenAI's completion and chat completion answers, rendered from duet's stream events.

One API call (its prompts, each with ``n`` sequences) becomes choices: whole, or as the chunks
of a stream, with logprobs, echo, token ids, tool calls and usage shaped as vLLM's server shapes
them (``_create_completion_logprobs``, ``_create_chat_logprobs`` in vLLM's serving classes).
router/http_server.py serves them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from duet.router.lifecycle import StreamEvent, Usage
from duet.router.tool_calls import ToolCalling
from duet.router.validation import ValidatedRequest
from duet.worker_runtime.worker_api import PositionLogprobs

# vLLM's floor for a logprob in JSON (OpenAI's: -inf is not JSON).
_MIN_LOGPROB = -9999.0


@dataclass
class Sequence:
    """One choice as it accumulates: its tokens, text and logprobs so far."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    started: bool = False


@dataclass
class Reply:
    """Renders the events of one API call (its prompts, each with ``n`` sequences; choice ``i``
    belongs to prompt ``i // n``, as in vLLM) as an OpenAI completion or chat completion."""

    chat: bool
    model: str
    prompts: list[ValidatedRequest]
    n: int
    return_token_ids: bool
    tokenizer: Any
    # Completions: the prompt's text prepended to each choice (echo), and whether the choice
    # shows only that (echo with max_tokens 0: one token generated, none shown).
    echo: bool = False
    echo_only: bool = False
    # How many alternatives each position lists (None: logprobs not asked for).
    top_logprobs: int | None = None
    # Chat: the tools the output is read back as calls of (router/tool_calls.py).
    tools: ToolCalling | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _tool_streams: dict[int, ToolCalling] = field(default_factory=dict)

    @property
    def request(self) -> ValidatedRequest:
        return self.prompts[0]

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request.request_id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _prompt(self, index: int) -> ValidatedRequest:
        return self.prompts[index // self.n]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _token_ids(self, choice: dict[str, Any], index: int, token_ids: list[int], first: bool) -> dict[str, Any]:
        """``return_token_ids``: a choice's tokens, and a completion choice's prompt (a chat's
        is the reply's own: :meth:`_prompt_token_ids`), as vLLM places them."""
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            if first and not self.chat:
                choice["prompt_token_ids"] = self._prompt(index).engine_prompt_ids
        return choice

    def _prompt_token_ids(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat reply's prompt (``return_token_ids``), on the whole reply or each choice's
        first chunk."""
        if self.chat and self.return_token_ids:
            body["prompt_token_ids"] = self.request.engine_prompt_ids
        return body

    def _echoed(self, index: int, first: bool, token_ids: list[int], text: str, logprobs: list[Any] | None,
                prompt_logprobs: list[Any] | None) -> tuple[list[int], str, list[Any] | None]:
        """A completion choice's tokens, text and logprobs with the prompt in front (echo)."""
        if self.echo_only:
            token_ids, text, logprobs = [], "", [] if logprobs is not None else None
        if not (self.echo and first):
            return token_ids, text, logprobs
        prompt = self._prompt(index).prompt_token_ids
        prompt_text = self.tokenizer.decode(prompt)
        if logprobs is not None:
            logprobs = list(prompt_logprobs or [None] * len(prompt)) + list(logprobs)
        return prompt + token_ids, prompt_text + text, logprobs

    def whole(self, sequences: dict[int, Sequence]) -> dict[str, Any]:
        choices = []
        for index in sorted(sequences):
            sequence = sequences[index]
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": sequence.text}
                finish = sequence.finish
                if self.tools is not None:
                    message, finish = self.tools.for_sequence().whole(sequence.text, sequence.token_ids, finish)
                choice: dict[str, Any] = {
                    "index": index, "message": message,
                    "logprobs": self._chat_logprobs(sequence.token_ids, sequence.logprobs), "finish_reason": finish,
                    "stop_reason": sequence.stop_reason,
                }
            else:
                token_ids, text, logprobs = self._echoed(
                    index, True, sequence.token_ids, sequence.text,
                    sequence.logprobs if self.top_logprobs is not None else None, sequence.prompt_logprobs,
                )
                choice = {
                    "index": index, "text": text, "logprobs": self._completion_logprobs(token_ids, logprobs, 0),
                    "finish_reason": sequence.finish, "stop_reason": sequence.stop_reason,
                }
            choices.append(self._token_ids(choice, index, sequence.token_ids, first=True))
        body = self._prompt_token_ids(self._envelope(self.object, choices))
        body["usage"] = self._usage(sequences)
        return body

    def chunk(self, index: int, event: StreamEvent, sequence: Sequence, with_usage_field: bool) -> dict[str, Any]:
        """The chunk for one event of choice ``index``; ``sequence`` holds what it sent before."""
        first = not sequence.started
        sequence.started = True
        logprobs = event.logprobs if self.top_logprobs is not None else None
        if self.chat:
            delta: dict[str, Any] = {"content": event.text}
            finish = event.finish_reason
            if self.tools is not None:
                tools = self._tool_streams.setdefault(index, self.tools.for_sequence())
                delta = tools.delta(
                    event.text, event.token_ids, self._prompt(index).prompt_token_ids, event.finish_reason is not None
                ) or {}
                finish = tools.finish_reason(finish)
            sequence.text += event.text
            choice: dict[str, Any] = {
                "index": index, "delta": delta, "logprobs": self._chat_logprobs(event.token_ids, logprobs),
                "finish_reason": finish, "stop_reason": event.stop_reason,
            }
        else:
            offset = len(sequence.text)
            token_ids, text, logprobs = self._echoed(index, first, event.token_ids, event.text, logprobs, event.prompt_logprobs)
            choice = {
                "index": index, "text": text, "logprobs": self._completion_logprobs(token_ids, logprobs, offset),
                "finish_reason": event.finish_reason, "stop_reason": event.stop_reason,
            }
            sequence.text += text
        body = self._envelope(self.object + (".chunk" if self.chat else ""), [self._token_ids(choice, index, event.token_ids, first)])
        if with_usage_field:
            body["usage"] = None
        return body

    def role_chunk(self, index: int, with_usage_field: bool) -> dict[str, Any]:
        """A chat choice's first chunk: the assistant's role, no content yet."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        body = self._prompt_token_ids(self._envelope(self.object + ".chunk", [choice]))
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, sequences: dict[int, Sequence]) -> dict[str, Any]:
        body = self._envelope(self.object + (".chunk" if self.chat else ""), [])
        body["usage"] = self._usage(sequences)
        return body

    def _usage(self, sequences: dict[int, Sequence]) -> dict[str, int]:
        """vLLM's counts: each prompt once, every choice's tokens (a resumed stream's usage
        counts what that call sent)."""
        prompt_tokens = sum(len(prompt.engine_prompt_ids) for prompt in self.prompts)
        completion_tokens = sum(
            sequence.usage.completion_tokens if sequence.usage is not None else len(sequence.token_ids)
            for sequence in sequences.values()
        )
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    def _completion_logprobs(self, token_ids: list[int], positions: list[Any] | None, offset: int) -> dict[str, Any] | None:
        """OpenAI's completion logprobs, as vLLM's ``_create_completion_logprobs`` builds them:
        each position lists the token and its ``logprobs`` likeliest alternatives."""
        if positions is None or self.top_logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, position in zip(token_ids, positions):
            offsets.append(offset)
            if position is None or token_id not in position:
                token = self.tokenizer.decode([token_id])
                token_logprobs.append(None)
                top.append(None)
            else:
                token = self._token_text(token_id, position[token_id])
                token_logprobs.append(max(position[token_id].logprob, _MIN_LOGPROB))
                top.append({
                    self._token_text(other, entry): max(entry.logprob, _MIN_LOGPROB)
                    for rank, (other, entry) in enumerate(position.items()) if rank <= self.top_logprobs
                })
            tokens.append(token)
            offset += len(token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def _chat_logprobs(self, token_ids: list[int], positions: list[Any] | None) -> dict[str, Any] | None:
        """OpenAI's chat logprobs (vLLM's ``_create_chat_logprobs``)."""
        if positions is None or self.top_logprobs is None:
            return None
        content = []
        for token_id, position in zip(token_ids, positions):
            if position is None or token_id not in position:
                token = self.tokenizer.decode([token_id])
                content.append({"token": token, "logprob": _MIN_LOGPROB, "bytes": list(token.encode()), "top_logprobs": []})
                continue
            entry = position[token_id]
            content.append({
                "token": self._token_text(token_id, entry),
                "logprob": max(entry.logprob, _MIN_LOGPROB),
                "bytes": None if entry.decoded_token is None else list(entry.decoded_token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": (text := self._token_text(other, alternative)), "logprob": max(alternative.logprob, _MIN_LOGPROB),
                     "bytes": list(text.encode("utf-8", errors="replace"))}
                    for rank, (other, alternative) in enumerate(position.items()) if rank < self.top_logprobs
                ],
            })
        return {"content": content}

    def _token_text(self, token_id: int, entry: Any) -> str:
        return entry.decoded_token if entry.decoded_token is not None else self.tokenizer.decode([token_id])
