"""Chaos across virtual hosts: a host's link cut under load (``duet bench chaos --hosts``).

The three-host plan (deploy/examples/three-hosts-cpu.yaml: the prefill engine on one host, a
decode engine on each of two more, duet's front door and control plane on the head) runs with
the manifests' own commands on virtual hosts (deploy/hosts.py), and the chaos harness
(benchmarks/chaos.py) replays the trace through it twice, the second time with these faults
from its seeded schedule:

  cut-decode-link, cut-prefill-link       a decode (prefill) host's link down for ``outage_s``
                                          (unplugged: nothing in or out), then up again
  kill-decode-engine, kill-prefill-engine SIGKILL of the vLLM engine core on that host

A host whose Ray node gave up while its link was down (its ``ray start`` exited) is started
again, as Kubernetes' restart policy would restart its pod's container. The cluster is back at
full capacity once every link is up and every worker ready, the victim replaced where it died.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable

import psutil

from duet.benchmarks.multinode import restart_if_gone
from duet.deploy.virtual_cluster import HEAD, VirtualCluster

HOST_KINDS = ("cut-decode-link", "cut-prefill-link", "kill-decode-engine", "kill-prefill-engine")
_ENGINE_TITLE = "VLLM::EngineCore"  # the engine-core process's title (vLLM sets it)


class HostsProcesses:
    """A deployment on virtual hosts, as the chaos harness acts on it and watches it."""

    def __init__(self, cluster: VirtualCluster, outage_s: float, connect: Callable[[], Any] | None = None) -> None:
        """``connect`` makes a client (default: the cluster's, with its rendered API key)."""
        self.cluster = cluster
        self.outage_s = outage_s
        self._connect = connect or cluster.client
        self.node_restarts: list[float] = []  # when a host's node was started again
        self._links_down: set[str] = set()
        self._lock = threading.Lock()

    def client(self) -> Any:
        return self._connect()

    def status(self) -> Any:
        with self.client() as client:
            return client.status(timeout=10)

    def workers(self, role: str) -> list[tuple[str, str]]:
        """Every ready worker of ``role``: (its name, the host it runs on, found by its KV
        channel's address)."""
        found = [
            (worker.name, self.cluster.network.host_at(worker.kv_endpoint))
            for pool in self.status().pools if pool.role == role
            for worker in pool.workers if worker.state == "ready"
        ]
        return [(name, host) for name, host in found if host is not None]

    def engine_pid(self, host: str) -> int:
        """The live vLLM engine core on ``host``."""
        for pid in self.cluster.network.pids(host):
            try:
                process = psutil.Process(pid)
                if process.cmdline()[:1] == [_ENGINE_TITLE] and process.status() != psutil.STATUS_ZOMBIE:
                    return pid
            except (psutil.Error, IndexError):
                continue
        raise RuntimeError(f"no vLLM engine core is running on {host}")

    def restarts(self, status: Any = None) -> dict[str, int]:
        status = status or self.status()
        return {worker.name: worker.restarts for pool in status.pools for worker in pool.workers}

    def missing_capacity(self, replaced: Callable[[dict[str, int]], bool] | None = None) -> str:
        """What keeps the cluster from full capacity now ("" when nothing does); starts a host's
        node again where its command has exited (Kubernetes' restart policy)."""
        with self._lock:
            down = sorted(self._links_down)
        for host in self.cluster.network.hosts:
            if host not in down and host != HEAD:
                restart_if_gone(self.cluster, host, self.node_restarts)
        try:
            status = self.status()
        except Exception as error:  # noqa: BLE001 - the front door still coming back
            return f"status: {type(error).__name__}"
        waiting = [f"{host}'s link down" for host in down]
        waiting += [f"{w.name} {w.state}" for pool in status.pools for w in pool.workers if w.state != "ready"]
        if not waiting and replaced is not None and not replaced(self.restarts(status)):
            waiting.append("the victim not yet replaced")
        return ", ".join(waiting)

    def inject(self, kind: str) -> tuple[str, str, Callable[[dict[str, int]], bool], float]:
        """Inject one fault of ``kind`` (one of :data:`HOST_KINDS`) on a host chosen at random
        among those running a worker of its role (a :data:`duet.benchmarks.chaos.Injector`)."""
        role = "decode" if "decode" in kind else "prefill"
        name, host = random.choice(self.workers(role))
        before = self.restarts()
        if kind.startswith("cut-"):
            with self._lock:
                self._links_down.add(host)
            self.cluster.network.set_link(host, up=False)
            when = time.monotonic()
            threading.Timer(self.outage_s, self._mend, args=(host,)).start()
            # Back once the link is up and every worker ready (the one on the host may have
            # been replaced, or may have kept its engine through the outage).
            return name, f"{host}'s link down {self.outage_s:g} s", lambda _: True, when
        pid = self.engine_pid(host)
        os.kill(pid, signal.SIGKILL)
        return name, f"engine pid {pid} on {host}", lambda now: now.get(name, 0) > before.get(name, 0), time.monotonic()

    def _mend(self, host: str) -> None:
        self.cluster.network.set_link(host, up=True)
        with self._lock:
            self._links_down.discard(host)
