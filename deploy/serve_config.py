"""The config the head's ``duet serve`` runs in the cluster: a base config, the plan applied to
it (cluster/plan_deploy.py), and what joining a KubeRay cluster changes.

The model path names a directory inside the image or a mounted volume, which need not exist on
the machine that renders the manifests; it is checked there, when ``duet serve`` loads the
config, and carried through unchecked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from duet.config import BUILTIN_MODEL, DEFAULT_CONFIG_PATH, ConfigError, DuetConfig, parse_config
from duet.cluster.placement.plan import Plan
from duet.cluster.plan_deploy import apply_plan
from duet.yaml_config import read_yaml


class DeployError(ValueError):
    """Input that cannot be rendered as manifests; the message says what to change."""


@dataclass(frozen=True)
class HeadConfig:
    config: DuetConfig  # validated, with the built-in model standing in for model_path
    model_path: str

    def yaml(self) -> str:
        data = self.config.model_dump(mode="json")
        data["model"]["path"] = self.model_path
        return yaml.safe_dump(data, sort_keys=False)


def head_config(plan: Plan, roles: list[str], base: Path | None = None, front_doors: int = 0) -> HeadConfig:
    """``base`` (default: the embedded config) with ``plan`` applied, set up to join the Ray
    cluster it runs in and to place each pool's workers on the node group of its role; with
    ``front_doors``, that many front doors, each on a pod of the front-door group."""
    path = base or DEFAULT_CONFIG_PATH
    data = read_yaml(path, "config", DeployError)
    model = data.get("model") if isinstance(data, dict) else None
    model_path = BUILTIN_MODEL
    if isinstance(model, dict):
        model_path = str(model.get("path", BUILTIN_MODEL))
        data["model"] = {**model, "path": BUILTIN_MODEL}
    try:
        config = apply_plan(parse_config(data, source=str(path)), plan).model_dump()
        config["ray"].update(address="auto", autoscaling=True)
        config["server"]["host"] = "0.0.0.0"  # the pod's address: the Service and probes reach it
        config["kv_transfer"]["side_channel_host"] = "auto"  # each worker's own pod address
        if front_doors:
            config["server"].update(front_ends=front_doors, front_end_placement="nodes")
        for role in roles:
            # Kubernetes, not the plan's node indices, decides the nodes: each group's pods
            # advertise the resource named after their role.
            config[role].update(nodes=None, resources={role: 1})
        deployed = parse_config(config, source="deployment")
    except ConfigError as error:
        raise DeployError(str(error)) from None
    _check_kubernetes_fit(deployed)
    return HeadConfig(deployed, model_path)


def _check_kubernetes_fit(config: DuetConfig) -> None:
    server = config.server
    if server.tls is not None:
        raise DeployError(
            "server.tls: Kubernetes' gRPC probes cannot speak TLS; terminate TLS in front of the "
            "duet Service (an Ingress or a mesh) and leave server.tls out of the config"
        )
    for name in ("port", "http_port", "metrics_port"):
        if getattr(server, name) == 0:
            raise DeployError(
                f"server.{name}: 0 picks a free port at start, which a Kubernetes Service cannot "
                "name; set a fixed port in the config"
            )
