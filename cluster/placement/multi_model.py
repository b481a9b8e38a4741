"""Fitting several models onto one cluster's devices (``duet plan-models``).

Each model has its own workload (trace, rate, SLO) and gets its own plan from the optimizer
(cluster/placement/optimizer.py): mode, pools, parallelism and placement. The models share the
cluster's GPUs, so they are planned one after another, in the order listed, each on the GPUs the
models before it left: the cluster is narrowed to those GPUs (a node with some taken becomes a
smaller node), the optimizer plans on it, and the plan's node and GPU numbers are mapped back to
the whole cluster's. Every plan is thus valid on the whole cluster and no GPU is held twice.
Listing the models that need the most, or the largest slices of a node, first leaves the others
the most room; a model that finds too few GPUs left is refused, naming what is left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from duet.cluster.placement.cluster_spec import ClusterSpec, NodeGroup
from duet.cluster.placement.optimizer import InfeasibleError, optimize
from duet.cluster.placement.plan import Plan, PlanError, Pool, validate_against
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import load_trace
from duet.yaml_config import read_yaml, validate_mapping


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Workload(_Strict):
    """One model's load and the SLO it must meet."""

    name: str | None = Field(default=None, min_length=1, description="the model name it is served under (default: model)")
    model: str = Field(min_length=1, description="the planner's name of the model's architecture (e.g. facebook/opt-13b)")
    trace: str = Field(min_length=1, description="Azure .csv, Mooncake .jsonl or synthetic:n=...,rate=...")
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    attainment: float = Field(default=0.9, gt=0, le=1)
    rate: float | None = Field(default=None, gt=0, description="req/s to plan for (default: the trace's own)")
    max_input: int | None = Field(default=None, ge=1)
    max_output: int | None = Field(default=None, ge=1)


class Workloads(_Strict):
    """The models to fit, in the order they are planned."""

    models: list[Workload] = Field(min_length=1)

    @model_validator(mode="after")
    def _named_apart(self) -> "Workloads":
        names = [workload.name or workload.model for workload in self.models]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"models: each served name once (set name: for a model listed twice); repeated: {', '.join(repeated)}")
        return self

    @classmethod
    def load(cls, path: Path) -> "Workloads":
        return validate_mapping(cls, read_yaml(Path(path), "workloads", PlanError), str(path), PlanError)


class NamedPlan(_Strict):
    """One served model's plan."""

    name: str
    plan: Plan


class MultiPlan(_Strict):
    """Every model's plan on one cluster (what ``duet plan-models`` writes; ``duet serve --plan``
    deploys it onto a config's ``models:``, matching names)."""

    version: int = 1
    plans: list[NamedPlan]

    def save(self, path: Path) -> None:
        data = {"version": self.version, "plans": [named.model_dump(mode="json", exclude_none=True) for named in self.plans]}
        Path(path).write_text(yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> "MultiPlan":
        return validate_mapping(cls, read_yaml(Path(path), "plans", PlanError), str(path), PlanError)

    def where(self) -> list[str]:
        """Which model goes where: a line per model, its GPUs node by node."""
        lines = []
        for named in self.plans:
            plan = named.plan
            held = sorted({held for _, pool in plan.pools() for held in pool.held()})
            nodes = sorted({node for node, _ in held})
            per_node = ", ".join(f"node {node}: GPUs {_ranges([g for n, g in held if n == node])}" for node in nodes)
            lines.append(f"{named.name}: {plan.describe_mode()}, {plan.gpus} GPUs ({per_node})")
        return lines


def fit_models(cluster: ClusterSpec, workloads: Workloads, **search: Any) -> MultiPlan:
    """A plan per workload, each on the GPUs the ones before it left (``search``: the
    optimizer's other settings). InfeasibleError names the model that does not fit."""
    free = {node.index: list(range(node.gpus)) for node in cluster.node_list()}
    plans = []
    for index, workload in enumerate(workloads.models):
        left = {node: gpus for node, gpus in free.items() if gpus}
        if not left:
            raise InfeasibleError(f"models.{index} ({workload.model}): no GPU is left after the models before it")
        narrowed = _narrowed(cluster, left, workload.model)
        trace = load_trace(workload.trace).capped(workload.max_input, workload.max_output)
        slo = Slo(workload.ttft_s, workload.tpot_s, workload.attainment)
        try:
            plan = optimize(narrowed, trace, slo, rate=workload.rate, **search).plan
        except InfeasibleError as error:
            remaining = sum(len(gpus) for gpus in left.values())
            raise InfeasibleError(
                f"models.{index} ({workload.model}) does not fit the {remaining} GPU(s) the models before it left: {error}"
            ) from None
        plan = _mapped_back(plan, list(left), left)
        validate_against(plan, cluster.model_copy(update={"model": workload.model}))
        for _, pool in plan.pools():
            for node, gpu in pool.held():
                free[node].remove(gpu)
        plans.append(NamedPlan(name=workload.name or workload.model, plan=plan))
    return MultiPlan(plans=plans)


def _narrowed(cluster: ClusterSpec, left: dict[int, list[int]], model: str) -> ClusterSpec:
    """``cluster`` reduced to the GPUs in ``left`` (node index -> free GPU ids), serving ``model``:
    node i of the result is the i-th node of ``left``, with as many GPUs as it has free."""
    nodes = {node.index: node for node in cluster.node_list()}
    groups = [NodeGroup(gpu_type=nodes[index].gpu_type, count=1, gpus_per_node=len(gpus)) for index, gpus in left.items()]
    data = {**cluster.model_dump(), "base_dir": cluster.base_dir, "model": model, "nodes": [g.model_dump() for g in groups]}
    return ClusterSpec.model_validate(data)


def _mapped_back(plan: Plan, node_of: list[int], left: dict[int, list[int]]) -> Plan:
    """``plan``, made on the narrowed cluster, in the whole cluster's node and GPU numbers."""

    def pool_back(pool: Pool) -> Pool:
        placement = [
            {"stages": [
                {"node": node_of[stage.node], "gpus": [left[node_of[stage.node]][gpu] for gpu in stage.gpus]}
                for stage in replica.stages
            ]}
            for replica in pool.placement
        ]
        return Pool.model_validate({**pool.model_dump(), "placement": placement})

    return plan.model_copy(update={role: pool_back(pool) for role, pool in plan.pools()})


def _ranges(gpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for gpu in sorted(gpus):
        if spans and gpu == spans[-1][1] + 1:
            spans[-1][1] = gpu
        else:
            spans.append([gpu, gpu])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
