"""The control plane apart from the front doors: a Ray actor that Ray restarts when it dies.

With several front doors (``server.front_ends`` of 2 or more) nothing that serves requests
lives in the control plane's process, and nothing of the control plane lives in the process
the user started. ``duet serve`` starts Ray (local) or joins it, then the :class:`ControlPlane`
actor, which runs the deployment (cluster/deployment.py): it creates the worker actors and the
front-door actors, watches them, scales and drains the pools, and answers the front doors'
Admin calls and status. Workers and front doors are detached, named actors that no process
owns, so the control plane's death touches neither: the front doors serve on with the workers
they know while it is down. Ray restarts the actor (``max_restarts``), and the new process
finds the running workers and front doors by name and takes them over, the workers' engine
cores reconnecting to its front ends (worker_runtime/engine_clients.py); nothing is restarted.
(What is lost with it: the health watch's and the autoscaler's history, the restart counts, a
drain in progress.)

What ``duet serve``'s own death means depends on where Ray runs:

- **a local Ray** (``ray.address: local``): the process ``duet serve`` runs is Ray's owner, so
  its death ends the deployment, every process included, as Ray's daemons stop with it;
- **a Ray cluster**: the control plane is a detached actor, owned by no client process, that
  starts its deployment by itself whenever Ray (re)starts it. ``duet serve`` starts it, prints
  where it serves, watches it, and stops the deployment on Ctrl-C; its death (or its host's
  launcher's) leaves the deployment serving with its control plane. A ``duet serve`` started
  again with the same config finds it (:func:`find_running`) and takes it over; ``duet stop``
  ends a deployment that no ``duet serve`` watches.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.config import ConfigError, DuetConfig
from duet.cluster.ray_runtime import start_ray
from duet.logs import configure_logging

logger = logging.getLogger(__name__)

# Names the deployment's actors, so that a control plane started again finds them.
DEPLOYMENT_ID_ENV = "DUET_DEPLOYMENT_ID"
# How often the control plane may be restarted for one deployment (Ray's max_restarts).
_MAX_RESTARTS = 100
# The control planes' actor names: this prefix, then the deployment id.
_ACTOR_PREFIX = "control-plane/"
# How long a running control plane has to say who it is before it is passed over.
_IDENTITY_TIMEOUT_S = 10.0


def config_digest(config: DuetConfig) -> str:
    """What makes two ``duet serve`` runs the same deployment: the whole resolved config."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """A running control plane's deployment: its id, config, host (Ray node) and ports."""

    deployment_id: str
    digest: str
    node_id: str
    port: int
    http_port: int | None

    def serves_ports_of(self, config: DuetConfig) -> bool:
        return (self.port, self.http_port) == (config.server.port, config.server.http_port)


