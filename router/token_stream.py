"""The router's end of the token streams of SIMULATED workers: one TCP listener they connect to.

(A vLLM worker's tokens need no stream of their own: its engine's front end runs in the router,
router/engine_front_end.py. A SIMULATED engine runs inside its actor, and streams from there.)

Workers send every request's new tokens in batches, one batch per engine step (see
:mod:`duet.cluster.token_outbox` for why, and why plain TCP), as msgpack objects back to back on
one connection per worker. Ray stays the control plane (actor lifecycle, the per-request call
that starts a request and reports its failure); only the per-token data bypasses it, because a
Ray streaming-generator item costs an object, an owner notification and a poll per item, which
on a CPU host was the largest part of the serving path's CPU per token. :class:`TokenReceiver`
decodes each connection's bytes as they arrive, in the event loop's own callback, and hands
each update to the queue of the request it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

import msgpack

from duet.cluster.worker_api import TokenUpdate

logger = logging.getLogger(__name__)


class StreamBroken(RuntimeError):
    """A request's tokens stopped coming: its worker call failed (``cause``) or went silent."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class _WorkerConnection(asyncio.Protocol):
    """One worker's connection: a stream of msgpack-encoded batches of updates."""

    def __init__(self, deliver: Callable[[list[TokenUpdate]], None], connections: set[asyncio.BaseTransport]) -> None:
        self._unpacker = msgpack.Unpacker(use_list=True)
        self._deliver = deliver
        self._connections = connections
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._connections.add(transport)

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        for batch in self._unpacker:
            self._deliver(batch)

    def connection_lost(self, exc: Exception | None) -> None:
        # A worker that goes away takes its requests with it; those are failed by the worker
        # call that reports its death (lifecycle), not from here.
        self._connections.discard(self._transport)  # type: ignore[arg-type]


class TokenReceiver:
    """Listens where workers send tokens, and demultiplexes updates by request id."""

    def __init__(self, host: str) -> None:
        # Bound now, so the address is known before the event loop serves it.
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        # (host, port) workers connect to.
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._queues: dict[str, asyncio.Queue[TokenUpdate | StreamBroken]] = {}
        self._connections: set[asyncio.BaseTransport] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _WorkerConnection(self._deliver, self._connections), sock=self._listener
        )

    def subscribe(self, request_id: str) -> asyncio.Queue[TokenUpdate | StreamBroken]:
        """A queue for ``request_id``'s updates; subscribe before a worker starts the request."""
        queue: asyncio.Queue[TokenUpdate | StreamBroken] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        for transport in list(self._connections):
            transport.close()

    def _deliver(self, batch: list[TokenUpdate]) -> None:
        for update in batch:
            queue = self._queues.get(update[0])
            if queue is not None:  # None: a request the router already gave up on
                queue.put_nowait(update)
