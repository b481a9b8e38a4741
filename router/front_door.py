"""A front door: a process that serves both APIs on the deployment's ports beside the others.

With ``server.front_ends: N`` of 2 or more, a deployment has N front doors, each a
:class:`FrontDoor`, a Ray actor on the control plane's host, and the control plane's own
process serves no API (with 1, it is the one front door: cluster/deployment.py). Every front
door listens on the same gRPC and HTTP ports (SO_REUSEPORT: the kernel spreads new connections
among them), hosts its own front end for every worker's engine core (client ``index`` of that
engine core, worker_runtime/engine_clients.py), and runs the whole serving path over its own view of
the pools: validation, admission, routing, the request lifecycle. A token goes from the engine
core to the client through this one process.

What a front door does not do is change the cluster. The control plane creates, replaces,
drains and removes workers, watches their health and scales the pools, and tells every front
door (cluster/front_doors.py): a worker's engine core to connect to, its state, its loss. Admin
calls and status that reach a front door are authorized here and carried to the control plane
(router/admin.py). A front door whose process dies takes only its own requests with it: the
engines abort them, the other front doors serve on, and the control plane starts a replacement
that listens where the dead one did, so the engine cores reconnect to it without restarting.

A deployment that serves several models (``models:``) has each front door serve them all, on
the same ports: the front door keeps each model's pools and serving path, and the control plane
tells it of a model added or removed while it runs (:meth:`FrontDoor.models_changed`).

What the front doors share: nothing on the request path. Each routes on its own count of the
requests it sent to each worker (outstanding prompt tokens, requests in flight) and its own
prefix index (docs/concepts/front-doors.md says what that means for routing).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from duet.config import DuetConfig
from duet.logs import configure_logging
from duet.worker_runtime.worker_api import EngineAddresses, ServedAdapter
from duet.router.actor_channel import ActorChannel
from duet.router.admin import ForwardingAdmin
from duet.router.assembly import request_service, router_host
from duet.router.auth import Gatekeeper
from duet.router.control_channel import control_stub
from duet.router.engine_front_end import EngineFrontEnd, FrontEndListeners
from duet.router.front_ends import FrontEnds
from duet.router.load_meter import LoadWindow
from duet.router.lora_adapters import ControlPlaneAdapters
from duet.router.metrics import RouterMetrics
from duet.router.pools import PoolMember, WorkerPool
from duet.router.proto import duet_api_pb2 as pb
from duet.router.proto import duet_api_pb2_grpc as pb_grpc
from duet.router.served_models import ServedModels
from duet.router.serving import RequestService
from duet.router.status import ClusterView
from duet.router.worker_engines import ActorEngine, WorkerGone

logger = logging.getLogger(__name__)


@dataclass
class WorkerSnapshot:
    """What a front door needs to reach one worker's engine core, and the worker's state."""

    name: str
    model: str  # the served model whose pool it is in
    pool: str  # "prefill", "encode", or "decode" (also a colocated deployment's pool)
    actor: Any
    state: str
    kv_endpoint: str
    # Where this front door listens for the worker: its front end's client address pair for a
    # vLLM engine core, its channel's (host, port) for a SIMULATED engine.
    addresses: EngineAddresses | tuple[str, int]
    engine_config: Any  # the vLLM engine's config; None for a SIMULATED engine


class WorkerLostByControlPlane(WorkerGone):
    """The control plane found the worker dead (its watch or ping) and is replacing it;
    ``crashed`` as its watch said."""


class ControlledClusterView(ClusterView):
    """A front door's cluster view: status is the control plane's, which lists every front door."""

    def __init__(self, model: str, transport: str, pools: list[WorkerPool], control: pb_grpc.AdminStub) -> None:
        super().__init__(model, transport, pools)
        self.control = control

    async def status(self) -> pb.ClusterStatus:
        """The control plane's view; while it is unreachable (restarting), this front door's
        own, saying so."""
        try:
            return await self.control.ListWorkers(pb.GetStatusRequest(), timeout=10)
        except grpc.aio.AioRpcError as error:
            own = await super().status()
            own.routing.append(f"control plane unreachable ({error.code().name}): this front door's own view")
            return own


@dataclass
class _DoorModel:
    """One served model as a front door holds it: its pools, and its serving path once served."""

    config: DuetConfig  # the model's view of the deployment's config (DuetConfig.served)
    pools: dict[str, WorkerPool]  # by role: "decode" (colocated: the colocated pool), "prefill", "encode"
    service: RequestService | None = None

    @property
    def ordered_pools(self) -> list[WorkerPool]:
        return [self.pools[role] for role in ("prefill", "decode", "encode") if role in self.pools]


class FrontDoor:
    """One front door in a process of its own (an async Ray actor; module docstring)."""

    def __init__(
        self, index: int, count: int, config: DuetConfig, models: list[DuetConfig], control_address: str, control_token: str | None
    ) -> None:
        """``config``: the deployment's; ``models``: each served model's view of it (the
        config's and any added while it runs), the default first."""
        configure_logging()
        self.index = index
        self.count = count
        self.config = config
        self.models: dict[str, _DoorModel] = {}
        self._gatekeeper = Gatekeeper.from_config(config.server.auth)  # the callers' keys, shared by every model
        self._control_channel, control = control_stub(control_address, control_token)
        transport = config.kv_transfer.transport if any(m.mode != "colocated" for m in models) else "none (colocated)"
        self.cluster = ControlledClusterView(models[0].model.name, transport, [], control)
        self.cluster.served_models = []
        for served in models:
            self._add_model(served)
        self.cluster.index, self.cluster.forwards_status = index, True
        # Its requests' metrics, which the control plane's /metrics endpoint gathers (router/metrics.py).
        self.cluster.metrics = RouterMetrics(CollectorRegistry())
        if config.server.front_end_placement == "nodes":  # hosts share names less often than addresses
            self.cluster.host = router_host(config)
        self.served: ServedModels | None = None  # every model's serving path, once serving
        self.front_ends: FrontEnds | None = None
        self._listening: dict[str, FrontEndListeners | ActorChannel] = {}
        self._replaced: dict[str, asyncio.Event] = {}

    # ---- models, as the control plane tells them --------------------------------------------

    def _add_model(self, served: DuetConfig) -> _DoorModel:
        """Pools for model ``served``, so that its workers can be connected; served once
        :meth:`_serve_model` gives it a serving path."""
        colocated = served.mode == "colocated"
        pools = {"decode": WorkerPool("colocated" if colocated else "decode")}
        if not colocated:
            pools["prefill"] = WorkerPool("prefill")
        if not colocated and served.encode.replicas:
            pools["encode"] = WorkerPool("encode")
        for pool in pools.values():
            pool.model, pool.restart = served.model.name, self._await_replacement
        model = self.models[served.model.name] = _DoorModel(served, pools)
        self.cluster.pools.extend(model.ordered_pools)
        return model

    def _serve_model(self, model: _DoorModel, limits: tuple[int, int, int], adapters: tuple[ServedAdapter, ...]) -> None:
        """Serve ``model``'s name (and its ``adapters``') from now on."""
        prefill = model.pools.get("prefill")
        service = request_service(
            model.config, prefill, model.pools["decode"], limits, self.cluster, self._gatekeeper, model.pools.get("encode")
        )
        service.set_adapters(adapters)
        service.adapter_admin = ControlPlaneAdapters(lambda: self.cluster.control)
        model.service = service
        self.cluster.served_models.append(model.config.model.name)
        if self.served is not None:
            self.served.services.append(service)
        if self.front_ends is not None:
            self.front_ends.start_rebalancing(service)

    def _retire(self, model: _DoorModel) -> None:
        """Refuse ``model``'s names from now on; its requests in flight carry on."""
        service = model.service
        if service is None or service.retired:
            return
        service.retired = True
        if self.served is not None:
            self.served.services.remove(service)
        if self.front_ends is not None:
            self.front_ends.stop_rebalancing(service)
        self.cluster.served_models.remove(model.config.model.name)
        self.cluster.adapters_by_model.pop(model.config.model.name, None)

    async def retire_model(self, name: str) -> None:
        """The control plane is removing model ``name``: refuse its names from now on, while
        its requests in flight finish (:meth:`inflight`) before its workers go."""
        if name in self.models:
            self._retire(self.models[name])

    async def inflight(self, names: list[str]) -> int:
        """Requests in flight at this front door for these model names."""
        return sum(self.cluster.model_inflight[name] for name in names)

    def _remove_model(self, name: str) -> None:
        """Forget model ``name`` and its pools (retired first, if it was not)."""
        model = self.models.pop(name)
        self._retire(model)
        self.cluster.encoders.pop(name, None)
        for pool in model.ordered_pools:
            self.cluster.pools.remove(pool)
            for member in pool.members:
                if member.engine is not None:
                    member.engine.close()
                    member.engine = None

    async def models_changed(
        self,
        models: list[DuetConfig],
        limits: dict[str, tuple[int, int, int]],
        adapters: dict[str, tuple[ServedAdapter, ...]],
    ) -> None:
        """Hold exactly these ``models`` (pools for a new one, before its workers start), serve
        each that has ``limits`` (its workers are ready) with its ``adapters``, and forget any
        other. Called again with the same lists, it changes nothing."""
        names = [served.model.name for served in models]
        for name in [name for name in self.models if name not in names]:
            self._remove_model(name)
        for served in models:
            if served.model.name not in self.models:
                self._add_model(served)
        if self.served is None:
            return  # not serving yet: start() serves every model with limits
        for name, model in self.models.items():
            if model.service is None and name in limits:
                self._serve_model(model, limits[name], adapters.get(name, ()))
            elif model.service is not None:
                model.service.set_adapters(adapters.get(name, ()))

    # ---- membership, as the control plane tells it ---------------------------------------

    async def listen(self, name: str, simulated: bool = False) -> EngineAddresses | tuple[str, int]:
        """Listen for worker ``name``'s engine core (or SIMULATED engine's channel), which is
        about to start; returns where."""
        if simulated:
            channel = ActorChannel(router_host(self.config))
            await channel.start()
            self._listening[name] = channel
            return channel.address
        listeners = FrontEndListeners.bind(router_host(self.config))
        self._listening[name] = listeners
        return listeners.addresses

    async def connect(self, worker: WorkerSnapshot) -> None:
        """Connect to ``worker``'s engine core (launched with this front door's addresses) and
        put it in its pool; a worker being replaced gets its new engine."""
        pool = self.models[worker.model].pools[worker.pool]
        simulated = worker.engine_config is None
        engine = await (self._simulated_engine(worker) if simulated else self._engine_front_end(worker))
        member = pool.find(worker.name)
        if member is None:
            member = PoolMember(worker.name, worker.actor, state=worker.state)
            pool.members.append(member)
        elif member.engine is not None:
            member.engine.close()
        member.actor, member.engine, member.kv_endpoint = worker.actor, engine, worker.kv_endpoint
        if member.state == "restarting":
            self._replaced.setdefault(worker.name, asyncio.Event()).set()  # _await_replacement: ready
        elif member.state != "draining":
            member.state = worker.state
        pool.changed()

    async def _engine_front_end(self, worker: WorkerSnapshot) -> EngineFrontEnd:
        """A front end on the listeners :meth:`listen` bound for ``worker``: the control plane
        always has a front door listen before it connects it (cluster/front_doors.py)."""
        listeners = self._listening.pop(worker.name, None)
        if listeners is None:
            raise RuntimeError(f"front door {self.index} was asked to connect to {worker.name} without listening for it")
        return await EngineFrontEnd.connect(
            worker.name, worker.actor, worker.engine_config, listeners, self.config.kv_transfer, (self.index, self.count)
        )

    async def _simulated_engine(self, worker: WorkerSnapshot) -> ActorEngine:
        """A SIMULATED worker's channel: the one it connected to while it started, or (this
        front door replaced a dead one) one where the worker dials its predecessor again."""
        channel = self._listening.pop(worker.name, None)
        if channel is None:
            channel = ActorChannel(*worker.addresses)
            await channel.start()
        await channel.connected(self.config.server.worker_start_timeout_s)
        return ActorEngine(worker.actor, channel)

    def _find(self, name: str) -> tuple[WorkerPool, PoolMember] | None:
        """Worker ``name`` and its pool, if this front door has it."""
        for pool in self.cluster.pools:
            member = pool.find(name)
            if member is not None:
                return pool, member
        return None

    async def set_state(self, name: str, state: str) -> None:
        """The control plane's state for worker ``name`` (ready, draining)."""
        found = self._find(name)
        if found is not None and found[1].state not in ("restarting", "failed"):
            pool, member = found
            if state == "draining" and member.state != "draining":
                pool.start_draining(member)
            else:
                member.state = state
                pool.changed()

    async def report_loads(self, loads: dict[str, tuple[float, int]]) -> None:
        """The workers' loads as the control plane's health pings found them (name -> KV cache
        use, running requests), for the decode routing policy (``least_kv_load``): this front
        door pings no engine itself."""
        for name, (kv_usage, running) in loads.items():
            found = self._find(name)
            if found is not None:
                found[1].kv_usage, found[1].running = kv_usage, running

    async def lost(self, name: str, reason: str, crashed: bool = False) -> None:
        """Worker ``name`` died (``crashed``: its engine ended itself): its requests here resume
        on the others while it is replaced, and count the crash (router/lifecycle.py)."""
        found = self._find(name)
        if found is not None and found[1].engine is not None:
            pool, member = found
            pool.mark_failed(member, WorkerLostByControlPlane(reason, crashed), member.engine)

    async def remove(self, name: str) -> None:
        """Worker ``name`` left the cluster (drained or removed): its requests here, if any
        are left, resume on the others."""
        found = self._find(name)
        if found is not None:
            pool, member = found
            if member.engine is not None:
                member.engine.close()
                member.engine = None
            pool.members.remove(member)
            pool.changed()
        listeners = self._listening.pop(name, None)
        if listeners is not None:
            listeners.close()

    async def _await_replacement(self, member: PoolMember) -> None:
        """A front door replaces no worker itself: it waits for the control plane's
        replacement to be connected (:meth:`connect`)."""
        replaced = self._replaced.setdefault(member.name, asyncio.Event())
        try:
            await asyncio.wait_for(replaced.wait(), self.config.server.worker_start_timeout_s)
        finally:
            self._replaced.pop(member.name, None)

    # ---- serving -------------------------------------------------------------------------

    async def start(
        self,
        grpc_port: int,
        http_port: int | None,
        limits: dict[str, tuple[int, int, int]],
        adapters: dict[str, tuple[ServedAdapter, ...]],
    ) -> tuple[int, int, int | None]:
        """Serve both APIs on the deployment's ports (0: pick one, which the other front doors
        then share), for every model with ``limits`` (its engine's) and the LoRA ``adapters``
        the control plane serves on it; returns this process's id and the ports."""
        for name, model in self.models.items():
            if name in limits and model.service is None:
                self._serve_model(model, limits[name], adapters.get(name, ()))
        services = [model.service for model in self.models.values() if model.service is not None]
        self.served = ServedModels(services)
        admin = ForwardingAdmin(self.served.default, lambda: self.cluster.control)
        self.front_ends = await FrontEnds.start(self.served, self.config.server, grpc_port, http_port, admin)
        gc.collect()
        gc.freeze()  # as in the control plane's process (cluster/deployment.py says why)
        return os.getpid(), self.front_ends.grpc_port, self.front_ends.http_port

    async def control_at(self, address: str, token: str | None) -> None:
        """Reach the control plane at ``address`` from now on (a control plane started again
        on another port takes this front door over)."""
        old = self._control_channel
        self._control_channel, self.cluster.control = control_stub(address, token)
        await old.close()

    async def serving(self) -> tuple[pb.FrontEnd, int, int | None, list[DuetConfig], dict[str, tuple[ServedAdapter, ...]]]:
        """What a restarted control plane takes over: this front door, its ports, the models it
        serves (those added while the deployment ran included) and each one's LoRA adapters."""
        if self.front_ends is None or self.served is None:
            raise RuntimeError(f"front door {self.index} is not serving yet")
        door = self.cluster.front_door(self.index)
        adapters = {service.limits.name: service.limits.adapters for service in self.served.services}
        return door, self.front_ends.grpc_port, self.front_ends.http_port, [m.config for m in self.models.values()], adapters

    async def load_sample(self, model: str, waiting_longer_than_s: float) -> tuple[LoadWindow, int]:
        """Model ``model``'s load at this front door since the control plane's last call (its autoscaler)."""
        served = self.models.get(model)
        if served is None or served.service is None:
            return LoadWindow(), 0
        return await served.service.load.sample(waiting_longer_than_s)

    async def metrics_text(self) -> str:
        """This front door's request metrics, in Prometheus' text format."""
        assert self.cluster.metrics is not None
        return self.cluster.metrics.text()

    async def status(self) -> pb.FrontEnd:
        """This front door for ``duet status``."""
        return self.cluster.front_door(self.index)

    async def wait(self) -> None:
        """Pending for as long as this front door lives: the control plane keeps one call
        waiting, which Ray fails the moment the process dies."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.front_ends is not None:
            await self.front_ends.stop()
        for pool in self.cluster.pools:
            for member in pool.members:
                if member.engine is not None:
                    member.engine.close()
                    member.engine = None
        await self._control_channel.close()
