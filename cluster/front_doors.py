"""The control plane's side of the front doors, when each is a process of its own.

With ``server.front_ends: N`` of 2 or more, the control plane serves no API itself: it starts
N front-door actors on its own host (router/front_door.py), clients 1..N of every engine core
(client 0 is the control plane's own front end, for health pings and status), tells
each about every worker (:meth:`FrontDoorSet.listen` before an engine core starts, then
:meth:`FrontDoorSet.connect`, then its state or its loss), and keeps one call pending on each
(:meth:`FrontDoor.wait`), which Ray fails the moment the front door's process dies. A dead
front door is replaced at once by a new actor with the same client index, which listens where
the dead one did, so every engine core reconnects to it by itself (worker_runtime/engine_clients.py):
no engine restarts. A worker that starts while a front door is down gets addresses picked here
for that front door, where its replacement will listen.
"""

from __future__ import annotations

import asyncio
import socket
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.config import DuetConfig
from duet.worker_runtime.worker_api import EngineAddresses
from duet.cluster.actor_names import actor_name, named_actors
from duet.router.engine_front_end import FrontEndListeners
from duet.router.front_door import FrontDoor, WorkerSnapshot
from duet.router.pools import PoolMember, WorkerPool
from duet.router.proto import duet_api_pb2 as pb

logger = logging.getLogger(__name__)

# Calls a front-door actor takes at once: it is an async actor serving the control plane's
# membership calls, its own status and its pending wait, all on its event loop.
_FRONT_DOOR_CONCURRENCY = 64
# A front door that does not answer a membership call within this is taken for dead (its
# replacement gets the whole membership anyway).
_CALL_TIMEOUT_S = 30.0


@dataclass
class _Door:
    """One front-door slot: its client index, its current actor and what status shows."""

    index: int
    actor: Any = None
    state: str = "starting"  # starting | ready | restarting | failed
    pid: int = 0
    restarts: int = 0
    error: str = ""
    watch: asyncio.Task[None] | None = None


