"""Worker pools as the router sees them: Ray actor handles, their health and how busy each is.

A member that fails (its actor died, or its engine did) is taken out of rotation at once and
handed to the pool's ``restart`` callback (the deployment replaces the actor); requests wait for a
ready member up to a bound instead of failing while a replacement starts. Picking is
least-in-flight among ready members; richer routing policies plug in here in a later issue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    """No member of a pool became ready within the wait bound."""


@dataclass
class PoolMember:
    name: str
    actor: Any  # a Ray ActorHandle
    state: str = "ready"  # ready | restarting | failed
    kv_endpoint: str = ""  # where its KV transfer channel listens (host:port), once started
    inflight: int = 0
    restarts: int = 0
    error: str = ""


@dataclass
class WorkerPool:
    role: str
    members: list[PoolMember] = field(default_factory=list)
    # Replaces a failed member's actor in place; supplied by the deployment.
    restart: Callable[[PoolMember], Awaitable[None]] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def pick(self) -> PoolMember:
        """The ready member with the fewest requests in flight (first one on ties)."""
        ready = [member for member in self.members if member.state == "ready"]
        if not ready:
            raise NoWorkerAvailable(f"no {self.role} worker is ready")
        return min(ready, key=lambda member: member.inflight)

    async def acquire(self, timeout_s: float) -> PoolMember:
        """Pick a ready member, waiting up to ``timeout_s`` for one (e.g. during a restart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.pick()
            except NoWorkerAvailable:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not any(m.state == "restarting" for m in self.members):
                    raise NoWorkerAvailable(
                        f"no {self.role} worker became ready within {timeout_s:.0f} s "
                        f"({', '.join(f'{m.name}: {m.state}' for m in self.members)})"
                    ) from None
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
                except TimeoutError:
                    pass

    def mark_failed(self, member: PoolMember, error: BaseException) -> None:
        """Take ``member`` out of rotation and start its replacement (once per failure)."""
        if member.state != "ready":
            return
        logger.warning("%s worker %s failed: %s", self.role, member.name, error)
        member.state, member.error = "restarting", f"{type(error).__name__}: {error}"
        if self.restart is None:
            member.state = "failed"
            return
        asyncio.get_running_loop().create_task(self._replace(member))

    async def _replace(self, member: PoolMember) -> None:
        try:
            await self.restart(member)  # type: ignore[misc]
        except Exception as error:
            logger.error("could not restart %s worker %s: %s", self.role, member.name, error)
            member.state, member.error = "failed", f"restart failed: {error}"
        else:
            member.state, member.error = "ready", ""
            member.restarts += 1
        self._changed.set()
