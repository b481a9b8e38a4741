"""Worker pools as the router sees them: Ray actor handles, their state and how busy each is.

A member's state is one of:

- ``starting``: its engine is coming up; it joins rotation when ready;
- ``ready``: in rotation;
- ``draining``: being removed; takes no new requests, finishes the ones it has;
- ``restarting``: it died (actor or engine) and its replacement is starting (started again,
  backing off, while it fails to);
- ``failed``: it died where nothing replaces it (a pool without ``restart``, or while draining),
  or its first start failed.

A member that fails is taken out of rotation at once and handed to the pool's ``restart``
callback (the deployment replaces the actor); a draining member that fails is simply gone.
Requests wait for a ready member up to a bound while one is starting or restarting, instead of
failing. Which ready member a request gets is the pool's routing policy (router/policies.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from duet.router.policies import LeastRequests, RoutingPolicy
from duet.router.worker_engines import WorkerGone

logger = logging.getLogger(__name__)


class ScaleError(ValueError):
    """A scale or drain request that cannot be carried out; the message names the field, or the
    resource the cluster is short of (``out_of_resources``)."""

    def __init__(self, message: str, out_of_resources: bool = False) -> None:
        super().__init__(message)
        self.out_of_resources = out_of_resources


class NoWorkerAvailable(RuntimeError):
    """No member of a pool became ready within the wait bound."""


WORKER_STATES = ("starting", "ready", "draining", "restarting", "failed")
# States in which a member will (again) take requests, so requests may wait for it.
_COMING = ("starting", "restarting")
# A failed replacement is started again after this long, doubling up to the most (WorkerPool._replace).
RESTART_RETRY_FIRST_S, RESTART_RETRY_MAX_S = 1.0, 60.0


@dataclass
class PoolMember:
    name: str
    actor: Any  # a Ray ActorHandle
    state: str = "ready"  # starting | ready | draining | restarting | failed
    kv_endpoint: str = ""  # where its KV transfer channel listens (host:port), once started
    inflight: int = 0
    # Prompt tokens of the requests it is computing (prefill) or holding (decode) right now.
    outstanding_tokens: int = 0
    # Prompt tokens it is computing itself, for requests not yet past their first token (a
    # decode worker prefilling locally under conditional disaggregation, or colocated).
    local_prefill_tokens: int = 0
    restarts: int = 0
    error: str = ""
    crashed: bool = False  # its last failure was a crash of its engine (router/worker_engines.py)
    cpu_core: int | None = None  # the core its forward pass is pinned to (CPU hosts)
    # The worker's last load report (cluster/health.py): KV cache usage and running requests.
    kv_usage: float = 0.0
    running: int = 0
    # Requests routed to this decode worker whose prompt another worker is still computing, and
    # their prompt tokens: neither its load report nor ``inflight`` counts them yet, so without
    # these a burst of requests, all chosen before the first one's KV arrives, lands on one worker.
    assigned: int = 0
    assigned_tokens: int = 0
    reported_at: float | None = None  # time.monotonic() of that report
    # What requests, health pings and status go through (router/worker_engines.py); set once
    # the worker's engine has started.
    engine: Any = None
    # A vLLM worker's engine core: its resolved config (which every front end of it needs; None
    # for a SIMULATED engine), and where each front door listens for it (client i of the engine
    # core, or the SIMULATED worker's channel i, at [i]; a replacement front door listens there
    # again).
    engine_config: Any = None
    client_addresses: list[Any] = field(default_factory=list)

    @contextmanager
    def assign(self, prompt_tokens: int) -> Iterator[None]:
        """Count a request as this worker's while its prompt is computed elsewhere."""
        self.assigned += 1
        self.assigned_tokens += prompt_tokens
        try:
            yield
        finally:
            self.assigned -= 1
            self.assigned_tokens -= prompt_tokens

    def kv_use_estimate(self) -> float:
        """The KV cache use last reported, plus the share its assigned requests will take
        (where its engine's capacity is known)."""
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        return self.kv_usage + (self.assigned_tokens / capacity if capacity else 0.0)


