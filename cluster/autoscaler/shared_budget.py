"""Several models' autoscalers sharing one budget of units (``autoscale_budget``).

Each model's autoscaler decides on its own (:mod:`duet.cluster.autoscaler.core`); what it may
hold is the budget less what the other models hold. That alone gives a freed unit to whichever
model asks first, and leaves a model missing its SLO waiting while another that meets its own
holds workers it could spare until its scale-down window passes. So the budget is arbitrated
by SLO shortfall, how far each model's attainment is below its target:

- free units go to the model furthest below its SLO first: a model that falls short by less
  (or not at all) may not take the units a worse-off model asked for;
- when nothing is free, a model meeting its SLO gives one unit back to a model that falls
  short and asked for more, at once (a drain, not after its scale-down window), one unit an
  interval, never below its pools' minimums. A model that itself falls short never gives, so
  two models short of their SLOs do not trade workers back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    """One model's standing in the shared budget."""

    name: str
    # Units its pools hold or are starting to hold.
    held: int
    # Units its last decision wanted beyond what the budget let it have.
    asked: int = 0
    # How far below its SLO attainment target it is (0: meeting it).
    shortfall: float = 0.0


@dataclass(frozen=True)
class BudgetShare:
    """What one model's pools may hold now, and for whom it holds back or gives back."""

    units: int
    # The model the units held back or given back go to ("" : none).
    to_model: str = ""


def share_of(total: int, me: Holder, others: list[Holder]) -> BudgetShare:
    """What ``me`` may hold of ``total`` while ``others`` hold theirs (module docstring)."""
    left = total - sum(other.held for other in others)
    worse = [other for other in others if other.asked > 0 and other.shortfall > me.shortfall]
    if not worse:
        return BudgetShare(left)
    worst = max(worse, key=lambda other: other.shortfall)
    if left <= me.held:  # nothing free
        if me.shortfall == 0 and me.held > 0:
            return BudgetShare(min(left, me.held - 1), worst.name)
        return BudgetShare(left)
    held_back = min(worst.asked, left - me.held)
    return BudgetShare(left - held_back, worst.name)
