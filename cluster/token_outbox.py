"""A worker's outgoing token stream: every request's new tokens, batched per engine step.

Streaming each request's tokens as its own Ray streaming-generator item cost a Ray object, a
pickle and an owner notification per token per request; at a few thousand tokens a second that
was more CPU than the engines could spare on a CPU host. Instead each worker keeps one outbox,
its request tasks drop :data:`TokenUpdate` tuples into it, and one long-lived stream per worker
(:meth:`TokenOutbox.batches`, served by ``EngineHost.token_stream``) carries everything that
accumulated since the last batch. When vLLM's output handler wakes the requests of one engine
step, they all run before the stream's task does (asyncio wakes tasks in order), so a batch is
one step's tokens for every request on the worker. The router demultiplexes
(:mod:`duet.router.token_stream`).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from duet.cluster.worker_api import TokenUpdate


class TokenOutbox:
    """Updates waiting for the router; :meth:`batches` hands them over in arrival order."""

    def __init__(self) -> None:
        self._pending: list[TokenUpdate] = []
        self._ready = asyncio.Event()

    def put(self, update: TokenUpdate) -> None:
        self._pending.append(update)
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[TokenUpdate]]:
        """Every update put since the previous batch, as soon as there is at least one."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            yield batch
