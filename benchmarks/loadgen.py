"""Open-loop trace replay against a running duet: requests leave at the trace's arrival times.

Open loop (each request is sent at its own arrival time, whether or not earlier ones finished) is
what the placement simulator assumes and what real clients do; a closed loop would slow its own
arrivals down exactly when the cluster falls behind and hide the queueing the SLOs are about.

Prompts are random token ids of the trace's input length, and ``ignore_eos`` with ``max_tokens``
equal to the trace's output length makes the engine generate exactly the trace's output, so the
real run and a simulation of the same :class:`~duet.cluster.placement.trace.Trace` serve the same
work. TTFT and TPOT are taken from the final message's usage (measured at the router); the
client's own view of both is kept beside them, since the two differ when the router falls behind.
The prompts and the open-loop schedule are shared with :mod:`~duet.benchmarks.openai_replay`, so
duet and a plain vLLM server are given the same requests at the same times.

    records = asyncio.run(replay("127.0.0.1:50051", trace.at_rate(4.0)))
    summary = replay_result(records).summary(Slo(1.0, 0.1))
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import numpy as np

from duet.cluster.placement.simulator import SimResult
from duet.cluster.placement.trace import Trace
from duet.benchmarks.request_mix import grpc_fields
from duet.router.client import build_request
from duet.router.proto import duet_api_pb2 as pb
from duet.router.proto import duet_api_pb2_grpc as pb_grpc

# Token ids for random prompts: above the tiny model's special tokens, inside any vocabulary.
PROMPT_TOKEN_RANGE = (3, 700)


@dataclass(frozen=True)
class RequestRecord:
    """One replayed request; latencies are NaN and ``error`` says why when it failed."""

    index: int
    scheduled_s: float  # arrival offset in the trace
    sent_s: float  # when it actually left, from the replay's start (lag = sent - scheduled)
    input_len: int
    output_len: int
    completion_tokens: int
    ttft_s: float  # router-measured (usage)
    tpot_s: float
    client_ttft_s: float  # from sending to the first message, at the client
    client_tpot_s: float
    error: str = ""
    client_e2e_s: float = math.nan  # from sending to the end of the stream (or the failure)
    prefill_worker: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def replay_result(records: list[RequestRecord], client: bool = False) -> SimResult:
    """The measured run in the simulator's result type, so both are summarised by one function.

    A failed request (rejected, error, or fewer tokens than asked) never met its SLO: it counts
    with infinite latency, as an unfinished request does in the simulator. ``client`` takes the
    client's TTFT/TPOT instead of the router's, to compare servers that differ in front ends.
    """
    ttft = [r.client_ttft_s if client else r.ttft_s for r in records]
    tpot = [r.client_tpot_s if client else r.tpot_s for r in records]
    failed = np.array([bool(r.error) for r in records], dtype=bool)
    return SimResult(
        ttft_s=np.where(failed, math.inf, np.array(ttft, dtype=float)),
        tpot_s=np.where(failed, math.inf, np.array(tpot, dtype=float)),
        stopped_early=False,
    )


def prompt_token_ids(trace: Trace, seed: int = 0) -> list[list[int]]:
    """The random prompt of each trace row; every replay of ``(trace, seed)`` sends these."""
    rng = np.random.default_rng(seed)
    low, high = PROMPT_TOKEN_RANGE
    return [rng.integers(low, high, int(n_in)).tolist() for n_in in trace.input_len]


def build_requests(trace: Trace, model: str = "", seed: int = 0, mix: str = "plain") -> list[pb.GenerateRequest]:
    """One greedy request per trace row, built before the replay so timing is not disturbed;
    ``mix`` adds features to each (benchmarks/request_mix.py)."""
    return [
        build_request(
            prompt_token_ids=prompt,
            max_tokens=int(n_out),
            ignore_eos=True,
            model=model,
            request_id=f"loadgen-{seed}-{i}",
            **grpc_fields(mix, i),
        )
        for i, (prompt, n_out) in enumerate(zip(prompt_token_ids(trace, seed), trace.output_len))
    ]


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (at least one), as the value at rank ``q x (n - 1)``."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def client_tpot(first_s: float, last_s: float, tokens: int) -> float:
    """Mean gap between streamed tokens as the client saw them; 0 for a single token."""
    return (last_s - first_s) / (tokens - 1) if tokens > 1 else 0.0


async def open_loop(
    trace: Trace,
    send: Callable[[int, float, float], Awaitable[RequestRecord]],
    on_done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Start ``send(index, scheduled_s, start)`` for each row at its arrival offset; records in order.

    ``start`` is the replay's ``time.perf_counter()`` origin. ``on_done`` is called as each
    request finishes (a progress bar), in completion order.
    """
    offsets = (trace.arrival_s - trace.arrival_s[0]).tolist()

    async def tracked(index: int, start: float) -> RequestRecord:
        record = await send(index, offsets[index], start)
        if on_done is not None:
            on_done()
        return record

    start = time.perf_counter()
    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(tracked(index, start)))
    return list(await asyncio.gather(*tasks))


async def send_one(
    stub: pb_grpc.DuetStub, index: int, request: pb.GenerateRequest, scheduled_s: float, start: float, timeout_s: float
) -> RequestRecord:
    sent = time.perf_counter()
    first = last = math.nan
    tokens = 0
    final = pb.GenerateResponse()
    error = ""
    try:
        async for message in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if message.token_ids:
                first = now if tokens == 0 else first
                last = now
                tokens += len(message.token_ids)
            final = message
    except grpc.aio.AioRpcError as rpc_error:
        error = f"{rpc_error.code().name}: {rpc_error.details()}"
    ended = time.perf_counter()
    if not error and tokens != request.max_tokens:
        error = f"got {tokens} of {request.max_tokens} tokens"
    usage = final.usage if final.HasField("usage") and not error else None
    return RequestRecord(
        index=index,
        scheduled_s=scheduled_s,
        sent_s=sent - start,
        input_len=len(request.prompt_token_ids.ids),
        output_len=request.max_tokens,
        completion_tokens=tokens,
        ttft_s=usage.ttft_s if usage else math.nan,
        tpot_s=usage.tpot_s if usage else math.nan,
        client_ttft_s=first - sent,
        client_tpot_s=client_tpot(first, last, tokens),
        error=error,
        client_e2e_s=ended - sent,
        prefill_worker=usage.prefill_worker if usage else "",
    )


@contextlib.asynccontextmanager
async def connected_stubs(target: str, connections: int) -> AsyncIterator[list[pb_grpc.DuetStub]]:
    """``connections`` ready stubs, each on a connection of its own (a local subchannel pool),
    which the kernel spreads over a deployment's front doors behind one port (SO_REUSEPORT)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(grpc.aio.insecure_channel(target, options)) for _ in range(connections)]
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        yield [pb_grpc.DuetStub(channel) for channel in channels]


async def replay(
    target: str,
    trace: Trace,
    model: str = "",
    seed: int = 0,
    timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
    connections: int = 1,
    mix: str = "plain",
) -> list[RequestRecord]:
    """Send every request of ``trace`` at its arrival offset; returns the records in trace order.

    ``connections``: requests take turns over this many connections (:func:`connected_stubs`)."""
    requests = build_requests(trace, model, seed, mix)
    async with connected_stubs(target, connections) as stubs:

        async def send(index: int, scheduled_s: float, start: float) -> RequestRecord:
            return await send_one(stubs[index % connections], index, requests[index], scheduled_s, start, timeout_s)

        return await open_loop(trace, send, on_done)
