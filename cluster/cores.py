"""Which CPU core each engine's forward pass is pinned to, handed out as workers come and go.

vLLM on CPU pins every engine to the machine's last core unless told otherwise, so workers must
be spread explicitly. A configured ``cpu_cores`` entry is honoured for the replicas it lists;
every other worker (scaled up at run time, or beyond the list) gets the core with the fewest
engines pinned to it, and returns it when removed. On a host with more workers than cores they
share, evenly.
"""

from __future__ import annotations

import os


class CoreAllocator:
    def __init__(self, cores: list[int] | None = None) -> None:
        available = sorted(cores if cores is not None else os.sched_getaffinity(0))
        self._engines = {core: 0 for core in available}

    def take(self, preferred: int | None = None) -> int:
        """A core for a new engine: ``preferred`` if given, else the least used one."""
        core = preferred if preferred is not None else min(self._engines, key=lambda c: (self._engines[c], c))
        self._engines[core] = self._engines.get(core, 0) + 1
        return core

    def release(self, core: int | None) -> None:
        if core is not None and self._engines.get(core, 0) > 0:
            self._engines[core] -= 1

    def usage(self) -> dict[int, int]:
        """Engines pinned to each core."""
        return dict(self._engines)