@dataclass
class FrontDoorSet:
    config: DuetConfig
    host: str  # where front doors listen for engine cores (the control plane's router host)
    control_socket: str  # the control plane's private gRPC socket (Admin, status)
    pools: list[WorkerPool]
    doors: list[_Door] = field(default_factory=list)
    # With a control plane apart (cluster/control_plane.py): the deployment's id, which names
    # the front doors' actors, detached so that they outlive the control plane's process.
    actor_prefix: str | None = None
    # What a (replacement) front door starts serving with: ports and model limits.
    _serving: tuple[int, int | None, tuple[int, int, int]] | None = None
    _stopping: bool = False

    @property
    def clients(self) -> int:
        """Clients of every engine core: the control plane's front end and each front door's."""
        return self.config.server.front_ends + 1

    def create(self) -> None:
        """Create the front-door actors (clients 1..N of every engine core); they listen for
        engine cores at once and serve once :meth:`start` is called."""
        self.doors = [_Door(index) for index in range(1, self.clients)]
        for door in self.doors:
            door.actor = self._actor(door.index)

    def _actor(self, index: int) -> Any:
        here = ray.get_runtime_context().get_node_id()  # the ports it shares are this host's
        options: dict[str, Any] = {}
        if self.actor_prefix is not None:
            options.update(name=actor_name(self.actor_prefix, f"front-door-{index}"), lifetime="detached")
        return ray.remote(FrontDoor).options(
            num_cpus=0, max_concurrency=_FRONT_DOOR_CONCURRENCY, enable_task_events=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False), **options,
        ).remote(index, self.clients, self.config, self.control_socket)

    async def adopt(self, limits: tuple[int, int, int]) -> tuple[int, int | None]:
        """Take over the front doors that run (a control plane started again): watch each
        again; one that is gone is replaced. Returns the ports they serve on."""
        self.doors = [_Door(index) for index in range(1, self.clients)]
        for door in self.doors:
            for full_name in named_actors(self.actor_prefix or "", f"front-door-{door.index}/"):
                try:
                    door.actor = ray.get_actor(full_name)
                    shown, grpc_port, http_port = await asyncio.wait_for(door.actor.serving.remote(), _CALL_TIMEOUT_S)
                except Exception as error:
                    logger.warning("front door %d could not be taken over: %s", door.index, error)
                    continue
                door.state, door.pid, door.restarts = "ready", shown.pid, shown.restarts
                self._serving = (grpc_port, http_port, limits)
                break
        if self._serving is None:
            raise RuntimeError("no front door of this deployment answers: start it anew")
        for door in self.doors:
            if door.state != "ready":
                await self._replace(door)
        return self._watch_all()

    async def start(self, grpc_port: int, http_port: int | None, limits: tuple[int, int, int]) -> tuple[int, int | None]:
        """Serve both APIs on every front door; returns the ports they share (0 asks the first
        front door to pick one, which the others then share). Then watch them."""
        self._serving = (grpc_port, http_port, limits)
        first, *others = self.doors
        self._serving = await self._serve(first)
        await asyncio.gather(*(self._serve(door) for door in others))
        return self._watch_all()

    def _watch_all(self) -> tuple[int, int | None]:
        """Keep a watch on every front door (:meth:`_watch`); returns the ports they serve on."""
        assert self._serving is not None
        loop = asyncio.get_running_loop()
        for door in self.doors:
            door.watch = loop.create_task(self._watch(door))
        return self._serving[0], self._serving[1]

    async def _serve(self, door: _Door) -> tuple[int, int | None, tuple[int, int, int]]:
        assert self._serving is not None
        grpc_port, http_port, limits = self._serving
        door.pid, bound_grpc, bound_http = await asyncio.wait_for(
            door.actor.start.remote(grpc_port, http_port, limits), self.config.server.worker_start_timeout_s
        )
        door.state, door.error = "ready", ""
        return bound_grpc, bound_http, limits

    # ---- membership ------------------------------------------------------------------------

    async def listen(self, worker: str, simulated: bool = False) -> list[EngineAddresses | tuple[str, int]]:
        """Where each front door listens for ``worker``'s engine core (or SIMULATED engine's
        channel), in client order; a front door that cannot answer gets addresses picked
        here, where its replacement listens."""
        return list(await asyncio.gather(*(self._listen(door, worker, simulated) for door in self.doors)))

    async def _listen(self, door: _Door, worker: str, simulated: bool) -> EngineAddresses | tuple[str, int]:
        if door.state in ("starting", "ready"):
            try:
                return await asyncio.wait_for(door.actor.listen.remote(worker, simulated), _CALL_TIMEOUT_S)
            except Exception as error:  # dead or stuck: its watch replaces it
                logger.warning("front door %d did not listen for %s: %s", door.index, worker, error)
        if simulated:
            with socket.create_server((self.host, 0)) as picked_port:
                return self.host, picked_port.getsockname()[1]
        picked = FrontEndListeners.bind(self.host)
        picked.close()
        return picked.addresses

    async def connect(self, member: PoolMember, pool: WorkerPool) -> None:
        """Every front door connects to ``member``'s engine core, which is running."""
        await asyncio.gather(*(self._call(door, "connect", _snapshot(member, pool, door.index)) for door in self.doors))

    def tell(self, method: str, *args: Any) -> None:
        """Tell every front door a worker's ``set_state``, ``lost`` or ``remove`` (not waited
        for: a front door that misses it is replaced, and its replacement starts from the
        whole membership)."""
        for door in self.doors:
            asyncio.get_running_loop().create_task(self._call(door, method, *args))

    async def _call(self, door: _Door, method: str, *args: Any) -> None:
        if door.state not in ("starting", "ready") or self._stopping:
            return
        try:
            await asyncio.wait_for(getattr(door.actor, method).remote(*args), _CALL_TIMEOUT_S)
        except Exception as error:
            logger.warning("front door %d: %s failed: %s", door.index, method, error)

    # ---- failures ---------------------------------------------------------------------------

    async def _watch(self, door: _Door) -> None:
        """Replace ``door``'s process whenever it dies, until the deployment stops."""
        while not self._stopping:
            try:
                await door.actor.wait.remote()
            except Exception as error:  # RayActorError: its process died
                if self._stopping:
                    return
                logger.warning("front door %d (pid %d) died: %s; starting its replacement", door.index, door.pid, error)
                door.error = f"{type(error).__name__}: {error}"
            await self._replace(door)

    async def _replace(self, door: _Door) -> None:
        door.state, door.pid = "restarting", 0
        if door.actor is not None:
            ray.kill(door.actor, no_restart=True)
        door.actor = self._actor(door.index)
        try:
            for pool in self.pools:
                for member in list(pool.members):
                    if member.engine is not None and member.state in ("ready", "draining"):
                        await door.actor.connect.remote(_snapshot(member, pool, door.index))
            await self._serve(door)
        except Exception as error:
            logger.error("front door %d could not be replaced: %s", door.index, error)
            door.state, door.error = "failed", f"replacement failed: {type(error).__name__}: {error}"
            ray.kill(door.actor, no_restart=True)  # its wait fails, and the watch tries again
            await asyncio.sleep(1.0)
        door.restarts += 1

    # ---- status and stop --------------------------------------------------------------------

    async def status(self) -> list[pb.FrontEnd]:
        """Every front door, as ``duet status`` lists it."""
        return list(await asyncio.gather(*(self._status(door) for door in self.doors)))

    async def _status(self, door: _Door) -> pb.FrontEnd:
        shown = pb.FrontEnd(index=door.index, state=door.state, restarts=door.restarts, error=door.error)
        if door.state == "ready":
            try:
                shown = await asyncio.wait_for(door.actor.status.remote(), 5.0)
            except Exception as error:
                shown.error = f"unreachable: {type(error).__name__}: {error}"
                return shown
            shown.restarts, shown.error = door.restarts, door.error
        return shown

    async def stop(self) -> None:
        self._stopping = True
        for door in self.doors:
            if door.watch is not None:
                door.watch.cancel()
        await asyncio.gather(*(self._stop(door) for door in self.doors))

    async def _stop(self, door: _Door) -> None:
        try:
            await asyncio.wait_for(door.actor.stop.remote(), 10)
        except Exception:  # already dead: nothing to stop
            pass
        ray.kill(door.actor, no_restart=True)


def _snapshot(member: PoolMember, pool: WorkerPool, index: int) -> WorkerSnapshot:
    return WorkerSnapshot(
        name=member.name,
        pool="prefill" if pool.role == "prefill" else "decode",
        actor=member.actor,
        state="draining" if member.state == "draining" else "ready",
        kv_endpoint=member.kv_endpoint,
        addresses=member.client_addresses[index],
        engine_config=member.engine_config,
    )
