"""The token data paths. vLLM workers: the engine core sends every step's outputs to its front
end in the router, which streams them to the clients (the end-to-end test runs through the
shared deployment: real gRPC server, real actors, real engines). SIMULATED workers: each pushes
every request's tokens, batched per engine step, to the router's token socket (the outbox tests
drive the real :class:`TokenOutbox` and :class:`TokenReceiver` on both event loops).
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvloop

from duet.cluster.token_outbox import TokenOutbox
from duet.router.client import build_request
from duet.router.token_stream import TokenReceiver


def test_outbox_batches_everything_put_since_the_last_batch():
    async def scenario() -> list[list[tuple]]:
        outbox = TokenOutbox()
        batches = outbox.batches()
        outbox.put(("a", [1], "x", None))
        outbox.put(("b", [2], "y", None))
        first = await anext(batches)
        outbox.put(("a", [3], "z", "length"))
        second = await anext(batches)
        assert (outbox.updates_sent, outbox.batches_sent) == (3, 2)
        return [first, second]

    first, second = asyncio.run(scenario())
    assert first == [("a", [1], "x", None), ("b", [2], "y", None)]
    assert second == [("a", [3], "z", "length")]


@pytest.mark.parametrize("run_loop", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_updates_cross_the_socket_in_order_to_their_requests_only(run_loop):
    """A real outbox writes to a real receiver over loopback, on both event loops duet runs
    (Ray's actors and the router use uvloop): each subscribed request gets its own updates in
    order, including a batch far larger than one socket read; updates for requests nobody
    subscribed to are dropped."""

    async def scenario() -> tuple[list[tuple], list[tuple]]:
        receiver = TokenReceiver("127.0.0.1")
        await receiver.start()
        outbox = TokenOutbox()
        sender = asyncio.get_running_loop().create_task(outbox.run(receiver.address))
        a, b = receiver.subscribe("a"), receiver.subscribe("b")
        big_text = "x" * 3_000_000  # arrives in many reads: frames must be reassembled
        outbox.put(("a", [1], "one", None))
        outbox.put(("gone", [9], "nobody listens", None))
        outbox.put(("b", [2], big_text, None))
        await asyncio.sleep(0)
        outbox.put(("a", [3, 4], "two", "length"))
        got_a = [tuple(await asyncio.wait_for(a.get(), 10)) for _ in range(2)]
        got_b = [tuple(await asyncio.wait_for(b.get(), 10))]
        assert a.empty() and b.empty()
        sender.cancel()
        receiver.close()
        return got_a, got_b

    got_a, got_b = run_loop(scenario())
    assert got_a == [("a", [1], "one", None), ("a", [3, 4], "two", "length")]
    assert got_b[0][:2] == ("b", [2]) and len(got_b[0][2]) == 3_000_000


def test_sixteen_concurrent_streams_are_exact_and_decode_in_shared_steps(client, reference, worker_status):
    """Token ids and text equal a colocated engine's for 16 requests decoding at once through the
    engine front ends in the router, and the decode engine ran them in shared steps (fewer
    engine steps than tokens generated, as its front end recorded them)."""
    rng = random.Random(1616)
    prompts = [[rng.randrange(3, 700) for _ in range(rng.randint(20, 700))] for _ in range(16)]
    before = worker_status("decode")

    def run(prompt: list[int]) -> tuple[list[int], str]:
        ids: list[int] = []
        text = ""
        for message in client.generate(build_request(prompt_token_ids=prompt, max_tokens=48, ignore_eos=True), timeout=300):
            ids.extend(message.token_ids)
            text += message.text
        return ids, text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
    expected = reference.greedy_completions(prompts, max_tokens=48, ignore_eos=True)
    for (ids, text), (want_ids, want_text) in zip(results, expected):
        assert ids == want_ids
        assert text == want_text
    after = worker_status("decode").engine_metrics

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.engine_metrics.get(name, 0.0)

    generated = grew("vllm:generation_tokens_total")
    steps = grew("vllm:iteration_tokens_total_count")
    assert generated >= 16 * 47, f"the decode engine generated {generated} tokens"
    assert 0 < steps < generated / 2, f"{generated} tokens took {steps} engine steps: the requests were not batched"
