"""Images in the planner: the simulator's encode step (EP+D, E+P+D, colocated), traces with images,
and `duet plan` choosing whether a vision-language model gets an encode pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from duet.cli import main
from duet.cluster.placement.cluster_spec import ClusterSpec, ClusterSpecError
from duet.cluster.placement.commands import with_images
from duet.cluster.placement.latency_model import EncoderPerf, LatencyModel
from duet.cluster.placement.optimizer import optimize
from duet.cluster.placement.plan import Plan, validate_against
from duet.cluster.placement.simulator import Slo, simulate_colocated, simulate_conditional, simulate_disaggregated
from duet.cluster.placement.trace import Trace, TraceError, image_counts, synthetic

pytestmark = pytest.mark.quick

TOKENS_PER_IMAGE = 16


def _trace(arrivals, inputs, outputs, images) -> Trace:
    return Trace("t", np.array(arrivals, float), np.array(inputs), np.array(outputs), np.array(images))


def _vision(model: LatencyModel, per_image_ms: float, fixed_ms: float = 0.0) -> LatencyModel:
    return dataclasses.replace(model, encoder=EncoderPerf((fixed_ms, per_image_ms), TOKENS_PER_IMAGE))


def test_an_engine_with_the_encoder_pays_for_the_images_in_the_step_that_starts_them(linear_model):
    engine = _vision(linear_model(prefill=(10.0, 0.1, 0.0)), per_image_ms=40.0, fixed_ms=5.0).engine(1, 1)
    trace = _trace([0.0], [200], [2], [2])
    ep_d = simulate_disaggregated(trace, [engine], [engine], kv_bytes_per_token=1)
    assert ep_d.ttft_s[0] == pytest.approx((10 + 0.1 * 200 + 5 + 2 * 40) / 1000)
    assert ep_d.encode_wait_s[0] == 0  # no encode pool
    colocated = simulate_colocated(trace, [engine])
    assert colocated.ttft_s[0] == pytest.approx(ep_d.ttft_s[0])
    # Without images nothing changes.
    text = simulate_disaggregated(_trace([0.0], [200], [2], [0]), [engine], [engine], kv_bytes_per_token=1)
    assert text.ttft_s[0] == pytest.approx((10 + 0.1 * 200) / 1000)


def test_an_encode_pool_encodes_first_and_its_prefill_engine_does_not_encode_again(linear_model):
    model = _vision(linear_model(prefill=(10.0, 0.1, 0.0)), per_image_ms=40.0, fixed_ms=5.0)
    engine = model.engine(1, 1)
    # Three requests at once: the first one's image is encoded at once, the second's two images
    # in the next step; the text-only one goes straight to prefill.
    trace = _trace([0.0, 0.0, 0.0], [200, 100, 50], [2, 2, 2], [1, 2, 0])
    result = simulate_disaggregated(trace, [engine.without_encoder()], [engine], kv_bytes_per_token=1, encode=[engine])
    first, second = (5 + 40) / 1000, (5 + 40 + 5 + 2 * 40) / 1000
    assert result.encode_wait_s.tolist() == pytest.approx([first, second, 0.0])
    # Prefill without encoder time: each prompt's own step, once its images are encoded.
    assert result.ttft_s.tolist() == pytest.approx([first + 0.030, second + 0.020, 0.015])
    # Two encode workers take one request each.
    two = simulate_disaggregated(trace, [engine.without_encoder()], [engine], 1, encode=[engine, engine])
    assert two.encode_wait_s.tolist() == pytest.approx([first, (5 + 2 * 40) / 1000, 0.0])


def test_prompts_a_decode_replica_prefills_itself_are_encoded_there(linear_model):
    model = _vision(linear_model(prefill=(10.0, 0.1, 0.0)), per_image_ms=40.0)
    engine = model.engine(1, 1)
    trace = _trace([0.0, 1.0], [100, 2000], [2, 2], [1, 1])
    result = simulate_conditional(
        trace, [engine.without_encoder()], [engine], 1, local_prefill_max_tokens=500, encode=[engine]
    )
    assert result.encode_wait_s[0] == 0 and result.ttft_s[0] == pytest.approx((10 + 0.1 * 100 + 40) / 1000)
    assert result.encode_wait_s[1] == pytest.approx(0.04)


def test_image_mixes_are_seeded_and_named_errors():
    counts = image_counts("vqa", 10_000, seed=3)
    assert np.array_equal(counts, image_counts("vqa", 10_000, seed=3))
    shares = np.bincount(counts) / len(counts)
    assert shares == pytest.approx([0.3, 0.5, 0.2], abs=0.02)
    assert set(image_counts("2", 5)) == {2}
    assert set(image_counts("0:0.5,4:0.5", 1000)) == {0, 4}
    for bad in ("lots", "-1", "1:0.5", "1:0.5,2:x"):
        with pytest.raises(TraceError, match="--images"):
            image_counts(bad, 10)
    trace = synthetic(20, 1.0, lengths="fixed:100:10").with_images(image_counts("1", 20), TOKENS_PER_IMAGE)
    assert set(trace.input_len) == {116} and trace.has_images
    assert trace.head(5).images.tolist() == [1] * 5 and trace.at_rate(3.0).has_images


def _cpu_cluster(tmp_path, model: LatencyModel, cores: int = 8) -> ClusterSpec:
    model.save(tmp_path / "profile.yaml")
    (tmp_path / "cluster.yaml").write_text(
        "model: duet-tiny-idefics3-large\nnetwork_gbs: 4.65\n"
        "gpu_types: {cpu-core: {nvlink_gbs: 4.65, profile: profile.yaml}}\n"
        f"nodes: [{{gpu_type: cpu-core, count: 1, gpus_per_node: {cores}}}]\n"
    )
    return ClusterSpec.load(tmp_path / "cluster.yaml")


def _plan(tmp_path, linear_model, per_image_ms: float):
    model = _vision(
        dataclasses.replace(linear_model(prefill=(5.0, 0.05, 0.0), decode=(5.0, 0.0, 0.2)), model="duet-tiny-idefics3-large"),
        per_image_ms=per_image_ms,
    )
    cluster = _cpu_cluster(tmp_path, model)
    trace = with_images(synthetic(600, 6.0, lengths="uniform:400:32", seed=1), "vqa", cluster)
    result = optimize(cluster, trace, Slo(0.5, 0.1, 0.9), rate=6.0, workers=1, modes=["disaggregated"], search_requests=300, verify_requests=600)
    validate_against(result.plan, cluster)
    return result


@pytest.fixture(scope="module")
def gpu_plan(opt13b, tmp_path_factory):
    """OPT-13B's DistServe A100 fits with a 30 ms-an-image encoder of 576 tokens an image (a
    ViT-L's order), on 16 GPUs: the best prefill engine has two GPUs (pp=2), and each pays the
    encoder's whole time on both; an encode worker pays it on one."""
    folder = tmp_path_factory.mktemp("gpu")
    dataclasses.replace(opt13b, encoder=EncoderPerf((3.0, 30.0), 576)).save(folder / "profile.yaml")
    (folder / "cluster.yaml").write_text(
        "model: facebook/opt-13b\nnetwork_gbs: 25\ngpu_types: {a100-80g: {nvlink_gbs: 300, profile: profile.yaml}}\n"
        "nodes: [{gpu_type: a100-80g, count: 2, gpus_per_node: 8}]\n"
    )
    cluster = ClusterSpec.load(folder / "cluster.yaml")
    trace = with_images(synthetic(1500, 4.0, seed=1), "vqa", cluster)
    result = optimize(
        cluster, trace, Slo(0.4, 0.1, 0.9), rate=6.0, workers=1, modes=["disaggregated"], algorithm="high-affinity",
        search_requests=500, verify_requests=1500,
    )
    validate_against(result.plan, cluster)
    return result, folder


