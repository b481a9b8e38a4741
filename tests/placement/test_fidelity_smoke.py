"""The fidelity benchmark's pieces: the load generator and the serving-path CPU model.

The load generator replays a handful of requests against the suite's running deployment (a few
seconds, no engines of its own) to check that the open-loop replay sends each request at its
arrival time, generates exactly the trace's output lengths, and records the router's TTFT/TPOT;
a failed request must count as a miss in the summary the predictions are compared with. The
serving-path CPU model (what made the simulator agree with the real CPU deployment: engine speed
follows the tokens streamed at each moment) is checked on hand-made latency models.
"""

from __future__ import annotations

import asyncio
import math
import os

import numpy as np
import pytest

from duet.benchmarks.host_overhead import host_cpu_seconds
from duet.benchmarks.loadgen import RequestRecord, replay, replay_result
from duet.cluster.placement.goodput import Deployment, SearchContext, simulate
from duet.cluster.placement.latency_model import LatencyModel
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


HOST_MS = 5.0  # serving-path CPU per streamed token in the tests below (decode steps are 5 ms)


def _host_trace(arrivals, inputs, outputs) -> Trace:
    return Trace("t", np.array(arrivals, float), np.array(inputs), np.array(outputs))


def test_decode_steps_carry_their_tokens_serving_cost(linear_model):
    # A step of n sequences streams n tokens: n * 5 ms of serving-path CPU over 2 processors
    # (both engines' cores) comes on top of the profiled 5 ms step.
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)
    one = simulate_disaggregated(
        _host_trace([0.0], [100], [201]), [engine], [engine], 1000, host_ms_per_token=HOST_MS
    )
    assert one.ttft_s[0] == pytest.approx(0.020)  # nothing streams yet: the prefill runs at full speed
    assert one.tpot_s[0] == pytest.approx((5.0 + 1 * HOST_MS / 2) / 1000)
    four = simulate_disaggregated(
        _host_trace([0.0] * 4, [100] * 4, [2001] * 4), [], [engine], 1000, host_ms_per_token=HOST_MS
    )
    # A decode pool simulated alone has only its own processor to share.
    assert np.allclose(four.tpot_s, (5.0 + 4 * HOST_MS / 1) / 1000, rtol=1e-3)
    # The planner's path passes the deployment's cost through, colocated engines included.
    ctx = SearchContext(_host_trace([0.0], [100], [201]), Slo(1.0, 0.1), {}, 1000, 1e12, {})
    shared = simulate(ctx, Deployment((engine,), (engine,), host_ms_per_token=HOST_MS), 1.0, None)
    assert shared.tpot_s[0] == pytest.approx(one.tpot_s[0])
    colocated_dep = Deployment((engine,), (), colocated=True, host_ms_per_token=HOST_MS)
    colocated = simulate(ctx, colocated_dep, 1.0, None)
    assert colocated.tpot_s[0] == pytest.approx((5.0 + HOST_MS / 1) / 1000)


def test_a_burst_slows_prefill_more_than_the_same_tokens_spread_out(linear_model, tmp_path):
    # Four 200-token streams, then a 20 ms probe prefill (one output token, so it never decodes).
    engine = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0)).engine(1, 1)

    def probe_ttft(arrivals: list[float], probe_at: float) -> float:
        trace = _host_trace([*arrivals, probe_at], [100] * 5, [201] * 4 + [1])
        return simulate_disaggregated(trace, [engine], [engine], 1000, host_ms_per_token=HOST_MS).ttft_s[-1]

    # Burst: all four decode together when the probe arrives. Host demand at full engine speed
    # is 4 tokens / 5 ms * 5 ms = 4 cores; the engines keep 1 / (1 + 4/2) of theirs.
    assert probe_ttft([0.0] * 4, 1.0) == pytest.approx(0.020 * 3)
    # Spread out, one streams at a time (1.5 s each): 1 / (1 + 1/2).
    assert probe_ttft([0.0, 2.0, 4.0, 6.0], 1.0) == pytest.approx(0.020 * 1.5)
    # Once the streams have ended, the prefill has its core back.
    assert probe_ttft([0.0] * 4, 10.0) == pytest.approx(0.020)

    path = tmp_path / "profile.yaml"
    model = linear_model()
    LatencyModel(**{**model.__dict__, "host_ms_per_token": 0.8}).save(path)
    assert LatencyModel.load(path).host_ms_per_token == 0.8


def test_host_cpu_counts_this_process():
    assert os.getpid() in host_cpu_seconds(os.getppid())
