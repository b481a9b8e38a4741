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
