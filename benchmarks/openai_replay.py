"""Open-loop trace replay against an OpenAI-compatible HTTP server (vLLM's ``api_server``).

The baseline a disaggregated deployment has to beat is plain vLLM behind its own HTTP front end.
To compare the two on equal terms this replay sends exactly what :func:`~duet.benchmarks.loadgen.replay`
sends to duet: the same prompt token ids (:func:`~duet.benchmarks.loadgen.prompt_token_ids`), the
same greedy ``ignore_eos`` requests with ``max_tokens`` equal to the trace's output, on the same
open-loop schedule (:func:`~duet.benchmarks.loadgen.open_loop`).

Latencies are the client's: TTFT from sending to the first streamed chunk that carries a choice,
TPOT from the first to the last such chunk over ``completion_tokens - 1``. The token count comes
from the final usage chunk (``stream_options.include_usage``), since vLLM may merge several
tokens into one chunk under load; without a usage chunk the chunks are counted. The server has
no router usage, so the record's ``ttft_s``/``tpot_s`` hold the client values too.

:func:`replay_openai_chat` replays chat requests built by the caller (``duet bench serve
--images``) through the same streaming and recording. A chat stream opens with a chunk carrying
the assistant's role alone, which vLLM's server and duet both send with the first token, so it
times the first token as a completion's first chunk does.

    records = asyncio.run(replay_openai("http://127.0.0.1:8000", model, trace.at_rate(4.0)))
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from duet.benchmarks.loadgen import RequestRecord, client_tpot, open_loop, prompt_token_ids
from duet.benchmarks.request_mix import openai_fields
from duet.cluster.placement.trace import Trace


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON payload of each ``data:`` line of a server-sent event stream, up to ``[DONE]``."""
    async for raw in content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, other fields
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def error_message(status: int, body: str) -> str:
    """``HTTP <status>: <message>`` from an OpenAI error body (``{"error": {...}}`` or vLLM's flat form)."""
    try:
        data = json.loads(body)
    except ValueError:
        return f"HTTP {status}: {body.strip()[:500]}"
    detail = data.get("error", data) if isinstance(data, dict) else data
    message = detail.get("message", detail) if isinstance(detail, dict) else detail
    return f"HTTP {status}: {message}"


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    input_len: int,
    index: int,
    scheduled_s: float,
    start: float,
    timeout_s: float,
) -> RequestRecord:
    sent = time.perf_counter()
    first = last = math.nan
    chunks = 0
    usage_tokens: int | None = None
    error = ""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                error = error_message(response.status, await response.text())
            else:
                async for event in sse_data(response.content):
                    now = time.perf_counter()
                    if "error" in event:  # vLLM reports a failure during generation in the stream
                        error = error_message(response.status, json.dumps(event))
                        break
                    if event.get("choices"):
                        first = now if chunks == 0 else first
                        last = now
                        chunks += 1
                    if event.get("usage"):
                        usage_tokens = int(event["usage"]["completion_tokens"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:  # incl. malformed chunks
        error = f"{type(exc).__name__}: {exc}"
    ended = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    if not error and tokens != body["max_tokens"]:
        error = f"got {tokens} of {body['max_tokens']} tokens"
    ttft = first - sent
    tpot = client_tpot(first, last, tokens)
    return RequestRecord(
        index=index,
        scheduled_s=scheduled_s,
        sent_s=sent - start,
        input_len=input_len,
        output_len=body["max_tokens"],
        completion_tokens=tokens,
        ttft_s=ttft,
        tpot_s=tpot,
        client_ttft_s=ttft,
        client_tpot_s=tpot,
        error=error,
        client_e2e_s=ended - sent,
    )


def greedy_stream(max_tokens: int) -> dict[str, Any]:
    """The fields every replayed OpenAI request carries, completion or chat: greedy, exactly
    ``max_tokens`` tokens (the trace's output), streamed, with the usage chunk that counts them."""
    return {
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _replay_bodies(
    url: str,
    trace: Trace,
    bodies: list[dict[str, Any]],
    input_lens: list[int],
    timeout_s: float,
    on_done: Callable[[], None] | None,
) -> list[RequestRecord]:
    """POST ``bodies[i]`` to ``url`` at row ``i``'s arrival offset; the records in trace order."""
    # No connection limit: an open loop must not queue requests in the client.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(index: int, scheduled_s: float, start: float) -> RequestRecord:
            return await _one(session, url, bodies[index], input_lens[index], index, scheduled_s, start, timeout_s)

        return await open_loop(trace, send, on_done)


async def replay_openai(
    base_url: str,
    model: str,
    trace: Trace,
    seed: int = 0,
    timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
    mix: str = "plain",
) -> list[RequestRecord]:
    """Send every request of ``trace`` to ``{base_url}/v1/completions`` at its arrival offset;
    ``mix`` adds features to each (benchmarks/request_mix.py).

    Returns the records in trace order; ``on_done`` is called as each request finishes.
    """
    bodies = [
        {"model": model, "prompt": prompt, **greedy_stream(int(n_out)), **openai_fields(mix, index)}
        for index, (prompt, n_out) in enumerate(zip(prompt_token_ids(trace, seed), trace.output_len))
    ]
    url = f"{base_url.rstrip('/')}/v1/completions"
    return await _replay_bodies(url, trace, bodies, [len(body["prompt"]) for body in bodies], timeout_s, on_done)


async def replay_openai_chat(
    base_url: str,
    trace: Trace,
    bodies: list[dict[str, Any]],
    timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Send ``bodies[i]``, chat requests built before the clock starts (the image trace's,
    benchmarks/image_trace.py: encoding images is the client's work, not the replay's), to
    ``{base_url}/v1/chat/completions`` at row ``i``'s arrival offset of ``trace``. A record's
    ``input_len`` is the trace's prompt length: the chat's text, its images' tokens not counted."""
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    return await _replay_bodies(url, trace, bodies, [int(n) for n in trace.input_len], timeout_s, on_done)
