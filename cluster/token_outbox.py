"""A worker's outgoing tokens: every request's new tokens, batched per engine step, pushed to
the router over ZeroMQ.

Streaming each request's tokens as its own Ray streaming-generator item cost a Ray object, a
pickle, an owner notification and a poll per token per request; at a few thousand tokens a
second that was more CPU than the engines could spare on a CPU host. Instead each worker keeps
one outbox: its request tasks drop :data:`TokenUpdate` tuples into it, and one sender task
pushes everything that accumulated as a single msgpack frame to the router's
:class:`~duet.router.token_stream.TokenReceiver`. When vLLM's output handler wakes the requests
of one engine step, they all run before the sender does (asyncio wakes tasks in order), so a
frame is one step's tokens for every request on the worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import msgpack
import zmq

from duet.cluster.worker_api import TokenUpdate

logger = logging.getLogger(__name__)

# Frames ZeroMQ may queue for a router that is not reading before sends fail instead of
# blocking the worker's event loop (a router that stopped reading is gone: its requests too).
_SEND_QUEUE_FRAMES = 100_000


class TokenOutbox:
    """Updates waiting for the router; :meth:`run` sends them in arrival order."""

    def __init__(self) -> None:
        self._pending: list[TokenUpdate] = []
        self._ready = asyncio.Event()
        # Totals for status: how much batching the stream achieves (updates per batch).
        self.updates_sent = 0
        self.batches_sent = 0

    def put(self, update: TokenUpdate) -> None:
        self._pending.append(update)
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[TokenUpdate]]:
        """Every update put since the previous batch, as soon as there is at least one."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            self.batches_sent += 1
            self.updates_sent += len(batch)
            yield batch

    async def run(self, address: str) -> None:
        """Push batches to the router's receiver at ``address`` (``tcp://host:port``) forever."""
        context = zmq.Context.instance()
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, _SEND_QUEUE_FRAMES)
        socket.connect(address)
        try:
            async for batch in self.batches():
                try:
                    socket.send(msgpack.packb(batch), flags=zmq.NOBLOCK)
                except zmq.Again:
                    logger.warning("router at %s is not reading tokens; dropped %d updates", address, len(batch))
        finally:
            socket.close()
