"""The autoscaler's decisions, driven observation by observation (no cluster: it is pure)."""

from __future__ import annotations

import pytest

from duet.cluster.autoscaler.capacity import CapacityModel, Load, erlang_c
from duet.cluster.autoscaler.core import Autoscaler, Observation, PoolObservation
from duet.cluster.autoscaler.error_budget import ErrorBudget
from duet.cluster.autoscaler.policy import AutoscalePolicy, SloProfile
from duet.worker_runtime.simulated_engine import simulated_perf

CHAT = SloProfile(ttft_s=0.25, tpot_s=0.1)


def policy(**changes: object) -> AutoscalePolicy:
    base = dict(
        slo=CHAT, interval_s=10, prefill={"min": 1, "max": 32}, decode={"min": 1, "max": 32},
        startup_s=60, scale_down={"delay_s": 120, "step": 1}, settle_s=30,
    )
    return AutoscalePolicy.model_validate({**base, **changes})


def opt13b() -> CapacityModel:
    """OPT-13B on a simulated A100 (DistServe's profile), sized for the chat SLO."""
    engine, _ = simulated_perf("distserve:opt-13b", 1, 1)
    return CapacityModel(engine, engine, CHAT, headroom=0.9)


@pytest.fixture(scope="module")
def opt13b_capacity() -> CapacityModel:
    return opt13b()


def observe(
    t: float, rate: float, sizes: dict[str, int], prompt: int = 800, output: int = 200,
    ttft_met: float = 1.0, tpot_met: float = 1.0, fresh: bool = True, age: float = 0.0,
    starting: dict[str, int] | None = None,
) -> Observation:
    arrivals = round(rate * 10)
    done = arrivals
    return Observation(
        time_s=t, window_s=10, arrivals=arrivals, prompt_tokens=arrivals * prompt,
        prompt_tokens_sq=arrivals * prompt * prompt, first_tokens=arrivals, ttft_met=round(arrivals * ttft_met),
        finished=done, output_tokens=done * output, tpot_met=round(done * tpot_met), ttft_overdue=0,
        pools={role: PoolObservation(ready=n, starting=(starting or {}).get(role, 0)) for role, n in sizes.items()},
        fresh=fresh, metrics_age_s=age,
    )


def run(scaler: Autoscaler, rates: list[float], sizes: dict[str, int], start: float = 10, **kwargs: object) -> list[dict[str, int]]:
    """Feed one observation per rate, applying each target as if workers started at once."""
    history = []
    for k, rate in enumerate(rates):
        decisions = scaler.decide(observe(start + 10 * k, rate, sizes, **kwargs))
        sizes = {d.role: d.target for d in decisions}
        history.append(sizes)
    return history


def test_erlang_c_matches_known_values() -> None:
    # Two servers, one erlang offered: P(wait) = 1/3; one server: P(wait) = utilisation.
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(1, 0.6) == pytest.approx(0.6)


def test_capacity_grows_with_load_and_with_tighter_slos(opt13b_capacity: CapacityModel) -> None:
    low = opt13b_capacity.prefill_workers(5, 800, 800**2, 0.05).workers
    high = opt13b_capacity.prefill_workers(50, 800, 800**2, 0.05).workers
    assert 1 <= low < high
    tight = CapacityModel(opt13b_capacity.prefill, opt13b_capacity.decode, SloProfile(ttft_s=0.12, tpot_s=0.1), 0.9)
    assert tight.prefill_workers(50, 800, 800**2, 0.05).workers > high
    # Varied prompt lengths (same mean) queue longer than uniform ones.
    assert opt13b_capacity.prefill_workers(50, 800, 2 * 800**2, 0.05).workers >= high
    assert opt13b_capacity.decode_workers(5, 800, 200, 0.05).workers < opt13b_capacity.decode_workers(50, 800, 200, 0.05).workers


