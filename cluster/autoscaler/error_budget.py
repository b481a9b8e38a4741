"""The SLO's error budget: how many misses the attainment target still allows.

An SLO of 90% attainment is judged over a period (an hour by default), not interval by
interval. A cluster that plans every interval for 90% spends none of the budget a quiet stretch
leaves unspent, and a static deployment sized for the hour spends it all at the peak; sized
interval by interval for a fixed share, an autoscaler either wastes GPUs or misses the target.
So the autoscaler plans each interval for the share of misses the period can still afford,
spread over the requests the rest of the period will bring (at the pace it has brought them so
far): looser after a clean stretch, tighter after a bad one. A debt is paid back over the rest
of the period, as an SRE burn-rate budget is, not within the next planning horizon: demanding
it back at once would plan for near-perfection (and hold GPUs for it) for as long as the debt
is larger than one horizon's allowance, which after one burst is most of the hour. The share
is never looser than ``max_factor`` times the target's own share (a burst must not spend the
whole budget) and never plans for perfection (which no queue delivers, and would size for the
unboundedly rare).

Periods are consecutive (the first starts with the first interval recorded), as SLO
compliance is reported per hour or per day; each starts with the whole budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ErrorBudget:
    attainment: float
    period_s: float
    max_factor: float = 2.0
    judged: int = 0
    missed: int = 0
    _start_s: float | None = None

    @property
    def nominal(self) -> float:
        return 1 - self.attainment

    def record(self, time_s: float, judged: int, missed: int) -> None:
        """Requests judged against the SLO in an interval ending at ``time_s``, and misses."""
        if self._start_s is None:
            self._start_s = time_s
        elif self.period_s > 0 and time_s > self._start_s + self.period_s:
            self._start_s += self.period_s * ((time_s - self._start_s) // self.period_s)
            self.judged = self.missed = 0
        self.judged += judged
        self.missed += missed

    def miss_share(self, time_s: float, horizon_s: float, expected: float) -> float:
        """Share of the requests still to come in this period that may miss and keep it on
        target; ``expected`` requests are forecast over the next ``horizon_s``."""
        if self.period_s <= 0 or self._start_s is None:
            return self.nominal
        rest = max(expected, self._pace(time_s, horizon_s, expected) * self._remaining_s(time_s, horizon_s))
        if rest <= 0:
            return self.nominal
        left = self.nominal * (self.judged + rest) - self.missed
        return min(max(left / rest, self.nominal / 10), self.nominal * self.max_factor)

    def _pace(self, time_s: float, horizon_s: float, expected: float) -> float:
        """Requests judged per second so far this period (the forecast's, before any)."""
        assert self._start_s is not None
        elapsed = time_s - self._start_s
        return self.judged / elapsed if elapsed > 0 and self.judged else expected / horizon_s

    def _remaining_s(self, time_s: float, horizon_s: float) -> float:
        """Seconds left in the period, at least one planning horizon."""
        assert self._start_s is not None
        return max(self._start_s + self.period_s - time_s, horizon_s)
