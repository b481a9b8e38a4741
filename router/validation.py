"""Turn a wire request into a validated one, or a message that names the bad field.

Everything a worker would otherwise reject deep inside vLLM (or, worse, accept and then hang on)
is checked here, before any worker is touched: the client gets INVALID_ARGUMENT with the field
name, and the cluster never sees the request.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from duet.worker_runtime.worker_api import SamplingSpec, ServedAdapter
from duet.router.proto import duet_api_pb2 as pb


class InvalidRequest(ValueError):
    """A request that cannot be served as sent; ``str()`` starts with the field name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class UnknownModel(InvalidRequest):
    """A request naming a model this deployment does not serve (vLLM's server answers 404)."""

    def __init__(self, model: str, base: str, served: list[str]) -> None:
        super().__init__("model", f"unknown model {model!r}; this deployment serves {', '.join(map(repr, served))}")
        self.model = model
        self.base = base  # the model's own name (vLLM's "valid aliases")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts, read once from the engine's configuration."""

    name: str
    max_model_len: int
    vocab_size: int
    # The deployment's bounds on one request (the config's ``api`` section).
    max_n: int = 16
    max_logprobs: int = 20
    max_structured_output_bytes: int = 64 * 1024
    max_batch_prompts: int = 64
    structured_output_timeout_s: float = 5.0
    # LoRA adapters on the model, each a model name of its own.
    adapters: tuple[ServedAdapter, ...] = ()
    # The engine's KV block: the unit of its prefix cache (batch jobs order prompts by it).
    block_size: int = 16

    def served_names(self) -> list[str]:
        """Every model name a request may send: the base model's, then its adapters'."""
        return [self.name, *(adapter.name for adapter in self.adapters)]


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # Tokens already produced and received before the stream broke (GenerateRequest.resume_after).
    resume_after: list[int] = field(default_factory=list)
    # Sequences to generate (each runs as a request of its own: router/serving.py).
    n: int = 1
    # A batch job's request (batch/runner.py): nobody waits for its first token, so it is never
    # prefilled on a decode worker, whose streams that would stall (conditional disaggregation).
    background: bool = False
    # A prompt with images as the engine computes it, each image placeholder expanded into the
    # image's tokens (the engines are sent prompt_token_ids and the images, and expand it
    # themselves). None: a prompt without images, computed as it is.
    expanded_prompt_ids: list[int] | None = None

    @property
    def engine_prompt_ids(self) -> list[int]:
        """The prompt's tokens as the engine computes them: what usage counts and replies show."""
        return self.expanded_prompt_ids if self.expanded_prompt_ids is not None else self.prompt_token_ids


# vLLM refuses a temperature above this (SamplingParams._verify_args); refused here, naming the
# field, instead of by the engine after the request reached a worker.
MAX_TEMPERATURE = 2.0


# Checks the engine itself makes on a request's sampling (vLLM's SamplingParams.verify, run by
# the engine's front end in this process: router/engine_front_end.py); raises vLLM's
# validation error. None where no vLLM engine serves (SIMULATED workers).
SamplingVerifier = Callable[[SamplingSpec], None]

# Checks a prompt's images (router/image_inputs.py, bound to the served model and the config's
# api.images): given the prompt's token ids and the images' bytes, returns the prompt as the
# engine computes it (each image placeholder expanded into the image's tokens), or raises
# InvalidRequest naming the image. None: the model takes no images.
ImageCheck = Callable[[list[int], list[bytes]], list[int]]

# vLLM's parameter names (VLLMValidationError.parameter) as this API's field paths.
_GRPC_FIELDS = {
    "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "min_p": "sampling.min_p", "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty", "repetition_penalty": "sampling.repetition_penalty",
    "logit_bias": "sampling.logit_bias", "bad_words": "sampling.bad_words",
    "allowed_token_ids": "sampling.allowed_token_ids", "structured_outputs": "sampling.structured_output",
    "stop": "stop.stop", "stop_token_ids": "stop.stop_token_ids", "min_tokens": "sampling.min_tokens",
}


