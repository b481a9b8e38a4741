"""The router's end of a worker's token stream: one Ray stream per worker, split by request.

A worker sends every request's new tokens over one long-lived Ray streaming call, one batch per
engine step (see :mod:`duet.cluster.token_outbox` for why). :class:`TokenStream` reads it in one
task and hands each update to the queue of the request it belongs to. When the stream breaks
(the actor died), every request still listening gets the error, so a worker's death reaches its
requests as fast as it reaches Ray, with no request polling for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from duet.cluster.worker_api import TokenUpdate

logger = logging.getLogger(__name__)


class StreamBroken(RuntimeError):
    """The worker's token stream ended or failed; ``cause`` is Ray's error, if any."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class TokenStream:
    """Demultiplexes one worker actor's token stream into per-request queues."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self._queues: dict[str, asyncio.Queue[TokenUpdate | StreamBroken]] = {}
        self._pump: asyncio.Task[None] | None = None

    def subscribe(self, request_id: str) -> asyncio.Queue[TokenUpdate | StreamBroken]:
        """A queue for ``request_id``'s updates; subscribe before the worker starts the request."""
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._read(), name=f"tokens-{self.name}")
        queue: asyncio.Queue[TokenUpdate | StreamBroken] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        """Stop reading (the worker is being replaced or shut down)."""
        if self._pump is not None:
            self._pump.cancel()

    async def _read(self) -> None:
        error: StreamBroken
        try:
            async for ref in self.actor.token_stream.options(num_returns="streaming").remote():
                for update in await ref:
                    queue = self._queues.get(update[0])
                    if queue is not None:  # None: a request the router already gave up on
                        queue.put_nowait(update)
            error = StreamBroken(f"worker {self.name} closed its token stream")
        except asyncio.CancelledError:
            error = StreamBroken(f"the router stopped reading worker {self.name}")
            raise
        except Exception as cause:  # the actor died: Ray's error says how
            error = StreamBroken(f"worker {self.name}'s token stream failed: {type(cause).__name__}", cause)
        finally:
            for queue in self._queues.values():
                queue.put_nowait(error)
