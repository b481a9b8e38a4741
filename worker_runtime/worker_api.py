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


@dataclass(frozen=True)
class SamplingSpec:
    """What to generate. ``temperature == 0`` is greedy."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut-off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def for_prefill(self) -> "SamplingSpec":
        """The prefill half: the same sampling, one token."""
        return replace(self, max_tokens=1)

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
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )


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


@dataclass(frozen=True)
class DecodeChunk:
    """New tokens since the previous chunk; the last chunk carries ``finish_reason``."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


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
