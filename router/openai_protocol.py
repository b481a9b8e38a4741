"""OpenAI's completions and chat completions requests, checked and turned into duet requests.

A request is parsed strictly (wrong types are errors, not coerced; unknown fields are rejected
as OpenAI rejects them), then converted into the gRPC API's ``GenerateRequest`` and validated by
the same :func:`validate` the gRPC front end uses, so both APIs accept and refuse exactly the same
things. Field names in error messages are OpenAI's (``temperature``, not ``sampling.temperature``).
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``bad_words``,
``structured_outputs``, ``prompt_logprobs``, ``return_token_ids``...) keep vLLM's names and
meanings, so clients written for vLLM's server work unchanged: its behaviour is the
specification (vllm/entrypoints/openai/*/protocol.py, ``to_sampling_params``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Awaitable, Callable, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duet.config import ImagesConfig
from duet.router.image_inputs import ImageChecker, image_url_bytes
from duet.router.proto import duet_api_pb2 as pb
from duet.router.tool_calls import ToolCalling
from duet.router.validation import (
    ImageCheck, InvalidRequest, ModelLimits, SamplingVerifier, Tokenizer, UnknownModel, ValidatedRequest, check_model, check_token_ids,
    validate,
)

# gRPC field paths (as validate() names them) and the OpenAI parameters they came from.
_OPENAI_NAMES = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.min_tokens": "min_tokens",
    "sampling.logit_bias": "logit_bias",
    "sampling.bad_words": "bad_words",
    "sampling.allowed_token_ids": "allowed_token_ids",
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


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class _SamplingFields(_Strict):
    """The fields both endpoints share, with OpenAI's and vLLM's names and defaults. A few of
    vLLM's are accepted only at their no-op value (beam search), so a client that relies on one
    learns at once instead of getting other output."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions (vllm bench serve sends repetition_penalty=1.0).
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Int32 = 0
    top_k: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[UInt32] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int32 | None = None
    structured_outputs: StructuredOutputs | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_token_ids: bool = False
    request_id: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[UInt32] | list[str] | list[list[UInt32]]
    max_tokens: Int32 | None = 16
    echo: bool = False
    logprobs: Int32 | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data: URL, or an http(s) URL on a host api.images.fetch_domains names
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # Extra fields (tool_calls: null and the like, which chat UIs send back) are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def parts(self) -> list[TextPart | ImagePart]:
        """The content as parts, as vLLM reads it (text alone is one text part, none is none)."""
        if isinstance(self.content, list):
            return list(self.content)
        return [] if self.content is None else [TextPart(type="text", text=self.content)]


@dataclass(frozen=True)
class ChatImages:
    """A chat request's images, in the order of their parts, read (router/image_inputs.py)."""

    fields: list[str]  # each one's part, as errors name it ("messages.0.content.1")
    data: list[bytes]
    check: ImageChecker  # the model's (it knows the model's placeholder)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


def parse(model: type[BaseModel], body: object) -> Any:
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
        "use_beam_search": (request.use_beam_search, False),
        "length_penalty": (request.length_penalty, 1.0),
        **extra,
    }
    for field, (value, no_op) in checks.items():
        if value != no_op:
            raise InvalidRequest(field, f"is not supported by duet (only {no_op!r} is accepted)")
    if request.n < 1:  # the gRPC API reads 0 as unset
        raise InvalidRequest("n", f"must be at least 1, got {request.n}")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options", "is only allowed when stream is true")


def _grpc_request(request: _SamplingFields, max_tokens: int, request_id: str) -> pb.GenerateRequest:
    """The gRPC request for ``request``'s sampling, as vLLM's ``to_sampling_params`` maps it
    (unset penalties and cut-offs are vLLM's defaults; OpenAI's temperature default is 1)."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    sampling = pb.SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p,
        top_k=0 if request.top_k in (None, -1) else request.top_k,  # vLLM's -1 means off, as 0 does
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        min_p=request.min_p,
        min_tokens=request.min_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        bad_words=request.bad_words or [],
        allowed_token_ids=request.allowed_token_ids or [],
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
    )
    constraint = _structured_output(request)
    if constraint is not None:
        sampling.structured_output.CopyFrom(constraint)
    grpc_request = pb.GenerateRequest(
        model=request.model or "",
        max_tokens=max_tokens,
        request_id=request_id,
        n=request.n,
        sampling=sampling,
        stop=pb.StopConditions(
            stop=stop, stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
        ),
    )
    if request.prompt_logprobs is not None:
        grpc_request.prompt_logprobs = request.prompt_logprobs
    return grpc_request


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's token-id strings as ids (vLLM's ``int(token)``), refused when not one."""
    ids: dict[int, float] = {}
    for token, value in (bias or {}).items():
        try:
            token_id = int(token)
        except ValueError:
            raise InvalidRequest("logit_bias", f"key {token!r} is not a token id") from None
        if not 0 <= token_id < 2**32:
            raise InvalidRequest("logit_bias", f"token id {token_id} is outside the vocabulary")
        ids[token_id] = value
    return ids


