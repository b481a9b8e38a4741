"""How a pool member's state follows what the health watcher finds (cluster/health.py,
router/pools.py), without engines: the states a removal passes through."""

from __future__ import annotations

import asyncio
import signal
import time

from duet.cluster.health import HealthWatcher
from duet.router import pools
from duet.router.engine_front_end import ping_needs_round_trip
from duet.router.pools import PoolMember, WorkerPool
from duet.worker_runtime.worker_api import EngineExit


def test_a_worker_being_removed_is_not_failed_by_the_health_watcher():
    """A drained worker's removal closes its engine (``engine`` None) and then waits for its
    actor to shut down, which takes a vLLM worker's actor up to a couple of seconds
    (worker_runtime/engine_host.py). The watcher keeps running meanwhile: it must leave the worker
    to its removal, not report it ``failed`` for having no engine to ping or watch."""
    member = PoolMember("decode-1", actor=None, state="draining", engine=None)
    pool = WorkerPool("decode", members=[PoolMember("decode-0", actor=None, state="starting"), member])

    async def watch_for_a_while() -> None:
        watcher = HealthWatcher([pool], interval_s=0.01, timeout_s=1.0)
        watcher.start()
        await asyncio.sleep(0.2)  # about twenty rounds of pings and watches
        watcher.stop()

    asyncio.run(watch_for_a_while())
    assert (member.state, member.error) == ("draining", "")


class _SlowEngine:
    """An engine whose first ``slow`` pings take longer than the watcher waits (a starved host,
    or a hung engine when ``slow`` is large); the others answer at once. ``starved``: its
    threads wait for a CPU all the time (as the kernel would report on an oversubscribed host),
    else never."""

    def __init__(self, slow: int, starved: bool = False) -> None:
        self.slow = slow
        self.starved = starved
        self.pings = 0

    async def threads_cpu_wait(self) -> dict[int, float]:
        return {1: time.monotonic() if self.starved else 0.0}

    async def ping(self) -> tuple[float, int]:
        self.pings += 1
        if self.pings <= self.slow:
            await asyncio.sleep(1.0)
        return 0.1, 0

    async def watch(self) -> str:
        await asyncio.Event().wait()
        return ""

    def lost(self, error: BaseException) -> None:
        """What the pool tells a failed worker's engine (its requests resume elsewhere)."""


def _watch(engine: _SlowEngine, seconds: float, starved_limit_s: float = 60.0) -> PoolMember:
    member = PoolMember("decode-0", actor=None, state="ready", engine=engine)  # type: ignore[arg-type]
    pool = WorkerPool("decode", members=[member])  # no restart: a failed worker stays "failed"

    async def watch_for_a_while() -> None:
        watcher = HealthWatcher([pool], interval_s=0.01, timeout_s=0.05, failures=3, starved_limit_s=starved_limit_s)
        watcher.start()
        await asyncio.sleep(seconds)
        watcher.stop()

    asyncio.run(watch_for_a_while())
    return member


def test_one_slow_health_ping_is_not_a_hang():
    """Two pings in a row answered late (fewer than router.health_failures), then answers: the
    worker stays in rotation, with its load reported."""
    member = _watch(_SlowEngine(slow=2), seconds=0.5)
    assert (member.state, member.error) == ("ready", "")
    assert member.kv_usage == 0.1


def test_a_worker_that_misses_its_pings_in_a_row_is_failed():
    member = _watch(_SlowEngine(slow=1000), seconds=0.5)
    assert member.state == "failed"
    assert "3 health ping(s) in a row" in member.error


def test_a_replacement_does_not_inherit_its_predecessors_missed_pings():
    """Two pings missed by an engine that is then replaced (same worker, new engine): the
    replacement's first slow ping is its first miss, not the third in a row."""
    member = PoolMember("decode-0", actor=None, state="ready", engine=_SlowEngine(slow=1000))  # type: ignore[arg-type]
    pool = WorkerPool("decode", members=[member])

    async def replace_after_two_misses() -> None:
        watcher = HealthWatcher([pool], interval_s=0.01, timeout_s=0.05, failures=3)
        watcher.start()
        await asyncio.sleep(0.12)  # two pings of 0.05 s missed
        member.engine = _SlowEngine(slow=1)  # type: ignore[assignment]
        await asyncio.sleep(0.3)
        watcher.stop()

    asyncio.run(replace_after_two_misses())
    assert (member.state, member.error) == ("ready", "")
    assert member.engine.pings >= 2, "the replacement was not pinged again after its slow ping"


