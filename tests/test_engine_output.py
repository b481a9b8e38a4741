"""A decode engine's outputs travel together, at most one message per interval
(worker_runtime/engine_output.py).

The queue is driven with vLLM's own output structs, as the engine core's busy loop fills it;
the end-to-end test streams through the shared deployment, whose decode worker runs with the
default interval, and checks the merged stream is the reference engine's, token for token.
"""

from __future__ import annotations

import queue
import time

import numpy as np
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason, UtilityOutput
from vllm.v1.metrics.stats import PrefillStats, PrefixCacheStats, SchedulerStats
from vllm.v1.outputs import LogprobsLists

from duet.worker_runtime.engine_output import CoalescingOutputQueue
from duet.router.client import build_request

# Long, so that "sent at once" can be told from "held for the interval" with a bound (half of
# it) that no scheduling delay of a loaded machine reaches.
INTERVAL_S = 2.0


def _step(*outputs: tuple[str, list[int]], finished: str | None = None, running: int = 1) -> tuple[int, EngineCoreOutputs]:
    """One engine step's message, as from an engine with a KV connector: it carries the
    connector's prefix cache statistics, empty, at every step."""
    return 0, EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id, tokens, finish_reason=FinishReason.LENGTH if request_id == finished else None)
            for request_id, tokens in outputs
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=running, connector_prefix_cache_stats=PrefixCacheStats()),
    )


def _sent_recently(inner: queue.Queue) -> CoalescingOutputQueue:
    """A queue whose previous send was just now, so the next one is held for the interval."""
    coalescing = CoalescingOutputQueue(inner, INTERVAL_S)
    inner.put_nowait((0, EngineCoreOutputs()))
    coalescing.get()
    return coalescing


def test_outputs_within_the_interval_arrive_as_one_message_in_order():
    inner: queue.Queue = queue.Queue()
    coalescing = _sent_recently(inner)
    inner.put_nowait(_step(("a", [1]), ("b", [10])))
    inner.put_nowait(_step(("a", [2]), ("b", [11]), running=2))
    inner.put_nowait(_step(("a", [3]), ("b", [12]), ("c", [20]), finished="a", running=3))
    client_index, merged = coalescing.get()
    assert client_index == 0
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in merged.outputs] == [
        ("a", [1, 2, 3], FinishReason.LENGTH),
        ("b", [10, 11, 12], None),
        ("c", [20], None),
    ]
    assert merged.scheduler_stats.num_running_reqs == 3  # the latest gauges


def test_a_step_after_a_quiet_interval_is_sent_at_once():
    inner: queue.Queue = queue.Queue()
    coalescing = CoalescingOutputQueue(inner, INTERVAL_S)
    inner.put_nowait(_step(("a", [1])))
    started = time.monotonic()
    _, outputs = coalescing.get()
    assert time.monotonic() - started < INTERVAL_S / 2
    assert outputs.outputs[0].new_token_ids == [1]


def test_a_held_step_waits_at_most_the_interval():
    """Both steps are queued before ``get``, so what it merges does not depend on when another
    thread runs; the previous send was between ``before`` and ``after``."""
    inner: queue.Queue = queue.Queue()
    before = time.monotonic()
    coalescing = _sent_recently(inner)
    after = time.monotonic()
    inner.put_nowait(_step(("a", [1])))
    inner.put_nowait(_step(("a", [2])))
    _, outputs = coalescing.get()
    sent = time.monotonic()
    assert outputs.outputs[0].new_token_ids == [1, 2]
    # Held until the interval since the previous send had passed; the slack is for a loaded machine.
    assert INTERVAL_S <= sent - before and sent - after < INTERVAL_S + 2


def test_a_first_token_is_sent_at_once_and_a_last_one_ends_the_wait():
    inner: queue.Queue = queue.Queue()
    coalescing = _sent_recently(inner)
    first = _step(("new", [7]))
    first[1].outputs[0].prefill_stats = PrefillStats(num_prompt_tokens=40)
    inner.put_nowait(first)
    started = time.monotonic()
    assert coalescing.get()[1].outputs[0].new_token_ids == [7]
    assert time.monotonic() - started < INTERVAL_S / 2, "the first token waited"

    inner.put_nowait(_step(("new", [8])))
    inner.put_nowait(_step(("new", [9]), finished="new"))
    started = time.monotonic()
    last = coalescing.get()[1].outputs[0]
    assert (last.new_token_ids, last.finish_reason) == ([8, 9], FinishReason.LENGTH)
    assert time.monotonic() - started < INTERVAL_S / 2, "the last token waited"


