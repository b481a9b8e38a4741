"""An engine core whose front ends may die and be replaced while it keeps running.

vLLM's engine core serves several front ends (its ``--api-server-count`` mode): it is launched
with one pair of ZeroMQ addresses per front end ("client"), connects a DEALER socket to each
client's request socket and a PUSH socket to its output socket, greets each client once with a
ready message, and sends every request's outputs to the client that sent it
(``client_index``). That suffices for front ends that live as long as the engine. duet's front
doors do not: a front door can be killed (an OOM kill, a crash, a rolling restart) while the
engine cores, which belong to the worker actors, run on. Two things then go wrong in vLLM's own
input loop, and this module's replacement of it fixes both:

- **Requests orphaned.** The engine core does not notice that a client went away, so the dead
  front door's requests keep decoding, and hold their KV blocks, until they reach their
  ``max_tokens``. Here the engine watches each client's connection (a ZeroMQ socket monitor;
  TCP heartbeats find a peer whose host vanished without closing it) and, when one drops,
  aborts every request that client sent, on the engine's own thread, as a client's abort would.
  (A prefill that already finished and keeps its KV for a decode worker's pull is not a
  running request: the KV lease frees it, ``kv_transfer.kv_lease_s``, as for any pull that
  never comes.)
- **No second greeting.** A replacement front door binds the same addresses and its
  ``AsyncLLM`` waits for the engine's ready message, which vLLM sends only once, at start-up.
  ZeroMQ reconnects the engine's sockets by itself; here the engine greets again on each
  reconnection, so the replacement attaches without the engine restarting.
- **Addresses fixed at start-up.** vLLM connects each client's sockets once, to the addresses
  it was launched with. A front door on a host of its own (``server.front_end_placement:
  nodes``) is replaced on whichever front-door host is free, at new addresses. The utility
  call :data:`READDRESS_METHOD`, sent by client 0 (the control plane's front end), moves one
  client's sockets there: the input loop reconnects the request socket and aborts what the
  old client had left, and the output thread reconnects the output socket before its next
  send to that client (:class:`OutputRoutes`).

Messages are decoded and queued exactly as vLLM's loop does (text requests; the data-parallel
coordinator, which duet does not use, keeps vLLM's own loop). duet's vLLM plugin installs this
in each duet engine core's process (kv_transfer/vllm_plugin.py) when the engine host asks for it
(:data:`ENV_CLIENT_RECONNECT`), with one more change for several clients: every step's
scheduler statistics go to client 0, the control plane's (:class:`StatsToFirstClient`). It is
written against vLLM 0.32.0's ``EngineCoreProc`` (pinned in pyproject.toml);
tests/test_engine_clients.py fails if vLLM moves it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from contextlib import ExitStack
from typing import Any

from duet.worker_runtime.engine_output import carries_deltas

logger = logging.getLogger(__name__)

# Set by duet's engine host for each worker's engine core; read by duet's vLLM plugin there.
ENV_CLIENT_RECONNECT = "DUET_CLIENT_RECONNECT"
# The request type, on the engine core's input queue, that aborts one client's requests. Not a
# vLLM request type: only the dispatch installed below knows it.
ABORT_CLIENT = "duet-abort-client"
# The utility call that moves one client to new addresses (:func:`_readdress`); its arguments
# are the client's index and its new input and output addresses.
READDRESS_METHOD = "duet_readdress_client"
# How often client 0 gets a step's gauges (KV usage, running requests) with several clients.
GAUGES_INTERVAL_S = 1.0
# ZeroMQ heartbeats on each client connection: a front door whose host vanished (no FIN, no
# RST) is taken for gone after the timeout, as one whose process died is at once.
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 5_000


class ClientConnections:
    """The connection state of each client socket: when to greet again, when to abort."""

    def __init__(self, count: int) -> None:
        self._dropped = [False] * count

    def moved(self, client_index: int) -> None:
        """Client ``client_index`` was moved to new addresses: greet it when it connects there."""
        self._dropped[client_index] = True

    def on_event(self, client_index: int, event: int) -> str | None:
        """What the input loop must do for a monitor ``event`` on client ``client_index``'s
        socket: ``"abort"`` (its connection dropped), ``"greet"`` (it reconnected after a
        drop), or None. The first handshake needs no greeting: vLLM's, queued at start-up,
        goes out on it."""
        import zmq

        if event == zmq.EVENT_DISCONNECTED and not self._dropped[client_index]:
            self._dropped[client_index] = True
            return "abort"
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._dropped[client_index]:
            self._dropped[client_index] = False
            return "greet"
        return None


def install() -> None:
    """Replace ``EngineCoreProc``'s input loop and extend its dispatch (see the module's
    docstring); idempotent, as the plugin loads in every process vLLM starts."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc.process_input_sockets, "_duet_original", None) is not None:
        return
    vllm_input_loop = EngineCoreProc.process_input_sockets
    vllm_dispatch = EngineCoreProc._handle_client_request

    def process_input_sockets(self: Any, input_addresses: list[str], coord_input_address: str | None,
                              identity: bytes, ready_event: Any) -> None:
        if coord_input_address is not None:  # data parallel with a coordinator: vLLM's own
            return vllm_input_loop(self, input_addresses, coord_input_address, identity, ready_event)
        return _serve_clients(self, input_addresses, identity, ready_event)

    def handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        if request_type == ABORT_CLIENT:
            _abort_client_requests(self, request)
            return
        vllm_dispatch(self, request_type, request)

    def duet_readdress_client(self: Any, client_index: int, input_address: str, output_address: str) -> bool:
        """Runs on the engine's thread after the input loop moved the client (:func:`_readdress`):
        its answer tells the caller the move is done."""
        return True

    def duet_requests_by_client(self: Any) -> dict[int, int]:
        """A utility call: how many requests the engine runs or queues for each client (front
        door). A prefill that finished and keeps its KV for a pull is not counted: the pull,
        or the KV lease (kv_transfer.kv_lease_s), ends it. A request moving out with its KV
        (worker_runtime/kv_migration.py) is, until its pull ends: a drain waits for it."""
        counts: dict[int, int] = {}
        for request in self.scheduler.requests.values():
            if not request.is_finished() or getattr(request, "duet_moving_out", False):
                counts[request.client_index] = counts.get(request.client_index, 0) + 1
        return counts

    vllm_output_loop = EngineCoreProc.process_output_sockets

    def process_output_sockets(self: Any, output_paths: list[str], *args: Any, **kwargs: Any) -> Any:
        if len(output_paths) > 1:
            self.output_queue = StatsToFirstClient(self.output_queue)
            OUTPUT_ROUTES.start(output_paths)
        return vllm_output_loop(self, output_paths, *args, **kwargs)

    vllm_send = EngineCoreProc._send_msg_tracking_payload

    def send_msg_tracking_payload(socket: Any, buffers: Any) -> Any:
        OUTPUT_ROUTES.follow(socket)
        return vllm_send(socket, buffers)

    EngineCoreProc.process_output_sockets = process_output_sockets  # type: ignore[method-assign]
    process_input_sockets._duet_original = vllm_input_loop  # type: ignore[attr-defined]
    EngineCoreProc.process_input_sockets = process_input_sockets  # type: ignore[method-assign]
    EngineCoreProc._handle_client_request = handle_client_request  # type: ignore[method-assign]
    EngineCoreProc.duet_requests_by_client = duet_requests_by_client  # type: ignore[attr-defined]
    EngineCoreProc.duet_readdress_client = duet_readdress_client  # type: ignore[attr-defined]
    EngineCoreProc._send_msg_tracking_payload = staticmethod(send_msg_tracking_payload)  # type: ignore[method-assign]


