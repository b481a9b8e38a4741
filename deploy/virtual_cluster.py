"""A rendered duet cluster (:func:`duet.deploy.render.plan_launch`) run on virtual hosts.

Every node runs its group's own container command with its group's own environment, plus what
KubeRay would add (:meth:`GroupLaunch.kuberay_env`) and the Secrets' values: the same processes
the manifests start in pods, here one per host of a :class:`~duet.deploy.hosts.HostNetwork`.
The head host runs Ray's head and duet's control plane (and its front door, unless the
front doors are a group of their own); each other group's replicas get hosts of their own
(``front-door-0``, ``prefill-0``, ``decode-0``, ...), so KV between prefill and decode, and
every token between a worker and a front door, crosses the shaped links.

Two things differ from a pod, both because the "hosts" share one kernel and file system:

- ``DUET_CONFIG`` names a file in the harness's directory instead of the ConfigMap mount;
- ``UCX_TLS=tcp``: UCX would otherwise see one machine and move NIXL's KV by cross-memory
  attach, past the network the test is about. On real hosts UCX picks the best transport
  itself (RDMA where present).
"""

from __future__ import annotations

import os
import secrets
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from duet.cluster.placement.plan import Plan
from duet.deploy.hosts import PREFIX, HostNetwork, LinkShape
from duet.deploy.launch import GCS_PORT, GroupLaunch
from duet.deploy.render import API_KEYS_ENV_KEY, ClusterLaunch, RenderOptions, plan_launch

HEAD = "head"
# Prefill on one host, decode on another (the plan the test and `duet bench multinode` run).
TWO_HOSTS_PLAN = Path(__file__).resolve().parent / "examples" / "two-hosts-cpu.yaml"
API_KEY_NAME = "harness"

if TYPE_CHECKING:  # grpc is only needed once duet's front end is up
    from duet.router.client import DuetClient


class ClusterStartError(RuntimeError):
    """A node or duet's front end did not come up; the message carries its log's tail."""


def host_groups(launch: ClusterLaunch) -> dict[str, GroupLaunch]:
    """Each host's node group: one host for the head and one per replica of each worker group
    (``prefill-0``, ``decode-0``, ...), in that order."""
    workers = {f"{group.name}-{i}": group for group in launch.workers for i in range(group.replicas)}
    return {HEAD: launch.head, **workers}


@dataclass(frozen=True)
class ClusterSecrets:
    """The values of the two Secrets the manifests reference (docs/guides/kubernetes.md)."""

    ray_token: str
    api_key: str

    @classmethod
    def generate(cls) -> ClusterSecrets:
        return cls(secrets.token_hex(32), secrets.token_hex(16))

    def resolve(self, launch: ClusterLaunch, group: GroupLaunch) -> dict[str, str]:
        """``group``'s secret environment, read from these values instead of Kubernetes."""
        values = {
            (launch.options.ray_token_secret, "auth_token"): self.ray_token,
            (launch.options.api_keys_secret, API_KEYS_ENV_KEY): f"{API_KEY_NAME}:{self.api_key}",
        }
        return {name: values[(ref.secret, ref.key)] for name, ref in group.secret_env.items()}


