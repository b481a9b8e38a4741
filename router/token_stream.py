"""The router's end of the token streams: one ZeroMQ socket that every worker pushes to.

Workers send every request's new tokens in batches, one batch per engine step (see
:mod:`duet.cluster.token_outbox` for why), as msgpack frames over a ZeroMQ PUSH socket to this
one PULL socket. Ray stays the control plane (actor lifecycle, the per-request call that starts
a request and reports its failure); only the per-token data bypasses it, because a Ray
streaming-generator item costs an object, an owner notification and a poll per item, which on a
CPU host was the largest part of the serving path's CPU per token. :class:`TokenReceiver` reads
the socket in one task and hands each update to the queue of the request it belongs to.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
import zmq
import zmq.asyncio

from duet.cluster.worker_api import TokenUpdate

logger = logging.getLogger(__name__)


class StreamBroken(RuntimeError):
    """A request's tokens stopped coming: its worker call failed (``cause``) or went silent."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class TokenReceiver:
    """Binds the socket workers push tokens to, and demultiplexes updates by request id."""

    def __init__(self, host: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._queues: dict[str, asyncio.Queue[TokenUpdate | StreamBroken]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="token-receiver")

    def subscribe(self, request_id: str) -> asyncio.Queue[TokenUpdate | StreamBroken]:
        """A queue for ``request_id``'s updates; subscribe before a worker starts the request."""
        queue: asyncio.Queue[TokenUpdate | StreamBroken] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close()
        self._context.term()

    async def _read(self) -> None:
        while True:
            frame = await self._socket.recv(copy=True)
            for update in msgpack.unpackb(frame, use_list=True):
                queue = self._queues.get(update[0])
                if queue is not None:  # None: a request the router already gave up on
                    queue.put_nowait(update)
