import pytest

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.plan import Plan, PlanError, validate_against

CLUSTER = """
model: facebook/opt-13b
network_gbs: 25
gpu_types:
  a100-80g: {nvlink_gbs: 300, profile: distserve}
nodes:
  - {gpu_type: a100-80g, count: 1, gpus_per_node: 4}
"""


def _plan(prefill_gpus, decode_gpus, decode_node=0, replicas=1) -> dict:
    def pool(gpus, node):
        return {
            "gpu_type": "a100-80g",
            "tensor_parallel": len(gpus),
            "pipeline_parallel": 1,
            "replicas": replicas,
            "placement": [{"stages": [{"node": node, "gpus": gpus}]}],
        }

    return {
        "model": "facebook/opt-13b",
        "algorithm": "high-affinity",
        "objective": "gpus",
        "slo": {"ttft_s": 0.25, "tpot_s": 0.1, "attainment": 0.9},
        "kv_transfer": {"path": "network", "bandwidth_gbs": 25},
        "prefill": pool(prefill_gpus, 0),
        "decode": pool(decode_gpus, decode_node),
        "expected": {
            "rate_rps": 1, "attainment": 1, "ttft_attainment": 1, "tpot_attainment": 1,
            "ttft_p90_s": 0.1, "tpot_p90_s": 0.05, "goodput_rps": 2, "goodput_per_gpu": 0.5,
        },
    }


def _colocated(gpus) -> dict:
    split = _plan([0], [1])
    for key in ("algorithm", "kv_transfer", "prefill", "decode"):
        del split[key]
    pool = {"gpu_type": "a100-80g", "tensor_parallel": 1, "pipeline_parallel": 1, "replicas": len(gpus),
            "placement": [{"stages": [{"node": 0, "gpus": [g]}]} for g in gpus]}
    return {**split, "mode": "colocated", "colocated": pool}


def _conditional(threshold: int = 512) -> dict:
    return {**_plan([0, 1], [2]), "mode": "conditional", "local_prefill_max_tokens": threshold}


@pytest.fixture
def cluster(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    return ClusterSpec.load(tmp_path / "c.yaml")


def test_valid_plan_round_trips(tmp_path, cluster):
    plan = Plan.model_validate(_plan([0, 1], [2]))
    plan.save(tmp_path / "plan.yaml")
    again = Plan.load(tmp_path / "plan.yaml")
    assert again == plan
    validate_against(again, cluster)


@pytest.mark.parametrize("data", [_colocated([0, 3]), _conditional()], ids=["colocated", "conditional"])
def test_every_mode_round_trips(tmp_path, cluster, data):
    plan = Plan.model_validate(data)
    plan.save(tmp_path / "plan.yaml")
    assert "null" not in (tmp_path / "plan.yaml").read_text()  # absent pools are left out
    again = Plan.load(tmp_path / "plan.yaml")
    assert again == plan and again.mode == data["mode"]
    validate_against(again, cluster)


def test_plan_without_a_mode_is_disaggregated():
    plan = Plan.model_validate(_plan([0, 1], [2]))
    assert plan.mode == "disaggregated" and plan.local_prefill_max_tokens == 0
    assert [role for role, _ in plan.pools()] == ["prefill", "decode"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({**_colocated([0]), "prefill": _plan([1], [2])["prefill"]}, "mode colocated: must not have prefill"),
        ({**_plan([0], [1]), "mode": "colocated"}, "mode colocated: needs colocated; must not have algorithm"),
        (_conditional(threshold=0), "must be > 0 exactly when the mode is conditional"),
        ({**_plan([0], [1]), "local_prefill_max_tokens": 256}, "must be > 0 exactly when the mode is conditional"),
    ],
)
def test_pools_must_match_the_mode(data, message):
    with pytest.raises(ValueError, match=message):
        Plan.model_validate(data)


def test_colocated_plan_is_checked_against_the_cluster(cluster):
    with pytest.raises(PlanError, match=r"colocated.placement.1.stages.0: GPUs \[4\] exceed"):
        validate_against(Plan.model_validate(_colocated([0, 4])), cluster)
    with pytest.raises(PlanError, match="uses 5 a100-80g GPUs, the cluster has 4"):
        validate_against(Plan.model_validate(_colocated([0, 1, 2, 3, 5])), cluster)


def test_gpu_held_by_two_pools_is_rejected(tmp_path):
    import yaml

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(_plan([0, 1], [1])))
    with pytest.raises(PlanError, match="node 0 gpu 1"):
        Plan.load(tmp_path / "p.yaml")


def test_pool_shape_must_match_its_parallelism():
    bad = _plan([0, 1], [2], replicas=2)  # two replicas, one placement
    with pytest.raises(ValueError, match="2 replicas but 1 placements"):
        Plan.model_validate(bad)


def test_plan_outside_the_cluster_is_rejected(cluster):
    plan = Plan.model_validate(_plan([0, 1, 2], [3], decode_node=1))
    with pytest.raises(PlanError, match="node 1 does not exist"):
        validate_against(plan, cluster)
    plan = Plan.model_validate(_plan([0, 1, 2], [5]))
    with pytest.raises(PlanError, match=r"GPUs \[5\] exceed"):
        validate_against(plan, cluster)


def test_gpu_budget_is_enforced(tmp_path, cluster):
    small = ClusterSpec.model_validate(
        {**cluster.model_dump(), "nodes": [{"gpu_type": "a100-80g", "count": 1, "gpus_per_node": 2}]}
    )
    plan = Plan.model_validate(_plan([0], [1, 2]))
    with pytest.raises(PlanError, match="uses 3 a100-80g GPUs, the cluster has 2"):
        validate_against(plan, small)
