"""How many workers a forecast load needs, from the placement optimizer's latency model.

Each phase may let a given share of requests miss its target (the autoscaler passes half of
what the SLO's error budget allows right now: with a 90% attainment target and no misses
spent, 5% may miss TTFT and 5% TPOT), and is sized with the queueing model that fits it:

- **Prefill** is a queue served by ``n`` workers that the router keeps evenly loaded: an M/G/n
  queue. Erlang's C formula gives the chance a request waits at all, and the wait beyond that is
  about exponential with rate ``(n*mu - lambda) * 2 / (1 + cs2)`` (the Allen-Cunneen correction
  for service times that vary: ``cs2`` is their squared coefficient of variation, which prompt
  lengths drive). The pool needs the smallest ``n`` for which the chance of waiting longer than
  the TTFT target leaves for queueing stays inside the allowance. The mean service time is exact
  for the latency model's features: ``prefill_latency_s(E[L], E[L**2])``.
- **Decode** holds every running request in a batch: by Little's law ``m = lambda * (output - 1)
  * step`` requests run at once, and the number running varies about as a Poisson count does.
  The largest batch whose step stays inside the TPOT target and whose KV fits sets what one
  worker holds; the pool needs room for ``m`` plus the allowance's quantile of its spread.

Both give the share of requests a pool of a given size serves late, so a pool can also be sized
for a *history* of loads (:meth:`CapacityModel.reserve`): the smallest pool that would have kept
the late share of all their requests within the allowance, which is what holds the pool between
bursts shorter than a worker's start-up.

``headroom`` scales what the model says one worker does, for what it does not know (the
serving path's CPU, a worse-than-modelled burst); the reactive correction in
:mod:`duet.cluster.autoscaler.core` covers the rest. DistServe sizes prefill with the M/D/1
model of one instance; a pool behind a least-loaded router waits far less than ``n`` separate
queues would, which is why the pool is modelled whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from duet.cluster.autoscaler.policy import SloProfile
from duet.cluster.placement.latency_model import EnginePerf

_MAX_WORKERS = 4096


@dataclass(frozen=True)
class Load:
    """One interval's load, as sizing sees it."""

    arrivals: int
    rate: float
    prompt_mean: float
    prompt_mean_sq: float
    output_mean: float


