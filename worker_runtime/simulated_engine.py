"""A SIMULATED engine: vLLM's ``AsyncLLM`` interface, timed by the placement latency model.

For control-plane scale tests and what-if runs only: it runs duet's real router, pools, Admin
API and workers (the same PrefillWorker and DecodeWorker actors, which call it instead of vLLM)
with dozens of workers on two cores, since it computes nothing and imports neither torch nor
vLLM. Its tokens are a deterministic function of the prompt, not a model's output, and every
place it is used says so (worker state, ``duet status``, logs).

What it models, from an :class:`~duet.cluster.placement.latency_model.EnginePerf` (a
``duet profile`` output, or DistServe's A100 profiles):

- continuous batching as vLLM schedules it: each step either runs a prefill batch (waiting
  prompts up to ``max_num_batched_tokens``) or one decode step for every running sequence, and
  takes the model's prefill or decode-step time;
- KV capacity: a request is admitted only while the KV its prompt and outputs need fits in
  ``kv_capacity_tokens``; the rest wait;
- KV transfer: a decode request that arrives with a prefill's transfer parameters waits the time
  its prompt's KV takes to cross at ``transfer_gbps`` before it joins the batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

from duet.cluster.placement.latency_model import EnginePerf
from duet.worker_runtime.worker_api import SamplingSpec

logger = logging.getLogger(__name__)

SIMULATED = "SIMULATED"


@dataclass(frozen=True)
class SimulatedParams:
    """What a worker hands the simulated engine instead of vLLM's SamplingParams."""

    sampling: SamplingSpec
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: None = None  # a SIMULATED engine computes no model, so no log-probabilities
    stop_reason: None = None


@dataclass
class _Output:
    """Shaped like vLLM's RequestOutput (delta outputs), as much as the workers read of it."""

    outputs: list[_Completion]
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: None = None
    num_cached_tokens: int = 0  # a SIMULATED engine keeps no prefix cache


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    remote_kv_tokens: int  # > 0: the prompt's KV comes from a prefill worker
    hand_over: bool  # prefill for a remote decode: finish after the first token, keep the KV
    outputs: asyncio.Queue[_Output] = field(default_factory=asyncio.Queue)
    produced: int = 0
    # Tokens produced but not yet sent (held to merge, as a duet engine core's outputs are).
    held: list[int] = field(default_factory=list)
    # The last 16 tokens of the prompt and output so far, which the next token is derived from.
    recent: list[int] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt) + self.max_tokens


def simulated_perf(profile: str, tp: int, pp: int) -> tuple[EnginePerf, float]:
    """The engine timing and KV bytes per token for ``profile``: ``distserve:MODEL`` or the path
    of a ``duet profile`` output."""
    from pathlib import Path

    from duet.cluster.placement.cluster_spec import traces_dir
    from duet.cluster.placement.latency_model import LatencyModel, load_distserve_profile
    from duet.cluster.placement.models import get_model

    if profile.startswith("distserve:"):
        model = get_model(profile.removeprefix("distserve:"))
        directory = traces_dir()
        latency = load_distserve_profile(
            directory / "profiler-a100-80g.distserve.json", model, directory / "max_num_tokens.csv"
        )
        return latency.engine(tp, pp), float(model.kv_bytes_per_token)
    return LatencyModel.load(Path(profile)).engine(tp, pp), 0.0


def simulated_next_token(recent: list[int], length: int, vocab_size: int) -> int:
    """The simulated engine's next token after a sequence (prompt and tokens so far) of
    ``length`` tokens that ends with ``recent`` (its last 16, or all if fewer).

    A function of the sequence alone, as greedy decoding is: every worker derives the same
    tokens, so decode re-derives prefill's first token, and a request that resumes on another
    worker (its streamed tokens appended to its prompt) continues exactly where it stopped."""
    seed = sum(recent[-16:]) * 1_000_003 + length
    return 3 + seed % (vocab_size - 3)


def simulated_tokens(prompt: list[int], count: int, vocab_size: int) -> list[int]:
    """The first ``count`` tokens the simulated engine generates for ``prompt``."""
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(simulated_next_token(sequence[-16:], len(sequence), vocab_size))
    return sequence[len(prompt):]


