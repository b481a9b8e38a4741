"""One pool's workers over their lifetime: create, start, replace, scale, drain, remove.

The router's :class:`WorkerPool` is what requests see (states, load); this is what changes it.
A new worker is created in state ``starting`` and joins rotation only once its engine is ready.
Removal drains: the worker takes no new requests, its requests finish (or, past the drain
timeout, are cut off and resume on the other workers, as after any failure), then its engine is
shut down, its actor killed, and its core and ports released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.config import DuetConfig, PoolConfig
from duet.cluster.cores import CoreAllocator
from duet.cluster.actor_names import actor_name, named_actors
from duet.worker_runtime.engine_host import WorkerHost
from duet.worker_runtime.worker_api import ServedAdapter
from duet.cluster.front_doors import FrontDoorSet
from duet.router.engine_front_end import EngineFrontEnd, FrontEndListeners
from duet.router.pools import PoolMember, ScaleError, WorkerPool
from duet.router.actor_channel import ActorChannel
from duet.router.worker_engines import ActorEngine

logger = logging.getLogger(__name__)


@dataclass
class PoolManager:
    pool: WorkerPool
    worker_class: type[WorkerHost]
    pool_config: PoolConfig
    config: DuetConfig
    # Where workers reach the router: vLLM engine cores their front ends, SIMULATED engines
    # their channels.
    router_host: str
    cores: CoreAllocator | None
    # Ray node ids for the first replicas, as a placement plan assigned them.
    plan_nodes: list[str] | None = None
    # The front doors in processes of their own (server.front_ends > 1): every engine core is
    # also their client, and they hear of every change to the pool.
    front_doors: FrontDoorSet | None = None
    # With a control plane apart (cluster/control_plane.py): the deployment's id, which names
    # its workers' actors, detached so that they outlive the control plane's process.
    actor_prefix: str | None = None
    # The LoRA adapters served now (the control plane's list): loaded on each new engine before
    # it joins rotation, so that no adapter is first loaded mid-step by a request.
    served_adapters: Callable[[], tuple[ServedAdapter, ...]] = tuple
    # Begins its workers' names: "" for a deployment's default model, "NAME/" for another
    # served model's (cluster/model_serving.py).
    worker_prefix: str = ""
    _next_index: int = 0
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.pool.restart = self.restart

    # ---- creating and starting ----------------------------------------------------------

    def create(self, count: int) -> list[PoolMember]:
        """Create ``count`` workers' actors (state ``starting``); their engines are not started."""
        members = []
        for _ in range(count):
            index = self._next_index
            self._next_index += 1
            configured = self.pool_config.cpu_cores
            preferred = configured[index] if configured and index < len(configured) else None
            core = self.cores.take(preferred) if self.cores is not None else None
            node = self.plan_nodes[index] if self.plan_nodes and index < len(self.plan_nodes) else None
            name = f"{self.worker_prefix}{self.pool.role}-{index}"
            member = PoolMember(name, self._actor(name, core, node), state="starting")
            member.cpu_core = core
            self.pool.members.append(member)
            members.append(member)
        return members

    def _actor(self, name: str, core: int | None, node_id: str | None) -> Any:
        options: dict[str, Any] = {}
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        pool = self.pool_config
        if self.actor_prefix is not None:
            options.update(name=actor_name(self.actor_prefix, name), lifetime="detached")
        # Task events feed Ray's dashboard and state API, which duet does not use; recording one
        # per actor call (each health ping, when pings went through the actors) cost each actor
        # and the GCS about a tenth of their idle CPU.
        return ray.remote(self.worker_class).options(
            num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources=pool.resources,
            max_concurrency=self.worker_class.max_concurrency, enable_task_events=False, **options,
        ).remote(name, self.config, core)

    @property
    def simulated(self) -> bool:
        return self.pool_config.engine == "simulated"

    async def _start_engine(self, member: PoolMember) -> None:
        """Start the engine of ``member``'s actor and connect the router to it (bounded)."""
        timeout = self.config.server.worker_start_timeout_s
        if self.simulated:
            channel = ActorChannel(self.router_host)
            try:
                await channel.start()
                others = await self.front_doors.listen(member.name, simulated=True) if self.front_doors is not None else []
                member.client_addresses = [channel.address, *others]
                status = await asyncio.wait_for(member.actor.start.remote(member.client_addresses), timeout)
                await channel.connected(timeout)
            except BaseException:
                channel.close()
                raise
            member.engine = ActorEngine(member.actor, channel)
        else:
            listeners = FrontEndListeners.bind(self.router_host)
            try:
                others = await self.front_doors.listen(member.name) if self.front_doors is not None else []
                member.client_addresses = [listeners.addresses, *others]
                status = await asyncio.wait_for(member.actor.start.remote(member.client_addresses), timeout)
                member.engine_config = await member.actor.engine_config.remote()
            except BaseException:
                listeners.close()
                raise
            member.engine = await asyncio.wait_for(
                EngineFrontEnd.connect(
                    member.name, member.actor, member.engine_config, listeners, self.config.kv_transfer,
                    (0, len(member.client_addresses)),
                ),
                timeout,
            )
            for adapter in self.served_adapters():  # a bad adapter fails the start, naming it
                try:
                    await asyncio.wait_for(member.engine.add_lora(adapter), timeout)
                except Exception as error:
                    raise RuntimeError(f"LoRA adapter {adapter.name!r} ({adapter.path}) did not load: {error}") from error
        member.kv_endpoint = status.kv_endpoint
        if self.front_doors is not None:
            await self.front_doors.connect(member, self.pool)
        await self._connect_kv_peers(member)

    async def _connect_kv_peers(self, member: PoolMember) -> None:
        """Where decode workers move requests to each other with their KV over NIXL (a drain,
        the rebalancer), have ``member``'s engine and every other ready decode engine handshake
        now (worker_runtime/kv_migration.py ``connect_kv_peer``): the first move between two of
        them then does not wait for it. Best effort: a handshake not made now is made by the
        first pull, as before."""
        router = self.config.router
        moves = router.drain_moves_kv or router.rebalance_kv_gap is not None
        if self.pool.role != "decode" or not moves or not hasattr(member.engine, "kv_peer"):
            return
        others = [other for other in self.pool.ready() if other is not member and hasattr(other.engine, "kv_peer")]
        try:
            mine = await member.engine.kv_peer() if others else None
            if mine is None:
                return
            # Each answered between two of that engine's steps: asked of every engine at once.
            theirs = await asyncio.gather(*(other.engine.kv_peer() for other in others))
            await asyncio.gather(
                *(member.engine.connect_kv_peer(peer) for peer in theirs),
                *(other.engine.connect_kv_peer(mine) for other in others),
            )
        except Exception as error:
            logger.warning("%s: NIXL handshakes with the other decode workers not made ahead (%s)", member.name, error)

    async def adopt(self) -> None:
        """Take over this pool's workers that run (a control plane started again): connect
        this process's front end to each engine core where its predecessor's listened, and
        put it in rotation. A worker that does not answer is replaced; a pool left short of
        its configured size grows back."""
        deployment = self.actor_prefix or ""
        for full_name in named_actors(deployment, f"{self.worker_prefix}{self.pool.role}-"):
            name = full_name[len(deployment) + 1:].rsplit("/", 1)[0]  # "[MODEL/]ROLE-N" without its unique part
            try:
                actor = ray.get_actor(full_name)
                addresses, engine_config, kv_endpoint, core = await asyncio.wait_for(actor.adoption.remote(), 30)
                engine = await self._reconnect(name, actor, addresses, engine_config)
            except Exception as error:
                logger.warning("%s could not be taken over (%s); it is replaced", name, error)
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(full_name), no_restart=True)
                continue
            member = PoolMember(name, actor, state="ready", kv_endpoint=kv_endpoint)
            member.cpu_core = self.cores.take(core) if self.cores is not None and core is not None else core
            member.client_addresses, member.engine_config, member.engine = addresses, engine_config, engine
            self.pool.members.append(member)
            self._next_index = max(self._next_index, int(name.rsplit("-", 1)[1]) + 1)
        missing = self.pool_config.replicas - len(self.active())
        if missing > 0:
            self.add(missing)
        self.pool.changed()

    async def _reconnect(self, name: str, actor: Any, addresses: list[Any], engine_config: Any) -> Any:
        """This process's engine client for a running worker taken over: listening where the
        dead control plane's did (``addresses[0]``), where the engine core's client (or a
        SIMULATED worker's channel, which dials it again by itself) reconnects."""
        if self.simulated:
            channel = ActorChannel(*addresses[0])
            await channel.start()
            try:
                await channel.connected(30)
            except BaseException:
                channel.close()
                raise
            return ActorEngine(actor, channel)
        listeners = FrontEndListeners.rebind(addresses[0])
        return await EngineFrontEnd.connect(name, actor, engine_config, listeners, self.config.kv_transfer, (0, len(addresses)))

    async def start(self, member: PoolMember) -> None:
        """Start ``member``'s engine; it joins rotation when ready. Raises if it cannot start."""
        try:
            await self._start_engine(member)
        except BaseException as error:
            member.state, member.error = "failed", root_cause(error)
            raise
        if member.state == "starting":  # not drained while it started
            member.state = "ready"
        self.pool.changed()

    async def restart(self, member: PoolMember) -> None:
        """Replace a dead worker with a fresh actor and engine under the same name and core."""
        if self.front_doors is not None:
            self.front_doors.tell("lost", member.name, member.error, member.crashed)
        self._close_engine(member)
        ray.kill(member.actor, no_restart=True)
        member.actor = self._actor(member.name, member.cpu_core, None)
        await self._start_engine(member)

    # ---- scaling ------------------------------------------------------------------------

    @property
    def min_replicas(self) -> int:
        """The fewest workers the pool serves with: an encode pool may have none (its prefill
        engines encode then), every other pool needs one."""
        return 0 if self.pool.role == "encode" else 1

    def active(self) -> list[PoolMember]:
        """Members that count towards the pool's size (everything not leaving or failed)."""
        return self.pool.active()

    def scale_to(self, replicas: int) -> list[str]:
        """Grow or shrink the pool to ``replicas`` workers; returns what was done, a line each.

        Growing checks the cluster's free resources first and fails fast naming the one that is
        short; new workers start in the background. Shrinking drains the newest workers.
        """
        if replicas < self.min_replicas:
            raise ScaleError(f"replicas: the {self.pool.role} pool needs at least {self.min_replicas} worker, got {replicas}")
        active = self.active()
        if replicas > len(active):
            added = self.add(replicas - len(active))
            return [f"{member.name}: starting" for member in added]
        # Leaving first: workers still starting, then the newest (their requests still drain).
        order = sorted(active, key=lambda m: (m.state != "starting", -self.pool.members.index(m)))
        return [self.drain(member.name) for member in order[: len(active) - replicas]]

    def add(self, count: int) -> list[PoolMember]:
        self._check_resources(count)
        members = self.create(count)
        for member in members:
            self._background(self._start_logged(member))
        return members

    async def _start_logged(self, member: PoolMember) -> None:
        try:
            await self.start(member)
        except Exception:
            logger.error("%s worker %s failed to start: %s", self.pool.role, member.name, member.error)

    def _check_resources(self, count: int) -> None:
        if self.config.ray.autoscaling:  # the autoscaler adds nodes for the waiting workers
            return
        free = ray.available_resources()
        pool = self.pool_config
        for resource, each in (("CPU", pool.num_cpus), ("GPU", pool.num_gpus), *pool.resources.items()):
            need = each * count
            if need and free.get(resource, 0.0) + 1e-9 < need:
                total = ray.cluster_resources().get(resource, 0.0)
                raise ScaleError(
                    f"replicas: {count} more {self.pool.role} worker(s) need {need:g} {resource}, "
                    f"the Ray cluster has {free.get(resource, 0.0):g} of {total:g} free",
                    out_of_resources=True,
                )

    # ---- draining and removing ------------------------------------------------------------

    def drain(self, name: str, timeout_s: float | None = None) -> str:
        """Start removing worker ``name``: no new requests, then gone once its requests end."""
        member = self.pool.find(name)
        if member is None:
            known = ", ".join(m.name for m in self.pool.members)
            raise ScaleError(f"worker: no {self.pool.role} worker named {name!r} (this pool has: {known})")
        if member.state == "draining":
            return f"{name}: already draining"
        if member.state in ("ready", "restarting", "starting") and len(self.active()) <= self.min_replicas:
            raise ScaleError(f"worker: {name} is the last active {self.pool.role} worker; scale up before draining it")
        self.pool.start_draining(member)
        if self.front_doors is not None:
            self.front_doors.tell("set_state", name, "draining")
        timeout = self.config.router.drain_timeout_s if timeout_s is None else timeout_s
        self._background(self._drain(member, timeout))
        return f"{name}: draining"

    async def _drain(self, member: PoolMember, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (busy := await self._busy(member)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if busy:
            logger.warning(
                "%s: drain timeout (%.0f s) with %d request(s) in flight; they resume on other workers",
                member.name, timeout_s, member.inflight,
            )
        await self.remove(member)

    async def _busy(self, member: PoolMember) -> bool:
        """Whether ``member`` still has requests: this process's, and as its engine core counts
        them, every front door's and those moving off it whose KV is still being pulled
        (worker_runtime/kv_migration.py)."""
        if member.inflight > 0:
            return True
        if member.engine is None or not hasattr(member.engine, "requests_by_client"):
            return False
        try:
            return sum((await member.engine.requests_by_client()).values()) > 0
        except Exception:  # its engine is gone: nothing left to wait for
            return False

    async def remove(self, member: PoolMember) -> None:
        """Shut ``member``'s engine down, kill its actor, release its core and ports.

        Requests still on it (past a drain timeout) end now and resume on the other workers."""
        if member.engine is not None:
            member.engine.lost(WorkerRemoved(f"{member.name} was removed"))
        if self.front_doors is not None:
            self.front_doors.tell("remove", member.name)
        self._close_engine(member)
        try:
            await asyncio.wait_for(member.actor.shutdown.remote(), 30)
        except Exception:  # already dead: nothing to shut down
            pass
        ray.kill(member.actor, no_restart=True)
        if member in self.pool.members:
            self.pool.members.remove(member)
        if self.cores is not None:
            self.cores.release(member.cpu_core)
        self.pool.changed()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        # Together: a vLLM worker's actor takes its shutdown call once its current watch call
        # returns (up to a couple of seconds each).
        await asyncio.gather(*(self.remove(member) for member in list(self.pool.members)))

    @staticmethod
    def _close_engine(member: PoolMember) -> None:
        if member.engine is not None:
            member.engine.close()
            member.engine = None

    def _background(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class WorkerRemoved(RuntimeError):
    """The worker was removed (drained, or the deployment stopped) while requests were on it."""


def root_cause(error: BaseException) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
