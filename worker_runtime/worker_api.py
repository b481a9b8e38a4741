"""The contract between the router and the workers: plain dataclasses that cross Ray.

Requests are described by a :class:`SamplingSpec`, which becomes vLLM's ``SamplingParams`` only
where a vLLM front end takes the request (in the router, router/engine_front_end.py), so the
rest of the router, the SIMULATED workers and the tests need no vLLM.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Any, Literal

FinishReason = Literal["length", "stop", "abort", "error"]


# The priority of a batch job's requests (batch/runner.py): after every online request.
BATCH_PRIORITY = 1


class EngineAborted(RuntimeError):
    """The engine ended a request as aborted: it was cancelled, or its worker was found dead."""


# Signals that stop a process from outside (an operator, the kernel's OOM killer, Ray, duet's own
# removal of a worker): an engine core that died of one was stopped, not crashed by its work.
_STOPPING_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@dataclass(frozen=True)
class EngineExit:
    """Why a worker's engine core process ended, as its actor saw it.

    ``crashed`` means the engine ended itself: it raised (vLLM's engine core exits with status 1
    after reporting the error) or died of a fault signal (SIGSEGV, SIGABRT, SIGBUS, ...). That
    is what a request can cause, so the router counts it against the requests the engine held
    (router/lifecycle.py); a kill from outside is not."""

    reason: str
    crashed: bool = False

    @classmethod
    def of_processes(cls, exit_codes: dict[str, int | None]) -> EngineExit:
        """The exit of the engine's processes, from their exit codes (negative: the signal)."""
        crashed = any(
            code is not None and code != 0 and -code not in _STOPPING_SIGNALS for code in exit_codes.values()
        )
        return cls(f"engine core {'crashed' if crashed else 'exited'}: {exit_codes}", crashed)


@dataclass(frozen=True)
class EngineAddresses:
    """Where a worker's engine core connects to its front end in the router (ZeroMQ endpoints,
    ``tcp://host:port``): requests come in on ``input``, outputs go back on ``output``."""

    input: str
    output: str


