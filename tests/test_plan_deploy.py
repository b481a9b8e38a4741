"""A placement plan becomes the deployment config `duet serve --plan` runs, as written."""

from __future__ import annotations

import pytest

from duet.cluster.config import load_config
from duet.cluster.deployment import WorkerStartError, _plan_node_ids
from duet.cluster.placement.plan import Plan
from duet.cluster.plan_deploy import PlanDeployError, apply_plan


def _pool(gpu_type: str, replicas: int, first_gpu: int) -> dict:
    return {
        "gpu_type": gpu_type,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "replicas": replicas,
        "placement": [{"stages": [{"node": 0, "gpus": [first_gpu + i]}]} for i in range(replicas)],
    }


def _plan(model: str = "duet-tiny-llama", gpu_type: str = "cpu-core", decode_replicas: int = 1) -> Plan:
    return Plan.model_validate(
        {
            "model": model,
            "algorithm": "high-affinity",
            "objective": "gpus",
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
            "kv_transfer": {"path": "network", "bandwidth_gbs": 4.65},
            "prefill": _pool(gpu_type, 1, 0),
            "decode": _pool(gpu_type, decode_replicas, 1),
            "expected": {
                "rate_rps": 1, "attainment": 1, "ttft_attainment": 1, "tpot_attainment": 1,
                "ttft_p90_s": 0.1, "tpot_p90_s": 0.01, "goodput_rps": 2, "goodput_per_gpu": 1,
            },
        }
    )


def test_cpu_plan_pins_each_replica_to_its_core():
    config = apply_plan(load_config(), _plan(decode_replicas=2))
    assert config.prefill.replicas == 1 and config.prefill.cpu_cores == [0]
    assert config.decode.replicas == 2 and config.decode.cpu_cores == [1, 2]
    assert config.decode.nodes == [0, 0] and config.decode.num_gpus == 0


def test_gpu_plan_requests_gpus_per_replica():
    config = apply_plan(load_config(), _plan(gpu_type="a100-80g"))
    assert config.prefill.num_gpus == 1 and config.prefill.cpu_cores is None


def test_plan_for_another_model_is_refused():
    with pytest.raises(PlanDeployError, match="plan is for model 'facebook/opt-13b'"):
        apply_plan(load_config(), _plan(model="facebook/opt-13b"))


def test_plan_node_beyond_the_ray_cluster_is_refused(ray_session):
    assert len(_plan_node_ids("prefill", [0])) == 1
    with pytest.raises(WorkerStartError, match=r"node\(s\) \[3\], but the Ray cluster has 1 node"):
        _plan_node_ids("prefill", [0, 3])