def test_load_step_scales_up_at_once_and_down_only_after_the_window(opt13b_capacity: CapacityModel) -> None:
    scaler = Autoscaler(policy(), opt13b_capacity)
    history = run(scaler, [5] * 3 + [40] * 3 + [5] * 20, {"prefill": 1, "decode": 1})
    before, peak = history[2], history[5]
    assert history[3]["prefill"] > before["prefill"] and history[3]["decode"] > before["decode"]  # the first interval of the step
    # The step ends at t=60. Nothing shrinks before the growth could show (start-up 60 s +
    # settle 30 s after the last size wanted), ...
    assert history[13] == peak, "shrank before the growth could be judged"
    # ... nor below what the step's load needs while it is in the 120 s window (until t=180), ...
    step_need = {
        "prefill": opt13b_capacity.prefill_workers(40, 800, 800**2, 0.05).workers,
        "decode": opt13b_capacity.decode_workers(40, 800, 200, 0.05).workers,
    }
    for sizes in history[6:17]:
        assert all(sizes[role] >= step_need[role] for role in sizes), sizes
    # ... and then by one worker per interval at most, down to well below the peak.
    final = history[-1]
    assert final["prefill"] < peak["prefill"] and final["decode"] < peak["decode"]
    shrinks = [a["prefill"] - b["prefill"] for a, b in zip(history[5:], history[6:])]
    assert max(shrinks) <= 1


def test_missing_or_stale_metrics_shrink_nothing(opt13b_capacity: CapacityModel) -> None:
    scaler = Autoscaler(policy(), opt13b_capacity)
    sizes = run(scaler, [40] * 20, {"prefill": 1, "decode": 1})[-1]
    # The load falls, but the metrics vanish for 5 minutes: every pool holds.
    for k in range(30):
        for decision in scaler.decide(observe(300 + 10 * k, 1, sizes, fresh=False)):
            assert decision.target == decision.current == sizes[decision.role]
            assert "missing" in decision.reason
    for decision in scaler.decide(observe(700, 1, sizes, age=120)):
        assert decision.target == sizes[decision.role] and "old" in decision.reason


def test_pressure_adds_one_worker_then_waits_for_it_to_settle() -> None:
    scaler = Autoscaler(policy(latency_model=None), None)
    sizes = {"prefill": 2, "decode": 2}
    first = {d.role: d for d in scaler.decide(observe(10, 5, sizes, ttft_met=0.5))}
    assert first["prefill"].target == 3 and "TTFT attainment 50%" in first["prefill"].reason
    assert first["decode"].target == 2  # TPOT was met: the bottleneck is prefill
    # The new worker is starting: more pressure must not start another.
    second = {d.role: d for d in scaler.decide(observe(20, 5, {"prefill": 2, "decode": 2}, ttft_met=0.5, starting={"prefill": 1}))}
    assert second["prefill"].target == 3
    # A TPOT shortfall grows decode instead.
    third = {d.role: d for d in scaler.decide(observe(30, 5, {"prefill": 3, "decode": 2}, tpot_met=0.5))}
    assert third["decode"].target == 3


def test_reactive_only_policy_shrinks_to_minimum_after_an_idle_window() -> None:
    scaler = Autoscaler(policy(latency_model=None), None)
    history = run(scaler, [0] * 20, {"prefill": 3, "decode": 3})
    assert history[5] == {"prefill": 3, "decode": 3}  # inside the window: hold
    assert history[-1] == {"prefill": 1, "decode": 1}


def test_bounds_and_budget(opt13b_capacity: CapacityModel) -> None:
    scaler = Autoscaler(policy(prefill={"min": 2, "max": 4}, decode={"min": 1, "max": 3}, budget=6), opt13b_capacity)
    history = run(scaler, [200] * 3, {"prefill": 2, "decode": 1})
    final = history[-1]
    assert final["prefill"] <= 4 and final["decode"] <= 3
    assert final["prefill"] + final["decode"] <= 6
    decisions = scaler.decide(observe(100, 200, final))
    assert any("budget" in d.reason or "clamped to max" in d.reason for d in decisions)


