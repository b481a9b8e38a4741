"""A placement plan as the Ray node groups that run it (:class:`ClusterLaunch`).

One head group runs duet's control plane (``duet serve``, which joins the cluster and places the
workers) and, by default, its one front door; with ``--front-doors N`` a front-door group of N
pods serves the APIs instead (each a Ray node advertising ``duet_front_end``, on which the
control plane starts a front door), so that the head's restart, with KubeRay's GCS fault
tolerance (``--gcs-redis``), leaves serving and the workers running. One worker group per plan
pool, each pod one replica: the pool's GPUs (tensor x
pipeline parallel) on a node of the pool's GPU type, advertising a Ray resource named after the
role, which that pool's workers request. Prefill and decode can so run on different GPU types,
and Ray's autoscaler (through KubeRay) knows which group to grow for a waiting worker.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from duet.config import DuetConfig, PoolConfig
from duet.cluster.control_plane import DEPLOYMENT_ID_ENV
from duet.cluster.front_doors import FRONT_END_RESOURCE
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.plan import Plan, PlanError, Pool, validate_against
from duet.cluster.plan_deploy import CPU_GPU_TYPES
from duet.deploy.launch import GroupLaunch, PodSize, Port, SecretKey
from duet.deploy.serve_config import DeployError, HeadConfig, head_config
from duet.kv_transfer.config import pool_serves

Kind = Literal["raycluster", "rayservice"]

CONFIG_DIR = "/etc/duet"
CONFIG_FILE = "duet.yaml"
# Keys of the <name>-api-keys Secret: NAME:KEY,... for $DUET_API_KEYS, or a whole keys file
# (docs/guides/security.md) when the config names server.auth.api_keys_file.
API_KEYS_ENV_KEY = "keys"
API_KEYS_FILE_KEY = "keys.yaml"
# The head runs the router, tokenizer and Ray's control plane; no engine.
HEAD_SIZE = PodSize(cpus=2, memory_gib=8)
# A front-door pod: the APIs, the tokenizer, and a front end (vLLM's output processing) per engine.
FRONT_DOOR_SIZE = PodSize(cpus=2, memory_gib=4)
FRONT_DOOR_GROUP = "front-door"
# Per GPU of a GPU worker pod: host threads of the engine and KV transfer, and pinned buffers.
CPUS_PER_GPU = 8
MEMORY_GIB_PER_GPU = 64
# A CPU engine: its forward-pass core(s), plus one for the engine core, Ray and NIXL; memory is
# its KV cache plus about 3 GB for the engine processes (../shared/ENVIRONMENT.md).
CPU_ENGINE_OVERHEAD_CPUS = 1
CPU_ENGINE_OVERHEAD_GIB = 4
# How long the head may take from container start to a running gRPC server: Ray, then every
# worker's engine (server.worker_start_timeout_s), plus pulling and starting worker pods.
HEAD_START_SLACK_S = 300

# The head waits for its own Ray to answer (bounded), then becomes duet's front end.
_HEAD_SCRIPT = """\
ulimit -n 65536
/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
for _ in $(seq 120); do
  if ray health-check --address "$RAY_ADDRESS" >/dev/null 2>&1; then
    exec duet serve --config "$DUET_CONFIG"
  fi
  sleep 1
done
echo "duet: the Ray head did not answer within 120 s" >&2
exit 1
"""
_WORKER_SCRIPT = """\
ulimit -n 65536
exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"
"""

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class RenderOptions:
    name: str = "duet"
    namespace: str = "default"
    image: str | None = None  # default: duet:gpu if any pool has GPUs, else duet:cpu
    kind: Kind = "raycluster"
    # Node label whose value is the plan's GPU type (label nodes to match, or pick a label the
    # nodes already carry whose values are the cluster.yaml's GPU type names).
    gpu_label: str = "duet/gpu-type"
    # Front doors in a group of their own (0: the head serves the APIs itself).
    front_doors: int = 0
    # An external Redis (HOST:PORT) for KubeRay's GCS fault tolerance: a restarted head keeps
    # the workers and front doors (its password in the <name>-redis Secret, key "password").
    gcs_redis: str | None = None

    @property
    def ray_token_secret(self) -> str:
        return f"{self.name}-ray-token"

    @property
    def api_keys_secret(self) -> str:
        return f"{self.name}-api-keys"

    @property
    def redis_secret(self) -> str:
        return f"{self.name}-redis"


@dataclass(frozen=True)
class ClusterLaunch:
    """Everything the manifests say, as data: the groups (head first) and the head's config."""

    options: RenderOptions
    image: str
    head_config: HeadConfig
    groups: list[GroupLaunch]

    @property
    def head(self) -> GroupLaunch:
        return self.groups[0]

    @property
    def workers(self) -> list[GroupLaunch]:
        """Every group but the head's: the front doors' (if any) and the pools'."""
        return self.groups[1:]

    @property
    def serving(self) -> GroupLaunch:
        """The group whose pods serve the APIs: the front doors', or the head."""
        return next((group for group in self.groups if group.name == FRONT_DOOR_GROUP), self.head)

    @property
    def api_keys_file(self) -> PurePosixPath | None:
        """Where the head reads its API keys file (mounted from the keys Secret), if anywhere."""
        path = self.head_config.config.server.auth.api_keys_file
        return PurePosixPath(path) if path else None

    @property
    def startup_budget_s(self) -> float:
        return self.head_config.config.server.worker_start_timeout_s + HEAD_START_SLACK_S


