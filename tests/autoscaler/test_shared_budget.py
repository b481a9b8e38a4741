"""Several models' autoscalers sharing one budget: arbitrated by SLO shortfall (pure: no cluster)."""

from __future__ import annotations

from dataclasses import replace

from duet.cluster.autoscaler.core import Autoscaler
from duet.cluster.autoscaler.shared_budget import BudgetShare, Holder, share_of

from test_core import observe, opt13b, policy


def test_free_units_go_to_the_model_furthest_below_its_slo():
    """Two models ask for more than the 2 free units: the one further short gets them; the
    other may not take them, and a model with nothing to ask keeps what it holds."""
    worse = Holder("chat", held=3, asked=2, shortfall=0.2)
    less = Holder("code", held=3, asked=1, shortfall=0.05)
    idle = Holder("embed", held=2)
    assert share_of(10, worse, [less, idle]) == BudgetShare(5)  # 10 - 5: both free units
    assert share_of(10, less, [worse, idle]) == BudgetShare(3, "chat")  # its own 3: held for chat
    assert share_of(10, idle, [worse, less]) == BudgetShare(2, "chat")
    assert share_of(10, idle, [replace(worse, asked=0), less]) == BudgetShare(3, "code")  # 4 free, 1 held for code
    assert share_of(10, less, [replace(worse, asked=0), idle]) == BudgetShare(5)  # nobody worse asks


def test_with_nothing_free_only_a_model_meeting_its_slo_gives_a_unit_back():
    short = Holder("chat", held=5, asked=1, shortfall=0.1)
    meeting = Holder("code", held=3)
    assert share_of(8, meeting, [short]) == BudgetShare(2, "chat")  # one unit back
    also_short = replace(meeting, shortfall=0.05)
    assert share_of(8, also_short, [short]) == BudgetShare(3)  # short itself: keeps its units
    assert share_of(8, short, [meeting]) == BudgetShare(5)  # the short one is not asked to give
    assert share_of(8, Holder("none", held=0), [short]) == BudgetShare(2, "chat")  # 3 free, 1 held for chat


def test_a_model_asked_for_a_unit_back_drains_one_at_once():
    """Inside its scale-down window (where it would hold), a model meeting its SLO whose
    share falls below what it holds drains a worker at once, saying to whom; at its share it
    holds, and when the budget trims it, it reports how many units it asked beyond it."""
    scaler = Autoscaler(policy(), opt13b())
    sizes = {"prefill": 2, "decode": 2}
    scaler.decide(replace(observe(10, 1, sizes), budget_units=4))
    held = scaler.decide(replace(observe(20, 1, sizes), budget_units=4, budget_to="chat"))
    assert all(decision.target == 2 for decision in held), held
    decisions = scaler.decide(replace(observe(30, 1, sizes), budget_units=3, budget_to="chat"))
    assert sorted(decision.target for decision in decisions) == [1, 2], decisions
    shrunk = next(decision for decision in decisions if decision.target == 1)
    assert "giving a unit back to chat" in shrunk.reason
    assert scaler.shortfall == 0.0

    busy = Autoscaler(policy(), opt13b())
    for k in range(3):
        decisions = busy.decide(replace(observe(10 + 10 * k, 200, sizes, ttft_met=0.5), budget_units=4))
    assert busy.shortfall > 0.3 and busy.asked > 0
    assert all(decision.target <= 2 for decision in decisions)  # held to its share, never drained
