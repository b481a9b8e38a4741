import re
from pathlib import Path

import numpy as np
import pytest

from duet.cluster.placement.cluster_spec import ClusterSpec, ClusterSpecError
from duet.cluster.placement.optimizer import InfeasibleError, optimize
from duet.cluster.placement.plan import validate_against
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import Trace, synthetic

EXAMPLES = Path(__file__).resolve().parents[2] / "cluster" / "placement" / "examples"
SLO = Slo(0.25, 0.1, 0.9)


def _cluster(tmp_path, nodes=2, extra="") -> ClusterSpec:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        f"""
model: facebook/opt-13b
network_gbs: 25
gpu_types:
  a100-80g: {{nvlink_gbs: 300, cost_per_hour: 4.1, power_watts: 400, profile: distserve}}
nodes:
  - {{gpu_type: a100-80g, count: {nodes}, gpus_per_node: 8}}
{extra}"""
    )
    return ClusterSpec.load(path)


@pytest.fixture
def cluster(tmp_path, opt13b):
    return _cluster(tmp_path)


def test_plan_is_feasible_valid_and_meets_the_slo(cluster):
    trace = synthetic(2000, 8.0, seed=1)
    result = optimize(cluster, trace, SLO, rate=8.0, workers=1, search_requests=500)
    plan = result.plan
    validate_against(plan, cluster)
    assert plan.gpus <= 16
    assert plan.expected.attainment >= 0.9
    assert plan.expected.goodput_rps >= 8.0
    assert plan.search.configs_evaluated > 0 and plan.search.configs_pruned > 0
    assert any("prefill" in line for line in plan.explanation)


@pytest.mark.parametrize("algorithm", ["high-affinity", "low-affinity"])
def test_each_algorithm_places_its_own_way(cluster, algorithm):
    plan = optimize(
        cluster, synthetic(1500, 6.0), SLO, rate=6.0, algorithm=algorithm, workers=1, modes=["disaggregated"]
    ).plan
    assert plan.mode == "disaggregated" and plan.algorithm == algorithm
    validate_against(plan, cluster)
    if algorithm == "low-affinity":
        assert plan.kv_transfer.path == "nvlink"
        # every prefill stage shares its node with a decode stage of the same unit
        prefill_nodes = {s.node for r in plan.prefill.placement for s in r.stages}
        decode_nodes = {s.node for r in plan.decode.placement for s in r.stages}
        assert prefill_nodes == decode_nodes
    else:
        assert plan.kv_transfer.path == "network"


def test_parallel_search_agrees_with_serial(cluster):
    trace = synthetic(1000, 8.0, seed=2)
    serial = optimize(cluster, trace, SLO, rate=8.0, workers=1, search_requests=400).plan
    parallel = optimize(cluster, trace, SLO, rate=8.0, workers=2, search_requests=400).plan
    assert parallel.search.workers == 2
    assert parallel.gpus == serial.gpus
    assert parallel.mode == serial.mode


def test_infeasible_slo_names_the_closest_feasible_option(cluster):
    trace = synthetic(800, 4.0)
    with pytest.raises(InfeasibleError) as err:
        optimize(cluster, trace, Slo(0.01, 0.1, 0.9), rate=4.0, workers=1, search_requests=300)
    message = str(err.value)
    assert "TTFT <= 0.01 s" in message
    suggested = re.search(r"--slo ttft=([\d.]+),tpot=([\d.]+)", message)
    assert suggested, message
    # the suggestion really is feasible
    ttft, tpot = float(suggested.group(1)), float(suggested.group(2))
    plan = optimize(cluster, trace, Slo(ttft, tpot, 0.9), rate=0.5, workers=1, search_requests=300).plan
    assert plan.expected.attainment >= 0.9


def test_over_budget_rate_names_the_closest_feasible_rate(cluster):
    trace = synthetic(1500, 4.0)
    with pytest.raises(InfeasibleError, match=r"Closest feasible: --rate") as err:
        optimize(cluster, trace, SLO, rate=5000.0, algorithm="high-affinity", workers=1, modes=["disaggregated"])
    closest = float(re.search(r"--rate ([\d.e+]+)", str(err.value)).group(1))
    assert 0 < closest < 5000
    # The same rate as data, under the deployment it belongs to, for callers that act on it.
    option = err.value.options["disaggregated, high-affinity"]
    assert option.closest_rate_rps == pytest.approx(closest, rel=1e-2)
    plan = optimize(
        cluster, trace, SLO, rate=closest * 0.9, algorithm="high-affinity", workers=1, modes=["disaggregated"]
    ).plan
    assert plan.gpus <= 16


def test_heterogeneous_pools_by_cost(tmp_path, opt13b):
    cluster = ClusterSpec.load(EXAMPLES / "hetero-a100-h100.yaml")
    result = optimize(
        cluster, synthetic(1500, 10.0), SLO, rate=10.0, objective="cost", workers=1, modes=["disaggregated"]
    )
    plan = result.plan
    validate_against(plan, cluster)
    assert plan.objective == "cost"
    assert {plan.prefill.gpu_type, plan.decode.gpu_type} <= {"a100-80g", "h100-80g"}