def plan_launch(
    plan: Plan, options: RenderOptions, base_config: Path | None = None, cluster: ClusterSpec | None = None
) -> ClusterLaunch:
    """The node groups that run ``plan``; ``cluster`` (the plan's cluster.yaml) bounds how far
    the autoscaler may grow each group, and is checked against the plan."""
    if not _NAME.match(options.name):
        raise DeployError(
            f"--name {options.name!r}: use 1-40 lowercase letters, digits and '-', starting with a letter"
        )
    if cluster is not None:
        validate_against(plan, cluster)
    if options.front_doors < 0:
        raise DeployError(f"--front-doors {options.front_doors}: give a number of front-door pods, or 0 for none")
    pools = plan.pools()  # (role, pool): prefill and decode, or colocated
    config = head_config(plan, [role for role, _ in pools], base_config, options.front_doors)
    keys_file = config.config.server.auth.api_keys_file
    if keys_file and PurePosixPath(keys_file).parent == PurePosixPath(CONFIG_DIR):
        raise DeployError(
            f"server.auth.api_keys_file {keys_file!r}: {CONFIG_DIR} holds the config; put the keys "
            "file in a directory of its own, e.g. /etc/duet-keys/keys.yaml"
        )
    workers = [
        _worker(role, pool, getattr(config.config, role), options, _max_replicas(role, pool, plan, cluster), _kv_pool(config.config, role))
        for role, pool in pools
    ]
    image = options.image or ("duet:gpu" if any(group.size.gpus for group in workers) else "duet:cpu")
    front_doors = [_front_doors(config.config, options)] if options.front_doors else []
    return ClusterLaunch(options, image, config, [_head(config.config, options), *front_doors, *workers])


def _ray_auth(options: RenderOptions) -> tuple[dict[str, str], dict[str, SecretKey]]:
    """Ray 2.60 token authentication, the same token in every pod (docs/guides/security.md); the key is
    the one KubeRay's authOptions.secretName expects."""
    return {"RAY_AUTH_MODE": "token"}, {"RAY_AUTH_TOKEN": SecretKey(options.ray_token_secret, "auth_token")}


def _api_keys(config: DuetConfig, options: RenderOptions) -> tuple[dict[str, str], dict[str, SecretKey]]:
    """What a pod that serves the APIs needs: Ray's token and, unless the config names a keys
    file (mounted from the same Secret, see manifests.py), the keys as NAME:KEY,... in one
    variable (a keys file is needed for admin keys and per-key quotas)."""
    env, secrets = _ray_auth(options)
    if config.server.auth.api_keys_file is None:
        secrets[config.server.auth.api_keys_env] = SecretKey(options.api_keys_secret, API_KEYS_ENV_KEY)
    return env, secrets


def _api_ports(config: DuetConfig) -> list[Port]:
    ports = [Port("grpc", config.server.port)]
    if config.server.http_port is not None:
        ports.append(Port("http", config.server.http_port))
    return ports


def _head(config: DuetConfig, options: RenderOptions) -> GroupLaunch:
    env, secrets = _api_keys(config, options)
    server = config.server
    ports = _api_ports(config)
    if options.front_doors:  # the APIs are the front doors'; a restarted head takes them over
        env[DEPLOYMENT_ID_ENV] = options.name
        ports = []
    if server.metrics_port is not None:
        # Not "metrics": KubeRay names Ray's own metrics port (8080) so unless one exists.
        ports.append(Port("duet-metrics", server.metrics_port))
    return GroupLaunch(
        name="head",
        head=True,
        command=["/bin/bash", "-c", _HEAD_SCRIPT],
        env={**env, "DUET_CONFIG": f"{CONFIG_DIR}/{CONFIG_FILE}"},
        secret_env=secrets,
        size=HEAD_SIZE,
        ray_cpus=0,
        ports=ports,
    )