def test_pings_missed_while_the_engine_waits_for_a_cpu_are_not_counted():
    """Beside busy engines on its core, a healthy engine's threads waited seconds for a CPU and
    its pings went unanswered: replaced three times in one benchmark run. Only the first miss,
    with nothing yet to compare with, counts; the next ones, each in a window where the
    engine's threads waited for a CPU, do not. Past the limit it is replaced all the same (an
    engine can also hang on a starved host)."""
    engine = _SlowEngine(slow=1000, starved=True)
    member = _watch(engine, seconds=0.6)
    assert engine.pings >= 6, "fewer missed pings than the test needs"
    assert (member.state, member.error) == ("ready", "")
    member = _watch(_SlowEngine(slow=1000, starved=True), seconds=0.6, starved_limit_s=0.3)
    assert member.state == "failed" and "starved of CPU or not" in member.error


def test_an_idle_engine_is_pinged_less_often_and_a_busy_silent_one_every_time():
    """A ping asks the engine core unless it just streamed an output; an engine with nothing
    of this front end's in flight is asked again only 5 s after its last answer (a hang there
    delays no stream), one with requests in flight at every ping (a hang there is a stall)."""
    now = 100.0
    assert not ping_needs_round_trip(now, output_at=now - 0.5, answered_at=0.0, in_flight=3)
    assert ping_needs_round_trip(now, output_at=now - 2.0, answered_at=now - 1.0, in_flight=1)
    assert not ping_needs_round_trip(now, output_at=0.0, answered_at=now - 1.0, in_flight=0)
    assert ping_needs_round_trip(now, output_at=0.0, answered_at=now - 6.0, in_flight=0)


def _failing_restarts(failures: int, drain_after: int | None = None) -> tuple[PoolMember, list[float]]:
    """A ready worker fails; its replacement fails to start ``failures`` times, then starts
    (or, with ``drain_after``, the worker is drained after that many failed starts). Returns
    the member and the moments each start was tried."""
    member = PoolMember("prefill-0", actor=None, state="ready", engine=_SlowEngine(slow=0))
    tries: list[float] = []

    async def restart(replaced: PoolMember) -> None:
        tries.append(time.monotonic())
        if drain_after is not None and len(tries) == drain_after:
            replaced.state = "draining"
        if len(tries) <= failures:
            raise RuntimeError("the actor died because its node has died")
        replaced.engine = _SlowEngine(slow=0)

    async def fail_and_wait() -> None:
        pool = WorkerPool("prefill", members=[member], restart=restart)
        pool.mark_failed(member, RuntimeError("no answer to 3 health pings"), member.engine)
        deadline = time.monotonic() + 10
        while member.state == "restarting" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(fail_and_wait())
    return member, tries


def test_a_replacement_that_fails_to_start_is_tried_again_backing_off(monkeypatch):
    """Found by ``duet bench chaos --hosts``: a prefill host's Ray node was declared dead while
    its link was down, the replacement's actor died with it, and the worker stayed ``failed``
    (its pool empty) for good. Now it is started again, each wait twice the last."""
    monkeypatch.setattr(pools, "RESTART_RETRY_FIRST_S", 0.05)
    member, tries = _failing_restarts(failures=2)
    assert (member.state, member.error, member.restarts) == ("ready", "", 1)
    waits = [later - earlier for earlier, later in zip(tries, tries[1:])]
    assert len(tries) == 3 and waits[0] >= 0.05 and waits[1] >= 0.1, waits


def test_a_worker_drained_while_its_replacement_fails_is_not_tried_again(monkeypatch):
    monkeypatch.setattr(pools, "RESTART_RETRY_FIRST_S", 0.05)
    member, tries = _failing_restarts(failures=100, drain_after=2)
    assert len(tries) == 2 and member.state == "draining" and member.restarts == 0


def test_an_engine_that_ended_itself_crashed_and_one_stopped_from_outside_did_not():
    """What the router counts against the requests an engine held (router/lifecycle.py): an
    engine core that raised (vLLM exits with status 1) or died of a fault signal crashed; one
    killed or stopped from outside (an operator, the OOM killer, duet's own removal) did not."""
    for code in (1, -signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS):
        assert EngineExit.of_processes({"EngineCore_DP0": code}).crashed, code
    for code in (0, None, -signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT):
        assert not EngineExit.of_processes({"EngineCore_DP0": code}).crashed, code
    ended = EngineExit.of_processes({"EngineCore_DP0": -signal.SIGSEGV})
    assert ended.reason == "engine core crashed: {'EngineCore_DP0': -11}"
