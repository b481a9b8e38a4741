import numpy as np
import pytest

from duet.cluster.placement.latency_model import (
    GpuPerfSpec,
    LatencyModel,
    LatencyModelError,
    fit_decode,
    fit_prefill,
    nonnegative_lstsq,
    roofline_model,
)
from duet.cluster.placement.models import UnknownModelError, get_model


def test_prefill_fit_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    true = (18.1, 0.1019, 7.12e-6)
    samples = []
    for b in (1, 2, 4, 8):
        for n in (32, 128, 512, 1024, 2000):
            lens = [n] * b
            ms = true[0] + true[1] * sum(lens) + true[2] * sum(x * x for x in lens)
            samples.append((lens, ms * (1 + rng.normal(0, 0.005))))
    a, b, c = fit_prefill(samples)
    assert a == pytest.approx(true[0], rel=0.05)
    assert b == pytest.approx(true[1], rel=0.05)
    assert c == pytest.approx(true[2], rel=0.25)


def test_decode_fit_finds_the_batch_threshold():
    small, large = (19.9, 0.000627, 0.0385), (7.17, 0.00058, 0.158)
    samples = []
    for b in (1, 4, 16, 32, 64, 128, 160, 192, 256):
        for ctx in (128, 512, 1024):
            a, k, c = small if b < 95 else large
            samples.append((b, b * ctx, a + k * b * ctx + c * b))
    got_small, got_large, threshold = fit_decode(samples)
    assert 64 < threshold <= 128
    assert np.allclose(got_small, small, rtol=1e-3)
    assert np.allclose(got_large, large, rtol=1e-3)


def test_nonnegative_lstsq_never_returns_negative_coefficients():
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falling line: unconstrained slope would be -1
    sol = nonnegative_lstsq(x, y)
    assert np.all(sol >= 0)
    assert sol[1] == 0 and sol[0] == pytest.approx(2.0)


def test_distserve_fit_reproduces_readme_example(opt13b):
    engine = opt13b.engine(1, 1)
    assert engine.prefill.batch_ms(512, 512**2) == pytest.approx(72.1, abs=0.2)
    assert engine.kv_capacity_tokens == 66144
    # small vs large batch coefficients switch at the published threshold (95)
    assert engine.decode.step_ms(94, 0) == pytest.approx(19.9347 + 0.0385 * 94, rel=1e-3)
    assert engine.decode.step_ms(95, 0) == pytest.approx(7.1662 + 0.1583 * 95, rel=1e-3)


def test_pipeline_parallel_divides_stage_time(opt13b):
    one, four = opt13b.engine(2, 1), opt13b.engine(2, 4)
    assert four.prefill_latency_s(1000, 1e6) == pytest.approx(one.prefill_latency_s(1000, 1e6))
    assert four.prefill_stage_s(1000, 1e6) == pytest.approx(one.prefill_stage_s(1000, 1e6) / 4)
    assert four.kv_capacity_tokens > one.kv_capacity_tokens


def test_unfitted_parallelism_is_rejected(opt13b):
    with pytest.raises(LatencyModelError, match="tensor_parallel=8"):
        opt13b.engine(8, 1)


def test_roofline_is_monotone_and_scales_with_tp():
    h100 = GpuPerfSpec("h100", 989e12, 3.35e12, 80 * 2**30, 450e9)
    model = roofline_model(get_model("facebook/opt-13b"), h100)
    e1, e4 = model.engine(1, 1), model.engine(4, 1)
    assert e1.prefill.batch_ms(2048, 2048**2) > e1.prefill.batch_ms(512, 512**2) > 0
    assert e4.prefill.batch_ms(2048, 2048**2) < e1.prefill.batch_ms(2048, 2048**2)
    assert e4.decode.step_ms(32, 32 * 1000) < e1.decode.step_ms(32, 32 * 1000)
    assert e4.kv_capacity_tokens > e1.kv_capacity_tokens


def test_roofline_refuses_a_model_that_does_not_fit():
    tiny_gpu = GpuPerfSpec("small", 100e12, 1e12, 16 * 2**30, 100e9)
    model = roofline_model(get_model("facebook/opt-66b"), tiny_gpu)
    with pytest.raises(LatencyModelError, match="does not fit"):
        model.engine(1, 1)
    assert (1, 1) not in model.parallelisms()


def test_profile_yaml_round_trip(tmp_path, opt13b):
    opt13b.save(tmp_path / "p.yaml")
    again = LatencyModel.load(tmp_path / "p.yaml")
    assert again.fits == opt13b.fits
    assert again.engine(2, 2).kv_capacity_tokens == opt13b.engine(2, 2).kv_capacity_tokens


def test_unknown_model_names_the_closest():
    with pytest.raises(UnknownModelError, match="opt-13b"):
        get_model("facebook/opt-13")
    assert get_model("OPT-66B").name == "facebook/opt-66b"


def test_scaled_model_times_each_phase_by_its_factor(linear_model):
    model = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.001, 0.2))
    slower = model.scaled(prefill=1.25, decode=0.8).engine(1, 1)
    engine = model.engine(1, 1)
    assert slower.prefill_latency_s(1000, 1000**2) == pytest.approx(1.25 * engine.prefill_latency_s(1000, 1000**2))
    assert slower.decode_step_s(8, 4000) == pytest.approx(0.8 * engine.decode_step_s(8, 4000))
    assert slower.kv_capacity_tokens == engine.kv_capacity_tokens
    with pytest.raises(LatencyModelError, match="speed factors must be > 0"):
        model.scaled(prefill=0.0, decode=1.0)
