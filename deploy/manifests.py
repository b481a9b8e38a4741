"""A :class:`ClusterLaunch` as Kubernetes objects: the ConfigMap holding the head's duet config,
the RayCluster (or a RayService wrapping it) and the Service in front of duet's APIs.

Secrets are referenced, never rendered: the Ray token (``<name>-ray-token``, key
``auth_token``) and duet's API keys (``<name>-api-keys``: key ``keys`` for ``$DUET_API_KEYS``, or
``keys.yaml`` mounted as the config's ``server.auth.api_keys_file``) are created once by the
operator (docs/guides/kubernetes.md), so the manifests can be kept in version control.
"""

from __future__ import annotations

import math
from importlib.metadata import version
from typing import Any

import yaml

from duet.deploy.launch import GCS_PORT, GPU_RESOURCE, GroupLaunch
from duet.deploy.render import API_KEYS_FILE_KEY, CONFIG_DIR, CONFIG_FILE, FRONT_DOOR_GROUP, ClusterLaunch
from duet.router.server import LIVENESS_SERVICE

Manifest = dict[str, Any]

# KubeRay runs the template's command as given instead of composing one around its `ray start`
# line (which it still passes as $KUBERAY_GEN_RAY_START_CMD; see launch.py).
_KV_POOL_VOLUME = "kv-pool"
_OVERWRITE_CMD = {"ray.io/overwrite-container-cmd": "true"}
_CONFIG_VOLUME = "duet-config"
_KEYS_VOLUME = "duet-api-keys"
# Ray's own head ports, named as KubeRay's head Service expects them.
_RAY_HEAD_PORTS = (("gcs-server", GCS_PORT), ("dashboard", 8265), ("client", 10001))
# Idle worker pods are removed after this long; a new engine takes minutes to be ready, so
# short idle periods must not cost one.
AUTOSCALER_IDLE_TIMEOUT_S = 300
_AUTOSCALER_SIZE = {"cpu": "500m", "memory": "512Mi"}  # KubeRay's own default sidecar size


def manifests(launch: ClusterLaunch) -> list[Manifest]:
    """ConfigMap, RayCluster or RayService, and the Service(s), in the order to apply them."""
    cluster_spec = _cluster_spec(launch)
    if launch.options.kind == "rayservice":
        # duet's front end is not a Ray Serve application, and KubeRay switches a RayService to
        # a new cluster only once its Serve applications run: no KubeRay-driven upgrades (None).
        service_spec = {"upgradeStrategy": {"type": "None"}, "rayClusterConfig": cluster_spec}
        ray = _object("ray.io/v1", "RayService", launch, {"spec": service_spec})
    else:
        ray = _object("ray.io/v1", "RayCluster", launch, {"spec": cluster_spec})
    config_map = _object("v1", "ConfigMap", launch, {"data": {CONFIG_FILE: launch.head_config.yaml()}}, "-config")
    services = [_service(launch, launch.serving, "")]
    if launch.serving is not launch.head and any(port.name == "duet-metrics" for port in launch.head.ports):
        services.append(_service(launch, launch.head, "-metrics"))  # the control plane's metrics
    return [config_map, ray, *services]


def to_yaml(documents: list[Manifest], header: str = "") -> str:
    """Multi-document YAML; multi-line strings (scripts, the config) as literal blocks."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)


class _Dumper(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        """Sequences indented under their key, as kubectl and yamllint write them."""
        return super().increase_indent(flow, False)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def _labels(launch: ClusterLaunch, component: str | None = None) -> dict[str, str]:
    """The labels that select one deployment's objects (and, with a component, its pods)."""
    labels = {"app.kubernetes.io/name": "duet", "app.kubernetes.io/instance": launch.options.name}
    return {**labels, "app.kubernetes.io/component": component} if component else labels


def _object(api: str, kind: str, launch: ClusterLaunch, body: Manifest, suffix: str = "") -> Manifest:
    metadata = {"name": launch.options.name + suffix, "namespace": launch.options.namespace, "labels": _labels(launch)}
    return {"apiVersion": api, "kind": kind, "metadata": metadata, **body}


def _cluster_spec(launch: ClusterLaunch) -> Manifest:
    head = launch.head
    spec: Manifest = {
        "rayVersion": version("ray"),
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": AUTOSCALER_IDLE_TIMEOUT_S,
            "resources": {"requests": dict(_AUTOSCALER_SIZE), "limits": dict(_AUTOSCALER_SIZE)},
        },
        "authOptions": {"mode": "token", "secretName": launch.options.ray_token_secret},
        "headGroupSpec": {
            "rayStartParams": head.ray_start_params,
            "template": _pod_template(launch, head, _head_container(launch), _head_volumes(launch)),
        },
        "workerGroupSpecs": [
            {
                "groupName": group.name,
                "replicas": group.replicas,
                "minReplicas": group.min_replicas,
                "maxReplicas": group.max_replicas,
                "rayStartParams": group.ray_start_params,
                "template": _pod_template(launch, group, *_worker_container(launch, group)),
            }
            for group in launch.workers
        ],
    }
    if launch.options.gcs_redis:
        # KubeRay's GCS fault tolerance: the head's state lives in Redis, so worker and
        # front-door pods (and their detached actors) outlive a head restart, and the
        # restarted `duet serve` takes them over (DUET_DEPLOYMENT_ID, docs/guides/kubernetes.md).
        redis_password = {"secretKeyRef": {"name": launch.options.redis_secret, "key": "password"}}
        spec["gcsFaultToleranceOptions"] = {
            "redisAddress": launch.options.gcs_redis,
            "redisPassword": {"valueFrom": redis_password},
            "externalStorageNamespace": launch.options.name,
        }
    return spec


