"""Health watching: every worker is pinged on a fixed period, whether or not traffic flows.

A ping asks both halves of the worker: its actor (Ray reports a dead one at once, and the actor
reports an engine core process that exited) and its engine core (a round trip through the
engine's front end, which a hung engine never completes within the timeout). A worker that
fails a ping is taken out of rotation and replaced at once, before any request finds it; with
another ready worker in its pool, no request waits for the replacement. Each answer also
carries the worker's load (KV cache usage, running requests), which the decode routing policy
uses.
"""

from __future__ import annotations

import asyncio
import logging
import time

from duet.router.pools import PoolMember, WorkerPool

logger = logging.getLogger(__name__)


class WorkerUnresponsive(RuntimeError):
    """A worker that did not answer its health ping in time (a hung engine or actor)."""


class HealthWatcher:
    def __init__(self, pools: list[WorkerPool], interval_s: float, timeout_s: float) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._checking: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-watcher")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for pool in self.pools:
                for member in pool.members:
                    # One ping in flight per worker: a slow one is judged by its own timeout.
                    if member.state in ("ready", "draining") and member.name not in self._checking:
                        self._checking.add(member.name)
                        loop.create_task(self._check(pool, member))
            await asyncio.sleep(self.interval_s)

    async def _check(self, pool: WorkerPool, member: PoolMember) -> None:
        engine = member.engine
        try:
            member.kv_usage, member.running = await asyncio.wait_for(engine.ping(), self.timeout_s)
            member.reported_at = time.monotonic()
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            if member.engine is engine:
                pool.mark_failed(member, WorkerUnresponsive(f"no answer to a health ping in {self.timeout_s:g} s"))
        except Exception as error:
            if member.engine is engine:  # not already replaced meanwhile
                pool.mark_failed(member, error)
        finally:
            self._checking.discard(member.name)
