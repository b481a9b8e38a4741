import math

import numpy as np
import pytest

from duet.cluster.placement.simulator import (
    Slo,
    simulate_colocated,
    simulate_conditional,
    simulate_disaggregated,
)
from duet.cluster.placement.trace import Trace, synthetic


def _trace(arrivals, inputs, outputs) -> Trace:
    return Trace("t", np.array(arrivals, float), np.array(inputs), np.array(outputs))


def test_single_request_latencies_are_the_model_exactly(linear_model):
    model = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.01, 1.0))
    e = model.engine(1, 1)
    r = simulate_disaggregated(_trace([0.0], [200], [6]), [e], [e], kv_bytes_per_token=1000)
    assert r.ttft_s[0] == pytest.approx((10 + 0.1 * 200 + 1e-4 * 200**2) / 1000)
    steps = [(5 + 0.01 * (201 + k) + 1.0) / 1000 for k in range(5)]
    assert r.tpot_s[0] == pytest.approx(sum(steps) / 5)


def _step_by_step_reference(arrivals, inputs, outputs, a, b, c):
    """Decode-only continuous batching, one event per step: the oracle for the closed form."""
    now, pending, running, finish = 0.0, list(range(len(arrivals))), {}, {}
    while pending or running:
        if not running and pending and arrivals[pending[0]] > now:
            now = arrivals[pending[0]]
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            running[i] = [inputs[i] + 1, outputs[i] - 1]
        step = (a + b * sum(ctx for ctx, _ in running.values()) + c * len(running)) / 1000
        now += step
        for i in list(running):
            running[i][0] += 1
            running[i][1] -= 1
            if running[i][1] == 0:
                finish[i] = now
                del running[i]
    return [finish[i] for i in range(len(arrivals))]


def test_closed_form_decode_matches_step_by_step_with_joins_mid_run(linear_model):
    a, b, c = 8.0, 0.02, 0.5
    e = linear_model(decode=(a, b, c)).engine(1, 1)
    rng = np.random.default_rng(7)
    arrivals = np.sort(rng.uniform(0, 2.0, 40))
    inputs, outputs = rng.integers(10, 500, 40), rng.integers(2, 60, 40)
    r = simulate_disaggregated(_trace(arrivals, inputs, outputs), [], [e], kv_bytes_per_token=1)
    finish = arrivals + r.tpot_s * (outputs - 1)  # TTFT is 0 without a prefill pool
    assert np.allclose(finish, _step_by_step_reference(arrivals, inputs, outputs, a, b, c), rtol=1e-9)


def test_more_load_never_improves_attainment(opt13b):
    e = opt13b.engine(1, 1)
    base = synthetic(400, 1.0, seed=2)
    slo = Slo(0.25, 0.1, 0.9)
    atts = [
        simulate_disaggregated(base.at_rate(r), [e], [e], 819200, 25e9).attainment(slo)
        for r in (1, 3, 6, 12, 24)
    ]
    assert all(x >= y for x, y in zip(atts, atts[1:]))
    assert atts[0] > 0.95 and atts[-1] < 0.5


def test_transfer_bandwidth_limits(opt13b):
    e = opt13b.engine(1, 1)
    t = synthetic(200, 1.0, seed=4).at_rate(2.0)
    slo = Slo(0.25, 0.1, 0.9)
    free = simulate_disaggregated(t, [e], [e], 819200, math.inf)
    fast = simulate_disaggregated(t, [e], [e], 819200, 1e15)
    slow = simulate_disaggregated(t, [e], [e], 819200, 1e6)  # 1 MB/s: ~0.8 s per token of KV
    assert np.allclose(fast.tpot_s, free.tpot_s, rtol=1e-4)
    assert np.array_equal(slow.ttft_s, free.ttft_s)  # TTFT ends at the prefill
    assert slow.summary(slo)["tpot_attainment"] < 0.05
    assert free.summary(slo)["tpot_attainment"] > 0.95


def test_colocated_decode_stalls_behind_prefill(linear_model):
    """Same two engines: colocated decodes wait out other requests' prefills, disaggregated
    decodes never do, so the colocated TPOT tail is far worse at the same load."""
    e = linear_model(prefill=(20.0, 0.48, 0.0), decode=(10.0, 0.0, 0.1)).engine(1, 1)
    t = synthetic(400, 1.0, seed=5, lengths="fixed:1000:20").at_rate(1.5)
    disagg = simulate_disaggregated(t, [e], [e], 1000, math.inf)
    coloc = simulate_colocated(t, [e, e])
    assert np.percentile(coloc.tpot_s, 90) > 2 * np.percentile(disagg.tpot_s, 90)
    assert np.percentile(disagg.tpot_s, 90) < 0.0125  # just the step time: 10 ms + 0.1 ms/seq


def test_kv_capacity_serialises_and_oversized_requests_never_finish(linear_model):
    e = linear_model(decode=(10.0, 0.0, 0.0), kv_tokens=300).engine(1, 1)
    r = simulate_disaggregated(_trace([0.0, 0.0, 0.0], [100, 100, 400], [101, 101, 10]), [], [e], 1)
    # each of the first two needs 201 tokens of 300: they run one after the other
    assert r.tpot_s[0] == pytest.approx(0.010)
    assert r.tpot_s[1] == pytest.approx(0.020)
    assert math.isinf(r.tpot_s[2])