def test_an_encoder_on_multi_gpu_prefill_engines_gets_a_pool_of_its_own(gpu_plan, capsys):
    result, folder = gpu_plan
    plan = result.plan
    assert plan.encode is not None and plan.encode.replicas >= 1 and plan.encode.tensor_parallel == 1
    assert "E+P+D" in plan.describe_mode() and plan.expected.attainment >= 0.9
    assert any(line.startswith("encode: ") and "x tp=1" in line for line in plan.explanation)
    assert any(line.startswith("-> E+P+D:") for line in plan.explanation)
    # The EP+D plan was sized too, and needs more GPUs.
    ep_d = [p for p in result.alternatives if p.encode is None]
    assert ep_d and ep_d[0].gpus > plan.gpus
    # The plan round-trips with its encode pool, and `duet simulate` predicts it as planned.
    plan.save(folder / "plan.yaml")
    assert Plan.load(folder / "plan.yaml").encode == plan.encode
    code = main(
        ["simulate", "--config", str(folder / "cluster.yaml"), "--trace", "synthetic:n=1500,rate=4,seed=1",
         "--slo", "ttft=0.4,tpot=0.1", "--images", "vqa", "--plan", str(folder / "plan.yaml"), "--rate", "6"]
    )
    assert code == 0 and f"attainment {plan.expected.attainment:.1%}" in capsys.readouterr().out


def test_a_light_encoder_stays_in_the_prefill_engines(tmp_path, linear_model):
    plan = _plan(tmp_path, linear_model, per_image_ms=1.0).plan
    assert plan.encode is None and plan.mode == "disaggregated"
    assert any(line.startswith("-> EP+D:") for line in plan.explanation)
    assert any(line.startswith("encode: in the prefill engines") for line in plan.explanation)


def test_images_need_a_profile_with_an_encoder(tmp_path, linear_model, capsys):
    cluster = _cpu_cluster(tmp_path, dataclasses.replace(linear_model(), model="duet-tiny-idefics3-large"))
    with pytest.raises(ClusterSpecError, match="no image encoder"):
        with_images(synthetic(10, 1.0), "vqa", cluster)
    code = main(
        ["plan", "--config", str(tmp_path / "cluster.yaml"), "--trace", "synthetic:n=50,rate=1", "--slo", "ttft=1,tpot=0.1",
         "--images", "vqa", "--out", str(tmp_path / "plan.yaml")]
    )
    assert code == 2 and "duet profile --model builtin-vl-large" in capsys.readouterr().err


def test_an_encode_pool_on_a_colocated_plan_is_refused(gpu_plan):
    data = gpu_plan[0].plan.model_dump(mode="json")
    data.update(mode="colocated", colocated=data["prefill"])
    for key in ("prefill", "decode", "kv_transfer", "algorithm"):
        data.pop(key)
    with pytest.raises(ValueError, match="must not have encode"):
        Plan.model_validate(data)


def test_an_e_p_d_plan_on_a_profile_without_an_encoder_is_named(gpu_plan, opt13b, tmp_path, capsys):
    result, folder = gpu_plan
    result.plan.save(tmp_path / "plan.yaml")
    opt13b.save(tmp_path / "profile.yaml")  # the same fits, no encoder
    (tmp_path / "cluster.yaml").write_text((folder / "cluster.yaml").read_text())
    code = main(
        ["simulate", "--config", str(tmp_path / "cluster.yaml"), "--trace", "synthetic:n=50,rate=4",
         "--slo", "ttft=0.4,tpot=0.1", "--plan", str(tmp_path / "plan.yaml")]
    )
    assert code == 2 and "has no image encoder" in capsys.readouterr().err
