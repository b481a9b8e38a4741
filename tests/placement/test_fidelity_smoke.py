"""The fidelity benchmark's pieces: the load generator and the serving-path CPU model.

The load generator replays a handful of requests against the suite's running deployment (a few
seconds, no engines of its own) to check that the open-loop replay sends each request at its
arrival time, generates exactly the trace's output lengths, and records the router's TTFT/TPOT;
a failed request must count as a miss in the summary the predictions are compared with. The
host-overhead model (what made the simulator agree with the real CPU deployment) is checked on
hand-made latency models.
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
from duet.cluster.placement.latency_model import LatencyModel, host_slowdown
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import synthetic


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


def test_host_overhead_takes_its_share_of_the_processors():
    assert host_slowdown(0.0, 1000.0, 2) == 1.0
    # 500 tokens/s at 1 ms each is half a core, spread over two: each engine keeps 75%.
    assert host_slowdown(1.0, 500.0, 2) == pytest.approx(1 / 0.75)
    assert host_slowdown(1.0, 1e6, 2) == pytest.approx(20.0)  # capped: cannot keep up at all


def test_host_overhead_slows_the_simulated_engines(linear_model, tmp_path):
    model = linear_model(prefill=(10.0, 0.1, 0.0), decode=(5.0, 0.0, 0.0))
    engine = model.engine(1, 1)
    trace = synthetic(200, rate=4.0, lengths="fixed:200:20", seed=0)
    ctx = SearchContext(trace, Slo(1.0, 0.1), {"t": model}, 1000, 1e12, {})
    alone = simulate(ctx, Deployment((engine,), (engine,)), 4.0, None)
    shared = simulate(ctx, Deployment((engine,), (engine,), host_ms_per_token=5.0), 4.0, None)
    # 4 req/s x 20 tokens x 5 ms over 2 processors: a 20% share, engines 1.25x slower.
    assert np.median(shared.tpot_s) == pytest.approx(1.25 * np.median(alone.tpot_s))
    assert np.median(shared.ttft_s) > np.median(alone.ttft_s)

    path = tmp_path / "profile.yaml"
    LatencyModel(**{**model.__dict__, "host_ms_per_token": 0.8}).save(path)
    assert LatencyModel.load(path).host_ms_per_token == 0.8


def test_host_cpu_counts_this_process():
    assert os.getpid() in host_cpu_seconds(os.getppid())
