"""Health watching: every worker is watched and pinged, whether or not traffic flows.

Two checks, each for what it catches cheaply:

- a watch: one actor call per worker that stays pending until its engine core process exits.
  Ray fails every pending call of an actor that dies, so a dead actor or a dead engine core is
  known at once, with no polling (the 1 s actor pings this replaced cost each idle actor more
  CPU than anything else it did);
- a ping on a fixed period: a round trip to the engine core (through the engine's front end for
  vLLM workers, the actor for SIMULATED ones), which a hung engine never completes within the
  timeout. A worker is taken for hung after ``failures`` such pings in a row (Kubernetes'
  probes count the same way): one slow answer is not a hang. Each answer also carries the
  worker's load (KV cache usage, running requests), which the decode routing policy uses; with
  front doors apart, which ping no engine, ``on_loads`` hands it to them every period.

A ping also goes unanswered when the engine is well but gets no CPU. With three systems'
engines sharing two cores (`duet bench serve` beside its peers), a healthy idle decode engine
missed 5-s pings three in a row three times in 40 minutes, and each replacement cost the
requests arriving meanwhile a cold start (one round at 0%). So after a missed ping the watcher
asks the worker's actor how long the engine's threads waited for a CPU since the previous miss
(the kernel counts it: worker_runtime/cpu_wait.py): a miss in a window where they waited at
least ``STARVED_SHARE`` of it is not counted. Starvation never excuses more than
``starved_limit_s`` without an answer, so an engine that hangs on a starved host is still
replaced, later.

A worker that fails either check is taken out of rotation and replaced at once, before any
request finds it; with another ready worker in its pool, no request waits for the replacement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from duet.router.pools import PoolMember, WorkerPool
from duet.router.worker_engines import WorkerEngine, WorkerExited
from duet.worker_runtime.cpu_wait import waited_between

logger = logging.getLogger(__name__)

# A missed ping is put down to starvation when the engine's threads together waited for a CPU at
# least this share of the time since the previous reading. An idle engine with a core to itself
# waits about 0.03% of the time; starved beside another system's busy engines, mostly 100-2,400% (the
# threads add up).
STARVED_SHARE = 0.5


class WorkerUnresponsive(RuntimeError):
    """A worker that did not answer its health ping in time (a hung engine or actor)."""


class HealthWatcher:
    def __init__(
        self, pools: list[WorkerPool], interval_s: float, timeout_s: float, failures: int = 1, starved_limit_s: float = 60.0
    ) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.starved_limit_s = starved_limit_s
        self._missed: dict[str, int] = {}  # worker name -> pings missed in a row, starvation aside
        self._unanswered_since: dict[str, float] = {}  # worker name -> when its first missed ping was sent
        # Worker name -> (when, its engine threads' CPU waits then), read at its last missed ping.
        self._cpu_waits: dict[str, tuple[float, dict[int, float]]] = {}
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
                        self.forget_misses(member.name)  # a replacement owes nothing for its predecessor
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
        sent_at = time.monotonic()
        try:
            member.kv_usage, member.running = await asyncio.wait_for(engine.ping(), self.timeout_s)
            member.reported_at = time.monotonic()
            self.forget_misses(member.name)
        except TimeoutError:
            await self._missed_ping(pool, member, engine, sent_at)
        except Exception as error:
            pool.mark_failed(member, error, engine)
        finally:
            self._checking.discard(member.name)

    async def _missed_ping(self, pool: WorkerPool, member: PoolMember, engine: WorkerEngine, sent_at: float) -> None:
        """Count a ping ``member`` did not answer in time, unless its engine was starved of CPU
        meanwhile; replace it once the count reaches ``failures``, or once it has answered
        nothing for ``starved_limit_s``."""
        name = member.name
        unanswered_s = time.monotonic() - self._unanswered_since.setdefault(name, sent_at)
        starved = await self._cpu_starvation(name, engine)
        if starved is not None and unanswered_s < self.starved_limit_s:
            waited_s, window_s = starved
            logger.warning(
                "%s did not answer a health ping in %g s, but its engine's threads waited %.1f s for a CPU in the "
                "last %.1f s: its host is oversubscribed, not counted as a hang", name, self.timeout_s, waited_s, window_s,
            )
            return
        missed = self._missed[name] = self._missed.get(name, 0) + 1
        if missed >= self.failures or unanswered_s >= self.starved_limit_s:
            self.forget_misses(name)
            reason = (
                f"no answer to {missed} health ping(s) in a row, {self.timeout_s:g} s each" if missed >= self.failures
                else f"no answer to a health ping for {unanswered_s:.0f} s, starved of CPU or not"
            )
            pool.mark_failed(member, WorkerUnresponsive(reason), engine)
        else:
            logger.warning("%s did not answer a health ping in %g s (%d of %d)", name, self.timeout_s, missed, self.failures)

    def forget_misses(self, name: str) -> None:
        """Start ``name``'s count of missed pings afresh: it answered, was failed, has a new
        engine, or was removed (a worker of a model added again later may take its name)."""
        for unanswered in (self._missed, self._unanswered_since, self._cpu_waits):
            unanswered.pop(name, None)

    async def _cpu_starvation(self, name: str, engine: WorkerEngine) -> tuple[float, float] | None:
        """(seconds waited for a CPU, window) when the engine's threads waited at least
        ``STARVED_SHARE`` of the time since the previous missed ping's reading; None when they
        did not, when this is the first reading, or when the actor cannot say in time (a vLLM
        worker's actor answers after its pending watch returns: up to 2 s)."""
        try:
            waits = await asyncio.wait_for(engine.threads_cpu_wait(), 2 * self.timeout_s)
        except Exception:  # TimeoutError, or the actor died (its watch reports that)
            return None
        if waits is None:
            return None
        now = time.monotonic()
        previous = self._cpu_waits.get(name)
        self._cpu_waits[name] = (now, waits)
        if previous is None:
            return None
        window_s = now - previous[0]
        waited_s = waited_between(previous[1], waits)
        return (waited_s, window_s) if waited_s >= STARVED_SHARE * window_s else None

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