# Structured-output constraints, as vLLM's ``StructuredOutputsParams`` names them: the kind, then
# its value as text (a JSON schema, a regular expression, a grammar; for "choice" a JSON list of
# the allowed strings; for "json_object" empty).
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability at one position, with its rank in the vocabulary and its
    text (the attribute names of vLLM's ``Logprob``, so either renders the same way)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# One position's log-probabilities, in vLLM's order: the sampled (or prompt) token first, then
# the top-k by rank (a token that is both appears once, where it came first).
PositionLogprobs = dict[int, TokenLogprob]


def logprobs_of(positions: Any) -> list[PositionLogprobs | None] | None:
    """vLLM's per-position logprobs (a list of dicts or its flat container) as duet's; None
    when the request asked for none."""
    if positions is None:
        return None
    return [
        None if position is None else {
            token_id: TokenLogprob(entry.logprob, entry.rank, entry.decoded_token) for token_id, entry in position.items()
        }
        for position in positions
    ]


def vllm_lora_request(name: str, lora_id: int, path: str) -> Any:
    """vLLM's ``LoRARequest`` for one load of an adapter.

    vLLM tells adapters apart by name (``LoRARequest`` equality, its prefix-cache keys), while
    duet may unload a name and load it again from other weights: the engines get the name with
    the load's id, unique to that load, so no request or cached prefix of the old weights is
    taken for the new ones. Clients only ever see ``name``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{name}#{lora_id}", lora_id, path)


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter served under a model name of its own (``model.lora.adapters``, or loaded
    at run time)."""

    name: str
    lora_id: int  # vLLM's integer id for this load: the same in every engine and front door, never reused
    path: str  # its directory, as every worker's host reads it


@dataclass(frozen=True)
class SamplingSpec:
    """What to generate. ``temperature == 0`` is greedy.

    Every field is one of vLLM's ``SamplingParams`` with the same meaning and default; only the
    containers differ (tuples and text, so that a spec crosses Ray and msgpack as it is)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut-off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # Log-probabilities of each sampled token and of this many top alternatives (None: none).
    logprobs: int | None = None
    # The same for each prompt token (the first has none).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # A structured-output constraint: one of STRUCTURED_KINDS ("" for none) and its value.
    structured_kind: str = ""
    structured_value: str = ""
    # The last this-many prompt tokens were generated by an earlier round of the request (it
    # resumed or moved): the engine treats them as output (worker_runtime/resumed_requests.py).
    resumed_tokens: int = 0
    # The LoRA adapter generating it ("" for the base model): its name, vLLM's integer id for
    # it (the same in every engine) and its directory. It rides with the sampling because every
    # engine the request touches (prefill, decode, a move's target) must apply the same one.
    lora_name: str = ""
    lora_id: int = 0
    lora_path: str = ""
    # The prompt's images (encoded files, one per image placeholder in the prompt, in order):
    # they ride with the sampling for the same reason, every engine must see them
    # (worker_runtime/images.py).
    images: tuple[bytes, ...] = ()
    # vLLM's request priority, lower first (engines run the "priority" scheduling policy): a
    # batch job's requests have BATCH_PRIORITY, so every engine serves online ones first.
    priority: int = 0

    def lora_request(self) -> Any:
        """vLLM's ``LoRARequest`` for the adapter, or None for the base model."""
        return vllm_lora_request(self.lora_name, self.lora_id, self.lora_path) if self.lora_name else None

    def for_prefill(self) -> "SamplingSpec":
        """The prefill half: the same sampling, one token (so the first token is sampled under
        the same constraints a single engine applies to it: a ``min_tokens`` of at least 1 keeps
        the end of sequence out of it too)."""
        return replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))

    def for_decode(self) -> "SamplingSpec":
        """The decode half: prompt logprobs come from the engine that computed the prompt (a
        decode engine that pulled its KV computes only the last position)."""
        return replace(self, prompt_logprobs=None) if self.prompt_logprobs is not None else self

    def structured_outputs(self) -> Any:
        """vLLM's ``StructuredOutputsParams`` for the constraint, or None."""
        if not self.structured_kind:
            return None
        import json

        from vllm.sampling_params import StructuredOutputsParams

        value: Any = self.structured_value
        if self.structured_kind == "choice":
            value = json.loads(value)
        elif self.structured_kind == "json_object":
            value = True
        return StructuredOutputsParams(**{self.structured_kind: value})

    def to_vllm(self, kv_transfer_params: dict[str, Any] | None, delta: bool = False) -> Any:
        """vLLM's SamplingParams; ``delta`` streams only what is new since the last output.

        Delta outputs are what a streaming worker needs: vLLM hands over each step's new token
        ids and text (merging steps a slow reader missed), so nothing is re-sliced from a
        growing cumulative output on every step.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop) or None,
            stop_token_ids=list(self.stop_token_ids) or None,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            logit_bias=dict(self.logit_bias) or None,
            bad_words=list(self.bad_words) or None,
            allowed_token_ids=list(self.allowed_token_ids) or None,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured_outputs(),
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            extra_args=self._extra_args(kv_transfer_params),
        )

    def _extra_args(self, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any] | None:
        extra: dict[str, Any] = {}
        if kv_transfer_params:
            extra["kv_transfer_params"] = kv_transfer_params
        if self.resumed_tokens:
            from duet.worker_runtime.resumed_requests import RESUMED_TOKENS

            extra[RESUMED_TOKENS] = self.resumed_tokens
        return extra or None


@dataclass(frozen=True)
class PrefillResult:
    """What prefill hands on: the first token and where the decode side can pull the KV."""

    first_token_id: int
    first_text: str
    num_prompt_tokens: int
    # None when prefill already finished the request (EOS or stop on the first token).
    kv_transfer_params: dict[str, Any] | None
    finish_reason: FinishReason | None
    worker: str
    # The first token's logprobs (one position) and the prompt's, when the request asked.
    first_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # What stopped it when prefill finished it: the stop string or stop token (None: EOS).
    stop_reason: int | str | None = None
    # Prompt tokens the engine did not compute: found in its prefix cache or loaded (the host's KV
    # pool, another host's); the router times prefills by the tokens computed. (The channel
    # sends the fields in order: router and workers run the same duet.)
    cached_tokens: int = 0


@dataclass(frozen=True)
class DecodeChunk:
    """New tokens since the previous chunk; the last chunk carries ``finish_reason``."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # One entry per token of ``token_ids`` when the request asked for logprobs.
    logprobs: list[PositionLogprobs | None] | None = None
    # On the first chunk of a round that computed the prompt, when the request asked for them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # On the last chunk: the stop string or stop token that ended it (None: EOS or length).
    stop_reason: int | str | None = None


@dataclass
class WorkerStatus:
    """A worker's state for ``duet status`` and the tests."""

    name: str
    role: str
    state: str  # starting | ready | failed | stopped
    kv_endpoint: str = ""
    requests_served: int = 0
    requests_inflight: int = 0
    engine_unfinished: int = 0
    error: str = ""
    # A SIMULATED worker's channel: messages sent to the router, and the frames that carried them.
    channel_messages: int = 0
    channel_frames: int = 0
    engine_metrics: dict[str, float] = field(default_factory=dict)
    # LoRA adapter loads since the engine started: "read" and "activated" (worker_runtime/adapter_loads.py).
    adapter_loads: dict[str, int] = field(default_factory=dict)