def _image_env() -> dict[str, str]:
    """What the image's environment provides: duet and ray on PATH, a home, a locale; plus the
    model cache, so the built-in model is not rebuilt per host."""
    env = {
        "PATH": f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    for name in ("DUET_CACHE_DIR", "HF_HOME"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


class VirtualCluster:
    """Start with :meth:`start`; the :class:`HostNetwork` owns (and removes) every process."""

    def __init__(self, launch: ClusterLaunch, network: HostNetwork, cluster_secrets: ClusterSecrets | None = None) -> None:
        self.launch = launch
        self.network = network
        self.secrets = cluster_secrets or ClusterSecrets.generate()
        self.config_file = network.workdir / "duet.yaml"
        self.config_file.write_text(launch.head_config.yaml())
        self._groups = host_groups(launch)

    @property
    def head_address(self) -> str:
        return self.network[HEAD].address

    @property
    def serving_hosts(self) -> list[str]:
        """The hosts that serve duet's APIs: the head, or each front-door host."""
        return [host for host, group in self._groups.items() if group is self.launch.serving]

    @property
    def targets(self) -> list[str]:
        """duet's gRPC API on each serving host, as a client outside the hosts reaches it."""
        port = self.launch.head_config.config.server.port
        return [f"{self.network[host].address}:{port}" for host in self.serving_hosts]

    @property
    def target(self) -> str:
        return self.targets[0]

    @property
    def metrics_url(self) -> str | None:
        port = self.launch.head_config.config.server.metrics_port
        return f"http://{self.head_address}:{port}/metrics" if port is not None else None

    def environment(self, host: str) -> dict[str, str]:
        """Exactly the environment the node on ``host`` runs with."""
        group = self._groups[host]
        return {
            **_image_env(),
            **group.env,
            **self.secrets.resolve(self.launch, group),
            **group.kuberay_env(self.head_address),
            "DUET_CONFIG": str(self.config_file),
            "UCX_TLS": "tcp",
            # UCX tuning given to the harness (e.g. UCX_TCP_TX_SEG_SIZE) reaches every node.
            **{name: value for name, value in os.environ.items() if name.startswith("UCX_") and name != "UCX_TLS"},
        }

    def start_node(self, host: str) -> None:
        """Run ``host``'s group command (the pod's container command) on it."""
        self.network.popen(host, self._groups[host].command, self.environment(host), log="node.log")

    def start(self, timeout_s: float = 600.0) -> VirtualCluster:
        """Head first (workers' ``ray start`` needs its GCS), then every worker; returns once
        duet's front end reports every pool ready."""
        deadline = time.monotonic() + timeout_s
        self.start_node(HEAD)
        self._wait(lambda: _port_open(self.head_address, GCS_PORT), "the Ray head's GCS", HEAD, deadline)
        for host in self._groups:
            if host != HEAD:
                self.start_node(host)
        self._wait(self.ready, "duet's front door(s) (every pool ready)", HEAD, deadline)
        return self

    def ready(self) -> bool:
        """Whether every serving host's front door reports every pool ready."""
        return all(self.serves(target) for target in self.targets)

    @staticmethod
    def serves(target: str) -> bool:
        from duet.router.client import DuetClient

        host, port = target.rsplit(":", 1)
        if not _port_open(host, int(port)):
            return False
        with DuetClient(target) as client:
            return client.is_serving(timeout=2.0)

    def client(self) -> DuetClient:
        """A client of every serving host (it resumes a broken stream on another)."""
        from duet.router.client import DuetClient

        return DuetClient(self.targets, api_key=self.secrets.api_key)

    def warnings(self, lines_per_host: int = 20) -> str:
        """The last of duet's warnings and every error each host logged (its node's output, and
        its Ray workers': the control plane on the head, front doors, engines), for a failing
        test's report: what those processes saw goes to their hosts' logs, not to the test."""
        report = []
        for host in self._groups:
            root = self.network[host].root
            # Ray's session_latest links to /tmp/ray as the host's own mounts see it: read the
            # session folder itself.
            logs = [root / "logs" / "node.log", *sorted(root.glob("ray-tmp/session_2*/logs/worker-*"))]
            found = [
                f"{path.name}: {line}"
                for path in logs if path.suffix in (".log", ".out", ".err") and path.is_file()
                for line in path.read_text(errors="replace").splitlines()
                if _WORTH_REPORTING.search(line)
            ]
            report.append(f"--- {host} ---\n" + "\n".join(found[-lines_per_host:]))
        return "\n".join(report)

    def _wait(self, check: Callable[[], bool], what: str, host: str, deadline: float) -> None:
        while not check():
            exited = [p for p in self.network[host].processes if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"exited with {exited[0].returncode}" if exited else "timed out"
                raise ClusterStartError(f"{what} on {host} {why}; its log ends:\n{self.network.log(host, 'node.log')}")
            time.sleep(0.5)


# A log line a failing test's report shows (:meth:`VirtualCluster.warnings`): duet's own
# warnings, and every error (vLLM's start-up warnings would crowd them out).
_WORTH_REPORTING = re.compile(r"\bWARNING duet\.|\bERROR\b|Traceback")


def _port_open(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@contextmanager
def serve_on_hosts(
    settings: dict[str, Any], shape: LinkShape = LinkShape(), plan: Path = TWO_HOSTS_PLAN, timeout_s: float = 600.0,
    options: RenderOptions = RenderOptions(),
) -> Iterator[VirtualCluster]:
    """``plan`` rendered (with ``options``, e.g. ``front_doors=2``) over a base config of
    ``settings`` (e.g. ``{"kv_transfer": {"transport": "nccl"}}``) and running on fresh
    virtual hosts whose links are ``shape``; every host, link and process is gone on exit.
    Raises HostsUnavailable where network namespaces cannot be made."""
    with tempfile.TemporaryDirectory(prefix=PREFIX) as scratch:  # read once, by plan_launch
        base = Path(scratch) / "base.yaml"
        base.write_text(yaml.safe_dump(settings))
        launch = plan_launch(Plan.load(plan), options, base)
    with HostNetwork(list(host_groups(launch)), shape) as network:
        yield VirtualCluster(launch, network).start(timeout_s)
