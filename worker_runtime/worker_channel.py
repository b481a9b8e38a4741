"""A SIMULATED worker's channel to the router: one TCP connection that carries its requests in
and their results out. (A vLLM worker needs none: its engine's front end runs in the router and
talks to the engine core over vLLM's own sockets, router/engine_front_end.py.)

Both directions are msgpack lists of messages, written back to back. Each end keeps an
:class:`Outbox`: whatever was put since the last write goes out as one object, so when vLLM's
output handler (or the simulated engine) wakes the requests of one engine step, their tokens
leave as a single frame, and a router starting many requests in one event-loop turn sends them
in one write.

Why not Ray for the data: a Ray actor call round trip measured 2-4 ms on the two-core machine
(each crosses the caller's core-worker thread, the actor's and its event loop), and a Ray
streaming-generator item costs an object, an owner notification and a poll per token. Two calls
per request were most of what the serving path added to an unloaded request with SIMULATED
workers (docs/benchmarks/router.md). Ray stays the control plane: actor lifecycle, health, status.

Messages, router to worker:

- ``["prefill", request_id, prompt_token_ids, sampling, decode_endpoint]``
- ``["decode", request_id, prompt_token_ids, sampling, kv_transfer_params, first_token_id, first_text]``
- ``["abort", request_id]``

and worker to router, each ``[request_id, kind, ...]``:

- ``[id, "tokens", token_ids, text, finish_reason]`` (the last one has a finish reason);
- ``[id, "prefilled", first_token_id, first_text, num_prompt_tokens, kv_transfer_params, finish_reason, worker]``
  (a :class:`~duet.worker_runtime.worker_api.PrefillResult`'s fields);
- ``[id, "failed", message]``: the worker's engine refused or failed the request.

The frames go over a plain TCP connection written from each side's event loop. ZeroMQ, used
before for the tokens, hands every frame to its I/O thread on each side (a wake-up and a context
switch per frame per side): measured on two cores, 0.23-0.26 ms of sender and 0.30-0.31 ms of
receiver CPU per frame against 0.18 and 0.13 ms on a socket the event loop writes itself.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import fields, replace
from typing import Any, AsyncIterator, Callable

import msgpack

from duet.worker_runtime.worker_api import SamplingSpec

logger = logging.getLogger(__name__)

# Bytes the kernel and the transport may hold for a peer that is not reading before the channel
# is closed instead of piling up (a peer that stopped reading is gone, and its requests with it).
_SEND_BUFFER_LIMIT = 64 * 1024 * 1024

Message = list[Any]


def field_values(instance: Any) -> list[Any]:
    """A dataclass instance's field values in order, as they are (``dataclasses.astuple``
    deep-copies each one, on every request)."""
    return [getattr(instance, field.name) for field in fields(instance)]


def sampling_to_wire(sampling: SamplingSpec) -> list[Any]:
    return field_values(sampling)


def sampling_from_wire(fields: list[Any]) -> SamplingSpec:
    """The inverse of :func:`sampling_to_wire` (msgpack turns the tuples into lists)."""
    spec = SamplingSpec(*fields)
    return replace(
        spec,
        stop=tuple(spec.stop),
        stop_token_ids=tuple(spec.stop_token_ids),
        logit_bias=tuple((int(token), float(bias)) for token, bias in spec.logit_bias),
        bad_words=tuple(spec.bad_words),
        allowed_token_ids=tuple(spec.allowed_token_ids),
        images=tuple(spec.images),
    )


class Outbox:
    """Messages waiting for the peer; :meth:`run` writes everything pending as one frame."""

    def __init__(self) -> None:
        self._pending: list[Message] = []
        self._ready = asyncio.Event()
        # Totals for status: how much batching the channel achieves (messages per frame).
        self.messages_sent = 0
        self.frames_sent = 0

    def put(self, message: Message) -> None:
        self._pending.append(message)
        self._ready.set()

    def discard(self) -> None:
        """Drop what is pending: it was for a connection that is gone."""
        self._pending = []
        self._ready.clear()

    async def batches(self) -> AsyncIterator[list[Message]]:
        """Every message put since the previous batch, as soon as there is at least one."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            self.frames_sent += 1
            self.messages_sent += len(batch)
            yield batch

    async def run(self, reader: "FrameReader") -> None:
        """Write batches to ``reader``'s connection, once it is made, until it closes."""
        await reader.connected.wait()
        # An asyncio transport in duck type only: uvloop's (Ray's actors run on it) is no subclass.
        transport = reader.transport
        async for batch in self.batches():
            if transport.is_closing():
                return
            if transport.get_write_buffer_size() > _SEND_BUFFER_LIMIT:
                # Dropping messages would leave holes in streams, or requests waiting forever;
                # a closed connection fails them all on both ends, and they resume elsewhere.
                logger.error("peer is not reading (%d bytes queued); closing the channel", transport.get_write_buffer_size())
                transport.abort()
                return
            try:
                transport.write(msgpack.packb(batch))
            except Exception:  # a message msgpack cannot carry: as above, rather than a silent stop
                logger.exception("cannot send %d messages; closing the channel", len(batch))
                transport.abort()
                return


