"""The SLO's error budget: how many misses the attainment target still allows.

An SLO of 90% attainment is judged over a window (an hour by default), not interval by
interval. A cluster that plans every interval for 90% spends none of the budget a quiet stretch
leaves unspent, and a static deployment sized for the hour spends it all at the peak; sized
interval by interval for a fixed share, an autoscaler either wastes GPUs or misses the target.
So the autoscaler plans each interval for the share of misses the window can still afford,
spread over the requests the next planning horizon will bring: looser after a clean stretch,
tighter after a bad one, never looser than ``max_factor`` times the target's own share (a
burst must not spend the whole budget) and never planning for perfection (which no queue
delivers, and would size for the unboundedly rare).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ErrorBudget:
    attainment: float
    window_s: float
    max_factor: float = 2.0
    _history: deque[tuple[float, int, int]] = field(default_factory=deque)

    @property
    def nominal(self) -> float:
        return 1 - self.attainment

    def record(self, time_s: float, judged: int, missed: int) -> None:
        """Requests judged against the SLO in an interval ending at ``time_s``, and misses."""
        self._history.append((time_s, judged, missed))
        while self._history and self._history[0][0] <= time_s - self.window_s:
            self._history.popleft()

    def miss_share(self, expected: float) -> float:
        """Share of the next ``expected`` requests that may miss and keep the window on target."""
        if self.window_s <= 0 or expected <= 0:
            return self.nominal
        judged = sum(j for _, j, _ in self._history)
        missed = sum(m for _, _, m in self._history)
        left = self.nominal * (judged + expected) - missed
        return min(max(left / expected, self.nominal / 10), self.nominal * self.max_factor)