class ControlPlane:
    """The deployment's control plane as a restartable Ray actor (the module docstring)."""

    def __init__(self, config: DuetConfig, deployment_id: str) -> None:
        configure_logging()
        self.config = config
        self.deployment_id = deployment_id
        self.deployment: Any = None
        self._starting = asyncio.Lock()
        self._started = False
        if config.ray.address != "local":
            # Detached on a cluster: no `duet serve` may be there to call start() after Ray
            # restarts this process, so it starts its deployment itself (taking it over).
            me = ray.get_runtime_context().current_actor
            threading.Thread(target=lambda: me.start.remote(), name="duet-control-plane-start", daemon=True).start()

    async def start(self) -> dict[str, Any]:
        """Start the deployment, or take over the one that runs (after a restart); returns what
        ``duet serve`` prints. Once started, answers at once (a second caller: ``duet serve``
        beside the actor's own start, or one taking the deployment over)."""
        from duet.cluster.deployment import Deployment

        async with self._starting:
            if not self._started:
                self.deployment = Deployment(self.config, deployment_id=self.deployment_id)
                await self.deployment.start()
                self._started = True
            return self.deployment.serving

    async def identity(self) -> Identity:
        config = self.config.server
        return Identity(
            self.deployment_id, config_digest(self.config), ray.get_runtime_context().get_node_id(),
            config.port, config.http_port,
        )

    async def pid(self) -> int:
        return os.getpid()

    async def wait(self) -> None:
        """Pending while this process lives: Ray fails it the moment the process dies."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.deployment is not None:
            await self.deployment.stop()


class RemoteControlPlane:
    """What ``duet serve`` runs with several front doors: Ray, the :class:`ControlPlane` actor,
    and a watch that starts it again whenever Ray restarts it."""

    def __init__(self, config: DuetConfig) -> None:
        self.config = config
        # A fixed id (on Kubernetes, the release's name) lets a `duet serve` started again after
        # its host restarted take over the workers and front doors that outlived it (KubeRay's
        # GCS fault tolerance keeps them); by default each `duet serve` is a deployment of its
        # own, unless it finds its own config already running on the cluster (a take-over).
        self.deployment_id = os.environ.get(DEPLOYMENT_ID_ENV) or f"duet-{uuid.uuid4().hex[:12]}"
        self.actor: Any = None
        self.serving: dict[str, Any] = {}
        self.restarts = 0
        self.took_over = False
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> "RemoteControlPlane":
        start_ray(self.config)
        here = ray.get_runtime_context().get_node_id()  # the control plane's host: this one
        on_cluster = self.config.ray.address != "local"
        running = await find_running(self.config, here) if on_cluster and DEPLOYMENT_ID_ENV not in os.environ else None
        if running is not None:
            self.deployment_id, self.took_over = running.deployment_id, True
        options: dict[str, Any] = dict(
            name=_ACTOR_PREFIX + self.deployment_id, num_cpus=0, max_concurrency=64,
            max_restarts=_MAX_RESTARTS, enable_task_events=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        if on_cluster:  # owned by no client process: it outlives this one (the module docstring)
            options.update(lifetime="detached", get_if_exists=True)
        self.actor = ray.remote(ControlPlane).options(**options).remote(self.config, self.deployment_id)
        self.serving = await self.actor.start.remote()
        self._watch = asyncio.get_running_loop().create_task(self._restart_when_dead())
        return self

    async def _restart_when_dead(self) -> None:
        while True:
            try:
                await self.actor.wait.remote()
            except Exception as error:  # its process died; Ray starts a new one
                logger.warning("the control plane died (%s); starting it again", type(error).__name__)
            while True:
                try:
                    self.serving = await self.actor.start.remote()
                    break
                except Exception as error:  # still restarting, or it failed: try again
                    logger.warning("the control plane did not start yet: %s", error)
                    await asyncio.sleep(1.0)
            self.restarts += 1
            logger.warning("the control plane is back (%s)", "took over the running deployment" if self.serving.get("adopted") else "new")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.actor is not None:
            try:
                await asyncio.wait_for(self.actor.stop.remote(), 120)
            finally:
                ray.kill(self.actor, no_restart=True)


async def find_running(config: DuetConfig, node_id: str) -> Identity | None:
    """The deployment that runs ``config`` on this cluster with its control plane on
    ``node_id`` and the same ports, to take over; None if no control plane serves those ports
    there. ConfigError when one does with another config: two deployments cannot share ports,
    and the operator has to say which one goes."""
    for identity in await running_control_planes():
        if identity.node_id != node_id or not identity.serves_ports_of(config):
            continue
        if identity.digest != config_digest(config):
            raise ConfigError(
                f"deployment {identity.deployment_id} already serves ports {identity.port}"
                f"{f'/{identity.http_port}' if identity.http_port else ''} on this host with another config; "
                f"stop it first (duet stop --deployment {identity.deployment_id} --config FILE) or choose other ports"
            )
        return identity
    return None


async def running_control_planes() -> list[Identity]:
    """Every live control plane of this Ray cluster's duet namespace that says who it is."""
    found = []
    for name in ray.util.list_named_actors():
        if not name.startswith(_ACTOR_PREFIX):
            continue
        try:
            actor = ray.get_actor(name)
            found.append(await asyncio.wait_for(actor.identity.remote(), _IDENTITY_TIMEOUT_S))
        except Exception as error:  # gone meanwhile, or restarting: not one to take over now
            logger.warning("control plane %s did not answer (%s); passed over", name, type(error).__name__)
    return found


async def stop_running(config: DuetConfig, deployment_id: str | None) -> str:
    """Stop a deployment on this cluster that no ``duet serve`` may watch (``duet stop``): the
    one named ``deployment_id``, else the one serving ``config``'s ports on any host; returns
    its id. ConfigError when there is none, or several and no id says which."""
    start_ray(config)
    running = await running_control_planes()
    if deployment_id is not None:
        chosen = [identity for identity in running if identity.deployment_id == deployment_id]
    else:
        chosen = [identity for identity in running if identity.serves_ports_of(config)]
    if len(chosen) != 1:
        known = ", ".join(f"{i.deployment_id} (port {i.port})" for i in running) or "none"
        wanted = f"--deployment {deployment_id}" if deployment_id else f"the config's ports ({config.server.port})"
        raise ConfigError(f"{'no' if not chosen else 'more than one'} running deployment matches {wanted}; running: {known}")
    actor = ray.get_actor(_ACTOR_PREFIX + chosen[0].deployment_id)
    try:
        await asyncio.wait_for(actor.stop.remote(), 120)
    finally:
        ray.kill(actor, no_restart=True)
    return chosen[0].deployment_id
