"""Turn a placement plan (``duet plan``'s output, or ``duet plan-models``' for several models)
into the deployment config ``duet serve`` runs.

The plan is deployed as written: its mode (disaggregated, conditional or colocated), pool sizes,
parallelism, and each replica's node. On a CPU node the plan's "GPU" indices are core indices,
so each replica's engine is pinned to the first core of its first stage; on GPU nodes Ray
assigns the devices inside the node.
"""

from __future__ import annotations

from duet.config import ConfigError, DuetConfig, parse_config
from duet.cluster.placement.multi_model import MultiPlan
from duet.cluster.placement.plan import Plan, Pool

CPU_GPU_TYPES = ("cpu", "cpu-core")


class PlanDeployError(ConfigError):
    """A plan that cannot be deployed with this config; says what differs."""


def _pool_overrides(pool: Pool) -> dict[str, object]:
    first_stages = [replica.stages[0] for replica in pool.placement]
    overrides: dict[str, object] = {
        "replicas": pool.replicas,
        "tensor_parallel": pool.tensor_parallel,
        "pipeline_parallel": pool.pipeline_parallel,
        "nodes": [stage.node for stage in first_stages],
    }
    if pool.gpu_type in CPU_GPU_TYPES:
        overrides["cpu_cores"] = [stage.gpus[0] for stage in first_stages]
        overrides["num_gpus"] = 0
    else:
        overrides["cpu_cores"] = None
        overrides["num_gpus"] = pool.tensor_parallel * pool.pipeline_parallel
    return overrides


def apply_plans(config: DuetConfig, plans: MultiPlan) -> DuetConfig:
    """``config``'s ``models:`` with each model's mode, pools and routing replaced by the plan of
    the same name (``duet plan-models``' output); every plan must name a served model."""
    if not config.models:
        raise PlanDeployError("the plans are for several models; deploy them with a config that lists models:")
    served = {one.model.name: one for one in config.served()}
    unknown = [named.name for named in plans.plans if named.name not in served]
    if unknown:
        raise PlanDeployError(
            f"the plans name {', '.join(map(repr, unknown))}, which the config does not serve (it serves: {', '.join(served)})"
        )
    data = config.model_dump(exclude_unset=True)
    order = list(served)  # config.served() is in the order of models:
    for named in plans.plans:
        planned = apply_plan(served[named.name], named.plan.model_copy(update={"model": named.name}))
        data["models"][order.index(named.name)].update(
            planned.model_dump(include={"mode", "prefill", "decode", "colocated", "encode", "router"})
        )
    try:
        return parse_config(data, source="plans")
    except ConfigError as error:
        raise PlanDeployError(str(error)) from None


def apply_plan(config: DuetConfig, plan: Plan) -> DuetConfig:
    """``config`` with its mode and pools replaced by the plan's; the model names must agree.

    A colocated plan deploys the ``colocated`` pool; a conditional one deploys the prefill and
    decode pools with the router's local-prefill threshold set to the plan's, and a
    disaggregated one with it off, since the plan was sized for exactly that split. Local
    prefill on a decode worker is held to the plan's TPOT target (router.local_prefill_tpot_s).
    Either deploys the plan's encode pool where it has one (E+P+D), and none otherwise.
    """
    if config.models:
        raise PlanDeployError(
            "this config serves several models (models:); plan them with `duet plan-models` and deploy its plans"
        )
    if plan.model != config.model.name:
        raise PlanDeployError(
            f"the plan is for model {plan.model!r} but the config serves {config.model.name!r}; "
            "plan with the served model's name or pass the matching --config"
        )
    data = config.model_dump()
    data["mode"] = "colocated" if plan.mode == "colocated" else "disaggregated"
    data["router"]["local_prefill_max_tokens"] = plan.local_prefill_max_tokens
    data["router"]["local_prefill_tpot_s"] = plan.slo.tpot_s
    data["encode"]["replicas"] = 0  # EP+D or colocated unless the plan has an encode pool
    for role, pool in plan.pools():
        data[role].update(_pool_overrides(pool))
    try:
        return parse_config(data, source="plan")
    except ConfigError as error:
        raise PlanDeployError(str(error)) from None