def test_utility_answers_and_the_shutdown_sentinel_are_not_merged_and_keep_their_place():
    inner: queue.Queue = queue.Queue()
    coalescing = _sent_recently(inner)
    answer = (0, EngineCoreOutputs(utility_output=UtilityOutput(call_id=7)))
    for item in (_step(("a", [1])), answer, _step(("a", [2])), b"ENGINE_CORE_DEAD"):
        inner.put_nowait(item)
    received = [coalescing.get() for _ in range(4)]
    assert received[0][1].outputs[0].new_token_ids == [1]
    assert received[1] is answer
    assert received[2][1].outputs[0].new_token_ids == [2]
    assert received[3] == b"ENGINE_CORE_DEAD"


def _rows(token: int, width: int) -> LogprobsLists:
    """One token's logprob row, ``width`` entries wide (the sampled token, then alternatives)."""
    return LogprobsLists(
        np.array([[token] + list(range(100, 100 + width - 1))]), np.full((1, width), -float(token)), np.array([token % 7]),
    )


def test_logprob_rows_of_merged_steps_are_stacked_in_order():
    """Logprobs no longer stop the merge (a third of a mixed load asked for them, so no decode
    message merged: measured 2x the router's CPU per token); rows of another width do."""
    inner: queue.Queue = queue.Queue()
    coalescing = _sent_recently(inner)
    steps = [_step(("a", [token]), ("b", [token + 10])) for token in (1, 2, 3)]
    for step, token in zip(steps, (1, 2, 3)):
        step[1].outputs[0].new_logprobs = _rows(token, 3)
        inner.put_nowait(step)
    wider = _step(("a", [4]))
    wider[1].outputs[0].new_logprobs = _rows(4, 5)
    inner.put_nowait(wider)
    merged = coalescing.get()[1].outputs
    assert [output.new_token_ids for output in merged] == [[1, 2, 3], [11, 12, 13]]
    rows = merged[0].new_logprobs
    assert rows.logprob_token_ids[:, 0].tolist() == [1, 2, 3] and rows.logprobs[:, 0].tolist() == [-1.0, -2.0, -3.0]
    assert rows.sampled_token_ranks.tolist() == [1, 2, 3] and merged[1].new_logprobs is None
    assert coalescing.get()[1].outputs[0].new_logprobs.logprobs.shape == (1, 5)


def test_a_step_with_prefix_cache_counts_is_not_merged_into():
    """Its per-step counters would be overwritten by the next step's statistics."""
    inner: queue.Queue = queue.Queue()
    coalescing = _sent_recently(inner)
    counted = _step(("a", [1]))
    counted[1].scheduler_stats.prefix_cache_stats.record(num_tokens=16, num_hits=8, preempted=False)
    inner.put_nowait(counted)
    inner.put_nowait(_step(("a", [2])))
    first, second = coalescing.get()[1], coalescing.get()[1]
    assert first.scheduler_stats.prefix_cache_stats.hits == 8 and first.outputs[0].new_token_ids == [1]
    assert second.outputs[0].new_token_ids == [2]


def test_merged_decode_stream_equals_the_reference_engine(client, reference):
    """The shared deployment's decode worker holds outputs for the default interval: its
    stream arrives in messages of several tokens, and they are the colocated engine's tokens."""
    prompt = list(range(5, 45))
    responses = list(client.generate(build_request(prompt_token_ids=prompt, max_tokens=64, ignore_eos=True), timeout=120))
    tokens = [token for response in responses for token in response.token_ids]
    assert tokens == reference.greedy([prompt], max_tokens=64, ignore_eos=True)[0]
    assert max(len(response.token_ids) for response in responses) >= 2, "no message carried more than one token"
