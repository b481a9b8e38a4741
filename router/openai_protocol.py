"""OpenAI's completions and chat completions requests, checked and turned into duet requests.

A request is parsed strictly (wrong types are errors, not coerced; unknown fields are rejected
as OpenAI rejects them), then converted into the gRPC API's ``GenerateRequest`` and validated by
the same :func:`validate` the gRPC front end uses, so both APIs accept and refuse exactly the same
things. Field names in error messages are OpenAI's (``temperature``, not ``sampling.temperature``).
vLLM's extensions that duet supports (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids``) keep vLLM's names, so clients written for vLLM work unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duet.router.proto import duet_api_pb2 as pb
from duet.router.validation import InvalidRequest, ModelLimits, Tokenizer, ValidatedRequest, validate

# gRPC field paths (as validate() names them) and the OpenAI parameters they came from.
_OPENAI_NAMES = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "stop.stop": "stop",
    "stop.stop_token_ids": "stop_token_ids",
    "prompt_token_ids": "prompt",
}


class ChatTokenizer(Tokenizer, Protocol):
    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


# Integers that travel in the gRPC request's int32 and uint32 fields: bounded here so that a value
# past them is refused naming its field, not turned into an internal error by protobuf.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """The fields both endpoints share; unsupported OpenAI features are accepted only at their
    no-op value, so a client that relies on one learns at once instead of getting other output."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions (vllm bench serve sends repetition_penalty=1.0).
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    top_k: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[UInt32] | None = None
    return_token_ids: bool = False
    request_id: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[UInt32] | list[str] | list[list[UInt32]]
    max_tokens: Int32 | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra fields (tool_calls: null and the like, which chat UIs send back) are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True


def parse(model: type[_SamplingFields], body: object) -> Any:
    """``model`` from a decoded JSON body, or InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        # The deepest problem is the most specific one (for a union, the branch that got furthest).
        first = max(error.errors(), key=lambda item: len(item["loc"]))
        field = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise InvalidRequest(field, f"Unrecognized request argument supplied: {field}") from None
        # Unions report the branch they tried (prompt.str, prompt.list[int]...): name the field.
        field = ".".join(str(part) for part in first["loc"] if not _is_union_branch(part)) or "body"
        raise InvalidRequest(field, first["msg"]) from None


def _is_union_branch(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper())


def _unsupported(request: _SamplingFields, extra: dict[str, tuple[Any, Any]]) -> None:
    """Reject features duet does not implement when set to anything but their no-op value."""
    checks: dict[str, tuple[Any, Any]] = {
        "n": (request.n, 1),
        "presence_penalty": (request.presence_penalty or 0.0, 0.0),
        "frequency_penalty": (request.frequency_penalty or 0.0, 0.0),
        "logit_bias": (request.logit_bias or None, None),
        "repetition_penalty": (request.repetition_penalty or 1.0, 1.0),
        "min_p": (request.min_p or 0.0, 0.0),
        "min_tokens": (request.min_tokens, 0),
        **extra,
    }
    for field, (value, no_op) in checks.items():
        if value != no_op:
            raise InvalidRequest(field, f"is not supported by duet (only {no_op!r} is accepted)")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options", "is only allowed when stream is true")


def _grpc_request(request: _SamplingFields, max_tokens: int, request_id: str) -> pb.GenerateRequest:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return pb.GenerateRequest(
        model=request.model or "",
        max_tokens=max_tokens,
        request_id=request_id,
        sampling=pb.SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=request.top_p,
            top_k=0 if request.top_k in (None, -1) else request.top_k,  # vLLM's -1 means off, as 0 does
            seed=request.seed,
        ),
        stop=pb.StopConditions(
            stop=stop, stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos
        ),
    )


def _validated(grpc_request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer, prompt_field: str) -> ValidatedRequest:
    try:
        return validate(grpc_request, limits, tokenizer)
    except InvalidRequest as error:
        field = prompt_field if error.field in ("prompt", "prompt_token_ids") else _OPENAI_NAMES.get(error.field, error.field)
        raise InvalidRequest(field, error.problem) from None


def completion_to_validated(
    request: CompletionRequest, limits: ModelLimits, tokenizer: Tokenizer, request_id: str
) -> ValidatedRequest:
    _unsupported(request, {
        "echo": (request.echo, False),
        "logprobs": (request.logprobs, None),
        "best_of": (request.best_of or 1, 1),
        "suffix": (request.suffix, None),
    })
    prompt: Any = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("prompt", f"duet serves one prompt per request, got a batch of {len(prompt)}")
        prompt = prompt[0]
    max_tokens = request.max_tokens
    if max_tokens is None:  # OpenAI: as many as the context leaves room for
        if isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)  # once: its length sets max_tokens
        max_tokens = max(1, limits.max_model_len - len(prompt))
    grpc_request = _grpc_request(request, max_tokens, request_id)
    if isinstance(prompt, str):
        grpc_request.prompt = prompt
    else:
        if any(token < 0 for token in prompt):
            raise InvalidRequest("prompt", "token ids must be >= 0")
        grpc_request.prompt_token_ids.ids.extend(prompt)
    return _validated(grpc_request, limits, tokenizer, "prompt")


def chat_to_validated(
    request: ChatCompletionRequest,
    limits: ModelLimits,
    tokenizer: ChatTokenizer,
    request_id: str,
    chat_template: str | None = None,
) -> ValidatedRequest:
    _unsupported(request, {
        "logprobs": (request.logprobs, False),
        "top_logprobs": (request.top_logprobs, None),
        "response_format": ((request.response_format or {"type": "text"}).get("type"), "text"),
        "tools": (request.tools or None, None),
        "tool_choice": (request.tool_choice if request.tool_choice != "none" else None, None),
    })
    template = chat_template or tokenizer.chat_template
    if not template:
        raise InvalidRequest(
            "messages", f"model {limits.name!r} has no chat template; set model.chat_template in the config"
        )
    conversation = [{"role": message.role, "content": message.text()} for message in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=request.add_generation_prompt
        )
    except Exception as error:  # a template's own raise_exception() (e.g. roles out of order)
        raise InvalidRequest("messages", f"the chat template rejected them: {error}") from None
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
    if request.max_completion_tokens is not None and request.max_tokens is not None:
        raise InvalidRequest("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
    max_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if max_tokens is None:
        max_tokens = max(1, limits.max_model_len - len(prompt_ids))
    grpc_request = _grpc_request(request, max_tokens, request_id)
    grpc_request.prompt_token_ids.ids.extend(prompt_ids)
    try:
        return _validated(grpc_request, limits, tokenizer, "messages")
    except InvalidRequest as error:
        if error.field == "max_tokens":
            raise InvalidRequest(max_field, error.problem) from None
        raise
