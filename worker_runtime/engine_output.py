"""Fewer, fuller output messages from an engine core: at most one per interval.

A vLLM engine core sends its front end one ZeroMQ message per engine step, and the front end
(``AsyncLLM``, in duet's router) pays for each whatever it carries: about 1 ms of Python in
``duet bench front-end``, about 2 ms in the serving router here (every message also wakes each
request's stream). A decode engine steps every 10-25 ms at the batches disaggregation gives it,
more often than one engine doing both phases, so one stream of 96 tokens cost the router 1.6 ms
of CPU per token, more than vLLM's whole API server (docs/benchmarks/router.md).

With an interval set, the engine core's output thread sends what the busy loop produced, then
holds later outputs until ``interval`` has passed since that send, merging each request's new
tokens meanwhile. A request's first token and its last are sent at once, so time to first
token and end-to-end latency do not move; the tokens in between wait at most ``interval``, and
when steps take longer than the interval nothing waits. Tokens, their order and finish reasons
are unchanged: the front end already takes several new tokens per request in one output
(speculative decoding sends them so), and their logprobs likewise (one row per token: the rows
of consecutive steps are stacked). Messages that carry anything not safely merged (utility
calls, prompt logprobs, pooling, per-step counters, logprob rows of another width) are sent as
they are, in order.

It applies to every duet engine core whose pool sets an interval
(``PoolConfig.output_interval_ms``, which the engine host passes in ``DUET_OUTPUT_INTERVAL_MS``),
and duet's vLLM plugin installs it in the engine core's process (kv_transfer/vllm_plugin.py).
Decode engines are where it matters: theirs are the frequent messages.
"""

from __future__ import annotations

import queue
import time
from typing import Any

# Set by duet for each worker's engine core; read by duet's vLLM plugin in that process.
ENV_OUTPUT_INTERVAL_MS = "DUET_OUTPUT_INTERVAL_MS"
# Per-step counters a message's scheduler statistics may carry (besides the prefix caches'); a
# message with any of them is not merged into, so vLLM's counters lose nothing.
_DELTA_STATS = ("spec_decoding_stats", "kv_connector_stats", "ec_connector_stats")
# Per-output fields the merge does not combine; an output carrying one is sent as it is.
_UNMERGED_OUTPUT_FIELDS = (
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "routed_experts",
    "new_sampling_mask",
    "prompt_token_id_logprobs",
    "mm_cache_miss_hashes",
)


class CoalescingOutputQueue:
    """The engine core's output queue as its output thread sees it: ``get`` returns the merge
    of every mergeable message produced until ``interval_s`` after the previous send."""

    def __init__(self, inner: "queue.Queue[Any]", interval_s: float) -> None:
        self._inner = inner
        self._interval_s = interval_s
        self._held: Any = None  # a message taken while merging that could not be merged
        self._last_sent = 0.0

    def put_nowait(self, item: Any) -> None:
        self._inner.put_nowait(item)

    def get(self) -> Any:
        item, self._held = (self._held, None) if self._held is not None else (self._inner.get(), None)
        if not _mergeable(item):
            return item
        client_index, merged = item
        deadline = self._last_sent + self._interval_s
        while not _urgent(merged):
            wait_s = deadline - time.monotonic()
            try:
                following = self._inner.get(timeout=wait_s) if wait_s > 0 else self._inner.get_nowait()
            except queue.Empty:
                break
            if (
                not _mergeable(following) or following[0] != client_index or carries_deltas(merged)
                or not _logprobs_stack(merged, following[1])
            ):
                self._held = following
                break
            _merge_into(merged, following[1])
        self._last_sent = time.monotonic()
        return client_index, merged


def _mergeable(item: Any) -> bool:
    if not isinstance(item, tuple) or item[0] < 0:
        return False  # the shutdown sentinel, or a message for the data-parallel coordinator
    outputs = item[1]
    if outputs.utility_output is not None or outputs.wave_complete is not None or outputs.start_wave is not None:
        return False
    return all(getattr(output, name) is None for output in outputs.outputs for name in _UNMERGED_OUTPUT_FIELDS)