class OutputRoutes:
    """Where each client's output socket must be connected, for the engine's output thread.

    vLLM's output loop owns the output sockets (ZeroMQ sockets belong to one thread), so a
    client moved by :data:`READDRESS_METHOD` is only recorded here, from the input thread;
    the output thread reconnects the socket when it next sends to that client (:meth:`follow`),
    which is before anything reaches the new client: its requests come after the greeting.
    Until a client moves, :meth:`follow` costs each send one check of an empty set.
    """

    def __init__(self) -> None:
        self._client_of: dict[str, int] = {}  # every address a client's socket had, to its index
        self._wanted: dict[int, str] = {}
        self._moved: set[int] = set()  # clients whose socket is not yet at the wanted address

    def start(self, output_paths: list[str]) -> None:
        self._client_of = {path: index for index, path in enumerate(output_paths)}
        self._wanted = dict(enumerate(output_paths))

    def move(self, client_index: int, output_address: str) -> None:
        self._client_of[output_address] = client_index
        self._wanted[client_index] = output_address
        self._moved.add(client_index)

    def follow(self, socket: Any) -> None:
        """Reconnect ``socket`` (on the output thread, before a send) if its client moved."""
        if not self._moved:
            return
        import zmq

        current = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        client_index = self._client_of.get(current)
        if client_index in self._moved:
            self._moved.discard(client_index)
            if self._wanted[client_index] != current:
                socket.disconnect(current)
                socket.connect(self._wanted[client_index])


# The engine core's one set of routes (one engine core per process).
OUTPUT_ROUTES = OutputRoutes()