def validate(
    request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer, verify: SamplingVerifier | None = None,
    check_images: ImageCheck | None = None,
) -> ValidatedRequest:
    """Check ``request`` field by field; raise :class:`InvalidRequest` on the first problem.
    A request with images opens each one: call it off the event loop."""
    adapter = check_model(request.model, limits)
    prompt_ids = _prompt_token_ids(request, limits, tokenizer)
    images = [image.data for image in request.images]
    expanded = _expanded_prompt(prompt_ids, images, limits, check_images)
    max_tokens = _max_tokens(request.max_tokens, len(expanded if expanded is not None else prompt_ids), limits)
    resume_after = _resume_after(request, limits, max_tokens)
    n = request.n or 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"must be in [1, {limits.max_n}] (api.max_n), got {request.n}")
    if n > 1 and resume_after:
        raise InvalidRequest("resume_after", "resumes one sequence: send it with n unset")
    sampling = request.sampling
    temperature = sampling.temperature
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidRequest("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if sampling.top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 disables it), got {sampling.top_k}")
    for token_id in request.stop.stop_token_ids:
        if token_id >= limits.vocab_size:
            raise InvalidRequest("stop.stop_token_ids", f"{token_id} is outside the vocabulary (size {limits.vocab_size})")
    if any(not text for text in request.stop.stop):
        raise InvalidRequest("stop.stop", "stop strings must not be empty")
    if not 0 <= sampling.min_tokens <= max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must be in [0, max_tokens ({max_tokens})], got {sampling.min_tokens}")
    if n > 1 and temperature == 0:  # as vLLM: greedy sequences would all be the same
        raise InvalidRequest("n", f"must be 1 when using greedy sampling, got {n}")
    structured_kind, structured_value = _structured_output(sampling, limits)
    # Prefill samples the first token and decode re-derives it: both must draw the same random
    # numbers, so a sampled request always carries a seed.
    seed = sampling.seed if sampling.HasField("seed") else (random.getrandbits(63) if temperature > 0 else None)
    spec = SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=sampling.top_k,
        seed=seed,
        stop=tuple(request.stop.stop),
        stop_token_ids=tuple(request.stop.stop_token_ids),
        ignore_eos=request.stop.ignore_eos,
        presence_penalty=_finite(sampling, "presence_penalty", 0.0),
        frequency_penalty=_finite(sampling, "frequency_penalty", 0.0),
        repetition_penalty=_finite(sampling, "repetition_penalty", 1.0),
        min_p=_finite(sampling, "min_p", 0.0),
        min_tokens=sampling.min_tokens,
        logit_bias=tuple(sorted((token, _finite_bias(token, bias)) for token, bias in sampling.logit_bias.items())),
        bad_words=tuple(sampling.bad_words),
        allowed_token_ids=tuple(sampling.allowed_token_ids),
        logprobs=_logprobs(request, "logprobs", limits),
        prompt_logprobs=_logprobs(request, "prompt_logprobs", limits),
        include_stop_str_in_output=request.stop.include_stop_str_in_output,
        skip_special_tokens=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            sampling.spaces_between_special_tokens if sampling.HasField("spaces_between_special_tokens") else True
        ),
        structured_kind=structured_kind,
        structured_value=structured_value,
        lora_name=adapter.name if adapter else "",
        lora_id=adapter.lora_id if adapter else 0,
        lora_path=adapter.path if adapter else "",
        images=tuple(images),
    )
    verify_spec(spec, verify)
    return ValidatedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling=spec,
        resume_after=resume_after,
        n=n,
        expanded_prompt_ids=expanded,
    )


def _finite(sampling: pb.SamplingParams, name: str, unset: float) -> float:
    value = getattr(sampling, name) if sampling.HasField(name) else unset
    if not math.isfinite(value):
        raise InvalidRequest(f"sampling.{name}", f"must be a finite number, got {value}")
    return value


def _finite_bias(token: int, bias: float) -> float:
    if not math.isfinite(bias):
        raise InvalidRequest("sampling.logit_bias", f"the bias of token {token} must be a finite number, got {bias}")
    return bias


def _logprobs(request: pb.GenerateRequest, name: str, limits: ModelLimits) -> int | None:
    if not request.HasField(name):
        return None
    value = getattr(request, name)
    if not 0 <= value <= limits.max_logprobs:
        raise InvalidRequest(name, f"must be in [0, {limits.max_logprobs}] (api.max_logprobs), got {value}")
    return value


def _structured_output(sampling: pb.SamplingParams, limits: ModelLimits) -> tuple[str, str]:
    """The constraint as (kind, text) for :class:`SamplingSpec`, bounded in size."""
    constraint = sampling.structured_output
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return "", ""
    if kind == "json_object":
        if not constraint.json_object:
            raise InvalidRequest("sampling.structured_output.json_object", "must be true if set")
        return "json_object", ""
    if kind == "choice":
        if not constraint.choice.choices:
            raise InvalidRequest("sampling.structured_output.choice", "must list at least one choice")
        value = json.dumps(list(constraint.choice.choices))
    else:
        value = getattr(constraint, kind)
    if len(value.encode()) > limits.max_structured_output_bytes:
        raise InvalidRequest(
            f"sampling.structured_output.{kind}",
            f"is {len(value.encode())} bytes; at most {limits.max_structured_output_bytes} (api.max_structured_output_bytes)",
        )
    if kind == "json_schema":
        try:
            json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequest("sampling.structured_output.json_schema", f"is not valid JSON: {error}") from None
        return "json", value
    return kind, value