@dataclass
class WorkerPool:
    role: str
    # The model its workers serve (a deployment may serve several; status shows it).
    model: str = ""
    members: list[PoolMember] = field(default_factory=list)
    policy: RoutingPolicy = field(default_factory=LeastRequests)
    # Replaces a failed member's actor in place; supplied by the deployment.
    restart: Callable[[PoolMember], Awaitable[None]] | None = None
    # Called with each member that begins draining (the request lifecycle moves its decoding
    # requests off it with their KV, router/lifecycle.py).
    on_draining: list[Callable[[PoolMember], Awaitable[object]]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _tasks: set[asyncio.Task[object]] = field(default_factory=set, repr=False)

    def ready(self) -> list[PoolMember]:
        return [member for member in self.members if member.state == "ready"]

    def active(self) -> list[PoolMember]:
        """Members that count towards the pool's size (everything not leaving or failed)."""
        return [member for member in self.members if member.state in ("starting", "ready", "restarting")]

    def pick(self, prompt: list[int] | None = None, avoid: str | None = None, adapter: str = "") -> PoolMember:
        """The ready member the pool's policy chooses for ``prompt`` under the LoRA ``adapter``
        ("" for the base model); not the one named ``avoid`` unless it is the only one ready."""
        ready = [member for member in self.ready() if member.name != avoid] or self.ready()
        if not ready:
            raise NoWorkerAvailable(f"no {self.role} worker is ready")
        return self.policy.choose(ready, prompt or [], adapter)

    def find(self, name: str) -> PoolMember | None:
        return next((member for member in self.members if member.name == name), None)

    def changed(self) -> None:
        """Wake requests waiting for a member (one became ready, or the pool changed)."""
        self._changed.set()

    def start_draining(self, member: PoolMember) -> None:
        """Take ``member`` out of rotation for good: its requests finish there, or move off it
        (:attr:`on_draining`)."""
        member.state = "draining"
        self.changed()
        for hook in self.on_draining:
            task = asyncio.get_running_loop().create_task(hook(member))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def acquire(
        self, timeout_s: float, prompt: list[int] | None = None, avoid: str | None = None, adapter: str = ""
    ) -> PoolMember:
        """Pick a ready member (see :meth:`pick`), waiting up to ``timeout_s`` for one (e.g.
        during a restart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.pick(prompt, avoid, adapter)
            except NoWorkerAvailable:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not any(m.state in _COMING for m in self.members):
                    raise NoWorkerAvailable(
                        f"no {self.role} worker became ready within {timeout_s:.0f} s "
                        f"({', '.join(f'{m.name}: {m.state}' for m in self.members)})"
                    ) from None
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
                except TimeoutError:
                    pass

    def mark_failed(self, member: PoolMember, error: BaseException, engine: object) -> None:
        """Take ``member`` out of rotation, end its requests (they resume on the others) and
        start its replacement (once per failure).

        ``engine`` is the engine that failed: a failure reported after ``member`` was replaced
        (a late ping, watch or request of the old engine) leaves the replacement alone, and one
        reported after its removal closed its engine (``member.engine`` is None) leaves it to
        that removal. A draining member is not replaced: it was leaving anyway.
        """
        if engine is None or member.engine is not engine:
            return
        if member.engine is not None and member.state in ("ready", "draining"):
            member.engine.lost(error)
        if member.state == "draining":
            logger.warning("%s worker %s failed while draining: %s", self.role, member.name, error)
            member.state, member.error = "failed", f"{type(error).__name__}: {error}"
            return
        if member.state != "ready":
            return
        logger.warning("%s worker %s failed: %s", self.role, member.name, error)
        member.state, member.error = "restarting", f"{type(error).__name__}: {error}"
        member.crashed = isinstance(error, WorkerGone) and error.crashed
        if self.restart is None:
            member.state = "failed"
            return
        asyncio.get_running_loop().create_task(self._replace(member))

    async def _replace(self, member: PoolMember) -> None:
        """Start ``member``'s replacement, and again after a failed start (waiting 1 s, then
        twice as long each time, at most a minute) until one starts or ``member`` leaves the
        pool. A replacement can fail for a reason that passes: its host's Ray node was declared
        dead while its link was down and is rejoining, or the resources are not free yet. Given
        up on after one try, such a worker left its pool short until someone restarted duet
        (found by ``duet bench chaos --hosts``)."""
        wait_s = RESTART_RETRY_FIRST_S
        while True:
            try:
                await self.restart(member)  # type: ignore[misc]
            except Exception as error:
                if member not in self.members or member.state != "restarting":
                    return  # drained or removed meanwhile: nothing to replace
                logger.error("could not restart %s worker %s (%s); trying again in %.0f s", self.role, member.name, error, wait_s)
                member.error = f"restart failed, trying again in {wait_s:.0f} s: {error}"
                self._changed.set()
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, RESTART_RETRY_MAX_S)
                continue
            member.state, member.error = "ready", ""
            member.restarts += 1
            self._changed.set()
            return
