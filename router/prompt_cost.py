"""What computing a prompt adds to an engine step, fitted to the prefills the router times.

The router times a prompt from its call to the prefill worker until its first token, on a
worker with nothing else queued, counting the tokens the engine computed (a prompt's tokens less
those found in its prefix cache or loaded from a KV pool; a prompt fetched from another host's
pool is timed as a fetch instead: router/pool_fetch.py). That time is
``fixed + linear x tokens + quadratic x tokens^2``: the fixed part is the engine step's own
overhead (scheduling, sampling, the Python around the forward pass, about 8 ms on one CPU core
for the built-in model) and the call's round trip; the quadratic part is attention over the
prompt. A prompt that joins a decode engine's step adds
only the parts that grow with its length: that step pays its fixed overhead anyway. Dividing the
whole time by the tokens, as the guard did until 2026-12-05, charged a 400-token prompt about
twice its stall (the profile in ``cluster/placement/examples/cpu-hosts/tiny-cpu-core.profile.yaml``:
22 ms timed, 14 ms of it growing with the prompt).

The fit is least squares over the last :data:`_WINDOW` timings, the quadratic term dropped where
it comes out negative; until the timings span prompt lengths at least :data:`_MIN_SPREAD` apart
(or while a fit comes out negative), a prompt's stall is the timings' seconds per token
(total over total), which overstates it, the safe side for the guard. A queue of prompts ahead
of a request on a prefill worker is timed at that rate too: each of them pays its fixed part.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# The timings the fit is made of: the most recent, so it follows the machine's speed.
_WINDOW = 64
# Timings needed, and the ratio of the longest prompt timed to the shortest, before a fit.
_MIN_SAMPLES = 8
_MIN_SPREAD = 2.0


class PromptCost:
    """Seconds a prompt of ``tokens`` stalls an engine step, from ``timed`` prefills."""

    def __init__(self) -> None:
        self._timings: deque[tuple[int, float]] = deque(maxlen=_WINDOW)  # (tokens computed, seconds)
        # (the whole prompt's tokens, seconds): a queue counts whole prompts, cached parts included.
        self._prompts: deque[tuple[int, float]] = deque(maxlen=_WINDOW)
        # (fixed, linear, quadratic): seconds, per token and per token squared; None until a fit holds.
        self._fit: tuple[float, float, float] | None = None

    @property
    def known(self) -> bool:
        return bool(self._timings)

    def timed(self, tokens: int, seconds: float, prompt_tokens: int | None = None) -> None:
        """A prompt whose engine computed ``tokens`` of its ``prompt_tokens`` (default: all) took
        ``seconds`` to its first token, nothing queued with it."""
        self._timings.append((tokens, seconds))
        self._prompts.append((prompt_tokens or tokens, seconds))
        self._fit = self._fitted()

    def stall_s(self, tokens: int) -> float:
        """Seconds a prompt of ``tokens`` adds to the step that computes it (0 before any
        timing: callers check :attr:`known`)."""
        if self._fit is None:
            return tokens * _per_token(self._timings)
        _, linear, quadratic = self._fit
        return tokens * linear + tokens * tokens * quadratic

    def prefill_s(self, tokens: int) -> float:
        """Seconds a prefill worker with nothing else queued takes to compute a prompt of
        ``tokens`` to its first token: the fit's fixed part and growth (before a fit, the
        timings' seconds per token)."""
        if self._fit is None:
            return tokens * _per_token(self._timings)
        return self._fit[0] + self.stall_s(tokens)

    def at_least_s(self, tokens: int) -> float:
        """How long ``tokens`` of queued prompts (whole prompts, as a queue counts them) take at the
        least: the timings' seconds per whole prompt's token, fixed overheads included (each
        queued prompt pays its own; the stall, which a decode step adds to its own fixed
        overhead, does not)."""
        return tokens * _per_token(self._prompts)

    def _fitted(self) -> tuple[float, float, float] | None:
        if len(self._timings) < _MIN_SAMPLES:
            return None
        tokens = np.array([timing[0] for timing in self._timings], dtype=float)
        seconds = np.array([timing[1] for timing in self._timings])
        if tokens.max() < _MIN_SPREAD * tokens.min():
            return None
        for growth in ((tokens, tokens * tokens), (tokens,)):
            fit = _least_squares(tokens, seconds, growth, fixed=True)
            if fit is not None and fit[0] < 0.0:  # growth fits, the fixed part comes out negative
                fit = _least_squares(tokens, seconds, growth, fixed=False)
            if fit is not None:
                return fit
        return None


def _least_squares(
    tokens: "np.ndarray", seconds: "np.ndarray", growth: tuple["np.ndarray", ...], fixed: bool
) -> tuple[float, float, float] | None:
    """(fixed, linear, quadratic) fitted with the ``growth`` columns (and a constant, if
    ``fixed``); None where a part that grows with the prompt comes out negative."""
    columns = ((np.ones_like(tokens),) if fixed else ()) + growth
    coefficients = [float(c) for c in np.linalg.lstsq(np.stack(columns, axis=1), seconds, rcond=None)[0]]
    constant = coefficients.pop(0) if fixed else 0.0
    linear, quadratic = coefficients[0], coefficients[1] if len(coefficients) > 1 else 0.0
    if min(linear, quadratic) < 0.0:
        return None
    return constant, linear, quadratic


def _per_token(timings: "deque[tuple[int, float]]") -> float:
    """Seconds per token over ``timings`` (total over total)."""
    tokens = sum(timing[0] for timing in timings)
    return sum(timing[1] for timing in timings) / tokens if tokens else 0.0