def verify_spec(spec: SamplingSpec, verify: SamplingVerifier | None) -> None:
    """vLLM's own checks, as the engine would make them, before any worker is touched;
    InvalidRequest naming the field vLLM refused."""
    if verify is None:
        return
    from vllm.exceptions import VLLMClientError

    try:
        verify(spec)
    except (VLLMClientError, ValueError) as error:  # vLLM's validation error, or a backend's ValueError
        raise InvalidRequest(_refused_field(error, spec), str(error)) from None


def _refused_field(error: Exception, spec: SamplingSpec) -> str:
    """The field vLLM's error is about: its ``parameter``, else the field its message starts
    with ("presence_penalty must be in [-2, 2]..."), else the constraint or the sampling."""
    parameter = getattr(error, "parameter", None) or str(error).split(" ", 1)[0]
    if parameter in _GRPC_FIELDS:
        return _GRPC_FIELDS[parameter]
    if parameter in ("logprobs", "prompt_logprobs"):
        return parameter
    return "sampling.structured_output" if spec.structured_kind else "sampling"


def check_model(model: str, limits: ModelLimits) -> ServedAdapter | None:
    """The adapter a request's ``model`` names; None for the base model (or no name)."""
    if not model or model == limits.name:
        return None
    for adapter in limits.adapters:
        if adapter.name == model:
            return adapter
    raise UnknownModel(model, limits.name, limits.served_names())


def check_token_ids(ids: list[int], field: str, limits: ModelLimits) -> None:
    """Every id within the vocabulary; InvalidRequest naming ``field`` and the first that is not."""
    if ids and max(ids) >= limits.vocab_size:  # max() first: the scan in C, the search only on failure
        bad = next(i for i in ids if i >= limits.vocab_size)
        raise InvalidRequest(field, f"token id {bad} is outside the vocabulary (size {limits.vocab_size})")


def _resume_after(request: pb.GenerateRequest, limits: ModelLimits, max_tokens: int) -> list[int]:
    ids = list(request.resume_after.ids)
    check_token_ids(ids, "resume_after", limits)
    if len(ids) >= max_tokens:
        raise InvalidRequest(
            "resume_after", f"{len(ids)} tokens already received leave nothing to generate (max_tokens {max_tokens})"
        )
    return ids


def _prompt_token_ids(request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("prompt", "required: set prompt or prompt_token_ids")
    if which == "prompt":
        if not request.prompt:
            raise InvalidRequest("prompt", "must not be empty")
        ids = list(tokenizer.encode(request.prompt))
        field = "prompt"
    else:
        ids = list(request.prompt_token_ids.ids)
        field = "prompt_token_ids"
        if not ids:
            raise InvalidRequest(field, "must not be empty")
        check_token_ids(ids, field, limits)
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(
            field,
            f"{len(ids)} tokens does not fit the model's context of {limits.max_model_len} tokens "
            "(the prompt must leave room for at least one generated token)",
        )
    return ids


def _expanded_prompt(prompt_ids: list[int], images: list[bytes], limits: ModelLimits, check: ImageCheck | None) -> list[int] | None:
    """The prompt with its images each expanded into the image's tokens; None without images."""
    if not images:
        return None
    if check is None:
        raise InvalidRequest("images", f"model {limits.name!r} takes no images (it is not a vision-language model)")
    expanded = check(prompt_ids, images)
    length = len(expanded)
    if length >= limits.max_model_len:
        raise InvalidRequest(
            "images",
            f"the prompt with its images is {length} tokens, which does not fit the model's context of "
            f"{limits.max_model_len} tokens (the prompt must leave room for at least one generated token)",
        )
    return expanded


def _max_tokens(max_tokens: int, prompt_len: int, limits: ModelLimits) -> int:
    if max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {max_tokens}")
    room = limits.max_model_len - prompt_len
    if max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"{max_tokens} exceeds the model's limit: the context holds {limits.max_model_len} "
            f"tokens and the prompt uses {prompt_len}, so at most {room} can be generated",
        )
    return max_tokens
