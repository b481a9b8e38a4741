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
