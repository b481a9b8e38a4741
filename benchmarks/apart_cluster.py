"""duet as ``duet serve --front-ends N`` runs it, started for a benchmark that acts on its processes.

``duet bench chaos`` kills and stops them; ``duet bench soak`` samples their memory, file
descriptors and threads. Both need what :class:`ClusterProcesses` gives: every process of the
deployment by what it is (the control plane, each front door, each worker's Ray actor and its
vLLM engine core), restart counts, and whether the cluster is at full capacity.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator


@contextmanager
def running_apart(config: Any, front_ends: int) -> Iterator[tuple[Any, str]]:
    """The control plane in a Ray actor and ``front_ends`` front-door actors on a free gRPC
    port (no HTTP or metrics port): (the RemoteControlPlane, its gRPC target). Its watch, which
    starts a killed control plane again, runs on a loop of its own meanwhile."""
    import ray

    from duet.background_loop import BackgroundLoop
    from duet.cluster.control_plane import RemoteControlPlane

    server = config.server.model_copy(update={"front_ends": front_ends, "port": 0, "http_port": None, "metrics_port": None})
    loop = BackgroundLoop()
    control = loop.run(RemoteControlPlane(config.model_copy(update={"server": server})).start(), timeout=900)
    try:
        yield control, f"127.0.0.1:{control.serving['port']}"
    finally:
        loop.run(control.stop(), timeout=180)
        loop.close()
        ray.shutdown()


class ClusterProcesses:
    """The running deployment's processes, and whether it is at full capacity."""

    def __init__(self, control: Any, target: str) -> None:
        self.control = control
        self.target = target

    def client(self) -> Any:
        """A new client of the front doors (it resumes a broken stream on another)."""
        from duet.router.client import DuetClient

        return DuetClient(self.target)

    def status(self) -> Any:
        with self.client() as client:
            return client.status(timeout=10)

    def workers(self, role: str | None = None) -> list[tuple[str, int, int]]:
        """Every ready worker (of ``role``): its name, its actor's process and its engine core's."""
        import ray

        from duet.cluster.actor_names import named_actors
        from duet.cluster.ray_runtime import RAY_NAMESPACE

        found = []
        for pool in self.status().pools:
            for worker in pool.workers:
                if worker.state != "ready" or (role is not None and pool.role != role):
                    continue
                # Named "<deployment>/<worker>/<unique>": a predecessor's name can linger a moment.
                for actor_name in named_actors(self.control.deployment_id, f"{worker.name}/"):
                    actor = ray.get_actor(actor_name, namespace=RAY_NAMESPACE)
                    try:
                        pids = ray.get(actor.__ray_call__.remote(
                            lambda host: (os.getpid(), host._engine_processes.processes[0].pid)), timeout=10)
                    except Exception:  # noqa: BLE001 - the predecessor, dying
                        continue
                    found.append((worker.name, *pids))
                    break
        if not found:
            raise RuntimeError(f"no ready {role or ''} worker found".replace("  ", " "))
        return found

    def processes(self) -> dict[str, int]:
        """Every process of the deployment by what it is: {"control plane": pid, "front door 1":
        pid, "decode-0 actor": pid, "decode-0 engine": pid, ...}."""
        import ray

        found = {"control plane": ray.get(self.control.actor.pid.remote(), timeout=30)}
        found.update({f"front door {door.index}": door.pid for door in self.status().front_ends if door.pid})
        for name, actor_pid, engine_pid in self.workers():
            found[f"{name} actor"], found[f"{name} engine"] = actor_pid, engine_pid
        return found

    def restarts(self, status: Any = None) -> dict[str, int]:
        """Every worker's and front door's restart count, the control plane's under ``control``
        (from ``status``, or a status asked for now)."""
        status = status or self.status()
        counts = {w.name: w.restarts for pool in status.pools for w in pool.workers}
        counts.update({f"front-door-{door.index}": door.restarts for door in status.front_ends})
        counts["control"] = self.control.restarts
        return counts

    def missing_capacity(self, replaced: Callable[[dict[str, int]], bool] | None = None) -> str:
        """What keeps the cluster from full capacity now ("" when nothing does), from one status
        snapshot; ``replaced``, given the restart counts, says whether a fault's victim has been
        replaced yet."""
        try:
            status = self.status()
        except Exception as error:  # noqa: BLE001 - a front door or the control plane still coming back
            return f"status: {type(error).__name__}"
        waiting = [f"{w.name} {w.state}" for pool in status.pools for w in pool.workers if w.state != "ready"]
        waiting += [f"front door {door.index} {door.state}" for door in status.front_ends if door.state != "ready"]
        if status.control_plane_pid == 0:
            waiting.append("control plane unreachable")
        if not waiting and replaced is not None and not replaced(self.restarts(status)):
            waiting.append("the victim not yet replaced")
        return ", ".join(waiting)
