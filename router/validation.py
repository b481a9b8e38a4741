"""Turn a wire request into a validated one, or a message that names the bad field.

Everything a worker would otherwise reject deep inside vLLM (or, worse, accept and then hang on)
is checked here, before any worker is touched: the client gets INVALID_ARGUMENT with the field
name, and the cluster never sees the request.
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from duet.worker_runtime.worker_api import SamplingSpec
from duet.router.proto import duet_api_pb2 as pb


class InvalidRequest(ValueError):
    """A request that cannot be served as sent; ``str()`` starts with the field name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts, read once from the engine's configuration."""

    name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # Tokens already produced and received before the stream broke (GenerateRequest.resume_after).
    resume_after: list[int] = field(default_factory=list)


# vLLM refuses a temperature above this (SamplingParams._verify_args); refused here, naming the
# field, instead of by the engine after the request reached a worker.
MAX_TEMPERATURE = 2.0


def validate(request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Tokenizer) -> ValidatedRequest:
    """Check ``request`` field by field; raise :class:`InvalidRequest` on the first problem."""
    if request.model and request.model != limits.name:
        raise InvalidRequest("model", f"unknown model {request.model!r}; this deployment serves {limits.name!r}")
    prompt_ids = _prompt_token_ids(request, limits, tokenizer)
    max_tokens = _max_tokens(request.max_tokens, len(prompt_ids), limits)
    resume_after = _resume_after(request, limits, max_tokens)
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
    # Prefill samples the first token and decode re-derives it: both must draw the same random
    # numbers, so a sampled request always carries a seed.
    seed = sampling.seed if sampling.HasField("seed") else (random.getrandbits(63) if temperature > 0 else None)
    return ValidatedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling=SamplingSpec(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=sampling.top_k,
            seed=seed,
            stop=tuple(request.stop.stop),
            stop_token_ids=tuple(request.stop.stop_token_ids),
            ignore_eos=request.stop.ignore_eos,
        ),
        resume_after=resume_after,
    )


def _resume_after(request: pb.GenerateRequest, limits: ModelLimits, max_tokens: int) -> list[int]:
    ids = list(request.resume_after.ids)
    bad = next((i for i in ids if i >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("resume_after", f"token id {bad} is outside the vocabulary (size {limits.vocab_size})")
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
        if max(ids) >= limits.vocab_size:  # max() first: the scan in C, the search only on failure
            bad = next(i for i in ids if i >= limits.vocab_size)
            raise InvalidRequest(field, f"token id {bad} is outside the vocabulary (size {limits.vocab_size})")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(
            field,
            f"{len(ids)} tokens does not fit the model's context of {limits.max_model_len} tokens "
            "(the prompt must leave room for at least one generated token)",
        )
    return ids


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
