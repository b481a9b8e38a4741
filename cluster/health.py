"""Health watching: every worker is watched and pinged, whether or not traffic flows.

Two checks, each for what it catches cheaply:

- a watch: one actor call per worker that stays pending until its engine core process exits.
  Ray fails every pending call of an actor that dies, so a dead actor or a dead engine core is
  known at once, with no polling (the 1 s actor pings this replaced cost each idle actor more
  CPU than anything else it did);
- a ping on a fixed period: a round trip to the engine core (through the engine's front end for
  vLLM workers, the actor for SIMULATED ones), which a hung engine never completes within the
  timeout. A worker is taken for hung after ``failures`` such pings in a row (Kubernetes'
  probes count the same way): one slow answer is not a hang. With three systems' engines
  sharing two cores (`duet bench serve` beside its peers), a healthy idle decode engine missed
  one 5-s ping three times in 15 minutes, and each time its replacement cost the requests
  arriving meanwhile a cold start (TTFT p90 9.4 s for a round). Each answer also carries the
  worker's load (KV cache usage, running requests), which the decode routing policy uses; with
  front doors apart, which ping no engine, ``on_loads`` hands it to them every period.

A worker that fails either is taken out of rotation and replaced at once, before any request
finds it; with another ready worker in its pool, no request waits for the replacement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from duet.router.pools import PoolMember, WorkerPool
from duet.router.worker_engines import WorkerEngine

logger = logging.getLogger(__name__)


class WorkerUnresponsive(RuntimeError):
    """A worker that did not answer its health ping in time (a hung engine or actor)."""


class WorkerExited(RuntimeError):
    """A worker whose engine core process exited (its watch ended)."""


class HealthWatcher:
    def __init__(self, pools: list[WorkerPool], interval_s: float, timeout_s: float, failures: int = 1) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self._missed: dict[str, int] = {}  # worker name -> pings missed in a row
        self._task: asyncio.Task[None] | None = None
        self._checking: set[str] = set()
        # Worker name -> (the engine its watch is on, the task awaiting that watch).
        self._watches: dict[str, tuple[object, asyncio.Task[None]]] = {}
        # Called every period with the ready workers' last loads: name -> (KV use, running).
        self.on_loads: Callable[[dict[str, tuple[float, int]]], None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-watcher")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for _, watch in self._watches.values():
            watch.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for pool in self.pools:
                for member in pool.members:
                    # A member being removed has had its engine closed already (its actor is
                    # shutting down): nothing is left to watch or ping.
                    engine = member.engine
                    if member.state not in ("ready", "draining") or engine is None:
                        continue
                    watched = self._watches.get(member.name)
                    if watched is None or watched[0] is not engine:
                        self._watches[member.name] = (engine, loop.create_task(self._watch(pool, member, engine)))
                    # One ping in flight per worker: a slow one is judged by its own timeout.
                    if member.name not in self._checking:
                        self._checking.add(member.name)
                        loop.create_task(self._check(pool, member, engine))
            await asyncio.sleep(self.interval_s)
            if self.on_loads is not None:
                self.on_loads(self.loads())

    def loads(self) -> dict[str, tuple[float, int]]:
        """Each ready worker's last reported load: name -> (KV cache use, running requests)."""
        return {
            member.name: (member.kv_usage, member.running)
            for pool in self.pools for member in pool.members
            if member.state == "ready" and member.reported_at is not None
        }

    async def _check(self, pool: WorkerPool, member: PoolMember, engine: WorkerEngine) -> None:
        try:
            member.kv_usage, member.running = await asyncio.wait_for(engine.ping(), self.timeout_s)
            member.reported_at = time.monotonic()
            self._missed.pop(member.name, None)
        except TimeoutError:
            missed = self._missed[member.name] = self._missed.get(member.name, 0) + 1
            if missed >= self.failures:
                self._missed.pop(member.name, None)
                pool.mark_failed(
                    member, WorkerUnresponsive(f"no answer to {missed} health ping(s) in a row, {self.timeout_s:g} s each"), engine
                )
            else:
                logger.warning("%s did not answer a health ping in %g s (%d of %d)", member.name, self.timeout_s, missed, self.failures)
        except Exception as error:
            pool.mark_failed(member, error, engine)
        finally:
            self._checking.discard(member.name)

    async def _watch(self, pool: WorkerPool, member: PoolMember, engine: WorkerEngine) -> None:
        """Wait on the watch of ``member``'s ``engine``; when it ends, the worker is gone unless
        it was replaced or removed meanwhile (a removed worker's actor is killed on purpose,
        which ends it too)."""
        try:
            error: BaseException = WorkerExited(await engine.watch())
        except Exception as failure:  # RayActorError: the actor died
            error = failure
        watched = self._watches.get(member.name)
        if watched is not None and watched[0] is engine:  # not already a newer engine's watch
            del self._watches[member.name]
        pool.mark_failed(member, error, engine)
