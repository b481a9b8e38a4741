"""Conditional disaggregation's TPOT guard: whether a decode worker may compute a prompt itself.

A decode worker that prefills a prompt (because every prefill worker's queue is long) saves that
request's TTFT, and stalls every stream it decodes for as long as the prompt takes: on two CPU
cores near the knee, that stall cost duet most of its tight-TPOT attainment (issue 53: 54/23/20%
with local prefill against 65/76/94% without). So the router lets a decode worker prefill only
while its streams stay inside the TPOT target with the stall added:

    pace + (its prompts in progress + this prompt) x prefill_cost / stream_length <= 0.8 x target

- ``pace``: the seconds per token the worker's streams saw lately (an average over the chunks
  this front door relayed from it, stalls of earlier local prefills included);
- ``prefill_cost``: seconds per prompt token, measured on prefill workers that had nothing else
  to do (a queue behind the prompt would inflate it);
- ``stream_length``: the mean ``max_tokens`` of the streams decoding there: a stall adds its
  length once to each of them, spread over all their tokens;
- 0.8: headroom, because the target is met per request, not on average.

A worker that decodes nothing can always prefill; one whose pace is not known yet (no stream
relayed) or before any prefill cost is measured, never (the remote path is the safe default).
Each front door judges from the streams it relays.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of each new observation in the running averages: about the last 10 chunks or prefills.
_SMOOTHING = 0.1
# The share of the TPOT target the predicted pace may reach (the target holds per request).
_HEADROOM = 0.8
# Prompts shorter than this are left out of the prefill cost: their fixed costs dominate.
_COST_MIN_TOKENS = 128


def _averaged(previous: float | None, value: float) -> float:
    return value if previous is None else previous + _SMOOTHING * (value - previous)


@dataclass
class LocalPrefillGuard:
    """What the router knows of each decode worker's pace and of a prompt's cost; ``allows``
    decides. ``tpot_target_s`` None: no guard (only the queue threshold decides)."""

    tpot_target_s: float | None
    prefill_s_per_token: float | None = None

    def __post_init__(self) -> None:
        self._pace_s: dict[str, float] = {}
        # The ``max_tokens`` of the streams each decode worker is relaying, by request id.
        self._streams: dict[str, dict[str, int]] = {}

    def prefilled(self, prompt_tokens: int, seconds: float) -> None:
        """A prefill worker with nothing else queued computed ``prompt_tokens`` in ``seconds``."""
        if prompt_tokens >= _COST_MIN_TOKENS and seconds > 0:
            self.prefill_s_per_token = _averaged(self.prefill_s_per_token, seconds / prompt_tokens)

    def stream_started(self, worker: str, request_id: str, max_tokens: int) -> None:
        """A stream's first tokens arrived from ``worker``: local prefills there now stall it."""
        self._streams.setdefault(worker, {})[request_id] = max_tokens

    def stream_ended(self, worker: str, request_id: str) -> None:
        streams = self._streams.get(worker, {})
        streams.pop(request_id, None)
        if not streams:
            self._streams.pop(worker, None)

    def streamed(self, worker: str, tokens: int, gap_s: float) -> None:
        """A stream on decode worker ``worker`` got ``tokens`` more, ``gap_s`` after its last."""
        if tokens > 0:
            self._pace_s[worker] = _averaged(self._pace_s.get(worker), gap_s / tokens)

    def pace_s(self, worker: str) -> float | None:
        """Seconds per token lately on ``worker``'s streams (None before any was relayed)."""
        return self._pace_s.get(worker)

    def allows(self, worker: str, pending_tokens: int) -> bool:
        """Whether ``worker`` may compute ``pending_tokens`` of prompts (its own in progress and
        the new one) and keep the streams it decodes inside the TPOT target."""
        stream_lengths = list(self._streams.get(worker, {}).values())
        if self.tpot_target_s is None or not stream_lengths:
            return True
        pace = self._pace_s.get(worker)
        if pace is None or self.prefill_s_per_token is None:
            return False
        stall_s = pending_tokens * self.prefill_s_per_token
        mean_length = max(1.0, sum(stream_lengths) / len(stream_lengths))
        return pace + stall_s / mean_length <= _HEADROOM * self.tpot_target_s