def test_early_stop_when_slo_is_lost(opt13b):
    e = opt13b.engine(1, 1)
    t = synthetic(400, 1.0, seed=6).at_rate(50.0)
    slo = Slo(0.25, 0.1, 0.9)
    r = simulate_disaggregated(t, [e], [e], 819200, 25e9, slo=slo)
    assert r.stopped_early and not r.meets(slo)
    full = simulate_disaggregated(t, [e], [e], 819200, 25e9)
    assert not full.stopped_early and full.attainment(slo) < 0.9


def _bimodal(n: int, rate: float, short: int, long: int, seed: int = 3) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0, n / rate, n))
    return _trace(arrivals, np.where(rng.random(n) < 0.5, short, long), rng.integers(2, 40, n))


def test_conditional_with_every_prompt_long_is_disaggregated(linear_model):
    e = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.01, 1.0)).engine(1, 1)
    t = _bimodal(300, 20.0, 100, 700)
    disagg = simulate_disaggregated(t, [e, e], [e, e], 1000, 1e8)
    cond = simulate_conditional(t, [e, e], [e, e], 1000, 100, 1e8)
    assert np.allclose(cond.ttft_s, disagg.ttft_s, rtol=1e-9)
    assert np.allclose(cond.tpot_s, disagg.tpot_s, rtol=1e-9)


def test_conditional_prefills_short_prompts_on_decode_without_transfer(linear_model):
    """A short prompt is computed by the decode replica (TTFT = its own prefill, no queue at the
    prefill pool, no KV pull); a long one pays the prefill pool and the link."""
    e = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)
    t = _trace([0.0, 0.0], [1000, 50], [3, 3])
    r = simulate_conditional(t, [e], [e], kv_bytes_per_token=1000, local_prefill_max_tokens=64, transfer_bytes_per_s=1e6)
    assert r.ttft_s[1] == pytest.approx((10 + 0.1 * 50) / 1000)
    assert r.ttft_s[0] == pytest.approx((10 + 0.1 * 1000) / 1000)
    pull_s = 1000 * 1000 / 1e6  # the long prompt's KV over a 1 MB/s link
    assert r.tpot_s[0] > pull_s / 2 > r.tpot_s[1]


def test_conditional_local_prefills_stall_the_decode_replica(linear_model):
    """The price of local prefill: short prompts' prefills stall the decodes of their replica,
    which a disaggregated deployment of the same engines never does."""
    e = linear_model(prefill=(20.0, 0.48, 0.0), decode=(10.0, 0.0, 0.1)).engine(1, 1)
    t = _bimodal(400, 3.0, 500, 1500)
    disagg = simulate_disaggregated(t, [e], [e], 1000, math.inf)
    cond = simulate_conditional(t, [e], [e], 1000, 1000, math.inf)
    assert np.percentile(cond.tpot_s, 90) > 2 * np.percentile(disagg.tpot_s, 90)


def test_conditional_prefill_pool_alone_computes_only_long_prompts(linear_model):
    """Sized alone, the prefill pool answers for the long prompts' TTFT; the short ones are the
    decode side's work, instant here, and count in the attainment as met."""
    e = linear_model(prefill=(10.0, 0.1, 0.0)).engine(1, 1)
    t = _bimodal(200, 5.0, 100, 900)
    r = simulate_conditional(t, [e], [], 1000, 512)
    short = t.input_len < 512
    assert np.all(r.ttft_s[short] == 0) and np.all(r.tpot_s == 0)
    assert np.all(r.ttft_s[~short] >= (10 + 0.1 * 900) / 1000 - 1e-12)


def test_chunked_prefill_fills_each_step_and_finishes_the_split_prompt_next(linear_model):
    from duet.cluster.placement.simulator import SimConfig

    e = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.0, 0.0)).engine(1, 1)

    def ms(tokens: int, square: int) -> float:
        return 10 + 0.1 * tokens + 1e-4 * square

    # A 100-token prompt runs while a 1,800- and a 1,000-token prompt arrive (at 1 ms).
    trace = _trace([0.0, 0.001, 0.001], [100, 1800, 1000], [2, 2, 2])
    busy = ms(100, 100**2)
    chunked = SimConfig(prefill_max_batch_tokens=2048, chunked_prefill=True)
    r = simulate_disaggregated(trace, [e], [e], kv_bytes_per_token=1000, cfg=chunked)
    # Next step: all of the 1,800 and 248 tokens of the 1,000; the step after: its other
    # 752, which attend to the 248 computed before them (2*248*752 + 752^2).
    both = ms(2048, 1800**2 + 248**2)
    assert r.ttft_s[1] == pytest.approx((busy + both) / 1000 - 0.001)
    assert r.ttft_s[2] == pytest.approx((busy + both + ms(752, 2 * 248 * 752 + 752**2)) / 1000 - 0.001)
    # Whole prompts (DistServe's batching): the 1,000 does not fit beside the 1,800.
    whole = simulate_disaggregated(trace, [e], [e], kv_bytes_per_token=1000, cfg=SimConfig(prefill_max_batch_tokens=2048))
    assert whole.ttft_s[1] == pytest.approx((busy + ms(1800, 1800**2)) / 1000 - 0.001)
    assert whole.ttft_s[2] == pytest.approx((busy + ms(1800, 1800**2) + ms(1000, 1000**2)) / 1000 - 0.001)
    # A prompt longer than the budget takes two steps, the second attending to the first.
    long = simulate_disaggregated(_trace([0.0], [3000], [2]), [e], [e], kv_bytes_per_token=1000, cfg=chunked)
    assert long.ttft_s[0] == pytest.approx((ms(2048, 2048**2) + ms(952, 2 * 2048 * 952 + 952**2)) / 1000)