def _logprobs_stack(merged: Any, later: Any) -> bool:
    """Whether each of ``later``'s logprob rows can follow its request's rows in ``merged``:
    both present or both absent, and as wide (a step's rows are as wide as its batch's most
    alternatives; the front end reads a request's own count of them from each row)."""
    earlier = {output.request_id: output.new_logprobs for output in merged.outputs if output.finish_reason is None}
    for output in later.outputs:
        if output.request_id not in earlier:
            continue
        rows, more = earlier[output.request_id], output.new_logprobs
        if (rows is None) != (more is None) or (rows is not None and rows.logprobs.shape[1:] != more.logprobs.shape[1:]):
            return False
    return True


def _urgent(outputs: Any) -> bool:
    """A request's first token (vLLM attaches its prefill statistics to it) or last one: the
    time to first token and the end of a stream never wait."""
    return any(output.prefill_stats is not None or output.finish_reason is not None for output in outputs.outputs)


def carries_deltas(outputs: Any) -> bool:
    stats = outputs.scheduler_stats
    if stats is None:
        return False
    return (
        _counted(stats.prefix_cache_stats)
        or _counted(stats.connector_prefix_cache_stats)
        or bool(stats.kv_cache_eviction_events)
        or any(getattr(stats, name) is not None for name in _DELTA_STATS)
    )


def _counted(cache_stats: Any) -> bool:
    """Whether a step's prefix cache statistics count anything (with a KV connector, every step
    carries the connector's, mostly empty)."""
    return cache_stats is not None and (cache_stats.requests > 0 or cache_stats.reset)


def _merge_into(merged: Any, later: Any) -> None:
    """Fold ``later``'s outputs into ``merged``, one output per unfinished request."""
    open_outputs = {output.request_id: output for output in merged.outputs if output.finish_reason is None}
    for output in later.outputs:
        earlier = open_outputs.get(output.request_id)
        if earlier is None:
            merged.outputs.append(output)
            if output.finish_reason is None:
                open_outputs[output.request_id] = output
            continue
        earlier.new_token_ids = earlier.new_token_ids + output.new_token_ids  # a new list: vLLM may hold the old
        if output.new_logprobs is not None:
            earlier.new_logprobs = _stacked(earlier.new_logprobs, output.new_logprobs)
        earlier.finish_reason = output.finish_reason
        earlier.stop_reason = output.stop_reason
        if output.events:
            earlier.events = (earlier.events or []) + output.events
        if output.kv_transfer_params is not None:
            earlier.kv_transfer_params = output.kv_transfer_params
        if output.ec_transfer_params is not None:
            earlier.ec_transfer_params = output.ec_transfer_params
        if output.spec_decode_metrics is not None:
            earlier.spec_decode_metrics = output.spec_decode_metrics
        if earlier.prefill_stats is None:
            earlier.prefill_stats = output.prefill_stats
        earlier.num_nans_in_logits += output.num_nans_in_logits
        if earlier.finish_reason is not None:
            del open_outputs[output.request_id]
    if later.scheduler_stats is not None:
        merged.scheduler_stats = later.scheduler_stats
    if later.finished_requests:
        merged.finished_requests = (merged.finished_requests or set()) | later.finished_requests
    if later.weight_version is not None:
        merged.weight_version = later.weight_version
    merged.timestamp = later.timestamp


def _stacked(rows: Any, more: Any) -> Any:
    """One request's logprob rows of two steps as one (vLLM's LogprobsLists, one row a token)."""
    import numpy as np

    return type(rows)(
        np.concatenate([rows.logprob_token_ids, more.logprob_token_ids]),
        np.concatenate([rows.logprobs, more.logprobs]),
        np.concatenate([rows.sampled_token_ranks, more.sampled_token_ranks]),
        None,
    )


def install(interval_s: float) -> None:
    """Make every engine core of this process send through a :class:`CoalescingOutputQueue`.

    Called by duet's vLLM plugin in the engine core's process before the engine is built; the
    output thread's target is looked up on the class when the engine starts it."""
    from vllm.v1.engine.core import EngineCoreProc

    send_outputs = getattr(EngineCoreProc.process_output_sockets, "_duet_original", EngineCoreProc.process_output_sockets)

    def process_output_sockets(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.output_queue = CoalescingOutputQueue(self.output_queue, interval_s)
        return send_outputs(self, *args, **kwargs)

    process_output_sockets._duet_original = send_outputs  # type: ignore[attr-defined]
    EngineCoreProc.process_output_sockets = process_output_sockets  # type: ignore[method-assign]