@dataclass(frozen=True)
class Sizing:
    workers: int
    why: str


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits, in an M/M/n queue with ``offered = lambda / mu`` (< n)."""
    blocking = 1.0
    for k in range(1, servers + 1):  # Erlang B by its recurrence, then C from B
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


@dataclass(frozen=True)
class CapacityModel:
    prefill: EnginePerf
    decode: EnginePerf
    slo: SloProfile
    headroom: float
    max_num_seqs: int = 256

    def prefill_workers(self, rate: float, prompt_mean: float, prompt_mean_sq: float, miss_allowance: float) -> Sizing:
        """Prefill workers for ``rate`` requests/s of prompts with mean length ``prompt_mean``
        and mean squared length ``prompt_mean_sq``, letting ``miss_allowance`` of them wait
        past the TTFT target."""
        if rate <= 0:
            return Sizing(0, "no arrivals")
        service = self._prefill_service_s(prompt_mean, prompt_mean_sq)
        workers = max(1, math.floor(rate * service) + 1)
        while workers < _MAX_WORKERS and self.prefill_late(workers, rate, prompt_mean, prompt_mean_sq) > miss_allowance:
            workers += 1
        return Sizing(
            workers,
            f"{rate:.2f} req/s x {prompt_mean:.0f}-token prompts ({service * 1000:.0f} ms each): "
            f"{rate * service:.1f} workers busy, {workers} keep waits past "
            f"{max(self.slo.ttft_s - service, 0.0) * 1000:.0f} ms under {miss_allowance:.1%}",
        )

    def prefill_late(self, workers: int, rate: float, prompt_mean: float, prompt_mean_sq: float) -> float:
        """The share of prompts that wait past what the TTFT target leaves for queueing, with
        ``workers`` serving ``rate`` requests/s (all of them when the pool cannot keep up)."""
        if rate <= 0:
            return 0.0
        service = self._prefill_service_s(prompt_mean, prompt_mean_sq)
        offered = rate * service
        if offered >= workers:
            return 1.0
        length_cv2 = max(prompt_mean_sq / max(prompt_mean, 1.0) ** 2 - 1, 0.0)
        slack = max(self.slo.ttft_s - service, 0.0)
        spare = workers / service - rate
        return min(1.0, erlang_c(workers, offered) * math.exp(-spare * slack * 2 / (1 + length_cv2)))

    def _prefill_service_s(self, prompt_mean: float, prompt_mean_sq: float) -> float:
        """Mean prefill time of one prompt, planned at ``headroom``."""
        return self.prefill.prefill_latency_s(prompt_mean, prompt_mean_sq) / self.headroom

    def decode_workers(self, rate: float, prompt_len: float, output_len: float, miss_allowance: float) -> Sizing:
        """Decode workers for ``rate`` requests/s producing ``output_len`` tokens each, with
        room for all running requests but in ``miss_allowance`` of intervals."""
        if rate <= 0 or output_len <= 1:
            return Sizing(0, "no tokens to decode")
        batch, step = self._largest_batch(prompt_len, output_len)
        running = rate * (output_len - 1) * step
        quantile = NormalDist().inv_cdf(1 - miss_allowance)
        workers = max(1, math.ceil((running + quantile * math.sqrt(running)) / (self.headroom * batch)))
        return Sizing(
            workers,
            f"{running:.0f} requests running; a worker holds {batch} at {step * 1000:.0f} ms/step",
        )

    def decode_late(self, workers: int, rate: float, prompt_len: float, output_len: float) -> float:
        """The chance that more requests run than ``workers`` hold (the inverse of
        :meth:`decode_workers`), with the running count spread as a Poisson count is."""
        if rate <= 0 or output_len <= 1:
            return 0.0
        batch, step = self._largest_batch(prompt_len, output_len)
        running = rate * (output_len - 1) * step
        return 1 - NormalDist().cdf((workers * self.headroom * batch - running) / math.sqrt(running))

    def reserve(self, role: str, history: Sequence[Load], miss_allowance: float) -> int:
        """The smallest pool that would have served ``history`` (one load per interval,
        weighted by its arrivals) with at most ``miss_allowance`` of the requests late.

        Bursts shorter than a worker's start-up are over before workers started for them
        serve, so the pool held between them is what meets them: a static pool for the recent
        past, sized by the share of its requests the SLO lets miss rather than by its busiest
        interval."""
        weight = sum(load.arrivals for load in history)
        if weight == 0:
            return 0

        def late(workers: int) -> float:
            return sum(load.arrivals * self.late_share(role, workers, load) for load in history) / weight

        low, high = 0, max(self.workers(role, load, miss_allowance) for load in history)
        while low < high:  # the late share falls as the pool grows: bisect
            middle = (low + high) // 2
            low, high = (low, middle) if late(middle) <= miss_allowance else (middle + 1, high)
        return low

    def workers(self, role: str, load: Load, miss_allowance: float) -> int:
        """The pool ``role`` needs for ``load`` with ``miss_allowance`` of requests late."""
        if role == "prefill":
            return self.prefill_workers(load.rate, load.prompt_mean, load.prompt_mean_sq, miss_allowance).workers
        return self.decode_workers(load.rate, load.prompt_mean, load.output_mean, miss_allowance).workers

    def late_share(self, role: str, workers: int, load: Load) -> float:
        """The share of ``load``'s requests that ``workers`` in pool ``role`` serve late."""
        if workers <= 0:
            return 1.0 if load.rate > 0 else 0.0
        if role == "prefill":
            return self.prefill_late(workers, load.rate, load.prompt_mean, load.prompt_mean_sq)
        return self.decode_late(workers, load.rate, load.prompt_mean, load.output_mean)

    def _largest_batch(self, prompt_len: float, output_len: float) -> tuple[int, float]:
        """The largest batch within the TPOT target and the KV capacity (at least 1)."""
        context = prompt_len + output_len / 2
        kv_limit = max(1, int(self.decode.kv_capacity_tokens // max(prompt_len + output_len, 1)))
        best = (1, self.decode.decode_step_s(1, context))
        low, high = 1, min(self.max_num_seqs, kv_limit)
        while low <= high:  # the step time grows with the batch: bisect
            batch = (low + high) // 2
            step = self.decode.decode_step_s(batch, batch * context)
            if step <= self.slo.tpot_s:
                best, low = (batch, step), batch + 1
            else:
                high = batch - 1
        return best
