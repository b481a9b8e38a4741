"""The router's end of a SIMULATED worker's channel (worker_runtime/worker_channel.py says why a
channel, and what crosses it).

The router listens on a port of its own for each SIMULATED worker, as it does for a vLLM
engine core, and the worker connects when its engine starts. Requests go out as messages; the
worker's answers are handed to the queue of the request they belong to. A connection that
closes (the actor died, or was killed) ends every request still waiting on it at once.
"""

from __future__ import annotations

import asyncio
import socket

from duet.worker_runtime.worker_channel import FrameReader, Message, Outbox


class ChannelClosed(RuntimeError):
    """The worker's channel is closed: the worker is gone, or was found dead."""


class ActorChannel:
    """Listens for one worker's connection, sends it requests and routes its answers."""

    def __init__(self, host: str, port: int = 0) -> None:
        """Listen on ``port`` of ``host`` (0: any free one; a dead front door's port: where its
        worker dials again, worker_runtime/worker_channel.py)."""
        # Bound now, so the address can be handed to the worker before the loop serves it.
        # (create_server sets SO_REUSEADDR: a dead predecessor's connection in TIME_WAIT does
        # not keep a replacement from listening on its port.)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.outbox = Outbox()
        self._queues: dict[str, asyncio.Queue[Message]] = {}
        self._reader = FrameReader(self._deliver, self._connection_lost)
        self._accepted = False
        self._server: asyncio.Server | None = None
        self._sender: asyncio.Task[None] | None = None
        self._closed: str | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, sock=self._listener)
        self._sender = loop.create_task(self.outbox.run(self._reader))

    async def connected(self, timeout_s: float) -> None:
        """Wait for the worker to connect (it does while its engine starts)."""
        await asyncio.wait_for(self._reader.connected.wait(), timeout_s)

    def send(self, message: Message) -> None:
        """Queue ``message`` for the worker; raises :class:`ChannelClosed` if it is gone."""
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        self.outbox.put(message)

    def subscribe(self, request_id: str) -> asyncio.Queue[Message]:
        """A queue for ``request_id``'s answers; subscribe before sending the request."""
        queue: asyncio.Queue[Message] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def fail_all(self, reason: str) -> None:
        """End every waiting request with a ``lost`` answer, and refuse new ones."""
        if self._closed is None:
            self._closed = reason
        for request_id, queue in self._queues.items():
            queue.put_nowait([request_id, "lost", reason])

    def close(self) -> None:
        self.fail_all("the worker was removed")
        if self._sender is not None:
            self._sender.cancel()
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()
        if self._reader.transport is not None:
            self._reader.transport.close()

    def _accept(self) -> FrameReader:
        if self._accepted:  # one worker per channel
            raise ConnectionRefusedError(f"the channel at {self.address} is taken")
        self._accepted = True
        if self._server is not None:  # stop listening: the port has served its one purpose
            asyncio.get_running_loop().call_soon(self._server.close)
        return self._reader

    def _deliver(self, frame: list[Message]) -> None:
        for message in frame:
            queue = self._queues.get(message[0])
            if queue is not None:  # None: a request the router already gave up on
                queue.put_nowait(message)

    def _connection_lost(self, exc: Exception | None) -> None:
        self.fail_all(f"the worker's channel closed ({exc or 'by the worker'})")
