"""The plan file: what ``duet plan`` writes and ``duet serve --plan`` deploys as is.

A plan is self-checking: loading it verifies the pools' shapes and that no GPU is held twice;
:func:`validate_against` also checks it against a cluster (nodes exist, GPU types match, budget).
The schema is documented in docs/placement.md.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.yaml_config import read_yaml, validate_mapping


class PlanError(ValueError):
    """A plan that must not be deployed; the message names every problem found."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StagePlacement(_Strict):
    """One pipeline stage of one replica: ``tensor_parallel`` GPUs of one node."""

    node: int = Field(ge=0)
    gpus: list[int] = Field(min_length=1)


class ReplicaPlacement(_Strict):
    stages: list[StagePlacement] = Field(min_length=1)


class Pool(_Strict):
    gpu_type: str
    tensor_parallel: int = Field(ge=1)
    pipeline_parallel: int = Field(ge=1)
    replicas: int = Field(ge=1)
    placement: list[ReplicaPlacement]

    @property
    def gpus(self) -> int:
        return self.replicas * self.tensor_parallel * self.pipeline_parallel

    @model_validator(mode="after")
    def _shape(self) -> Pool:
        if len(self.placement) != self.replicas:
            raise ValueError(f"{self.replicas} replicas but {len(self.placement)} placements")
        for r, replica in enumerate(self.placement):
            if len(replica.stages) != self.pipeline_parallel:
                raise ValueError(
                    f"placement.{r}: {len(replica.stages)} stages, pipeline_parallel is "
                    f"{self.pipeline_parallel}"
                )
            for s, stage in enumerate(replica.stages):
                if len(stage.gpus) != self.tensor_parallel or len(set(stage.gpus)) != len(stage.gpus):
                    raise ValueError(
                        f"placement.{r}.stages.{s}: needs {self.tensor_parallel} distinct GPUs, "
                        f"got {stage.gpus}"
                    )
        return self

    def held(self) -> list[tuple[int, int]]:
        """Every (node, gpu) this pool occupies."""
        return [
            (stage.node, gpu)
            for replica in self.placement
            for stage in replica.stages
            for gpu in stage.gpus
        ]


class SloSpec(_Strict):
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    attainment: float = Field(gt=0, le=1)


class KvTransfer(_Strict):
    """How KV moves: over NVLink inside a node (low affinity) or the inter-node network."""

    path: Literal["nvlink", "network"]
    bandwidth_gbs: float = Field(gt=0)


class Expected(_Strict):
    """What the simulator predicts for the plan at ``rate_rps``."""

    rate_rps: float
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_p90_s: float
    tpot_p90_s: float
    goodput_rps: float = Field(description="the highest rate the plan serves at the target attainment")
    goodput_per_gpu: float


class SearchStats(_Strict):
    configs_evaluated: int
    configs_pruned: int
    simulations: int
    wall_s: float
    workers: int


class Plan(_Strict):
    version: Literal[1] = 1
    model: str
    algorithm: Literal["high-affinity", "low-affinity"]
    objective: Literal["gpus", "cost", "power"]
    slo: SloSpec
    kv_transfer: KvTransfer
    prefill: Pool
    decode: Pool
    expected: Expected
    search: SearchStats | None = None
    explanation: list[str] = Field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @model_validator(mode="after")
    def _no_gpu_held_twice(self) -> Plan:
        counts = Counter(self.prefill.held() + self.decode.held())
        twice = sorted(k for k, n in counts.items() if n > 1)
        if twice:
            shown = ", ".join(f"node {n} gpu {g}" for n, g in twice[:8])
            raise ValueError(f"GPUs held by more than one replica or pool: {shown}")
        return self

    def summary(self) -> str:
        """One line: algorithm, pools, and the simulated goodput, for CLIs and benchmarks."""
        pools = ", ".join(
            f"{role} {p.replicas} x tp={p.tensor_parallel} pp={p.pipeline_parallel} [{p.gpu_type}]"
            for role, p in (("prefill", self.prefill), ("decode", self.decode))
        )
        e = self.expected
        return (
            f"{self.algorithm}, {self.gpus} GPUs: {pools}; at {e.rate_rps:.3g} req/s attainment "
            f"{e.attainment:.1%} (TTFT {e.ttft_attainment:.1%}, TPOT {e.tpot_attainment:.1%}), "
            f"goodput {e.goodput_rps:.3g} req/s = {e.goodput_per_gpu:.3g} per GPU"
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> Plan:
        return validate_mapping(cls, read_yaml(Path(path), "plan", PlanError), str(path), PlanError)


def validate_against(plan: Plan, cluster: ClusterSpec) -> None:
    """Raise :class:`PlanError` unless ``plan`` fits ``cluster`` exactly as written."""
    problems = []
    if cluster.model_spec.name != plan.model:
        problems.append(f"plan is for {plan.model!r}, cluster serves {cluster.model_spec.name!r}")
    nodes = cluster.node_list()
    for role, pool in (("prefill", plan.prefill), ("decode", plan.decode)):
        if pool.gpu_type not in cluster.gpu_types:
            problems.append(f"{role}.gpu_type {pool.gpu_type!r} is not in the cluster")
        for r, replica in enumerate(pool.placement):
            for s, stage in enumerate(replica.stages):
                where = f"{role}.placement.{r}.stages.{s}"
                if stage.node >= len(nodes):
                    problems.append(f"{where}: node {stage.node} does not exist ({len(nodes)} nodes)")
                    continue
                node = nodes[stage.node]
                if node.gpu_type != pool.gpu_type:
                    problems.append(f"{where}: node {stage.node} has {node.gpu_type}, not {pool.gpu_type}")
                bad = [g for g in stage.gpus if g >= node.gpus]
                if bad:
                    problems.append(f"{where}: GPUs {bad} exceed node {stage.node}'s {node.gpus}")
    for gpu_type in {plan.prefill.gpu_type, plan.decode.gpu_type}:
        used = sum(p.gpus for p in (plan.prefill, plan.decode) if p.gpu_type == gpu_type)
        have = cluster.gpu_count(gpu_type)
        if used > have:
            problems.append(f"plan uses {used} {gpu_type} GPUs, the cluster has {have}")
    if problems:
        raise PlanError("plan does not fit the cluster: " + "; ".join(problems))
