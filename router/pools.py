"""Worker pools as the router sees them: Ray actor handles and how busy each one is.

Picking is least-in-flight within a pool; richer routing policies (prefix affinity, KV-aware
scoring) plug in here in a later issue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PoolMember:
    name: str
    actor: Any  # a Ray ActorHandle
    inflight: int = 0


@dataclass
class WorkerPool:
    role: str
    members: list[PoolMember] = field(default_factory=list)

    def pick(self) -> PoolMember:
        """The member with the fewest requests in flight (first one on ties)."""
        if not self.members:
            raise LookupError(f"the {self.role} pool has no workers")
        return min(self.members, key=lambda member: member.inflight)
