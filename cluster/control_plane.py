"""The control plane apart from the front doors: a Ray actor that Ray restarts when it dies.

With several front doors (``server.front_ends`` of 2 or more) nothing that serves requests
lives in the control plane's process, and nothing of the control plane lives in the process
the user started. ``duet serve`` starts Ray (local) or joins it, then the :class:`ControlPlane`
actor, which runs the deployment (cluster/deployment.py): it creates the worker actors and the
front-door actors, watches them, scales and drains the pools, and answers the front doors'
Admin calls and status. Workers and front doors are detached, named actors that no process
owns, so the control plane's death touches neither: the front doors serve on with the workers
they know while it is down. Ray restarts the actor (``max_restarts``); ``duet serve`` starts it
again, and the new process finds the running workers and front doors by name and takes them
over, the workers' engine cores reconnecting to its front ends (worker_runtime/engine_clients.py);
nothing is restarted. (What is lost with it: the health watch's and the autoscaler's history,
the restart counts, a drain in progress.)

The process ``duet serve`` runs is Ray's owner on a local Ray: its death ends the deployment,
every process included, as Ray's daemons stop with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.config import DuetConfig
from duet.cluster.ray_runtime import start_ray
from duet.logs import configure_logging

logger = logging.getLogger(__name__)

# Names the deployment's actors, so that a control plane started again finds them.
DEPLOYMENT_ID_ENV = "DUET_DEPLOYMENT_ID"
# How often the control plane may be restarted for one deployment (Ray's max_restarts).
_MAX_RESTARTS = 100


class ControlPlane:
    """The deployment's control plane as a restartable Ray actor (the module docstring)."""

    def __init__(self, config: DuetConfig, deployment_id: str) -> None:
        configure_logging()
        self.config = config
        self.deployment_id = deployment_id
        self.deployment: Any = None

    async def start(self) -> dict[str, Any]:
        """Start the deployment, or take over the one that runs (after a restart); returns what
        ``duet serve`` prints."""
        from duet.cluster.deployment import Deployment

        self.deployment = Deployment(self.config, deployment_id=self.deployment_id)
        await self.deployment.start()
        return self.deployment.serving

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
        # GCS fault tolerance keeps them); by default each `duet serve` is a deployment of its own.
        self.deployment_id = os.environ.get(DEPLOYMENT_ID_ENV) or f"duet-{uuid.uuid4().hex[:12]}"
        self.actor: Any = None
        self.serving: dict[str, Any] = {}
        self.restarts = 0
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> "RemoteControlPlane":
        start_ray(self.config)
        here = ray.get_runtime_context().get_node_id()  # the control plane's host: this one
        self.actor = ray.remote(ControlPlane).options(
            name=f"control-plane/{self.deployment_id}", num_cpus=0, max_concurrency=64,
            max_restarts=_MAX_RESTARTS, enable_task_events=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(self.config, self.deployment_id)
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
