"""The token data paths. vLLM workers: the engine core sends every step's outputs to its front
end in the router, which streams them to the clients (the end-to-end test runs through the
shared deployment: real gRPC server, real actors, real engines). SIMULATED workers: requests go
in and every request's tokens, batched per engine step, come back over the worker's channel
(the channel tests drive both real ends, :class:`ActorChannel` and :class:`RouterLink`, over
loopback on both event loops).
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import uvloop

from duet.worker_runtime.worker_api import PrefillResult, SamplingSpec
from duet.worker_runtime.worker_channel import Outbox, RouterLink, sampling_from_wire, sampling_to_wire
from duet.router.actor_channel import ActorChannel
from duet.router.client import build_request


def test_outbox_batches_everything_put_since_the_last_batch():
    async def scenario() -> list[list[list]]:
        outbox = Outbox()
        batches = outbox.batches()
        outbox.put(["a", "tokens", [1], "x", None])
        outbox.put(["b", "tokens", [2], "y", None])
        first = await anext(batches)
        outbox.put(["a", "tokens", [3], "z", "length"])
        second = await anext(batches)
        assert (outbox.messages_sent, outbox.frames_sent) == (3, 2)
        return [first, second]

    first, second = asyncio.run(scenario())
    assert [m[0] for m in first] == ["a", "b"] and second == [["a", "tokens", [3], "z", "length"]]


def test_sampling_survives_the_wire():
    spec = SamplingSpec(
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, seed=7, stop=("x", "yz"), stop_token_ids=(2,), ignore_eos=True,
        presence_penalty=0.5, logit_bias=((3, -2.0), (9, 1.5)), bad_words=("no",), allowed_token_ids=(1, 2, 3),
        logprobs=2, structured_kind="regex", structured_value="[a-z]+", resumed_tokens=4,
    )
    assert sampling_from_wire(msgpack.unpackb(msgpack.packb(sampling_to_wire(spec)))) == spec


class _ScriptedWorker:
    """A worker's request handler with fixed answers, to drive the channel alone: prefill
    answers at once; decode streams ``count`` steps (one 3 MB text among them, which arrives in
    many socket reads) unless aborted; "boom" fails."""

    def __init__(self) -> None:
        self.link = RouterLink(self)
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    async def prefill(self, request_id, prompt_token_ids, sampling, decode_endpoint, pool_source=None) -> PrefillResult:
        if request_id == "boom":
            raise ValueError("no such thing")
        return PrefillResult(prompt_token_ids[-1] + 1, "t", len(prompt_token_ids), {"at": decode_endpoint}, None, "w")

    async def decode(self, request_id, prompt_token_ids, sampling, kv_transfer_params, first_token_id, first_text, *, reply) -> None:
        for step in range(sampling.max_tokens):
            text = "x" * 3_000_000 if step == 1 else f"s{step}"
            reply([request_id, "tokens", [first_token_id + step], text, "length" if step == sampling.max_tokens - 1 else None])
            await self.release.wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def _connected() -> tuple[ActorChannel, _ScriptedWorker]:
    """A router end and a worker end, connected over loopback."""
    channel = ActorChannel("127.0.0.1")
    await channel.start()
    worker = _ScriptedWorker()
    await worker.link.connect(channel.address)
    await channel.connected(5)
    return channel, worker


@pytest.mark.parametrize("run_loop", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_channel_carries_requests_and_answers_to_their_requests_only(run_loop):
    """A real router end and a real worker end over loopback, on both event loops duet runs
    (Ray's actors and the router use uvloop): each request gets its own answers in order; a
    worker's failure reaches its request as ``failed``; an abort cancels the worker's task;
    and when the worker's connection goes, every request still waiting gets ``lost``."""

    async def scenario() -> None:
        channel, worker = await _connected()
        spec = sampling_to_wire(SamplingSpec(max_tokens=3))

        prefilled, failed = channel.subscribe("p"), channel.subscribe("boom")
        channel.send(["prefill", "p", [5, 6], spec, "decode-0"])
        channel.send(["prefill", "boom", [5], spec, None])
        assert await asyncio.wait_for(prefilled.get(), 10) == ["p", "prefilled", 7, "t", 2, {"at": "decode-0"}, None, "w", None, None, None, 0]
        answer = await asyncio.wait_for(failed.get(), 10)
        assert answer[1] == "failed" and "no such thing" in answer[2]

        a, b = channel.subscribe("a"), channel.subscribe("b")
        channel.send(["decode", "a", [1], spec, None, 100, ""])
        channel.send(["decode", "b", [1], spec, None, 200, ""])
        channel.send(["decode", "nobody-listens", [1], spec, None, 300, ""])
        worker.release.set()
        got_a = [await asyncio.wait_for(a.get(), 10) for _ in range(3)]
        got_b = [await asyncio.wait_for(b.get(), 10) for _ in range(3)]
        assert [m[2] for m in got_a] == [[100], [101], [102]] and got_a[-1][4] == "length"
        assert [m[2] for m in got_b] == [[200], [201], [202]] and len(got_b[1][3]) == 3_000_000
        assert a.empty() and b.empty()

        worker.release.clear()
        slow = channel.subscribe("slow")
        channel.send(["decode", "slow", [1], spec, None, 1, ""])
        assert (await asyncio.wait_for(slow.get(), 10))[2] == [1]
        channel.send(["abort", "slow"])
        for _ in range(100):
            if "slow" in worker.aborted:
                break
            await asyncio.sleep(0.01)
        assert worker.aborted == ["slow"] and not worker.link._tasks

        waiting = channel.subscribe("w")
        channel.send(["decode", "w", [1], spec, None, 1, ""])
        await asyncio.wait_for(waiting.get(), 10)
        worker.link.close()  # as when the actor dies: its socket closes
        answer = await asyncio.wait_for(waiting.get(), 10)
        assert answer[1] == "lost"
        channel.close()

    run_loop(scenario())


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


def test_a_worker_dials_a_lost_channel_again_and_serves_whoever_listens_there():
    """A front door (or a control plane) that dies drops its channel to every SIMULATED worker:
    the worker aborts the requests that came over it, dials the same address again, and serves
    the replacement that listens there, as a vLLM engine core does for its clients."""

    async def scenario() -> None:
        channel, worker = await _connected()
        spec = sampling_to_wire(SamplingSpec(max_tokens=3))
        orphan = channel.subscribe("orphan")
        channel.send(["decode", "orphan", [1], spec, None, 1, ""])
        await asyncio.wait_for(orphan.get(), 10)
        channel.close()  # the front door's process died
        for _ in range(200):
            if "orphan" in worker.aborted:
                break
            await asyncio.sleep(0.01)
        assert worker.aborted == ["orphan"] and not worker.link._tasks

        replacement = ActorChannel(*channel.address)
        await replacement.start()
        await replacement.connected(10)  # the worker dialled again within its redial period
        worker.release.set()
        fresh = replacement.subscribe("fresh")
        replacement.send(["decode", "fresh", [1], spec, None, 50, ""])
        got = [await asyncio.wait_for(fresh.get(), 10) for _ in range(3)]
        assert [m[2] for m in got] == [[50], [51], [52]]
        outbox = worker.link.outbox
        assert outbox.messages_sent >= 4 and outbox.frames_sent >= 1  # counted over both connections
        worker.link.close()
        replacement.close()

    asyncio.run(scenario())
