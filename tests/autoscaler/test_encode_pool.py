"""Sizing the encode pool (E+P+D) from the encodes in flight (cluster/autoscaler/encode_pool.py),
and the live autoscaler carrying it out beside the prefill and decode pools' decisions. The
encode step on real engines is tested in test_vision_language.py."""

from __future__ import annotations

import time

import pytest

from duet.cluster.autoscaler.encode_pool import encode_decision
from duet.cluster.autoscaler.live import LiveAutoscaler
from duet.cluster.autoscaler.policy import AutoscalePolicy, EncodeLimits, PolicyError, SloProfile
from duet.router.load_meter import LoadMeter, LoadWindow
from duet.router.pools import PoolMember, WorkerPool

LIMITS = EncodeLimits(min=0, max=3, in_flight_per_worker=1.0)


@pytest.mark.parametrize(
    "active, wait_s, fallbacks, target",
    [
        (1, 25.0, 0, 3),  # 2.5 encodes in flight: three workers, at once
        (1, 80.0, 0, 3),  # never past max
        (1, 7.0, 0, 1),  # 0.7 in flight: one is enough
        (3, 2.0, 0, 2),  # load gone: down one worker an interval
        (1, 0.0, 0, 0),  # no image at all: down to min (0: the prefill engines encode)
        (0, 0.0, 4, 1),  # images left to prefill with no encode worker: start one
        (0, 0.0, 0, 0),
    ],
)
def test_the_encode_pool_follows_the_encodes_in_flight(active, wait_s, fallbacks, target):
    decision = encode_decision(LIMITS, active, wait_s, fallbacks, window_s=10.0)
    assert (decision.role, decision.current, decision.target) == ("encode", active, target), decision.reason


def test_the_policys_floor_holds():
    assert encode_decision(EncodeLimits(min=1, max=2), 1, 0.0, 0, 10.0).target == 1
    with pytest.raises(ValueError, match="above max"):
        EncodeLimits(min=3, max=2)


def test_a_front_doors_encodes_reach_the_autoscalers_window():
    meter, other = LoadMeter(), LoadWindow(encode_wait_s=1.5, image_fallbacks=1)
    meter.encoded(0.25, 2)
    window = meter.window()
    window.add(other)
    assert (window.encode_wait_s, window.image_fallbacks) == (1.75, 3)
    assert meter.window().encode_wait_s == 0.0


class _Operator:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def scale(self, role: str, replicas: int) -> list[str]:
        self.calls.append((role, replicas))
        return [f"{role}: {replicas}"]


def _pool(role: str, workers: int) -> WorkerPool:
    pool = WorkerPool(role)
    for index in range(workers):
        pool.members.append(PoolMember(f"{role}-{index}", actor=None, reported_at=time.monotonic()))
    return pool


def test_the_live_autoscaler_scales_the_encode_pool_beside_the_others():
    policy = AutoscalePolicy(
        slo=SloProfile(ttft_s=1.0, tpot_s=0.1), latency_model=None, encode={"min": 0, "max": 4},
        prefill={"min": 1, "max": 1}, decode={"min": 1, "max": 1},
    )
    pools = {"prefill": _pool("prefill", 1), "decode": _pool("decode", 1), "encode": _pool("encode", 1)}
    operator = _Operator()
    scaler = LiveAutoscaler(policy, pools, LoadMeter(), operator)
    scaler._last_tick -= 10.0  # an interval of 10 s
    decisions = scaler.tick(LoadWindow(arrivals=20, encode_wait_s=22.0), ttft_overdue=0)
    encode = next(decision for decision in decisions if decision.role == "encode")
    assert (encode.current, encode.target) == (1, 3) and ("encode", 3) in operator.calls
    assert {decision.role for decision in decisions} == {"prefill", "decode", "encode"}


def test_the_encode_pool_grows_only_into_what_the_budget_leaves():
    """A budget of 4 cores: prefill and decode keep their two, the encode pool (holding one)
    may grow to two, not the three its load asks for."""
    assert encode_decision(LIMITS, 1, 25.0, 0, 10.0, room=2).target == 2
    # Over what the budget leaves: one worker given back an interval, never below the minimum.
    assert encode_decision(LIMITS, 2, 25.0, 0, 10.0, room=0).target == 1
    assert encode_decision(EncodeLimits(min=1, max=3), 1, 25.0, 0, 10.0, room=0).target == 1
    policy = AutoscalePolicy(
        slo=SloProfile(ttft_s=1.0, tpot_s=0.1), latency_model=None, encode={"min": 0, "max": 4},
        prefill={"min": 1, "max": 3}, decode={"min": 1, "max": 1}, budget=4,
    )
    pools = {"prefill": _pool("prefill", 1), "decode": _pool("decode", 1), "encode": _pool("encode", 1)}
    scaler = LiveAutoscaler(policy, pools, LoadMeter(), _Operator())
    scaler._last_tick -= 10.0
    decisions = {d.role: d for d in scaler.tick(LoadWindow(arrivals=20, encode_wait_s=25.0), ttft_overdue=0)}
    assert decisions["prefill"].target + decisions["decode"].target + decisions["encode"].target <= 4
    assert decisions["encode"].target == 4 - decisions["prefill"].target - decisions["decode"].target
    assert "budget leaves" in decisions["encode"].reason
    with pytest.raises(ValueError, match="budget"):
        AutoscalePolicy(slo=SloProfile(ttft_s=1.0, tpot_s=0.1), latency_model=None, encode={"min": 2}, budget=3)


def test_a_bad_encode_bound_in_a_policy_is_named(tmp_path):
    from duet.cluster.autoscaler.policy import load_policy

    path = tmp_path / "bad.yaml"
    path.write_text("slo: chat\nencode: {min: 2, max: 1}\n")
    with pytest.raises(PolicyError, match="encode"):
        load_policy(str(path))