def test_a_shared_budget_holds_a_model_to_what_the_others_leave(opt13b_capacity: CapacityModel) -> None:
    """With several models sharing the deployment's autoscale_budget, a model's pools grow
    only into the units the others leave (``budget_units``), and say so; its own policy may
    allow far more."""
    scaler = Autoscaler(policy(), opt13b_capacity)
    sizes = {"prefill": 1, "decode": 1}
    for k in range(4):
        obs = observe(10 + 10 * k, 200, sizes)
        decisions = scaler.decide(Observation(**{**obs.__dict__, "budget_units": 5}))
        sizes = {d.role: d.target for d in decisions}
    assert sum(sizes.values()) == 5, sizes
    assert any("the other models leave" in d.reason for d in decisions)
    unbounded = run(Autoscaler(policy(), opt13b_capacity), [200] * 4, {"prefill": 1, "decode": 1})
    assert sum(unbounded[-1].values()) > 5


def test_noise_around_a_steady_load_moves_nothing(opt13b_capacity: CapacityModel) -> None:
    # Arrivals that wander +-10% about 40 req/s: once grown, neither pool reverses direction.
    scaler = Autoscaler(policy(), opt13b_capacity)
    history = run(scaler, [36, 44, 40, 38, 42] * 40, {"prefill": 1, "decode": 1})
    settled = history[30:]
    for role in ("prefill", "decode"):
        sizes = [h[role] for h in settled]
        moves = [b - a for a, b in zip(sizes, sizes[1:]) if b != a]
        reversals = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
        assert reversals == 0, (role, sizes)


def test_a_backlog_being_cleared_adds_no_worker() -> None:
    scaler = Autoscaler(policy(latency_model=None), None)

    def prefill_target(t: float, ttft_met: float, queued: int) -> int:
        obs = observe(t, 5, {"prefill": 2, "decode": 2}, ttft_met=ttft_met)
        pools = {**obs.pools, "prefill": PoolObservation(ready=2, queued=queued)}
        decisions = scaler.decide(Observation(**{**obs.__dict__, "pools": pools}))
        return next(d.target for d in decisions if d.role == "prefill")

    assert prefill_target(10, 1.0, 20_000) == 2
    # Half the first tokens were late, but the queue is shrinking: the late ones were queued
    # before, and a new worker would not take them.
    assert prefill_target(20, 0.5, 12_000) == 2
    # Late again and the queue grows: the pool does not keep up.
    assert prefill_target(30, 0.5, 15_000) == 3


def test_reserve_sizes_for_the_share_of_requests_not_the_busiest_interval(opt13b_capacity: CapacityModel) -> None:
    quiet = Load(50, 5.0, 800, 800**2, 200)
    spike = Load(300, 30.0, 800, 800**2, 200)
    spike_alone = opt13b_capacity.workers("prefill", spike, 0.05)
    # One 10 s spike among 25 minutes of quiet holds 4% of the requests: within a 5% allowance
    # the pool is sized for the quiet load, not the spike.
    rare = opt13b_capacity.reserve("prefill", [quiet] * 150 + [spike], 0.05)
    assert rare < spike_alone
    assert rare <= opt13b_capacity.workers("prefill", quiet, 0.05) + 1
    # The same spike among 1 minute of quiet holds half the requests: it must be served.
    common = opt13b_capacity.reserve("prefill", [quiet] * 6 + [spike], 0.05)
    assert common > rare and common >= spike_alone - 1


def test_the_error_budget_spreads_a_debt_over_the_rest_of_the_period() -> None:
    budget = ErrorBudget(attainment=0.9, period_s=3600)
    budget.record(10, 1000, 0)
    budget.record(20, 1000, 600)  # a burst: 30% of the period's requests so far missed
    # 100 req/s for the rest of the hour: the 600 misses are repaid over ~358,000 requests,
    # not the next horizon's 7,000 (which would plan for the 1% floor).
    share = budget.miss_share(20, 70, 7000)
    assert 0.05 < share < 0.1
    # A debt larger than the whole period allows still plans for the floor.
    budget.record(30, 1000, 50_000)
    assert budget.miss_share(30, 70, 7000) == pytest.approx(0.01)
    # The next period starts with the whole budget: the target's own share again.
    budget.record(3620, 1000, 0)
    assert budget.miss_share(3620, 70, 7000) == pytest.approx(0.1, abs=0.005)