def _structured_output(request: _SamplingFields) -> pb.StructuredOutput | None:
    """The one structured-output constraint of ``structured_outputs`` or ``response_format``
    (vLLM's ``structured_outputs_from_response_format``: json_schema is the schema, json_object
    any object, text none)."""
    constraints: dict[str, Any] = {}
    if request.structured_outputs is not None:
        constraints = {k: v for k, v in request.structured_outputs.model_dump(by_alias=True).items() if v is not None}
        if len(constraints) != 1:
            raise InvalidRequest(
                "structured_outputs", f"set exactly one of json, regex, choice, grammar, json_object, structural_tag (got {len(constraints)})"
            )
    if request.response_format is not None:
        kind = request.response_format.get("type")
        if kind == "json_schema":
            schema = (request.response_format.get("json_schema") or {})
            if not isinstance(schema, dict) or "schema" not in schema:
                raise InvalidRequest("response_format.json_schema", "must be an object with a schema")
            constraints.setdefault("json", schema["schema"])
        elif kind == "json_object":
            constraints.setdefault("json_object", True)
        elif kind != "text":
            raise InvalidRequest("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if not constraints:
        return None
    (kind, value), = list(constraints.items())[:1]
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)
        return pb.StructuredOutput(json_schema=text)
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest("structured_outputs.json_object", "must be true if set")
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{kind: value})


def _validated(
    grpc_request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer, prompt_field: str,
    verify: SamplingVerifier | None, check_images: ImageCheck | None = None,
) -> ValidatedRequest:
    try:
        return validate(grpc_request, limits, tokenizer, verify, check_images)
    except UnknownModel:
        raise  # answered as vLLM answers it (404), not as a bad field
    except InvalidRequest as error:
        field = prompt_field if error.field in ("prompt", "prompt_token_ids") else openai_name(error.field)
        raise InvalidRequest(field, error.problem) from None


def openai_name(field: str) -> str:
    """A gRPC field path as the OpenAI parameter it came from."""
    if field.startswith("sampling.structured_output"):
        return "structured_outputs"
    return _OPENAI_NAMES.get(field, field)


def completion_to_validated(
    request: CompletionRequest, limits: ModelLimits, tokenizer: Tokenizer, request_id: str,
    verify: SamplingVerifier | None = None,
) -> list[ValidatedRequest]:
    """One validated request per prompt of ``request`` (OpenAI's batch of prompts), each with its
    ``n``. ``echo`` asks for the prompt's logprobs as vLLM does (``prompt_logprobs`` defaults to
    ``logprobs``); with ``max_tokens`` 0 it generates one token that is not shown."""
    _unsupported(request, {"best_of": (request.best_of or 1, 1), "suffix": (request.suffix, None)})
    prompts: list[Any] = request.prompt if _is_batch(request.prompt) else [request.prompt]  # type: ignore[assignment]
    if not prompts:
        raise InvalidRequest("prompt", "must not be an empty list")
    if len(prompts) > limits.max_batch_prompts:
        raise InvalidRequest("prompt", f"a batch of {len(prompts)} prompts; at most {limits.max_batch_prompts} (api.max_batch_prompts)")
    if request.logprobs is not None and request.logprobs < 0:
        raise InvalidRequest("logprobs", f"must be >= 0, got {request.logprobs}")
    if request.max_tokens == 0 and not request.echo:
        raise InvalidRequest("max_tokens", "must be >= 1 (0 only with echo)")
    batch = []
    for index, prompt in enumerate(prompts):
        field = f"prompt.{index}" if len(prompts) > 1 else "prompt"
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        if max_tokens is None:  # OpenAI: as many as the context leaves room for
            if isinstance(prompt, str):
                prompt = tokenizer.encode(prompt)  # once: its length sets max_tokens
            max_tokens = max(1, limits.max_model_len - len(prompt))
        grpc_request = _grpc_request(request, max_tokens, request_id if len(prompts) == 1 else f"{request_id}-p{index}")
        if request.logprobs is not None:
            grpc_request.logprobs = request.logprobs
        if request.echo and request.prompt_logprobs is None and request.logprobs is not None:
            grpc_request.prompt_logprobs = request.logprobs
        if isinstance(prompt, str):
            grpc_request.prompt = prompt
        else:
            if any(token < 0 for token in prompt):
                raise InvalidRequest(field, "token ids must be >= 0")
            grpc_request.prompt_token_ids.ids.extend(prompt)
        batch.append(_validated(grpc_request, limits, tokenizer, field, verify))
    return batch