class StatsToFirstClient:
    """The engine core's output queue as its output thread sees it, with the scheduler
    statistics that client 0 needs sent to it.

    vLLM attaches a step's scheduler statistics (KV cache usage, running and waiting requests,
    prefix-cache and KV-transfer counters) to the outputs of whichever client has outputs in
    that step, so with several front doors they were scattered among them. Client 0 is the
    control plane's front end, which serves the metrics endpoint and reads each worker's load
    from them. Statistics that count something (KV transfers, prefix-cache lookups) go to it,
    as a message of their own right after the outputs they came with, and so does a step's
    gauges at most once per :data:`GAUGES_INTERVAL_S`: a message per engine step cost the control
    plane about as much CPU as a front door. Request-level counters (tokens, latencies) stay
    with each front door, which counts its own requests.
    """

    def __init__(self, inner: "queue.Queue[Any]") -> None:
        self._inner = inner
        self._split: deque[Any] = deque()
        self._gauges_sent = 0.0

    def put_nowait(self, item: Any) -> None:
        self._inner.put_nowait(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._split:
            return self._split.popleft()
        item = self._inner.get(block, timeout)
        if isinstance(item, tuple) and item[0] > 0 and item[1].scheduler_stats is not None:
            stats, now = item[1].scheduler_stats, time.monotonic()
            if carries_deltas(item[1]) or now - self._gauges_sent >= GAUGES_INTERVAL_S:
                from vllm.v1.engine import EngineCoreOutputs

                self._split.append((0, EngineCoreOutputs(scheduler_stats=stats)))
                item[1].scheduler_stats = None
                self._gauges_sent = now
        return item

    def get_nowait(self) -> Any:
        return self.get(block=False)


def _abort_client_requests(engine: Any, client_index: int) -> None:
    """Abort every request of client ``client_index`` (on the engine core's busy-loop thread,
    which owns the scheduler). Nothing is sent back: nobody listens on that client's socket."""
    request_ids = [rid for rid, request in engine.scheduler.requests.items() if request.client_index == client_index]
    if request_ids:
        logger.warning("front end %d disconnected: aborting its %d request(s)", client_index, len(request_ids))
        engine.abort_requests(request_ids)


def _readdress(engine: Any, sockets: list[Any], connections: ClientConnections,
               client_index: int, input_address: str, output_address: str) -> None:
    """Move client ``client_index`` to new addresses (on the input thread, which owns the
    request sockets): what its old front door left is aborted, the request socket reconnects
    to the new one, which is greeted once connected, and the output thread follows."""
    import zmq

    socket = sockets[client_index]
    current = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    logger.warning("front end %d moved from %s to %s", client_index, current, input_address)
    engine.input_queue.put_nowait((ABORT_CLIENT, client_index))
    connections.moved(client_index)
    OUTPUT_ROUTES.move(client_index, output_address)
    if current != input_address:
        socket.disconnect(current)
        socket.connect(input_address)


def _serve_clients(engine: Any, input_addresses: list[str], identity: bytes, ready_event: Any) -> None:
    """vLLM's input loop (``EngineCoreProc.process_input_sockets``) without a coordinator,
    plus a monitor per client socket that greets a reconnected client and aborts the requests
    of a dropped one."""
    import msgspec
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder

    add_request_decoder = MsgpackDecoder(EngineCoreRequest, oob_tensor_provider=engine.tensor_ipc_receiver)
    generic_decoder = MsgpackDecoder(oob_tensor_provider=engine.tensor_ipc_receiver)
    connections = ClientConnections(len(input_addresses))
    with ExitStack() as stack, zmq.Context() as ctx:
        # Defaults for every socket made in this context from here on.
        ctx.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        ctx.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sockets = [
            stack.enter_context(make_zmq_socket(ctx, address, zmq.DEALER, identity=identity, bind=False))
            for address in input_addresses
        ]
        monitors = {
            stack.enter_context(
                sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            ): index
            for index, sock in enumerate(sockets)
        }
        poller = zmq.Poller()
        ready_payload = msgspec.msgpack.encode(engine._make_ready_response())
        for sock in sockets:
            # Queued until the client's router accepts the connection; it must hear from the
            # engine before it can send to it.
            sock.send(ready_payload)
            poller.register(sock, zmq.POLLIN)
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        ready_event.set()
        del ready_event
        while True:
            for sock, _ in poller.poll():
                if sock in monitors:
                    client_index = monitors[sock]
                    action = connections.on_event(client_index, recv_monitor_message(sock)["event"])
                    if action == "greet":
                        logger.info("front end %d reconnected: greeting it", client_index)
                        sockets[client_index].send(ready_payload)
                    elif action == "abort":
                        engine.input_queue.put_nowait((ABORT_CLIENT, client_index))
                    continue
                type_frame, *data_frames = sock.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(bytes(type_frame.buffer))
                request: Any
                if request_type == EngineCoreRequestType.ADD:
                    added = add_request_decoder.decode(data_frames)
                    try:
                        request = engine.preprocess_add_request(added)
                    except Exception:
                        engine._handle_request_preproc_error(added)
                        continue
                else:
                    request = generic_decoder.decode(data_frames)
                    if request_type == EngineCoreRequestType.UTILITY and request[2] == READDRESS_METHOD:
                        _readdress(engine, sockets, connections, *request[3])
                    if request_type == EngineCoreRequestType.ABORT:
                        # Eager abort, and in order with the inputs (as vLLM does).
                        engine.aborts_queue.put_nowait(request)
                engine.input_queue.put_nowait((request_type, request))
