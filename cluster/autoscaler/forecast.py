"""The arrival-rate forecast the predictive sizing plans for.

Holt's smoothing with a damped trend (Gardner's: each interval ahead adds ``phi`` times the
last one's share of the trend, so a projection never runs further than ``phi / (1 - phi)``
intervals of trend however far ahead it looks) projects the rate to when a worker started now
would be serving: an undamped trend, extrapolated over a minute of start-up from the first ten
seconds of a burst, would ask for several times the burst. The forecast never drops below the mean rate of the recent window (as long as
a worker takes to start), because smoothing forgets a burst within a few intervals while the
pool must still clear what the burst left queued. Shorter bursts than a worker's start-up cannot
be met by starting workers anyway: queues absorb them, and sizing for their peak would only hold
idle workers through the scale-down window. Prompt and output lengths are smoothed means.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Ewma:
    alpha: float
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value


@dataclass
class RateForecast:
    window_s: float
    level_alpha: float = 0.5
    trend_beta: float = 0.3
    trend_damping: float = 0.8  # phi, per interval
    level: float | None = None
    trend: float = 0.0  # requests/s per second
    interval_s: float = 1.0
    _recent: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, time_s: float, rate: float, interval_s: float) -> None:
        """One interval's measured arrival rate (requests/s), ending at ``time_s``."""
        self.interval_s = interval_s
        if self.level is None:
            self.level = rate
        else:
            previous = self.level
            self.level = self.level_alpha * rate + (1 - self.level_alpha) * (self.level + self.trend * interval_s)
            self.trend = self.trend_beta * (self.level - previous) / interval_s + (1 - self.trend_beta) * self.trend
        self._recent.append((time_s, rate))
        while self._recent and self._recent[0][0] <= time_s - self.window_s:
            self._recent.popleft()

    def predict(self, horizon_s: float) -> float:
        """The rate to plan for ``horizon_s`` from now (requests/s)."""
        if self.level is None:
            return 0.0
        phi, steps = self.trend_damping, horizon_s / self.interval_s
        damped_steps = phi * (1 - phi**steps) / (1 - phi)
        projected = self.level + self.trend * self.interval_s * damped_steps
        recent = sum(rate for _, rate in self._recent) / len(self._recent) if self._recent else 0.0
        return max(projected, recent, 0.0)