def _is_batch(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def render_chat(
    messages: list[ChatMessage],
    tokenizer: ChatTokenizer,
    limits: ModelLimits,
    chat_template: str | None,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
    image_placeholder: str = "",
) -> list[int]:
    """The prompt's token ids for ``messages``, rendered with the chat template and tokenized
    without adding special tokens again, as vLLM does (``add_special_tokens``: /tokenize's);
    each image where the template puts it, or as ``image_placeholder``."""
    template = chat_template or tokenizer.chat_template
    if not template:
        raise InvalidRequest(
            "messages", f"model {limits.name!r} has no chat template; set model.chat_template in the config"
        )
    conversation = chat_conversation(messages, content_format(template), image_placeholder)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),
        )
    except Exception as error:  # a template's own raise_exception() (e.g. roles out of order)
        raise InvalidRequest("messages", f"the chat template rejected them: {error}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)  # type: ignore[call-arg]


def content_format(chat_template: str) -> Literal["string", "openai"]:
    """How the template reads a message's content, as vLLM detects it: as text (``string``),
    or iterating over parts (``openai``: text parts and ``{"type": "image"}``)."""
    from vllm.renderers.hf import _detect_content_format

    return _detect_content_format(chat_template, default="string")


def chat_conversation(
    messages: list[ChatMessage], content_format: Literal["string", "openai"], image_placeholder: str = ""
) -> list[dict[str, Any]]:
    """The messages as the chat template receives them, as vLLM's chat parsing makes them
    (vllm/renderers/chat_utils.py): for a ``string`` template, a message's texts joined by
    newlines, with one ``image_placeholder`` per image in front unless the text already places
    it; for an ``openai`` one, the parts themselves."""
    conversation = []
    for index, message in enumerate(messages):
        parts = message.parts()
        if not image_placeholder and any(isinstance(part, ImagePart) for part in parts):
            position = next(i for i, part in enumerate(parts) if isinstance(part, ImagePart))
            raise InvalidRequest(f"messages.{index}.content.{position}", "images are taken by chat completions on a vision-language model only")
        if content_format == "openai" and message.role == "tool" and all(isinstance(part, TextPart) for part in parts):
            content: Any = "\n".join(part.text for part in parts)  # vLLM gives a tool's result as text
        elif content_format == "openai":
            content = [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"} for part in parts]
        else:
            content = _string_content(parts, image_placeholder)
        conversation.append({"role": message.role, "content": content})
    return conversation


def _string_content(parts: list[TextPart | ImagePart], placeholder: str) -> str:
    text = "\n".join(part.text for part in parts if isinstance(part, TextPart))
    images = sum(isinstance(part, ImagePart) for part in parts)
    if not images:
        return text
    missing = images - text.count(placeholder)
    if missing < 0:
        raise InvalidRequest("messages", f"more {placeholder!r} placeholders in the text than images in the message")
    return "\n".join([placeholder] * missing + ([text] if text else []))


async def read_chat_images(
    messages: list[ChatMessage], image_check: Callable[[], Awaitable[ImageChecker | None]], limits: ImagesConfig
) -> ChatImages | None:
    """The images of ``messages``' ``image_url`` parts, fetched or decoded from their URLs;
    None without images (``image_check``, the model's, is asked for only then). Refused naming
    the part: on a model that takes none, past ``api.images.max_per_request``, or a URL it may
    not or cannot fetch."""
    fields = [
        f"messages.{index}.content.{position}"
        for index, message in enumerate(messages) for position, part in enumerate(message.parts())
        if isinstance(part, ImagePart)
    ]
    if not fields:
        return None
    check = await image_check()
    if check is None:
        raise InvalidRequest(fields[0], "this model takes no images (it is not a vision-language model)")
    if len(fields) > limits.max_per_request:
        raise InvalidRequest(fields[limits.max_per_request], f"{len(fields)} images; at most {limits.max_per_request} (api.images.max_per_request)")
    urls = [part.image_url.url for message in messages for part in message.parts() if isinstance(part, ImagePart)]
    data = [await image_url_bytes(url, field, limits) for url, field in zip(urls, fields)]
    return ChatImages(fields, data, check)


def _checked_images(images: ChatImages, prompt_ids: list[int]) -> list[int]:
    """The prompt as the engine computes it, its images checked; a bad one refused naming its
    part (``messages.0.content.1``), a count that does not match naming the messages."""
    try:
        return images.check(prompt_ids, images.data)
    except InvalidRequest as error:
        index = error.field.removeprefix("images.")
        field = images.fields[int(index)] if index.isdigit() else "messages"
        raise InvalidRequest(field, error.problem) from None


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter`` body (loading in place is not offered: load new weights
    under a new name, so that no prefix cached with the old weights is reused)."""

    lora_name: str = ""
    lora_path: str = ""
    # The served model it adapts (the name vLLM's --lora-modules JSON gives it); none: the
    # default model. vLLM's server has one base model and no such field.
    base_model_name: str = ""


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` body; its ``lora_int_id`` is accepted and unused
    (duet's ids are its own)."""

    lora_name: str = ""
    lora_int_id: int | None = None


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a completion's ``prompt`` or a chat's ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[UInt32]


def tokenize(
    request: TokenizeRequest, limits: ModelLimits, tokenizer: ChatTokenizer, chat_template: str | None
) -> list[int]:
    """The token ids vLLM's ``/tokenize`` answers for ``request``."""
    check_model(request.model or "", limits)
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequest("prompt", "set prompt or messages, not both")
    if request.messages is not None:
        return render_chat(
            request.messages, tokenizer, limits, chat_template, request.add_generation_prompt,
            add_special_tokens=bool(request.add_special_tokens),
        )
    add_special_tokens = True if request.add_special_tokens is None else request.add_special_tokens
    return tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)  # type: ignore[arg-type, call-arg]


def detokenize(request: DetokenizeRequest, limits: ModelLimits, tokenizer: Tokenizer) -> str:
    """The text vLLM's ``/detokenize`` answers for ``request``."""
    check_model(request.model or "", limits)
    check_token_ids(request.tokens, "tokens", limits)
    return tokenizer.decode(request.tokens)  # type: ignore[attr-defined]


def chat_to_validated(
    request: ChatCompletionRequest,
    limits: ModelLimits,
    tokenizer: ChatTokenizer,
    request_id: str,
    chat_template: str | None = None,
    verify: SamplingVerifier | None = None,
    tools: ToolCalling | None = None,
    images: ChatImages | None = None,
) -> ValidatedRequest:
    """The validated request for a chat request; ``tools`` (:class:`ToolCalling`, from its
    ``tools`` and ``tool_choice``) go to the chat template and constrain the output; its
    ``images`` (:func:`read_chat_images`) are opened and checked, so call it off the event
    loop when there are any."""
    _unsupported(request, {})
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs set to true")
    template_tools = tools.template_tools() if tools is not None else None
    placeholder = images.check.prompts.placeholder if images is not None else ""
    prompt_ids = render_chat(
        request.messages, tokenizer, limits, chat_template, request.add_generation_prompt, template_tools,
        image_placeholder=placeholder,
    )
    if request.max_completion_tokens is not None and request.max_tokens is not None:
        raise InvalidRequest("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
    max_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    expanded = _checked_images(images, prompt_ids) if images is not None else prompt_ids
    # Validation's image check, already made: its answer.
    check = (lambda _ids, _data: expanded) if images is not None else None
    if max_tokens is None:
        max_tokens = max(1, limits.max_model_len - len(expanded))
    grpc_request = _grpc_request(request, max_tokens, request_id)
    grpc_request.prompt_token_ids.ids.extend(prompt_ids)
    if images is not None:
        grpc_request.images.extend(pb.Image(data=data) for data in images.data)
    tool_constraint = tools.constraint() if tools is not None else None
    if tool_constraint is not None:  # as vLLM: a forced tool call overrides response_format
        kind, value = tool_constraint
        grpc_request.sampling.structured_output.CopyFrom(pb.StructuredOutput(**{kind: value}))
    if tools is not None and not tools.skip_special_tokens:
        grpc_request.sampling.skip_special_tokens = False
    if request.logprobs:  # vLLM: the sampled token's, and top_logprobs alternatives
        grpc_request.logprobs = request.top_logprobs or 0
    try:
        return _validated(grpc_request, limits, tokenizer, "messages", verify, check)
    except InvalidRequest as error:
        if error.field == "images":
            raise InvalidRequest("messages", error.problem) from None
        if error.field == "max_tokens":
            raise InvalidRequest(max_field, error.problem) from None
        if error.field == "logprobs":
            raise InvalidRequest("top_logprobs", error.problem) from None
        raise
