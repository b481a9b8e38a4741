"""The control plane's side of the front doors, when each is a process of its own.

With ``server.front_ends: N`` of 2 or more (or ``server.front_end_placement: nodes``), the
control plane serves no API itself: it starts N front-door actors (router/front_door.py), on
its own host or one on each front-door host, clients 1..N of every engine core (client 0 is
the control plane's own front end, for health pings and status), tells each about every worker
(:meth:`FrontDoorSet.listen` before an engine core starts, then :meth:`FrontDoorSet.connect`,
then its state or its loss), and keeps one call pending on each (:meth:`FrontDoor.wait`), which
Ray fails the moment the front door's process dies. A dead front door is replaced at once by a
new actor with the same client index, on the same host or (``nodes``) on any front-door host
that is free; it listens for every running engine core at new addresses, to which the control
plane moves that client of the engine core (worker_runtime/engine_clients.py): no engine
restarts. A worker that starts while a front door is down is launched with addresses picked
here, to be moved when the replacement comes.

With several models (``models:``), every front door serves all of them: it holds each model's
pools and serving path, and is told of a model added or removed while the deployment runs
(:meth:`FrontDoorSet.set_models`); a replacement starts with every model served then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.config import DuetConfig
from duet.worker_runtime.worker_api import EngineAddresses, ServedAdapter
from duet.cluster.actor_names import actor_name, named_actors
from duet.router.engine_front_end import FrontEndListeners
from duet.router.front_door import FrontDoor, WorkerSnapshot
from duet.router.load_meter import LoadWindow
from duet.router.pools import PoolMember, WorkerPool
from duet.router.proto import duet_api_pb2 as pb

logger = logging.getLogger(__name__)

# Calls a front-door actor takes at once: it is an async actor serving the control plane's
# membership calls, its own status and its pending wait, all on its event loop.
_FRONT_DOOR_CONCURRENCY = 64
# A front door that does not answer a membership call within this is taken for dead (its
# replacement gets the whole membership anyway).
_CALL_TIMEOUT_S = 30.0
# A Prometheus scrape waits at most this for each front door's metrics.
_SCRAPE_TIMEOUT_S = 3.0
# The Ray resource a front-door host advertises (one unit: one front door per host).
FRONT_END_RESOURCE = "duet_front_end"


def front_door_host_command(cluster: str, node_ip: str | None = None) -> list[str]:
    """``ray start`` that joins ``cluster`` as a front-door host (``duet front-end``): it
    advertises :data:`FRONT_END_RESOURCE` and offers no CPUs, so no worker lands there."""
    ray_cli = Path(sys.executable).with_name("ray")
    resources = json.dumps({FRONT_END_RESOURCE: 1}, separators=(",", ":"))
    command = [str(ray_cli), "start", f"--address={cluster}", f"--resources={resources}", "--num-cpus=0", "--block"]
    return command + ([f"--node-ip-address={node_ip}"] if node_ip else [])


@dataclass(frozen=True)
class ControlEndpoint:
    """Where the front doors reach the control plane's private gRPC server (Admin calls and
    status): a Unix socket when they share its host, else TCP with a token that only the
    deployment's own actors are given (over Ray, which authenticates its nodes)."""

    address: str  # "unix:PATH" or "HOST:PORT"
    token: str | None = None


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
    # The workers whose engine cores this front door has a front end for, or listens for.
    workers: set[str] = field(default_factory=set)


