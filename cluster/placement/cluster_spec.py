"""cluster.yaml: the hardware a plan may use, validated at load time with the field named.

Example (``cluster/placement/examples/a100-32x8.yaml``)::

    model: facebook/opt-13b
    network_gbs: 25              # inter-node bandwidth per node, GB/s (KV between nodes)
    gpu_types:
      a100-80g:
        nvlink_gbs: 300          # intra-node bandwidth per GPU, GB/s (TP, KV inside a node)
        cost_per_hour: 4.1
        power_watts: 400
        profile: distserve       # DistServe's published fit; or a path to a profile.yaml
                                 # from ``duet profile``; omit it to use the roofline below
        tflops: 312
        memory_bandwidth_gbs: 2039
        memory_gib: 80
    nodes:
      - {gpu_type: a100-80g, count: 32, gpus_per_node: 8}

Relative profile paths are relative to the cluster.yaml file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from duet.cluster.placement.latency_model import (
    GpuPerfSpec,
    LatencyModel,
    LatencyModelError,
    load_distserve_profile,
    roofline_model,
)
from duet.cluster.placement.models import ModelSpec, UnknownModelError, get_model
from duet.yaml_config import read_yaml, validate_mapping

_REPO = Path(__file__).resolve().parents[2]
_BUILTIN_PROFILES = {"distserve": "distserve", "distserve-vllm": "vllm"}


class ClusterSpecError(ValueError):
    """A cluster.yaml that cannot be planned for; the message names the field."""


def traces_dir() -> Path:
    """Where DistServe's profiles and the public traces live (``DUET_TRACES_DIR`` overrides)."""
    return Path(os.environ.get("DUET_TRACES_DIR", _REPO.parent / "shared" / "traces"))


class GpuType(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nvlink_gbs: float = Field(gt=0, description="intra-node GB/s per GPU")
    cost_per_hour: float = Field(default=0.0, ge=0)
    power_watts: float = Field(default=0.0, ge=0)
    profile: str | None = None
    tflops: float | None = Field(default=None, gt=0)
    memory_bandwidth_gbs: float | None = Field(default=None, gt=0)
    memory_gib: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _has_a_latency_source(self) -> GpuType:
        if self.profile is None and None in (self.tflops, self.memory_bandwidth_gbs, self.memory_gib):
            raise ValueError(
                "needs either 'profile' (a measured or DistServe profile) or all of "
                "'tflops', 'memory_bandwidth_gbs' and 'memory_gib' (for the roofline model)"
            )
        return self


class NodeGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_type: str
    count: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)


@dataclass(frozen=True)
class Node:
    index: int
    gpu_type: str
    gpus: int


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    network_gbs: float = Field(gt=0, description="inter-node GB/s per node")
    gpu_types: dict[str, GpuType] = Field(min_length=1)
    nodes: list[NodeGroup] = Field(min_length=1)
    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        for i, group in enumerate(self.nodes):
            if group.gpu_type not in self.gpu_types:
                raise ValueError(
                    f"nodes.{i}.gpu_type: {group.gpu_type!r} is not one of gpu_types "
                    f"({', '.join(self.gpu_types)})"
                )
        try:
            get_model(self.model)
        except UnknownModelError as exc:
            raise ValueError(f"model: {exc}") from None
        return self

    @property
    def model_spec(self) -> ModelSpec:
        return get_model(self.model)

    def node_list(self) -> list[Node]:
        """Nodes numbered in file order; plans refer to these indices."""
        out: list[Node] = []
        for group in self.nodes:
            for _ in range(group.count):
                out.append(Node(len(out), group.gpu_type, group.gpus_per_node))
        return out

    def gpu_count(self, gpu_type: str | None = None) -> int:
        return sum(n.gpus for n in self.node_list() if gpu_type in (None, n.gpu_type))

    def gpus_per_node(self, gpu_type: str) -> int:
        return max(g.gpus_per_node for g in self.nodes if g.gpu_type == gpu_type)

    def latency_model(self, gpu_type: str) -> LatencyModel:
        """The one latency model of ``self.model`` on ``gpu_type`` that everything else uses."""
        spec = self.gpu_types[gpu_type]
        model = self.model_spec
        where = f"gpu_types.{gpu_type}.profile"
        try:
            if spec.profile is None:
                return roofline_model(
                    model,
                    GpuPerfSpec(
                        name=gpu_type,
                        flops=spec.tflops * 1e12,
                        memory_bandwidth=spec.memory_bandwidth_gbs * 1e9,
                        memory_bytes=spec.memory_gib * 2**30,
                        tp_link_bandwidth=spec.nvlink_gbs * 1e9,
                    ),
                )
            if spec.profile in _BUILTIN_PROFILES:
                engine = _BUILTIN_PROFILES[spec.profile]
                return load_distserve_profile(
                    traces_dir() / f"profiler-a100-80g.{engine}.json",
                    model,
                    traces_dir() / "max_num_tokens.csv",
                )
            path = Path(spec.profile)
            path = path if path.is_absolute() else self.base_dir / path
            if path.suffix == ".json":
                return load_distserve_profile(path, model, path.parent / "max_num_tokens.csv")
            loaded = LatencyModel.load(path)
        except LatencyModelError as exc:
            raise ClusterSpecError(f"{where}: {exc}") from None
        if get_model(loaded.model).name != model.name:
            raise ClusterSpecError(
                f"{where}: {path} profiles {loaded.model!r}, but the cluster serves {model.name!r}"
            )
        return loaded

    @classmethod
    def load(cls, path: Path) -> ClusterSpec:
        path = Path(path)
        data = read_yaml(path, "cluster config", ClusterSpecError)
        base = {"base_dir": path.parent}
        return validate_mapping(cls, data, str(path), ClusterSpecError, extra=base)
