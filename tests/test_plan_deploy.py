"""A placement plan becomes the deployment config `duet serve --plan` runs, as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.config import load_config
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


def _plan(
    model: str = "duet-tiny-llama", gpu_type: str = "cpu-core", decode_replicas: int = 1, **mode: object
) -> Plan:
    pools: dict[str, object] = {
        "algorithm": "high-affinity",
        "kv_transfer": {"path": "network", "bandwidth_gbs": 4.65},
        "prefill": _pool(gpu_type, 1, 0),
        "decode": _pool(gpu_type, decode_replicas, 1),
    }
    if mode.get("mode") == "colocated":
        pools = {"colocated": _pool(gpu_type, 2, 0)}
    return Plan.model_validate(
        {
            "model": model,
            "objective": "gpus",
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
            **pools,
            **mode,
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


def test_colocated_plan_deploys_the_colocated_pool():
    config = apply_plan(load_config(), _plan(mode="colocated"))
    assert config.mode == "colocated"
    assert config.colocated.replicas == 2 and config.colocated.cpu_cores == [0, 1]
    assert config.colocated.nodes == [0, 0] and config.router.local_prefill_max_tokens == 0


def test_conditional_plan_sets_the_local_prefill_threshold():
    config = apply_plan(load_config(), _plan(mode="conditional", local_prefill_max_tokens=512))
    assert config.mode == "disaggregated" and config.router.local_prefill_max_tokens == 512
    assert config.prefill.cpu_cores == [0] and config.decode.cpu_cores == [1]
    # Local prefill is held to the plan's SLO, not the embedded default's 40 ms.
    assert load_config().router.local_prefill_tpot_s == 0.04 and config.router.local_prefill_tpot_s == 0.1


def test_disaggregated_plan_turns_local_prefill_off():
    """The plan was sized with every prompt disaggregated; a threshold left in the config would
    deploy something else."""
    base = load_config().model_copy(update={"mode": "colocated"})
    base = base.model_copy(update={"router": base.router.model_copy(update={"local_prefill_max_tokens": 256})})
    config = apply_plan(base, _plan())
    assert config.mode == "disaggregated" and config.router.local_prefill_max_tokens == 0


def test_e_p_d_plan_deploys_its_encode_pool_and_ep_d_none():
    vision = load_config(Path(__file__).resolve().parents[1] / "configs" / "vision.yaml")
    config = apply_plan(vision, _plan(model="duet-tiny-idefics3", encode=_pool("cpu-core", 1, 2)))
    assert config.encode.replicas == 1 and config.encode.cpu_cores == [2] and config.encode.nodes == [0]
    assert (config.prefill.cpu_cores, config.decode.cpu_cores) == ([0], [1])
    # EP+D: the config's encode workers are not part of the plan's pools.
    assert vision.encode.replicas == 1 and apply_plan(vision, _plan(model="duet-tiny-idefics3")).encode.replicas == 0
    assert apply_plan(vision, _plan(model="duet-tiny-idefics3", mode="colocated")).encode.replicas == 0


def test_plan_for_another_model_is_refused():
    with pytest.raises(PlanDeployError, match="plan is for model 'facebook/opt-13b'"):
        apply_plan(load_config(), _plan(model="facebook/opt-13b"))


def test_plan_node_beyond_the_ray_cluster_is_refused(ray_session):
    assert len(_plan_node_ids("prefill", [0])) == 1
    with pytest.raises(WorkerStartError, match=r"node\(s\) \[3\], but the Ray cluster has 1 node"):
        _plan_node_ids("prefill", [0, 3])