class FrameReader(asyncio.Protocol):
    """One end's connection: hands each received frame (a list of messages) to ``on_frame``."""

    def __init__(self, on_frame: Callable[[list[Message]], None], on_lost: Callable[[Exception | None], None]) -> None:
        self._unpacker = msgpack.Unpacker(use_list=True)
        self._on_frame = on_frame
        self._on_lost = on_lost
        self.transport: Any = None
        self.connected = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Frames are small and latency is the point: never wait to coalesce.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport
        self.connected.set()

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        for frame in self._unpacker:
            self._on_frame(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


class RouterLink:
    """A worker's end of one channel: runs each request it receives as a task on the worker's
    event loop, and sends back tokens (put by the handler), prefill results and failures.

    ``handler`` is the worker actor: its ``prefill`` returns a
    :class:`~duet.worker_runtime.worker_api.PrefillResult`, its ``decode`` puts each step's
    ``[id, "tokens", ...]`` message with the ``reply`` it is given (this link's :meth:`put`),
    and its ``abort`` frees a request's engine state (prefill_worker/worker.py,
    decode_worker/worker.py, worker_runtime/simulated_host.py).

    A worker has one link per front door (cluster/front_doors.py). When a link's connection
    drops, its requests are aborted (nobody reads their tokens) and the link dials the same
    address again until it is closed: a front door, or a control plane, that replaces a dead
    one listens where it did, as the engine cores' clients do (worker_runtime/engine_clients.py).
    """

    # Seconds between dials of a lost channel's address.
    redial_s = 0.2

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.outbox = Outbox()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborts: set[asyncio.Task[None]] = set()  # held until done, so none is collected early
        self._reader: FrameReader | None = None
        self._sender: asyncio.Task[None] | None = None
        self._address: tuple[str, int] | None = None
        self._redial: asyncio.Task[None] | None = None
        self._closed = False

    async def connect(self, address: tuple[str, int]) -> None:
        host, port = address
        self._address = (host, port)
        loop = asyncio.get_running_loop()
        self._reader = FrameReader(self._on_frame, self._on_lost)
        await loop.create_connection(lambda: self._reader, host, port)
        self._sender = loop.create_task(self.outbox.run(self._reader))

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it dials (and dials again): its front door's channel."""
        return self._address

    def put(self, message: Message) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self._closed = True
        if self._redial is not None:
            self._redial.cancel()
        if self._sender is not None:
            self._sender.cancel()
        if self._reader is not None and self._reader.transport is not None:
            self._reader.transport.close()

    def _on_frame(self, frame: list[Message]) -> None:
        for message in frame:
            kind, request_id = message[0], message[1]
            if kind == "abort":
                self._abort(request_id)
                continue
            task = asyncio.get_running_loop().create_task(self._serve(message))
            self._tasks[request_id] = task
            task.add_done_callback(lambda done, request_id=request_id: self._forget(request_id, done))

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    async def _serve(self, message: Message) -> None:
        kind, request_id, prompt = message[0], message[1], message[2]
        try:
            sampling = sampling_from_wire(message[3])
            if kind == "prefill":
                result = await self.handler.prefill(request_id, prompt, sampling, message[4])
                self.put([request_id, "prefilled", *field_values(result)])
            else:
                await self.handler.decode(request_id, prompt, sampling, *message[4:7], reply=self.put)
        except Exception as error:  # the router fails the request with this message
            logger.warning("request %s failed: %s", request_id, error)
            self.put([request_id, "failed", f"{type(error).__name__}: {error}"])

    def _abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        # Also frees a request the engine still holds after its task ended.
        abort = asyncio.get_running_loop().create_task(self.handler.abort(request_id))
        self._aborts.add(abort)
        abort.add_done_callback(self._aborts.discard)

    def _on_lost(self, exc: Exception | None) -> None:
        """The router is gone or dropped this worker: nobody will read these requests' tokens."""
        for request_id in list(self._tasks):
            self._abort(request_id)
        if self._sender is not None:
            self._sender.cancel()
        self.outbox.discard()  # what was queued for the lost connection is not sent to the next
        if not self._closed and self._address is not None:
            self._redial = asyncio.get_running_loop().create_task(self._dial_again())

    async def _dial_again(self) -> None:
        assert self._address is not None
        while not self._closed:
            await asyncio.sleep(self.redial_s)
            try:
                await self.connect(self._address)
                logger.info("channel to %s:%d connected again", *self._address)
                return
            except OSError:
                continue