@dataclass
class FrontDoorSet:
    config: DuetConfig
    host: str  # where addresses are picked for a front door that is down (the control plane's host)
    control: ControlEndpoint  # the control plane's private gRPC server (Admin, status)
    pools: list[WorkerPool]
    doors: list[_Door] = field(default_factory=list)
    # With a control plane apart (cluster/control_plane.py): the deployment's id, which names
    # the front doors' actors, detached so that they outlive the control plane's process.
    actor_prefix: str | None = None
    # Each served model's view of the config (the config's models and any added since), the
    # default first; each served model's engine limits, once its workers are ready; and each
    # one's LoRA adapters (the config's and any loaded since). A front door brought up starts
    # with them; a control plane that takes the front doors over reads them back from the
    # first that answers (:meth:`find`).
    models: list[DuetConfig] = field(default_factory=list)
    limits: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    adapters: dict[str, tuple[ServedAdapter, ...]] = field(default_factory=dict)
    # What a (replacement) front door starts serving on: the ports they share.
    _ports: tuple[int, int | None] | None = None
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

    @property
    def on_nodes(self) -> bool:
        """Whether each front door runs on a front-door host of its own."""
        return self.config.server.front_end_placement == "nodes"

    def _actor(self, index: int) -> Any:
        options: dict[str, Any] = {}
        if self.on_nodes:  # any front-door host that has none yet; Ray waits for one to join
            options["resources"] = {FRONT_END_RESOURCE: 1}
        else:  # the ports it shares are this host's
            here = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
        if self.actor_prefix is not None:
            options.update(name=actor_name(self.actor_prefix, f"front-door-{index}"), lifetime="detached")
        return ray.remote(FrontDoor).options(
            num_cpus=0, max_concurrency=_FRONT_DOOR_CONCURRENCY, enable_task_events=False, **options,
        ).remote(index, self.clients, self.config, self.models, self.control.address, self.control.token)

    async def find(self) -> bool:
        """Find the front doors that run (a control plane started again, before it takes its
        workers over): each is told where the control plane is now, and the first that answers
        says what they serve (:attr:`models`, :attr:`adapters`, the ports). False when none
        answers."""
        self.doors = [_Door(index) for index in range(1, self.clients)]
        for door in self.doors:
            for full_name in named_actors(self.actor_prefix or "", f"front-door-{door.index}/"):
                try:
                    door.actor = ray.get_actor(full_name)
                    await asyncio.wait_for(door.actor.control_at.remote(self.control.address, self.control.token), _CALL_TIMEOUT_S)
                    shown, grpc_port, http_port, models, adapters = await asyncio.wait_for(door.actor.serving.remote(), _CALL_TIMEOUT_S)
                except Exception as error:
                    logger.warning("front door %d could not be taken over: %s", door.index, error)
                    continue
                door.state, door.pid, door.restarts = "ready", shown.pid, shown.restarts
                if self._ports is None:
                    self._ports, self.models, self.adapters = (grpc_port, http_port), models, adapters
                break
        return self._ports is not None

    async def adopt(self, limits: dict[str, tuple[int, int, int]]) -> tuple[int, int | None]:
        """Watch the front doors :meth:`find` found again, now that the workers are taken over
        (each model's engine ``limits``); one that is gone is replaced. Returns the ports they
        serve on."""
        if self._ports is None and not self.on_nodes:
            raise RuntimeError("no front door of this deployment answers: start it anew")
        self._ports = self._ports or (self.config.server.port, self.config.server.http_port)
        self.limits = dict(limits)
        for door in self.doors:
            if door.state == "ready":
                door.workers = {member.name for pool in self.pools for member in pool.members}
            else:
                door.state = "restarting"
                door.actor = door.actor or self._actor(door.index)
        return self._watch_all()

    async def start(self, grpc_port: int, http_port: int | None, limits: dict[str, tuple[int, int, int]]) -> tuple[int, int | None]:
        """Serve both APIs on every front door, for every model (each with its engine's
        ``limits``); returns the ports they share (0 asks the first front door to pick one,
        which the others then share). Then watch them. Front doors on hosts of their own are
        brought up by their watch as their hosts join: this returns at once, with the
        configured ports."""
        self._ports, self.limits = (grpc_port, http_port), dict(limits)
        if not self.on_nodes:
            first, *others = self.doors
            self._ports = await asyncio.wait_for(self._serve(first), self.config.server.worker_start_timeout_s)
            await asyncio.gather(*(self._serve(door) for door in others))
        return self._watch_all()

    def _watch_all(self) -> tuple[int, int | None]:
        """Keep a watch on every front door (:meth:`_watch`); returns the ports they serve on."""
        assert self._ports is not None
        loop = asyncio.get_running_loop()
        for door in self.doors:
            door.watch = loop.create_task(self._watch(door))
        return self._ports

    async def _serve(self, door: _Door) -> tuple[int, int | None]:
        assert self._ports is not None
        grpc_port, http_port = self._ports
        door.pid, bound_grpc, bound_http = await door.actor.start.remote(grpc_port, http_port, self.limits, self.adapters)
        door.state, door.error = "ready", ""
        return bound_grpc, bound_http

    # ---- membership ------------------------------------------------------------------------

    async def listen(self, worker: str, simulated: bool = False) -> list[EngineAddresses | tuple[str, int]]:
        """Where each front door listens for ``worker``'s engine core (or SIMULATED engine's
        channel), in client order; a front door that cannot answer gets addresses picked
        here, where its replacement listens."""
        return list(await asyncio.gather(*(self._listen(door, worker, simulated) for door in self.doors)))

    async def _listen(self, door: _Door, worker: str, simulated: bool) -> EngineAddresses | tuple[str, int]:
        # A front door on a host that has not joined yet is not waited for: it attaches to the
        # worker when it comes up (_bring_up).
        if door.state == "ready" or (door.state == "starting" and not self.on_nodes):
            try:
                addresses = await asyncio.wait_for(door.actor.listen.remote(worker, simulated), _CALL_TIMEOUT_S)
                door.workers.add(worker)
                return addresses
            except Exception as error:  # dead or stuck: its watch replaces it
                logger.warning("front door %d did not listen for %s: %s", door.index, worker, error)
        door.workers.discard(worker)  # an engine launched elsewhere: attached (moved) when it connects
        if simulated:
            with socket.create_server((self.host, 0)) as picked_port:
                return self.host, picked_port.getsockname()[1]
        picked = FrontEndListeners.bind(self.host)
        picked.close()
        return picked.addresses

    async def connect(self, member: PoolMember, pool: WorkerPool) -> None:
        """Every front door connects to ``member``'s engine core, which is running: where it
        listened while the engine started, or (it came up since) where it listens now."""
        await asyncio.gather(*(self._connect(door, member, pool) for door in self.doors))

    async def _connect(self, door: _Door, member: PoolMember, pool: WorkerPool) -> None:
        if member.name in door.workers:
            await self._call(door, "connect", _snapshot(member, pool, door.index))
        elif door.state == "ready":
            try:
                await self._attach(door, member, pool)
            except Exception as error:  # dead or stuck: its watch replaces it
                logger.warning("front door %d did not attach to %s: %s", door.index, member.name, error)

    async def _attach(self, door: _Door, member: PoolMember, pool: WorkerPool) -> None:
        """Give ``door`` a front end for ``member``'s running engine core: it listens at new
        addresses, and the engine core's client ``door.index`` is moved there (a SIMULATED
        worker dials its front door's address again by itself)."""
        door.workers.add(member.name)
        if member.engine_config is not None and member.engine is not None:
            addresses = await asyncio.wait_for(door.actor.listen.remote(member.name), _CALL_TIMEOUT_S)
            await asyncio.wait_for(member.engine.move_client(door.index, addresses), _CALL_TIMEOUT_S)
            member.client_addresses[door.index] = addresses
        await asyncio.wait_for(door.actor.connect.remote(_snapshot(member, pool, door.index)), _CALL_TIMEOUT_S)

    async def set_adapters(self, model: str, adapters: tuple[ServedAdapter, ...]) -> None:
        """Have every serving front door serve exactly ``adapters`` on ``model``, waited for: a
        load is answered once every front door that answers serves the adapter (one that does
        not is left to its watch: a dead one's replacement starts with them)."""
        self.adapters[model] = adapters
        await self._tell_models()

    async def set_models(self, models: list[DuetConfig]) -> None:
        """Every front door holds exactly these ``models`` (each model's view of the config),
        serving those with :attr:`limits`: a model being added gets its pools before its workers
        start, and is served once its limits are set (:meth:`serve_model`). Waited for, as
        :meth:`set_adapters`."""
        self.models = list(models)
        names = {served.model.name for served in models}
        self.limits = {name: limits for name, limits in self.limits.items() if name in names}
        self.adapters = {name: adapters for name, adapters in self.adapters.items() if name in names}
        await self._tell_models()

    async def serve_model(self, model: str, limits: tuple[int, int, int], adapters: tuple[ServedAdapter, ...]) -> None:
        """Every front door serves ``model`` (added with :meth:`set_models`; its workers are
        ready, its engine's ``limits`` known) from now on."""
        self.limits[model], self.adapters[model] = limits, adapters
        await self._tell_models()

    async def retire_model(self, model: str) -> None:
        """Every front door refuses ``model``'s names from now on (its requests in flight
        carry on: :meth:`inflight`), before its workers are removed."""
        await asyncio.gather(*(self._call(door, "retire_model", model) for door in self.doors))

    async def inflight(self, names: list[str]) -> int:
        """Requests in flight for these model names at every front door that answers."""
        counts = await asyncio.gather(
            *(asyncio.wait_for(door.actor.inflight.remote(names), 5.0) for door in self.doors if door.state == "ready"),
            return_exceptions=True,
        )
        return sum(count for count in counts if isinstance(count, int))

    async def _tell_models(self) -> None:
        await asyncio.gather(*(self._tell_models_to(door) for door in self.doors))

    async def _tell_models_to(self, door: _Door) -> None:
        await self._call(door, "models_changed", self.models, self.limits, self.adapters)

    def tell(self, method: str, *args: Any) -> None:
        """Tell every front door a worker's ``set_state``, ``lost`` or ``remove``, or the
        workers' ``report_loads`` (not waited for: a front door that misses a change is
        replaced, and its replacement starts from the whole membership; loads come again
        every health period)."""
        for door in self.doors:
            if method == "remove":
                door.workers.discard(args[0])
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
        """Bring ``door`` up whenever it is not, and replace its process whenever it dies,
        until the deployment stops."""
        while not self._stopping:
            if door.state != "ready":
                await self._bring_up(door)
                continue
            try:
                await door.actor.wait.remote()
            except Exception as error:  # RayActorError: its process died
                if self._stopping:
                    return
                logger.warning("front door %d (pid %d) died: %s; starting its replacement", door.index, door.pid, error)
                door.error = f"{type(error).__name__}: {error}"
            door.state, door.pid, door.workers = "restarting", 0, set()
            door.restarts += 1
            ray.kill(door.actor, no_restart=True)
            door.actor = self._actor(door.index)

    async def _bring_up(self, door: _Door) -> None:
        """Attach ``door`` to every running worker, then serve; a failure leaves it ``failed``
        with a new actor, for the next try a second later."""
        try:
            # Models added or removed since its actor was made: it needs their pools to attach.
            await asyncio.wait_for(door.actor.models_changed.remote(self.models, {}, {}), _CALL_TIMEOUT_S)
            await self._attach_all(door)
            await asyncio.wait_for(self._serve(door), None if self.on_nodes else self.config.server.worker_start_timeout_s)
            await self._attach_all(door)  # workers that came up while it started serving
            await self._tell_models_to(door)  # models and adapters changed while it started
        except Exception as error:
            logger.error("front door %d could not be brought up: %s", door.index, error)
            door.state, door.error = "failed", f"start failed: {type(error).__name__}: {error}"
            door.workers = set()
            ray.kill(door.actor, no_restart=True)
            door.actor = self._actor(door.index)
            await asyncio.sleep(1.0)

    async def _attach_all(self, door: _Door) -> None:
        for pool in self.pools:
            for member in list(pool.members):
                if member.name not in door.workers and member.engine is not None and member.state in ("ready", "draining"):
                    await self._attach(door, member, pool)

    # ---- load, for the autoscaler ------------------------------------------------------------

    def load_of(self, model: str) -> "ModelLoad":
        """Model ``model``'s load at every front door, for its autoscaler."""
        return ModelLoad(self, model)

    async def sample(self, model: str, waiting_longer_than_s: float) -> tuple[LoadWindow, int]:
        """Every serving front door's load of ``model`` since the last call, summed. A front
        door that does not answer is left out: its requests are missing from this interval, as
        they would be from a door that was just replaced."""
        samples = await asyncio.gather(
            *(
                asyncio.wait_for(door.actor.load_sample.remote(model, waiting_longer_than_s), 5.0)
                for door in self.doors if door.state == "ready"
            ),
            return_exceptions=True,
        )
        total, overdue = LoadWindow(), 0
        for sample in samples:
            if isinstance(sample, BaseException):
                logger.warning("a front door's load could not be read: %s", sample)
                continue
            total.add(sample[0])
            overdue += sample[1]
        return total, overdue

    def metrics_texts(self) -> list[tuple[int, str]]:
        """Every serving front door's request metrics, in Prometheus' text format, by index:
        the metrics endpoint's scrape, from its own thread. A door that does not answer within
        a few seconds is left out of this scrape rather than failing it."""
        calls = {door.actor.metrics_text.remote(): door.index for door in self.doors if door.state == "ready"}
        if not calls:
            return []
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=_SCRAPE_TIMEOUT_S)
        texts = []
        for call in answered:
            try:
                texts.append((calls[call], ray.get(call)))
            except Exception as error:  # it died since: its replacement is in the next scrape
                logger.debug("no metrics from front door %d: %s", calls[call], error)
        return sorted(texts)

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


@dataclass(frozen=True)
class ModelLoad:
    """One model's load at every front door: the autoscaler's
    :class:`~duet.cluster.autoscaler.live.LoadSource` for that model."""

    front_doors: FrontDoorSet
    model: str

    async def sample(self, waiting_longer_than_s: float) -> tuple[LoadWindow, int]:
        return await self.front_doors.sample(self.model, waiting_longer_than_s)


def _snapshot(member: PoolMember, pool: WorkerPool, index: int) -> WorkerSnapshot:
    return WorkerSnapshot(
        name=member.name,
        model=pool.model,
        pool=pool.role if pool.role in ("prefill", "encode") else "decode",
        actor=member.actor,
        state="draining" if member.state == "draining" else "ready",
        kv_endpoint=member.kv_endpoint,
        addresses=member.client_addresses[index],
        engine_config=member.engine_config,
    )