def _worker_container(launch: ClusterLaunch, group: GroupLaunch) -> tuple[Manifest, list[Manifest]]:
    """A worker group's container and volumes; a front door's serves the APIs, taken into the
    Service once its gRPC server reports healthy."""
    container = _container(launch, group, "ray-worker")
    if group.name != FRONT_DOOR_GROUP:
        if group.kv_pool is None:
            return container, []
        directory, gib = group.kv_pool
        container["volumeMounts"] = [{"name": _KV_POOL_VOLUME, "mountPath": directory}]
        return container, [{"name": _KV_POOL_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{gib:g}Gi"}}]
    grpc_port = next(port.number for port in group.ports if port.name == "grpc")
    container["ports"] = [{"name": port.name, "containerPort": port.number} for port in group.ports]
    container["readinessProbe"] = _readiness_probe(grpc_port)
    volumes = _keys_volumes(launch)
    if volumes:
        container["volumeMounts"] = _keys_mounts(launch)
    return container, volumes


def _pod_template(launch: ClusterLaunch, group: GroupLaunch, container: Manifest, volumes: list[Manifest]) -> Manifest:
    spec: Manifest = {"containers": [container]}
    if group.node_selector:
        spec["nodeSelector"] = dict(group.node_selector)
    if group.size.gpus:
        # GPU nodes are commonly tainted so that only pods asking for GPUs land there.
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if volumes:
        spec["volumes"] = volumes
    return {"metadata": {"labels": _labels(launch, group.name), "annotations": dict(_OVERWRITE_CMD)}, "spec": spec}


def _container(launch: ClusterLaunch, group: GroupLaunch, name: str) -> Manifest:
    env: list[Manifest] = [{"name": key, "value": value} for key, value in group.env.items()]
    env += [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
        for key, ref in group.secret_env.items()
    ]
    quantities = group.size.quantities()
    return {
        "name": name,
        "image": launch.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(group.command),
        "env": env,
        "resources": {"requests": dict(quantities), "limits": dict(quantities)},
    }


def _head_container(launch: ClusterLaunch) -> Manifest:
    head = launch.head
    container = {
        **_container(launch, head, "ray-head"),
        "ports": [{"name": name, "containerPort": number} for name, number in _RAY_HEAD_PORTS]
        + [{"name": port.name, "containerPort": port.number} for port in head.ports],
        "volumeMounts": _head_mounts(launch),
    }
    grpc_port = next((port.number for port in head.ports if port.name == "grpc"), None)
    if grpc_port is None:  # the front doors serve; the head runs Ray and the control plane
        return container
    period_s = 10
    return {
        **container,
        # The gRPC server starts once every worker is ready: allow that long, then restart only
        # a server that stops answering (liveness) and take it out of the Service while a pool
        # has no ready worker (readiness, grpc.health.v1's overall status).
        "startupProbe": {
            "grpc": {"port": grpc_port, "service": LIVENESS_SERVICE},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(launch.startup_budget_s / period_s),
        },
        "livenessProbe": {
            "grpc": {"port": grpc_port, "service": LIVENESS_SERVICE},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": _readiness_probe(grpc_port),
    }


def _readiness_probe(grpc_port: int) -> Manifest:
    """In the Service only while grpc.health.v1's overall status is SERVING (every pool has a
    ready worker): the head's with one front door, each front-door pod's with several."""
    return {"grpc": {"port": grpc_port}, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 2}


def _head_volumes(launch: ClusterLaunch) -> list[Manifest]:
    return [{"name": _CONFIG_VOLUME, "configMap": {"name": f"{launch.options.name}-config"}}, *_keys_volumes(launch)]


def _head_mounts(launch: ClusterLaunch) -> list[Manifest]:
    return [{"name": _CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}, *_keys_mounts(launch)]


def _keys_volumes(launch: ClusterLaunch) -> list[Manifest]:
    """The API keys file from its Secret, where the config names one."""
    if launch.api_keys_file is None:
        return []
    items = [{"key": API_KEYS_FILE_KEY, "path": launch.api_keys_file.name}]
    return [{"name": _KEYS_VOLUME, "secret": {"secretName": launch.options.api_keys_secret, "items": items}}]


def _keys_mounts(launch: ClusterLaunch) -> list[Manifest]:
    if launch.api_keys_file is None:
        return []
    return [{"name": _KEYS_VOLUME, "mountPath": str(launch.api_keys_file.parent), "readOnly": True}]


def _service(launch: ClusterLaunch, group: GroupLaunch, suffix: str) -> Manifest:
    """``group``'s ports (gRPC, OpenAI HTTP, Prometheus metrics) on its ready pods: duet's APIs
    on the head or the front doors, and the control plane's metrics on the head."""
    service_names = {"grpc": "grpc", "http": "http", "duet-metrics": "metrics"}
    protocols = {"grpc": "kubernetes.io/h2c", "http": "http", "duet-metrics": "http"}
    ports = [
        {
            "name": service_names[port.name],
            "port": port.number,
            "targetPort": port.name,
            "protocol": "TCP",
            "appProtocol": protocols[port.name],
        }
        for port in group.ports
    ]
    spec = {"type": "ClusterIP", "selector": _labels(launch, group.name), "ports": ports}
    return _object("v1", "Service", launch, {"spec": spec}, suffix)
