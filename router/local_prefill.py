"""Conditional disaggregation's TPOT guard: whether a decode worker may compute a prompt itself.

A decode worker that prefills a prompt (because every prefill worker's queue is long) saves that
request's TTFT, and stalls every stream it decodes for as long as the prompt takes: on two CPU
cores near the knee, that stall cost duet most of its tight-TPOT attainment (issue 53: 54/23/20%
with local prefill against 65/76/94% without). So the router lets a decode worker prefill only
if every stream it decodes stays inside the TPOT target with the stall added.

For each stream the front door relays from the worker it knows when its first token came, how
many tokens it has had and its ``max_tokens``, so it predicts the stream's TPOT at its end:

    (seconds since its first token + stall + tokens still to come x pace) / (max_tokens - 1)

- ``stall``: what the prompts the worker is computing itself and this one add to its steps, from
  a fit to prefills timed on prefill workers that had nothing else queued (a queue behind the
  prompt would inflate it), the part that grows with a prompt's length
  (:class:`~duet.router.prompt_cost.PromptCost`: a decode step pays its fixed overhead anyway);
- ``pace``: the seconds per token of the worker's steps that carried no prompt, the steady pace
  the rest of each stream will get: the lower quartile over the last :data:`_PACE_CHUNKS` chunks
  relayed. The prompts a worker is computing are counted once, as stall; the gaps they stretched
  would count them again. At 26 req/s on the conversation slice, an average over about ten
  chunks read 0.1-0.24 s a token and a median 85 ms while the worker prefilled, with the streams'
  TPOT p50 at 27-31 ms, and the 100 ms guard held back prompts that stalled nothing (66% and 75%
  of requests inside the loose SLO against 81-83% without the guard, all of it TTFT).

A request counts from the moment it is assigned to the worker, not from its worker's first
chunk: a prompt prefilled remotely gives the client its first token (which starts the TPOT the
SLO judges) before its KV is pulled, and one prefilled on the worker itself gets its first token
just before the next local prompt's chunk, so a local prefill that starts while either is still
being prefilled or pulled stalls its first decoded tokens. Such a request is predicted as if
its first token came now (the whole stall lands on it), unless its prompt is queued on a
prefill worker behind other prompts: then its first token comes no sooner than those take, and
only the part of the stall left by then counts (counting all of it held back local prefills
that queued prompts never felt: 99% of streams inside 40 ms at 22 req/s with TTFT the limit).
Counting streams only from their first decoded chunk left requests mid-pull unprotected: on the
code slice, bursts of 1,800-token prompts with 6-10 output tokens, a stall of a second spread
over 5-9 gaps put them past 40 ms.

The prompt is prefilled locally only if every stream is predicted inside :data:`_HEADROOM` x
the target with the stall; a worker with nothing assigned always may. Before a pace and a
prompt's cost are known, never (the remote path is the safe default). A stream already
predicted past the target holds local prefills back too: ignoring such streams as lost to the
SLO let every stream pass the target under load (the stalls inflate the pace, every stream
looks lost, and the guard lets every prompt through: at 14 req/s on the conversation slice, 56%
of streams inside 40 ms against 92% without local prefill, 2026-12-02). With this rule, 98% of
streams stayed inside and 79% of requests met TTFT 1 s and TPOT 40 ms, against 50% without the
guard and 67% without local prefill (docs/benchmarks/serving.md). Each front door judges by the
streams it relays. The TPOT is the one the SLO judges: the mean gap between a stream's tokens
after its first, so a stall counts once, spread over the stream's tokens.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from duet.router.prompt_cost import PromptCost

# A worker's pace is the lower quartile of seconds per token over its streams' last this many chunks.
_PACE_CHUNKS = 32
# The share of the TPOT target a stream's prediction may reach (predictions err both ways).
_HEADROOM = 0.9
# Prompts shorter than this are left out of the prompt cost's fit: their fixed costs dominate.
_COST_MIN_TOKENS = 128


@dataclass
class _Stream:
    max_tokens: int
    # None while its first token is still being computed (on a prefill worker).
    first_token_at: float | None = None
    tokens: int = 0
    # The soonest its first token can come: queued behind other prompts on a prefill worker.
    first_token_not_before: float | None = None

    def predicted_tpot_s(self, now: float, pace_s: float, stall_s: float) -> float:
        """Its mean time per token after the first, at its end, if stalled ``stall_s`` now. A
        stream still waiting for its first token gets the part of the stall left once that
        token can come (all of it if it may come now)."""
        if self.max_tokens <= 1:
            return 0.0  # one token: no time per output token to spoil
        if self.first_token_at is None:
            since_first_token = 0.0
            stall_s = max(0.0, stall_s - max(0.0, (self.first_token_not_before or now) - now))
        else:
            since_first_token = now - self.first_token_at
        still_to_come = max(0, self.max_tokens - max(1, self.tokens))
        return (since_first_token + stall_s + still_to_come * pace_s) / (self.max_tokens - 1)


@dataclass
class LocalPrefillGuard:
    """What the router knows of each decode worker's streams and of a prompt's cost; ``allows``
    decides. ``tpot_target_s`` None: no guard (only the queue threshold decides)."""

    tpot_target_s: float | None
    prompt_cost: PromptCost = field(default_factory=PromptCost)

    def __post_init__(self) -> None:
        # Seconds per token of each decode worker's last chunks relayed.
        self._paces_s: dict[str, deque[float]] = {}
        # The streams each decode worker is relaying, by request id.
        self._streams: dict[str, dict[str, _Stream]] = {}

    def prefilled(self, prompt_tokens: int, seconds: float, computed_tokens: int | None = None) -> None:
        """A prefill worker with nothing else queued took ``seconds`` over a prompt of
        ``prompt_tokens``, of which its engine computed ``computed_tokens`` (default: all)."""
        computed = prompt_tokens if computed_tokens is None else computed_tokens
        if computed >= _COST_MIN_TOKENS and seconds > 0:
            self.prompt_cost.timed(computed, seconds, prompt_tokens)

    def stream_assigned(self, worker: str, request_id: str, max_tokens: int) -> None:
        """``request_id`` will decode on ``worker`` (its prompt computed there or on a prefill
        worker): a local prefill there from now on may stall its first decoded tokens."""
        self._streams.setdefault(worker, {}).setdefault(request_id, _Stream(max_tokens))

    def queued_behind(self, worker: str, request_id: str, prompt_tokens_ahead: int, now: float | None = None) -> None:
        """``request_id``'s prompt joined a prefill worker with ``prompt_tokens_ahead`` tokens of
        other prompts in progress: its first token comes no sooner than they take (a lower bound:
        its own prompt is not counted), so only a stall lasting past that reaches it."""
        stream = self._stream(worker, request_id)
        if stream is not None and self.prompt_cost.known:
            at = time.perf_counter() if now is None else now
            stream.first_token_not_before = at + self.prompt_cost.at_least_s(prompt_tokens_ahead)

    def first_token(self, worker: str, request_id: str, now: float | None = None) -> None:
        """The prefill worker's first token of ``request_id`` went to the client: its TPOT counts
        from now, while its KV is still to be pulled to ``worker``."""
        stream = self._stream(worker, request_id)
        if stream is not None:
            stream.first_token_at, stream.tokens = time.perf_counter() if now is None else now, 1

    def stream_started(self, worker: str, request_id: str, tokens: int, max_tokens: int, now: float | None = None) -> None:
        """``worker``'s first chunk of a stream, ``tokens`` long, arrived: added to its first
        token where that came from a prefill worker, else its TPOT counts from now."""
        at = time.perf_counter() if now is None else now
        stream = self._streams.setdefault(worker, {}).setdefault(request_id, _Stream(max_tokens))
        if stream.first_token_at is None:
            stream.first_token_at = at
        stream.tokens += tokens

    def streamed(self, worker: str, request_id: str, tokens: int, gap_s: float) -> None:
        """The stream ``request_id`` on ``worker`` got ``tokens`` more, ``gap_s`` after its last."""
        if tokens <= 0:
            return
        self._paces_s.setdefault(worker, deque(maxlen=_PACE_CHUNKS)).append(gap_s / tokens)
        stream = self._stream(worker, request_id)
        if stream is not None:
            stream.tokens += tokens

    def _stream(self, worker: str, request_id: str) -> _Stream | None:
        return self._streams.get(worker, {}).get(request_id)

    def stream_ended(self, worker: str, request_id: str) -> None:
        streams = self._streams.get(worker, {})
        streams.pop(request_id, None)
        if not streams:
            self._streams.pop(worker, None)

    def pace_s(self, worker: str) -> float | None:
        """Seconds per token lately on ``worker``'s streams, its steps without a prompt (None
        before any was relayed)."""
        paces = self._paces_s.get(worker)
        if not paces:
            return None
        return paces[0] if len(paces) == 1 else statistics.quantiles(paces, n=4)[0]

    def allows(self, worker: str, prompt_tokens: int, in_progress_tokens: int = 0, now: float | None = None) -> bool:
        """Whether ``worker`` may compute a prompt of ``prompt_tokens`` beside the
        ``in_progress_tokens`` of prompts it is computing already, with every stream it decodes
        still inside the TPOT target."""
        streams = self._streams.get(worker)
        if self.tpot_target_s is None or not streams:
            return True
        pace = self.pace_s(worker)
        if pace is None or not self.prompt_cost.known:
            return False
        at = time.perf_counter() if now is None else now
        limit = _HEADROOM * self.tpot_target_s
        stall_s = self.prompt_cost.stall_s(prompt_tokens) + self.prompt_cost.stall_s(in_progress_tokens)
        return all(stream.predicted_tpot_s(at, pace, stall_s) <= limit for stream in streams.values())