class SimulatedEngine:
    def __init__(
        self,
        perf: EnginePerf,
        max_model_len: int,
        vocab_size: int,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_bytes_per_token: float = 0.0,
        transfer_gbps: float = 25.0,
        output_interval_s: float = 0.0,
    ) -> None:
        self.perf = perf
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.transfer_gbps = transfer_gbps
        # Outputs leave at most once per interval, as from a duet engine core (the pool's
        # output_interval_ms, worker_runtime/engine_output.py), so that the serving path sees
        # the messages a real deployment sends it: first and last tokens at once, the tokens
        # in between merged until the first step after the interval.
        self.output_interval_s = output_interval_s
        self._last_sent = 0.0
        self.vocab_size = vocab_size
        # The attributes of AsyncLLM that duet's workers read.
        self.model_config = SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: vocab_size)
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size))
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: len(self._requests))
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._kv_used = 0
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        # Seconds each request spent in this engine (arrival to last output), for measuring
        # what the serving path around the engines adds (`duet bench router`).
        self.engine_seconds: dict[str, float] = {}

    # ---- the AsyncLLM interface the workers use -------------------------------------------

    async def generate(
        self, inputs: dict[str, Any], params: SimulatedParams, request_id: str, lora_request: Any = None, priority: int = 0
    ) -> AsyncIterator[_Output]:
        """``AsyncLLM.generate``'s shape; ``lora_request`` and ``priority`` are accepted and
        ignored (no model is computed here, so an adapter changes nothing a simulation measures;
        its queue is first come, first served)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="simulated-engine")
        prompt = list(inputs["prompt_token_ids"])
        transfer = params.kv_transfer_params or {}
        request = _Request(
            request_id,
            prompt,
            params.sampling.max_tokens,
            remote_kv_tokens=int(transfer.get("simulated_kv_tokens", 0)),
            hand_over=bool(transfer.get("do_remote_decode")),
            recent=prompt[-16:],
        )
        self._requests[request_id] = request
        arrived = time.perf_counter()
        if request.remote_kv_tokens:
            await asyncio.sleep(request.remote_kv_tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9))
        self._waiting.append(request)
        self._wake.set()
        try:
            while True:
                output = await request.outputs.get()
                yield output
                if output.finished:
                    return
        finally:
            self._forget(request)
            if len(self.engine_seconds) < 1_000_000:
                self.engine_seconds[request_id] = time.perf_counter() - arrived

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._forget(request)
            request.outputs.put_nowait(_Output([_Completion([], "", "abort")], finished=True))

    async def reset_prefix_cache(self) -> bool:
        return True  # it caches nothing

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()

    def check_scheduler(self) -> None:
        """Raises if the scheduler loop has ended (an error stopped it): every request would
        wait on it forever while the actor still answers, so the health ping must fail."""
        task = self._loop_task
        if task is not None and task.done():
            error = "cancelled" if task.cancelled() else repr(task.exception())
            raise RuntimeError(f"the SIMULATED scheduler stopped: {error}")

    def load(self) -> tuple[float, int]:
        """(KV usage, running sequences), as a health ping reports them."""
        return self._kv_used / max(1, self.perf.kv_capacity_tokens), len(self._running)

    # ---- the scheduler ---------------------------------------------------------------------

    def _forget(self, request: _Request) -> None:
        if self._requests.pop(request.request_id, None) is None:
            return
        if request in self._waiting:
            self._waiting.remove(request)
        elif request in self._running:
            self._running.remove(request)
            self._kv_used -= request.kv_tokens

    def _admit(self) -> list[_Request]:
        """Waiting requests that fit this step's token budget, the sequence limit and the KV."""
        batch: list[_Request] = []
        budget = self.max_num_batched_tokens
        while self._waiting and len(self._running) + len(batch) < self.max_num_seqs:
            request = self._waiting[0]
            compute = 1 if request.remote_kv_tokens else len(request.prompt)
            if batch and compute > budget:
                break
            if self._kv_used + request.kv_tokens > self.perf.kv_capacity_tokens and (batch or self._running):
                break
            self._waiting.popleft()
            self._kv_used += request.kv_tokens
            budget -= compute
            batch.append(request)
        return batch

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            batch = self._admit()
            if batch:
                computed = [1 if r.remote_kv_tokens else len(r.prompt) for r in batch]
                await asyncio.sleep(self.perf.prefill_latency_s(sum(computed), sum(n * n for n in computed)))
                for request in batch:
                    if request.request_id in self._requests:
                        self._running.append(request)
                        self._emit(request)
                    else:  # aborted during its prefill
                        self._kv_used -= request.kv_tokens
                continue
            if self._running:
                context = sum(len(r.prompt) + r.produced for r in self._running)
                await asyncio.sleep(self.perf.decode_step_s(len(self._running), context))
                now = time.monotonic()
                send = now - self._last_sent >= self.output_interval_s
                if send:
                    self._last_sent = now
                for request in list(self._running):
                    self._emit(request, send)

    def _emit(self, request: _Request, send: bool = True) -> None:
        """Produce ``request``'s next token; send what it holds if ``send``, or if the token is
        its first or last."""
        token = simulated_next_token(request.recent, len(request.prompt) + request.produced, self.vocab_size)
        request.recent = request.recent[-15:] + [token]
        request.produced += 1
        request.held.append(token)
        done = request.produced >= request.max_tokens or request.hand_over
        if send or done or request.produced == 1:
            tokens, request.held = request.held, []
            transfer = {"simulated_kv_tokens": len(request.prompt)} if request.hand_over else None
            completion = _Completion(tokens, "".join(f" t{t}" for t in tokens), "length" if done else None)
            request.outputs.put_nowait(_Output([completion], finished=done, kv_transfer_params=transfer))
        if done:
            self._running.remove(request)
            self._kv_used -= request.kv_tokens