def _front_doors(config: DuetConfig, options: RenderOptions) -> GroupLaunch:
    """The front-door group: pods that join as Ray nodes advertising FRONT_END_RESOURCE (and no
    CPUs: no worker lands there); the control plane starts a front door on each."""
    env, secrets = _api_keys(config, options)
    return GroupLaunch(
        name=FRONT_DOOR_GROUP,
        head=False,
        command=["/bin/bash", "-c", _WORKER_SCRIPT],
        env=env,
        secret_env=secrets,
        size=FRONT_DOOR_SIZE,
        ray_cpus=0,
        ray_resources={FRONT_END_RESOURCE: 1},
        replicas=options.front_doors,
        min_replicas=options.front_doors,
        max_replicas=options.front_doors,
        ports=_api_ports(config),
    )


# UCX's TCP transport, used by NIXL between hosts without RDMA: with its default 8 KiB send
# segments and the kernel's socket buffers it moved a prompt's KV at about 55% of a 10 Gbit/s
# link on these CPU hosts; with these, at the link's rate (docs/benchmarks/multinode.md). RDMA and
# same-host transports ignore them.
UCX_TCP_TUNING = {
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_TCP_SNDBUF": "8m",
    "UCX_TCP_RCVBUF": "8m",
}


def _kv_pool(config: DuetConfig, role: str) -> tuple[str, float] | None:
    """The host KV pool a worker pod of ``role`` holds (its directory and GiB), if any: each pod
    is a host of its own (its own /dev/shm)."""
    if not pool_serves(config, role):
        return None
    return config.kv_pool.directory, config.kv_pool.capacity_gib


def _worker(
    role: str, pool: Pool, config: PoolConfig, options: RenderOptions, max_replicas: int, kv_pool: tuple[str, float] | None
) -> GroupLaunch:
    env, secrets = _ray_auth(options)
    env.update(UCX_TCP_TUNING)
    engine_gpus = pool.tensor_parallel * pool.pipeline_parallel
    if pool.gpu_type in CPU_GPU_TYPES:
        cpus = max(math.ceil(config.num_cpus), engine_gpus) + CPU_ENGINE_OVERHEAD_CPUS
        # A memory-backed pool counts against the pod's memory limit.
        pool_gib = kv_pool[1] if kv_pool else 0
        size = PodSize(cpus=cpus, memory_gib=math.ceil(config.kv_cache_gib + pool_gib) + CPU_ENGINE_OVERHEAD_GIB)
        selector: dict[str, str] = {}
    else:
        if not _LABEL_VALUE.match(pool.gpu_type):
            raise DeployError(
                f"{role}.gpu_type {pool.gpu_type!r} is not a valid Kubernetes label value for "
                f"{options.gpu_label}; rename the GPU type in cluster.yaml and re-plan"
            )
        pool_gib = kv_pool[1] if kv_pool else 0
        size = PodSize(
            cpus=CPUS_PER_GPU * engine_gpus, memory_gib=MEMORY_GIB_PER_GPU * engine_gpus + math.ceil(pool_gib), gpus=engine_gpus
        )
        selector = {options.gpu_label: pool.gpu_type}
    return GroupLaunch(
        name=role,
        head=False,
        command=["/bin/bash", "-c", _WORKER_SCRIPT],
        env=env,
        secret_env=secrets,
        size=size,
        ray_cpus=size.cpus,
        ray_resources={role: 1},
        replicas=pool.replicas,
        min_replicas=pool.replicas,
        max_replicas=max_replicas,
        node_selector=selector,
        kv_pool=kv_pool,
    )


def _max_replicas(role: str, pool: Pool, plan: Plan, cluster: ClusterSpec | None) -> int:
    """The most replicas of ``pool`` the cluster's GPUs of its type hold beside the other pools
    as planned (without the cluster spec: the plan's own size, i.e. no growth)."""
    if cluster is None or pool.gpu_type in CPU_GPU_TYPES:
        return pool.replicas
    others = sum(p.gpus for r, p in plan.pools() if r != role and p.gpu_type == pool.gpu_type)
    per_replica = pool.tensor_parallel * pool.pipeline_parallel
    if per_replica > cluster.gpus_per_node(pool.gpu_type):
        raise PlanError(
            f"{role}: a replica needs {per_replica} GPUs in one pod, but {pool.gpu_type} nodes have "
            f"{cluster.gpus_per_node(pool.gpu_type)}"
        )
    return max(pool.replicas, (cluster.gpu_count(pool.gpu_type) - others) // per_replica)
