"""How a pool member's state follows what the health watcher finds (cluster/health.py,
router/pools.py), without engines: the states a removal passes through."""

from __future__ import annotations

import asyncio

from duet.cluster.health import HealthWatcher
from duet.router.pools import PoolMember, WorkerPool


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
    or a hung engine when ``slow`` is large); the others answer at once."""

    def __init__(self, slow: int) -> None:
        self.slow = slow
        self.pings = 0

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


def _watch(engine: _SlowEngine, seconds: float) -> PoolMember:
    member = PoolMember("decode-0", actor=None, state="ready", engine=engine)  # type: ignore[arg-type]
    pool = WorkerPool("decode", members=[member])  # no restart: a failed worker stays "failed"

    async def watch_for_a_while() -> None:
        watcher = HealthWatcher([pool], interval_s=0.01, timeout_s=0.05, failures=3)
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
