"""Several models fitted onto one cluster (``duet plan-models``) and deployed (``duet serve --plan``).

Each model is planned by the optimizer on the GPUs the models before it left; the plans are
checked against the whole cluster (valid, no GPU held by two models, each meeting its SLO in
simulation), a model that does not fit is named, and the plans deploy onto a config's
``models:`` by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.cli import main as duet_main
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.multi_model import MultiPlan, NamedPlan, Workloads, fit_models
from duet.cluster.placement.optimizer import InfeasibleError
from duet.cluster.placement.plan import validate_against
from duet.cluster.plan_deploy import PlanDeployError, apply_plan, apply_plans
from duet.config import load_config, parse_config

pytestmark = pytest.mark.quick

MULTI_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "multi-model.yaml"


def _cluster(tmp_path: Path, gpus: int) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "model: facebook/opt-13b\nnetwork_gbs: 25\n"
        "gpu_types:\n  a100-80g: {nvlink_gbs: 300, cost_per_hour: 4.1, power_watts: 400, profile: distserve}\n"
        f"nodes:\n  - {{gpu_type: a100-80g, count: 1, gpus_per_node: {gpus}}}\n"
    )
    return path


def _workloads(tmp_path: Path, second_rate: float) -> Path:
    path = tmp_path / "workloads.yaml"
    path.write_text(
        "models:\n"
        "  - {name: chat, model: facebook/opt-13b, trace: 'synthetic:n=600,rate=6,seed=1', ttft_s: 0.25, tpot_s: 0.1}\n"
        f"  - {{name: code, model: opt-13b, trace: 'synthetic:n=600,rate={second_rate},seed=2', ttft_s: 0.5, tpot_s: 0.05}}\n"
    )
    return path


def test_two_models_share_a_node_without_sharing_a_gpu(tmp_path, opt13b, capsys):
    """`duet plan-models` plans both; each plan is valid on the whole cluster and meets its
    SLO in simulation, the second holds none of the first's GPUs, and the output says which
    model goes where."""
    out = tmp_path / "plans.yaml"
    config, workloads = _cluster(tmp_path, 8), _workloads(tmp_path, 2)
    args = ["plan-models", "--config", str(config), "--workloads", str(workloads), "--workers", "1",
            "--search-requests", "300", "--out", str(out)]
    assert duet_main(args) == 0
    plans = MultiPlan.load(out)
    assert [named.name for named in plans.plans] == ["chat", "code"]
    cluster = ClusterSpec.load(config)
    held = []
    for named in plans.plans:
        validate_against(named.plan, cluster)
        assert named.plan.expected.attainment >= 0.9
        held.append({gpu for _, pool in named.plan.pools() for gpu in pool.held()})
    assert not held[0] & held[1]
    printed = capsys.readouterr().out
    assert "chat: " in printed and "code: " in printed and "node 0: GPUs" in printed and "of the cluster's 8 GPUs" in printed


def test_a_model_that_does_not_fit_what_is_left_is_named(tmp_path, opt13b):
    """On three GPUs the first model takes two and the second, at a rate one GPU cannot
    serve, is refused by name with the GPUs left."""
    cluster = ClusterSpec.load(_cluster(tmp_path, 3))
    with pytest.raises(InfeasibleError, match=r"models\.1 \(opt-13b\) does not fit the 1 GPU\(s\)"):
        fit_models(cluster, Workloads.load(_workloads(tmp_path, 40)), workers=1, search_requests=300)


def test_workloads_name_each_model_once(tmp_path):
    path = tmp_path / "workloads.yaml"
    path.write_text("models:\n  - {model: opt-13b, trace: x.csv, ttft_s: 1, tpot_s: 1}\n  - {model: opt-13b, trace: y.csv, ttft_s: 1, tpot_s: 1}\n")
    assert duet_main(["plan-models", "--config", str(_cluster(tmp_path, 2)), "--workloads", str(path)]) == 2


def test_plans_deploy_onto_the_models_they_name():
    """Each served model of configs/multi-model.yaml gets its plan's mode, pools and local
    prefill target; a plan naming a model not served, or several plans on a one-model config,
    are refused."""
    from test_plan_deploy import _plan

    config = load_config(MULTI_MODEL_CONFIG)
    plans = MultiPlan(plans=[
        NamedPlan(name="duet-tiny-llama", plan=_plan(decode_replicas=2)),
        NamedPlan(name="duet-tiny-llama-wide", plan=_plan(mode="colocated")),
    ])
    tiny, wide = apply_plans(config, plans).served()
    assert tiny == apply_plan(config.served()[0], plans.plans[0].plan)
    assert tiny.decode.replicas == 2 and tiny.decode.cpu_cores == [1, 2]
    assert wide.mode == "colocated" and wide.colocated.cpu_cores == [0, 1]
    assert tiny.router.local_prefill_tpot_s == wide.router.local_prefill_tpot_s == 0.1
    with pytest.raises(PlanDeployError, match="does not serve"):
        apply_plans(config, MultiPlan(plans=[NamedPlan(name="other", plan=_plan())]))
    with pytest.raises(PlanDeployError, match="models:"):
        apply_plans(load_config(), plans)
    with pytest.raises(PlanDeployError, match="duet plan-models"):
        apply_plan(config, plans.plans[0].plan)


def test_plans_deploy_onto_a_model_named_by_default():
    """A models: entry that leaves model.name at its default is found by that name."""
    from test_plan_deploy import _plan

    data = {"models": [{"model": {"path": "builtin"}}, {"model": {"name": "wide", "path": "builtin-wide"}}]}
    config = parse_config(data)
    planned = apply_plans(config, MultiPlan(plans=[NamedPlan(name="duet-tiny-llama", plan=_plan(mode="colocated"))]))
    assert [served.mode for served in planned.served()] == ["colocated", "disaggregated"]
