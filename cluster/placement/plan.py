"""The plan file: what ``duet plan`` writes and ``duet serve --plan`` deploys as is.

A plan deploys one of three modes: ``disaggregated`` (prefill and decode pools, KV moved
between them), ``conditional`` (the same pools, but prompts shorter than
``local_prefill_max_tokens`` are prefilled by the decode replica itself) or ``colocated`` (one
pool of engines that run whole requests). Plans written before modes existed have no ``mode``
and are disaggregated. For a vision-language model, a disaggregated or conditional plan may add
an ``encode`` pool (E+P+D: encode workers encode the prefill pool's images); without one, the
prefill engines encode them (EP+D).

A plan is self-checking: loading it verifies the pools' shapes, that the pools match the mode,
and that no GPU is held twice;
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
from duet.yaml_config import read_yaml, validate_mapping


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
    """Identical replicas (prefill, decode, encode or colocated engines) and where each one runs."""

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


Mode = Literal["disaggregated", "colocated", "conditional"]


class Plan(_Strict):
    version: Literal[1] = 1
    model: str
    mode: Mode = "disaggregated"
    # conditional only: prompts shorter than this many tokens are prefilled on the decode side
    local_prefill_max_tokens: int = Field(default=0, ge=0)
    algorithm: Literal["high-affinity", "low-affinity"] | None = None  # how the pools were sized
    objective: Literal["gpus", "cost", "power"]
    slo: SloSpec
    kv_transfer: KvTransfer | None = None
    prefill: Pool | None = None
    decode: Pool | None = None
    colocated: Pool | None = None
    encode: Pool | None = None  # E+P+D: encode workers for the prefill pool's images
    expected: Expected
    search: SearchStats | None = None
    explanation: list[str] = Field(default_factory=list)

    def pools(self) -> list[tuple[str, Pool]]:
        """(role, pool) for every pool the mode deploys."""
        roles = (("prefill", self.prefill), ("decode", self.decode), ("colocated", self.colocated), ("encode", self.encode))
        return [(role, pool) for role, pool in roles if pool is not None]

    @property
    def gpus(self) -> int:
        return sum(pool.gpus for _, pool in self.pools())

    @model_validator(mode="after")
    def _pools_match_mode(self) -> Plan:
        split = {
            "algorithm": self.algorithm, "kv_transfer": self.kv_transfer, "prefill": self.prefill, "decode": self.decode
        }
        if self.mode == "colocated":
            wrong = [name for name, value in {**split, "encode": self.encode}.items() if value is not None]
            missing = ["colocated"] if self.colocated is None else []
        else:
            wrong = ["colocated"] if self.colocated is not None else []
            missing = [name for name, value in split.items() if value is None]
        problems = ([f"needs {', '.join(missing)}"] if missing else []) + (
            [f"must not have {', '.join(wrong)}"] if wrong else []
        )
        if problems:
            raise ValueError(f"mode {self.mode}: " + "; ".join(problems))
        if (self.mode == "conditional") != (self.local_prefill_max_tokens > 0):
            raise ValueError(
                f"local_prefill_max_tokens is {self.local_prefill_max_tokens}: it must be > 0 exactly "
                f"when the mode is conditional (mode {self.mode})"
            )
        return self

    @model_validator(mode="after")
    def _no_gpu_held_twice(self) -> Plan:
        counts = Counter(held for _, pool in self.pools() for held in pool.held())
        twice = sorted(k for k, n in counts.items() if n > 1)
        if twice:
            shown = ", ".join(f"node {n} gpu {g}" for n, g in twice[:8])
            raise ValueError(f"GPUs held by more than one replica or pool: {shown}")
        return self

    def describe_mode(self) -> str:
        """The mode in words, with what the pools were sized by."""
        if self.mode == "colocated":
            return "colocated"
        encode = ", E+P+D (an encode pool)" if self.encode is not None else ""
        if self.mode == "conditional":
            return f"conditional (prompts < {self.local_prefill_max_tokens} tokens prefilled on decode){encode}, {self.algorithm}"
        return f"disaggregated{encode}, {self.algorithm}"

    def summary(self) -> str:
        """One line: mode, pools, and the simulated goodput, for CLIs and benchmarks."""
        pools = ", ".join(
            f"{role} {p.replicas} x tp={p.tensor_parallel} pp={p.pipeline_parallel} [{p.gpu_type}]"
            for role, p in self.pools()
        )
        e = self.expected
        return (
            f"{self.describe_mode()}, {self.gpus} GPUs: {pools}; at {e.rate_rps:.3g} req/s attainment "
            f"{e.attainment:.1%} (TTFT {e.ttft_attainment:.1%}, TPOT {e.tpot_attainment:.1%}), "
            f"goodput {e.goodput_rps:.3g} req/s = {e.goodput_per_gpu:.3g} per GPU"
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> Plan:
        return validate_mapping(cls, read_yaml(Path(path), "plan", PlanError), str(path), PlanError)


def validate_against(plan: Plan, cluster: ClusterSpec) -> None:
    """Raise :class:`PlanError` unless ``plan`` fits ``cluster`` exactly as written."""
    problems = []
    if cluster.model_spec.name != plan.model:
        problems.append(f"plan is for {plan.model!r}, cluster serves {cluster.model_spec.name!r}")
    nodes = cluster.node_list()
    for role, pool in plan.pools():
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
    for gpu_type in {pool.gpu_type for _, pool in plan.pools()}:
        used = sum(p.gpus for _, p in plan.pools() if p.gpu_type == gpu_type)
        have = cluster.gpu_count(gpu_type)
        if used > have:
            problems.append(f"plan uses {used} {gpu_type} GPUs, the cluster has {have}")
    if problems:
        raise PlanError("plan does not fit the cluster: " + "; ".join(problems))
