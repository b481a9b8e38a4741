"""The fidelity benchmark's pieces: the load generator and the serving-path CPU model.

The load generator replays a handful of requests against the suite's running deployment (a few
seconds, no engines of its own) to check that the open-loop replay sends each request at its
arrival time, generates exactly the trace's output lengths, and records the router's TTFT/TPOT;
a failed request must count as a miss in the summary the predictions are compared with. The
serving-path CPU model (idle engines' cores absorb it; only when every core is wanted do the
engines slow, by the cost of the steps, tokens and requests running) is checked on hand-made
latency models.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os

import numpy as np
import pytest

from duet.benchmarks.host_overhead import ServingPathSample, fit_serving_path, host_cpu_seconds
from duet.benchmarks.loadgen import RequestRecord, replay, replay_result
from duet.cluster.placement.goodput import Deployment, SearchContext, simulate
from duet.cluster.placement.latency_model import LatencyModel, ServingPathCost
from duet.cluster.placement.simulator import Slo, simulate_disaggregated
from duet.cluster.placement.trace import Trace, synthetic


@pytest.mark.engine
def test_replay_records_router_latencies(deployment):
    trace = synthetic(6, rate=4.0, lengths="uniform:200:12", seed=1)
    records = asyncio.run(replay(f"127.0.0.1:{deployment.port}", trace, model=deployment.config.model.name))

    assert [r.error for r in records] == [""] * len(trace)
    assert [r.completion_tokens for r in records] == trace.output_len.tolist()
    assert [r.input_len for r in records] == trace.input_len.tolist()
    for record in records:
        assert 0 < record.ttft_s <= record.client_ttft_s < 30
        assert record.tpot_s > 0 or record.output_len == 1
        assert abs(record.sent_s - record.scheduled_s) < 0.5, "requests did not leave on schedule"
    assert replay_result(records).summary(Slo(30.0, 5.0))["attainment"] == 1.0


# Percentiles over infinite latencies interpolate inf - inf; the attainments are what matter here.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_failed_requests_count_as_misses():
    ok = RequestRecord(0, 0.0, 0.0, 10, 4, 4, 0.1, 0.01, 0.11, 0.01)
    failed = RequestRecord(1, 0.5, 0.5, 10, 4, 0, math.nan, math.nan, math.nan, 0.0, error="UNAVAILABLE: gone")
    summary = replay_result([ok, failed]).summary(Slo(1.0, 0.1))
    assert summary["attainment"] == summary["ttft_attainment"] == summary["tpot_attainment"] == 0.5


PER_TOKEN = ServingPathCost(ms_per_token=5.0)  # decode steps below are 5 ms


def _host_trace(arrivals, inputs, outputs) -> Trace:
    return Trace("t", np.array(arrivals, float), np.array(inputs), np.array(outputs))


def test_an_idle_engines_core_absorbs_the_serving_path(linear_model):
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)
    # One request: while it decodes the prefill engine is idle, and its core takes the serving
    # path's one core of work (5 ms per 5 ms step): the decode runs at full speed.
    one = simulate_disaggregated(_host_trace([0.0], [100], [201]), [engine], [engine], 1000, serving_path=PER_TOKEN)
    assert one.ttft_s[0] == pytest.approx(0.020)
    assert one.tpot_s[0] == pytest.approx(0.005)
    # A decode pool simulated alone has only its own core: four streams need 4 cores of
    # serving path beside the engine's 1, so the engine keeps 1/5.
    four = simulate_disaggregated(
        _host_trace([0.0] * 4, [100] * 4, [2001] * 4), [], [engine], 1000, serving_path=PER_TOKEN
    )
    assert np.allclose(four.tpot_s, 0.005 * 5, rtol=1e-3)
    # The planner's path passes the deployment's cost through, colocated engines included
    # (one engine on one core: 1 core of serving path beside it halves its speed).
    ctx = SearchContext(_host_trace([0.0], [100], [201]), Slo(1.0, 0.1), {}, 1000, 1e12, {})
    shared = simulate(ctx, Deployment((engine,), (engine,), serving_path=PER_TOKEN), 1.0, None)
    assert shared.tpot_s[0] == pytest.approx(one.tpot_s[0])
    colocated = simulate(ctx, Deployment((engine,), (), colocated=True, serving_path=PER_TOKEN), 1.0, None)
    assert colocated.tpot_s[0] == pytest.approx(0.005 * 2)


def test_a_steps_cost_is_shared_by_its_batch_and_idle_cost_always_paid(linear_model):
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)
    per_step = ServingPathCost(ms_per_step=5.0)

    def tpot(streams: int, cost: ServingPathCost) -> float:
        trace = _host_trace([0.0] * streams, [100] * streams, [201] * streams)
        return float(simulate_disaggregated(trace, [], [engine], 1000, serving_path=cost).tpot_s[0])

    # One message per step, however many sequences it carries: 1 core, the engine keeps 1/2.
    assert tpot(1, per_step) == pytest.approx(0.010, rel=1e-3)
    assert tpot(8, per_step) == pytest.approx(0.010, rel=1e-3)
    # Engines that merge their outputs send one message per 20 ms interval, not per 5 ms step:
    # a quarter of a core, the engine keeps 1/1.25. Prefill steps send first tokens at once.
    merged = dataclasses.replace(per_step, output_interval_ms=20.0)
    assert tpot(1, merged) == pytest.approx(0.005 * 1.25, rel=1e-3)
    assert merged.step_cores(tokens=1, requests=1, step_s=0.005) == pytest.approx(1.0)
    assert merged.step_cores(tokens=1, requests=0, step_s=0.040) == pytest.approx(0.125)
    # One router serving pools measured apart: the larger costs, the shorter interval.
    heaviest = ServingPathCost.heaviest([merged, ServingPathCost(ms_per_token=1.0, output_interval_ms=40.0)])
    assert heaviest == ServingPathCost(ms_per_token=1.0, ms_per_step=5.0, output_interval_ms=20.0)
    assert ServingPathCost(output_interval_ms=40.0).free  # an interval alone costs nothing
    # Ray's daemons and the health pings take their cores first: half of the only core.
    assert tpot(1, ServingPathCost(idle_cores=0.5)) == pytest.approx(0.010, rel=1e-3)


def test_a_burst_slows_prefill_only_while_every_core_is_wanted(linear_model, tmp_path):
    # Four 200-token streams, then a 20 ms probe prefill (one output token, so it never decodes).
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)

    def probe_ttft(arrivals: list[float], probe_at: float) -> float:
        trace = _host_trace([*arrivals, probe_at], [100] * 5, [201] * 4 + [1])
        return simulate_disaggregated(trace, [engine], [engine], 1000, serving_path=PER_TOKEN).ttft_s[-1]

    # The probe's own first token costs 5 ms over its 20 ms: 0.25 cores at full speed.
    # Burst: both engines busy, the four streams want 4 cores: speed 2 / (2 + 4 + 0.25).
    assert probe_ttft([0.0] * 4, 1.0) == pytest.approx(0.020 * (2 + 4.25) / 2)
    # One stream (1 core): 2 / (2 + 1.25).
    assert probe_ttft([0.0, 2.0, 4.0, 6.0], 0.5) == pytest.approx(0.020 * (2 + 1.25) / 2)
    # Once the streams have ended, the decode engine's idle core takes the probe's share.
    assert probe_ttft([0.0] * 4, 10.0) == pytest.approx(0.020)

    path = tmp_path / "profile.yaml"
    model = linear_model()
    cost = ServingPathCost(ms_per_token=0.1, ms_per_step=0.4, ms_per_request=3.0, idle_cores=0.05, output_interval_ms=40)
    LatencyModel(**{**model.__dict__, "serving_path": cost}).save(path)
    assert LatencyModel.load(path).serving_path == cost
    # A profile from before the cost had parts: its one number is the per-token part.
    legacy = {k: v for k, v in model.to_dict().items() if k != "serving_path"} | {"host_ms_per_token": 0.8}
    assert LatencyModel.from_dict(legacy).serving_path == ServingPathCost(ms_per_token=0.8)


def test_engines_side_by_side_slow_each_other_only_while_both_are_busy(linear_model):
    # A 20 ms probe prefill; the decode engine runs 200-token streams of 5 ms steps.
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)
    corun = ServingPathCost(corun_slowdown=0.25)

    def probe_ttft(decoding: bool) -> float:
        arrivals, outputs = ([0.0, 0.5], [201, 1]) if decoding else ([0.5], [1])
        trace = _host_trace(arrivals, [100] * len(arrivals), outputs)
        return float(simulate_disaggregated(trace, [engine], [engine], 1000, serving_path=corun).ttft_s[-1])

    assert probe_ttft(decoding=False) == pytest.approx(0.020)
    assert probe_ttft(decoding=True) == pytest.approx(0.020 * 1.25)
    # Kept when a measured serving path replaces the profile's (which has only this part).
    model = linear_model()
    profiled = LatencyModel(**{**model.__dict__, "serving_path": corun})
    measured = profiled.with_serving_path(ServingPathCost(ms_per_token=0.3))
    assert measured.serving_path == ServingPathCost(ms_per_token=0.3, corun_slowdown=0.25)


def test_host_cpu_counts_this_process():
    assert os.getpid() in host_cpu_seconds(os.getppid())


def test_serving_path_parts_are_recovered_from_samples():
    truth = ServingPathCost(ms_per_token=0.1, ms_per_step=0.8, ms_per_request=6.0, idle_cores=0.05)

    def sample(wall: float, steps: int, tokens: int, requests: int) -> ServingPathSample:
        busy = (steps * truth.ms_per_step + tokens * truth.ms_per_token + requests * truth.ms_per_request) / 1000
        return ServingPathSample(busy + truth.idle_cores * wall, wall, tokens, requests, steps)

    # idle; two rates (bigger batches: fewer steps for the same tokens); short outputs
    samples = [sample(10, 0, 0, 0), sample(50, 6000, 7000, 80), sample(25, 3500, 7000, 80), sample(50, 400, 320, 80)]
    fitted = fit_serving_path(samples, output_interval_ms=40)
    assert fitted.output_interval_ms == 40.0  # how the measured deployment sent its messages
    for part in ("ms_per_token", "ms_per_step", "ms_per_request", "idle_cores"):
        assert getattr(fitted, part) == pytest.approx(getattr(truth, part), rel=1e-6)
        assert type(getattr(fitted, part)) is float  # it is written to profile.yaml
    # Noise that would make a part negative leaves that part out instead.
    # (here unconstrained least squares would say -0.1 ms per token).
    cheaper = dataclasses.replace(samples[2], cpu_s=samples[2].cpu_s - 0.6)
    refit = fit_serving_path([*samples[:2], cheaper, samples[3]])
    assert refit.ms_per_token == 0
    assert refit.ms_per_step > 0 and refit.ms_per_request > 0
    with pytest.raises(ValueError, match="idle window"):
        fit_serving_path(samples[1:])
