"""What each Ray node group of a duet cluster runs, independent of what starts it.

KubeRay builds every pod's ``ray start`` line from its group's ``rayStartParams`` and passes it to
the container as ``$KUBERAY_GEN_RAY_START_CMD``. duet's pod templates carry
``ray.io/overwrite-container-cmd: "true"``, so the container runs :attr:`GroupLaunch.command`,
which runs that line itself: on the head in the background, followed by ``duet serve`` once Ray
answers (KubeRay always adds ``--block``, and would otherwise put a user command *before* its
``ray start``); on a worker in the foreground.

:meth:`GroupLaunch.kuberay_env` reproduces the variables KubeRay sets that those commands read,
so a test harness (or a bare-metal launcher) starts exactly the node Kubernetes would::

    env = {**os.environ, **group.env, **tokens_for(group.secret_env), **group.kuberay_env(head_ip)}
    subprocess.Popen(group.command, env=env)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

GCS_PORT = 6379
GPU_RESOURCE = "nvidia.com/gpu"
# What KubeRay adds to every group's rayStartParams (ray-operator/controllers/ray/common/pod.go,
# setMissingRayStartParams), reproduced by GroupLaunch.ray_start_command.
_KUBERAY_DEFAULT_PARAMS = {"metrics-export-port": "8080", "dashboard-agent-listen-port": "52365"}
# Flags KubeRay writes as --flag=true|false instead of a bare switch (convertParamMap).
_KUBERAY_VALUED_SWITCHES = ("log-color", "include-dashboard")


@dataclass(frozen=True)
class SecretKey:
    """An environment value read from a key of a Kubernetes Secret: secrets never appear in the
    rendered manifests, only the reference does."""

    secret: str
    key: str


@dataclass(frozen=True)
class PodSize:
    """A pod's resources; requests equal limits (Guaranteed QoS, so engines are not throttled
    or evicted first under node pressure)."""

    cpus: int
    memory_gib: int
    gpus: int = 0

    def quantities(self) -> dict[str, str]:
        quantities = {"cpu": str(self.cpus), "memory": f"{self.memory_gib}Gi"}
        if self.gpus:
            quantities[GPU_RESOURCE] = str(self.gpus)
        return quantities


@dataclass(frozen=True)
class Port:
    name: str
    number: int


@dataclass(frozen=True)
class GroupLaunch:
    """One Ray node group: the head (duet's front end) or the workers of one pool."""

    name: str  # "head" or the pool's role: prefill, decode, colocated
    head: bool
    command: list[str]
    env: dict[str, str]
    secret_env: dict[str, SecretKey]
    size: PodSize
    # Logical CPUs Ray offers on each node of the group (0 on the head: no worker lands there).
    ray_cpus: int
    # Custom resources each node advertises; a worker requests its pool's, so it lands here.
    ray_resources: dict[str, int] = field(default_factory=dict)
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    node_selector: dict[str, str] = field(default_factory=dict)
    ports: list[Port] = field(default_factory=list)
    # The host KV pool's directory and size on each node of the group (kv_pool; None: no pool),
    # a memory-backed volume of the pod: a container's /dev/shm is 64 MiB.
    kv_pool: tuple[str, float] | None = None

    @property
    def ray_start_params(self) -> dict[str, str]:
        """The group's ``rayStartParams``, exactly as the manifest gives them to KubeRay."""
        params = {"num-cpus": str(self.ray_cpus), "num-gpus": str(self.size.gpus)}
        if self.ray_resources:
            # Quoted for the shell that runs KubeRay's generated line (as KubeRay quotes its own).
            params["resources"] = f"'{json.dumps(self.ray_resources, separators=(',', ':'), sort_keys=True)}'"
        if self.head:
            # KubeRay sets this itself when its autoscaler is on (always, for duet): the autoscaler
            # runs as KubeRay's sidecar, not as Ray's monitor. Explicit here so the line is whole.
            params["no-monitor"] = "true"
        return params

    def ray_start_command(self, gcs_address: str) -> str:
        """The ``ray start`` line KubeRay generates for a pod of this group
        (``$KUBERAY_GEN_RAY_START_CMD``); ``gcs_address`` is where workers reach the head."""
        params = dict(self.ray_start_params)
        if self.head:
            params.setdefault("dashboard-host", "0.0.0.0")
        else:
            params.setdefault("address", gcs_address)
        for name, value in _KUBERAY_DEFAULT_PARAMS.items():
            params.setdefault(name, value)
        params["block"] = "true"
        params.setdefault("memory", str(self.size.memory_gib * 2**30))  # from the memory limit
        flags = []
        for name in sorted(params):
            value = params[name]
            if value.lower() in ("true", "false") and name not in _KUBERAY_VALUED_SWITCHES:
                flags += [f"--{name}"] if value.lower() == "true" else []
            else:
                flags.append(f"--{name}={value}")
        return " ".join(["ray", "start", *(["--head"] if self.head else []), *flags])

    def kuberay_env(self, head_host: str) -> dict[str, str]:
        """The variables KubeRay adds to this group's container that :attr:`command` reads.

        ``head_host`` is the head's address as workers reach it (on Kubernetes, the DNS name of
        the head's Service, which KubeRay passes as ``FQ_RAY_IP``).
        """
        gcs_address = f"{head_host}:{GCS_PORT}"
        env = {
            "KUBERAY_GEN_RAY_START_CMD": self.ray_start_command(gcs_address),
            "RAY_PORT": str(GCS_PORT),
            # What `ray.init(address="auto")` (duet's ray.address on Kubernetes) connects to.
            "RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}" if self.head else gcs_address,
        }
        if not self.head:
            env["FQ_RAY_IP"] = head_host
        return env