def test_cpu_profile_drives_a_two_core_plan(tmp_path, linear_model):
    # coefficients of the order `duet profile` measured for the tiny model on this machine
    linear_model(prefill=(6.9, 0.076, 3.4e-5), decode=(3.6, 0.005, 0.0), kv_tokens=262144).save(
        tmp_path / "profile.yaml"
    )
    (tmp_path / "cpu.yaml").write_text(
        """
model: duet-tiny-llama
network_gbs: 4.65
gpu_types:
  cpu-core: {nvlink_gbs: 4.65, profile: profile.yaml}
nodes:
  - {gpu_type: cpu-core, count: 1, gpus_per_node: 2}
"""
    )
    cluster = ClusterSpec.load(tmp_path / "cpu.yaml")
    trace = synthetic(600, 2.0, lengths="uniform:1000:64")
    plan = optimize(cluster, trace, Slo(1.0, 0.1, 0.9), rate=2.0, workers=1, modes=["disaggregated"]).plan
    validate_against(plan, cluster)
    assert (plan.prefill.replicas, plan.decode.replicas) == (1, 1)
    assert {s.gpus[0] for r in plan.prefill.placement + plan.decode.placement for s in r.stages} == {0, 1}


def test_unknown_model_in_cluster_config_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: facebook/opt-13\nnetwork_gbs: 1\n"
        "gpu_types: {g: {nvlink_gbs: 1, profile: distserve}}\n"
        "nodes: [{gpu_type: g, count: 1, gpus_per_node: 8}]\n"
    )
    with pytest.raises(ClusterSpecError, match=r"model: unknown model 'facebook/opt-13'.*opt-13b"):
        ClusterSpec.load(path)


def test_cluster_config_errors_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: facebook/opt-13b\nnetwork_gbs: 0\n"
        "gpu_types: {g: {nvlink_gbs: 1}}\n"
        "nodes: [{gpu_type: h, count: 1, gpus_per_node: 8}]\n"
    )
    with pytest.raises(ClusterSpecError) as err:
        ClusterSpec.load(path)
    assert "network_gbs" in str(err.value)
    assert "gpu_types.g" in str(err.value) and "roofline" in str(err.value)


def _cost_by_mode(result) -> dict[str, float]:
    """The least GPUs each mode needed (alternatives come cheapest first)."""
    gpus: dict[str, float] = {}
    for plan in [result.plan, *result.alternatives]:
        gpus.setdefault(plan.mode, plan.gpus)
    return gpus


def test_hetero_example_chooses_the_mode_needing_fewest_gpus(opt13b):
    """At 4 req/s a disaggregated plan rounds both pools up to whole replicas; the planner must
    compare every mode by what it needs and say so."""
    cluster = ClusterSpec.load(EXAMPLES / "hetero-a100-h100.yaml")
    trace = synthetic(800, 4.0, lengths="sharegpt")
    result = optimize(cluster, trace, SLO, rate=4.0, workers=1, search_requests=400, verify_requests=800)
    plan = result.plan
    validate_against(plan, cluster)
    gpus = _cost_by_mode(result)
    assert set(gpus) == {"disaggregated", "colocated", "conditional"}
    assert plan.gpus == min(gpus.values())
    assert plan.mode == "colocated" and plan.expected.attainment >= 0.9
    text = "\n".join(plan.explanation)
    assert "deployment: colocated meets the SLO at 4 req/s with 1 GPU" in text
    assert "disaggregated, high-affinity needs" in text and "conditional (prompts < 512 tokens" in text
    assert any(line.startswith("-> colocated, the fewest GPUs") for line in plan.explanation)


def test_long_prompts_and_a_tight_tpot_choose_disaggregation(cluster):
    """1,500-token prompts stall every decode of an engine that also prefills them: with TPOT
    30 ms, colocated engines need far more GPUs than separate pools."""
    trace = synthetic(800, 8.0, lengths="fixed:1500:200")
    result = optimize(cluster, trace, Slo(1.0, 0.03, 0.9), rate=8.0, workers=1, search_requests=400, verify_requests=800)
    gpus = _cost_by_mode(result)
    assert result.plan.mode == "disaggregated"
    assert gpus["colocated"] > gpus["disaggregated"]
    assert any("no threshold of (128, 256, 512, 1024) tokens splits" in line for line in result.plan.explanation)


def test_bimodal_prompts_choose_conditional_disaggregation(tmp_path, linear_model):
    """80% of prompts are 50 tokens (15 ms to prefill), 20% are 2,000 (405 ms). Colocated, the
    long prefills stall decodes past the 20 ms TPOT; disaggregated, the one prefill replica the
    long prompts need is pushed past its TTFT budget by the short ones' queueing, so it takes two.
    Conditional prefills the short prompts on the decode replica: one of each suffices."""
    linear_model(prefill=(5.0, 0.2, 0.0), decode=(10.0, 0.0, 0.1), kv_tokens=200_000).save(tmp_path / "profile.yaml")
    (tmp_path / "c.yaml").write_text(
        "model: duet-tiny-llama\nnetwork_gbs: 4.65\n"
        "gpu_types: {g: {nvlink_gbs: 4.65, profile: profile.yaml}}\n"
        "nodes: [{gpu_type: g, count: 1, gpus_per_node: 16}]\n"
    )
    cluster = ClusterSpec.load(tmp_path / "c.yaml")
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / 8.0, 800))
    prompts = np.where(rng.random(800) < 0.2, 2000, 50)
    trace = Trace("bimodal", arrivals - arrivals[0], prompts, np.full(800, 50))
    result = optimize(
        cluster, trace, Slo(1.0, 0.02, 0.9), rate=8.0, workers=1, search_requests=400, verify_requests=800
    )
    plan = result.plan
    validate_against(plan, cluster)
    gpus = _cost_by_mode(result)
    assert plan.mode == "conditional" and plan.gpus < min(gpus["disaggregated"], gpus["colocated"])
    assert plan.expected.attainment >= 0.9
    assert 50 < plan.local_prefill_max_tokens <= 2000
    assert any(line.startswith("conditional: prompts under") for line in plan.explanation)
