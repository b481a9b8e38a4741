"""Which worker failures a request survives, and which end it (router/lifecycle.py).

The request lifecycle is real; the engines are scripted to fail a request in the two ways the
router tells apart (router/worker_engines.py): crashed (the engine ended itself while it held
the request, which the request may have caused) or lost some other way (killed, hung,
removed). The real thing, a vLLM engine core dying of SIGSEGV twice under one stream, is in
tests/test_faults.py; these cover every count quickly.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from duet.router.lifecycle import RequestCrashesEngines, RequestFailed, RequestLifecycle, RetryPolicy
from duet.router.pools import PoolMember, WorkerPool
from duet.router.validation import ValidatedRequest
from duet.router.worker_engines import EngineLost
from duet.worker_runtime.worker_api import DecodeChunk, SamplingSpec


class _ScriptedEngine:
    """Streams one token per request, then either finishes it or fails as scripted."""

    def __init__(self, failure: EngineLost | None) -> None:
        self.failure = failure
        self.requests: list[list[int]] = []

    async def decode(self, request_id, prompt_token_ids, sampling, kv_transfer_params, first_token_id, first_text) -> AsyncIterator[DecodeChunk]:
        self.requests.append(list(prompt_token_ids))
        yield DecodeChunk([len(prompt_token_ids)], "x")
        if self.failure is not None:
            raise self.failure
        yield DecodeChunk([0], "y", "length")

    def lost(self, error: BaseException) -> None:
        """What the pool tells a failed worker's engine."""


class _FirstReady:
    """Routes to the first ready worker, so each attempt lands on the next scripted one."""

    name = "first_ready"

    def choose(self, ready: list[PoolMember], prompt: list[int], adapter: str = "") -> PoolMember:
        return ready[0]

    def describe(self) -> str:
        return self.name


def _serve(failures: list[EngineLost | None], max_engine_crashes: int = 2) -> tuple[list[int] | BaseException, list[_ScriptedEngine]]:
    """One request through a colocated pool whose workers fail as ``failures`` say, in order
    (no replacements: a failed worker stays failed, so each attempt lands on the next one)."""
    engines = [_ScriptedEngine(failure) for failure in failures]
    members = [PoolMember(f"worker-{n}", actor=None, engine=engine) for n, engine in enumerate(engines)]
    pool = WorkerPool("colocated", members=members, policy=_FirstReady())
    lifecycle = RequestLifecycle(None, pool, RetryPolicy(worker_wait_s=1.0, max_engine_crashes=max_engine_crashes))
    request = ValidatedRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=8))

    async def run() -> list[int]:
        return [token for event in [e async for e in lifecycle.run(request)] for token in event.token_ids]

    try:
        return asyncio.run(run()), engines
    except (RequestFailed, RequestCrashesEngines) as error:
        return error, engines


def crashed() -> EngineLost:
    return EngineLost("worker is gone (engine core crashed: {'EngineCore_DP0': -11})", crashed=True)


def killed() -> EngineLost:
    return EngineLost("worker is gone (engine core exited: {'EngineCore_DP0': -9})")


def test_a_request_resumes_after_one_crash_and_after_kills():
    for failures in ([crashed(), None], [killed(), killed(), None], [crashed(), killed(), None]):
        tokens, engines = _serve(failures)
        assert isinstance(tokens, list), f"{failures}: {tokens}"
        # Each attempt resumed from the tokens already streamed (they joined its prompt).
        assert [len(engine.requests[0]) for engine in engines] == [3 + n for n in range(len(engines))]


def test_a_request_held_by_two_crashing_engines_is_not_tried_on_another():
    # Kills in between neither count as crashes nor reset the count.
    for failures in ([crashed(), crashed(), None], [crashed(), killed(), crashed(), None]):
        error, engines = _serve(failures)
        assert isinstance(error, RequestCrashesEngines), f"{failures}: {error}"
        assert "2 engines crashed while they held this request" in str(error)
        assert engines[-1].requests == [], "the request went on to another engine"


def test_without_the_guard_crashes_are_retried_like_any_failure():
    tokens, _ = _serve([crashed(), crashed(), None], max_engine_crashes=0)
    assert isinstance(tokens, list)
    error, engines = _serve([crashed(), crashed(), crashed(), None], max_engine_crashes=0)
    assert isinstance(error, RequestFailed) and "gave up after 3 attempts" in str(error)
    assert engines[-1].requests == []


def test_clients_are_told_not_to_retry_a_request_that_crashes_engines():
    """gRPC's INTERNAL is outside every client's retry rule; OpenAI's SDKs retry a 500 unless
    the answer says ``x-should-retry: false``."""
    from duet.router.http_server import _api_error

    response = _api_error(RequestCrashesEngines("2 engines crashed while they held this request")).response()
    assert response.status == 500
    assert response.headers["x-should-retry"] == "false"
    assert b'"code":"request_crashes_engines"' in response.body.replace(b" ", b"")


def test_a_crash_found_by_the_control_plane_counts_in_every_front_door():
    """With front doors apart, the control plane's watch finds the crash: its pool records it,
    and it tells each front door the worker was lost and whether it crashed, so that the
    requests there count the crash too."""
    from duet.config import DuetConfig
    from duet.router.front_door import FrontDoor
    from duet.router.worker_engines import WorkerExited, WorkerGone
    from duet.worker_runtime.worker_api import EngineExit

    crash = WorkerExited(EngineExit.of_processes({"EngineCore": -11}))
    watched = PoolMember("decode-0", actor=None, engine=_ScriptedEngine(None))
    WorkerPool("decode", members=[watched]).mark_failed(watched, crash, watched.engine)
    assert watched.crashed and watched.state == "failed"  # what the control plane tells ("lost")

    told: list[BaseException] = []

    async def front_door_told() -> None:
        config = DuetConfig()
        door = FrontDoor(0, 2, config, config.served(), "127.0.0.1:1", None)
        engine = _ScriptedEngine(None)
        engine.lost = told.append  # type: ignore[method-assign]
        door.models[config.model.name].pools["decode"].members.append(PoolMember("decode-0", actor=None, engine=engine))
        await door.lost("decode-0", watched.error, watched.crashed)

    asyncio.run(front_door_told())
    assert len(told) == 1 and isinstance(told[0], WorkerGone) and told[0].crashed
