"""`duet bench front-door`'s floor: bare servers of duet's two APIs that the benchmark's own
replayers (gRPC and HTTP) must be able to drive like a front door, or the ratio means nothing."""

from __future__ import annotations

import asyncio

import pytest

from duet.benchmarks.front_door_cost import FloorServer, measure


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_bare_server_answers_the_replayer_and_its_cpu_is_counted(api: str) -> None:
    # The kernel reports a process's CPU in 10 ms ticks, and a bare server spends 0.3-0.8 ms on a
    # request: 10 requests could read as 0 ticks on a fast spell. 120 requests cost it 40-100 ms,
    # several ticks at any speed this machine runs at.
    floor = FloorServer(api)
    try:
        result = asyncio.run(
            measure("floor", api, floor.port, floor.processes, "builtin", rate=120, duration_s=1.0,
                    lengths="fixed:16:7", seed=0)
        )
    finally:
        floor.stop()
    assert result["requests"] == 120
    assert result["failed"] == 0, result["errors"]  # every answer had all 7 tokens
    assert result["cpu_ms_per_request"] > 0
    assert result["cpu_us_per_token"] == pytest.approx(result["cpu_ms_per_request"] * 1000 / 7)
