"""The autoscaler's decisions: observations in, a target size per pool (with its reason) out.

This is a pure function of what it is shown and when, so the same object drives the live cluster
(:mod:`duet.cluster.autoscaler.live`, wall clock) and a replay on the simulated backend
(:mod:`duet.cluster.autoscaler.replay`, a simulated clock that runs an hour in seconds).

Each interval, per pool:

1. **Predictive**: forecast the arrival rate for when a worker started now would serve
   (``startup_s`` ahead). With the latency model
   (:class:`~duet.cluster.autoscaler.capacity.CapacityModel`), the pool wanted is the smallest
   that would have served the last ``scale_down.delay_s`` of load *and* the forecast horizon
   with no more than the affordable share of requests late, times a per-pool correction. A
   burst shorter than a worker's start-up is over before workers started for it serve: the pool
   held between bursts is what meets them, so it is sized by the share of the window's
   requests the SLO lets miss, not by the window's busiest interval.
2. **Reactive**: when the pool's SLO share (TTFT for prefill, TPOT for decode) falls under the
   target, or its queue says it soon will (prompts waiting past the TTFT target; decode requests
   waiting for KV room or KV nearly full), ask for one more worker than it has and raise the
   correction so the prediction stops undershooting; the correction decays when all is well.
   Misses from a backlog the pool is already clearing are not pressure: queued work stays with
   the worker it was routed to, so a new worker would not clear it.
3. **Guard rails**: clamp to the pool's min and max and the total budget (shared by several
   models: :mod:`duet.cluster.autoscaler.shared_budget`, which may ask a model meeting its SLO
   to give a unit back at once to one missing its own); grow at once
   (workers still starting count as capacity, so a slow start is not answered with more
   starts); shrink only after a whole ``scale_down.delay_s`` has been seen, never below a size
   wanted in the last ``startup_s + settle_s`` (a growth cannot be judged before its workers
   serve), nor below one observed misses asked for within ``scale_down.delay_s``, nor below
   the size that keeps the late share within *half* the allowance the pool grows for (a band
   in which the forecast's noise moves nothing); by ``scale_down.step`` at a time, never while
   the pool is under pressure, and never while metrics are missing or stale. Shrinking is
   always a drain (the driver's job).

Dynamo's Planner users report flapping, scale-down killing requests and shrinking on missing
metrics; the holds and the band, drain-only removal and the stale hold are the answers to each.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from duet.cluster.autoscaler.capacity import CapacityModel, Load
from duet.cluster.autoscaler.error_budget import ErrorBudget
from duet.cluster.autoscaler.forecast import Ewma, RateForecast
from duet.cluster.autoscaler.policy import ROLES, AutoscalePolicy, SloProfile

# Fewer completions than this in an interval say nothing about attainment.
_MIN_SAMPLES = 5
# KV usage of the decode pool above which new requests soon wait for room.
_KV_PRESSURE = 0.9
# How far the correction falls back towards 1 per calm interval, and its ceiling.
_CORRECTION_DECAY = 0.95
_CORRECTION_MAX = 4.0
# The SLO shortfall a pool whose queue says it is about to miss counts at least, for a shared
# budget's arbitration (shared_budget.py): it is short, though its attainment does not show it yet.
_QUEUE_SHORTFALL = 0.01


@dataclass(frozen=True)
class PoolObservation:
    ready: int
    starting: int = 0
    draining: int = 0
    # Prefill: prompt tokens queued or being prefilled. Decode: requests waiting for KV room.
    queued: int = 0
    # Decode: mean KV cache usage of the ready workers (0..1).
    kv_usage: float = 0.0

    @property
    def active(self) -> int:
        """Workers that count towards the pool's size: serving or about to."""
        return self.ready + self.starting


@dataclass(frozen=True)
class Observation:
    """What the cluster did over the ``window_s`` seconds ending at ``time_s``."""

    time_s: float
    window_s: float
    arrivals: int
    prompt_tokens: int
    # Sum of the squared prompt lengths: their spread is what makes a prefill queue wait.
    prompt_tokens_sq: int
    # Requests that got their first token in the window, and how many met the TTFT target.
    first_tokens: int
    ttft_met: int
    # Requests that finished in the window, their output tokens, and how many met the TPOT target.
    finished: int
    output_tokens: int
    tpot_met: int
    # Requests still waiting for their first token longer than the TTFT target.
    ttft_overdue: int
    pools: dict[str, PoolObservation]
    # False when the metrics could not be read; with ``metrics_age_s`` past the policy's
    # ``stale_after_s`` it counts as missing too. The autoscaler then holds every pool.
    fresh: bool = True
    metrics_age_s: float = 0.0
    # Units (GPUs, or cores on CPU) this model's pools may hold now when several models share
    # the deployment's autoscale_budget: that budget less what the other models hold. None:
    # only the policy's own budget bounds them.
    budget_units: int | None = None
    # The model the shared budget holds units back for, or asks this one to give one back to
    # when ``budget_units`` is below what its pools hold ("" : none).
    budget_to: str = ""
    # Units held by this model's pools that are sized elsewhere (its encode pool,
    # encode_pool.py): every budget above is less them for prefill and decode.
    other_units: int = 0


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


@dataclass
class _PoolState:
    correction: float = 1.0
    # (time, size, observed) of each size wanted; ``observed``: asked for by misses seen.
    wanted: deque[tuple[float, int, bool]] = field(default_factory=deque)
    ready: int | None = None
    # When the pool last gained a serving worker: a backlog built up before it takes a while
    # to clear, and must not be read as a need for yet another worker.
    grew_at_s: float = -math.inf
    # The first observation: the pool is not shrunk until a whole scale-down window is seen.
    since_s: float | None = None
    # The pool's queue at the previous observation (prefill: prompt tokens; decode: requests
    # waiting for KV room), to tell a backlog that is clearing from one that is not.
    queued: int | None = None
    # (time, judged, met) of the pool's SLO share over the last start-up.
    attained: deque[tuple[float, int, int]] = field(default_factory=deque)


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy, capacity: CapacityModel | None) -> None:
        self.policy = policy
        self.slo: SloProfile = policy.slo_profile()
        self.capacity = capacity
        self.rate = RateForecast(policy.forecast_window_s)
        self.prompt_len = Ewma(0.3)
        self.prompt_sq = Ewma(0.3)
        self.output_len = Ewma(0.3)
        self.pools = {role: _PoolState() for role in ROLES}
        self.budget = ErrorBudget(self.slo.attainment, policy.error_budget_window_s)
        self.miss_share = self.budget.nominal
        # For a shared budget (shared_budget.py), after each decision: how far the model is below
        # its SLO attainment target (0: meeting it), and the units the budget kept it from.
        self.shortfall = 0.0
        self.asked = 0
        # Each interval's load over the last scale-down window, for the pools' reserve.
        self.loads: deque[tuple[float, Load]] = deque()

    def decide(self, obs: Observation) -> list[Decision]:
        """One target per pool for this observation."""
        if not obs.fresh:
            return self._hold(obs, "metrics missing: holding every pool at its size")
        if obs.metrics_age_s > self.policy.stale_after_s:
            return self._hold(obs, f"metrics {obs.metrics_age_s:.0f} s old: holding every pool at its size")
        self.rate.observe(obs.time_s, obs.arrivals / obs.window_s, obs.window_s)
        if obs.arrivals:
            self.prompt_len.update(obs.prompt_tokens / obs.arrivals)
            self.prompt_sq.update(obs.prompt_tokens_sq / obs.arrivals)
        for role in ROLES:
            state = self.pools[role]
            if state.ready is not None and obs.pools[role].ready > state.ready:
                state.grew_at_s = obs.time_s
            state.ready = obs.pools[role].ready
        if obs.finished:
            self.output_len.update(obs.output_tokens / obs.finished)
        self._remember_load(obs)
        self.budget.record(obs.time_s, obs.finished, (obs.first_tokens - obs.ttft_met) + (obs.finished - obs.tpot_met))
        horizon = self._horizon_s
        self.miss_share = self.budget.miss_share(obs.time_s, horizon, self.rate.predict(horizon) * horizon)
        self.shortfall = 0.0
        wanted = {role: self._wanted(role, obs) for role in ROLES}
        for role in ROLES:
            self.pools[role].queued = obs.pools[role].queued
        wanted, giving_back = self._within_budget(wanted, obs)
        return [self._damped(role, obs, *wanted[role], giving_back=role in giving_back) for role in ROLES]

    # ---- sizing ---------------------------------------------------------------------------

    def _wanted(self, role: str, obs: Observation) -> tuple[int, str, bool]:
        """(size wanted, why, under pressure) for ``role`` before the guard rails."""
        pool = obs.pools[role]
        state = self.pools[role]
        pressure = self._pressure(role, obs)
        need, why = self._predicted(role)
        predicted = None if need is None else math.ceil(need * state.correction - 1e-9)
        if pressure:
            settling = pool.starting > 0 or obs.time_s - state.grew_at_s < self.policy.settle_s
            reactive = pool.active if settling else pool.active + 1
            if not settling:
                state.wanted.append((obs.time_s, reactive, True))
            if need and not settling and predicted is not None and predicted < reactive:
                state.correction = min(_CORRECTION_MAX, reactive / need)
            if settling:
                pressure += " (a new worker is starting or settling)"
            return max(reactive, predicted or 0), pressure, True
        state.correction = max(1.0, state.correction * _CORRECTION_DECAY)
        if predicted is None:  # reactive only: shrink after a whole window without traffic
            if self.rate.predict(0.0) == 0:
                return self.policy.limits(role).min, "no traffic (no latency model: reactive only)", False
            return pool.active, "SLO met (no latency model: reactive only)", False
        return predicted, f"forecast {why}", False

    def _predicted(self, role: str) -> tuple[int | None, str]:
        """Workers the latency model says serve the last scale-down window and the forecast
        horizon with no more than the affordable share of requests late, and why."""
        if self.capacity is None or self.prompt_len.value is None:
            return None, ""
        allowance = self.miss_share / 2  # half the affordable misses to each phase
        ahead = self._ahead()
        workers = self._reserve(role, allowance, ahead)
        return workers, (
            f"{ahead.rate:.2f} req/s ahead ({self.capacity.workers(role, ahead, allowance)} workers alone); "
            f"{workers} serve the last {self.policy.scale_down.delay_s:.0f} s and the next {self._horizon_s:.0f} s "
            f"with under {allowance:.1%} late"
        )

    @property
    def _horizon_s(self) -> float:
        """How far ahead sizing plans: until a worker started now serves, one interval on."""
        return self.policy.startup_s + self.policy.interval_s

    def _ahead(self) -> Load:
        """The load the forecast expects over the planning horizon."""
        assert self.prompt_len.value is not None
        horizon = self._horizon_s
        rate = self.rate.predict(horizon)
        prompt = self.prompt_len.value
        output = self.output_len.value if self.output_len.value is not None else 1.0
        return Load(round(rate * horizon), rate, prompt, self.prompt_sq.value or prompt**2, output)

    def _reserve(self, role: str, allowance: float, ahead: Load) -> int:
        """The smallest pool that serves the scale-down window's load and the forecast horizon's
        (``ahead``) with at most ``allowance`` of requests late (at least one while requests come)."""
        assert self.capacity is not None
        history = [load for _, load in self.loads] + [ahead]
        return max(self.capacity.reserve(role, history, allowance), 1 if ahead.rate > 0 else 0)

    def _pressure(self, role: str, obs: Observation) -> str:
        """Why ``role`` is missing (or about to miss) the share of its SLO the error budget asks
        for now; empty when it is not, or when the misses are a backlog the pool is clearing."""
        why = self._shortfall(role, obs)
        if why and self._clearing(role, obs):
            return ""
        return why

    def _clearing(self, role: str, obs: Observation) -> bool:
        """Whether ``role``'s queue shrank since the last observation: the pool then serves
        faster than work arrives, and its misses are requests queued before, which a worker
        added now would not take (queued work stays with the worker it was routed to; new
        workers get new arrivals)."""
        before = self.pools[role].queued
        return before is not None and obs.pools[role].queued < before

    def _shortfall(self, role: str, obs: Observation) -> str:
        """Why ``role`` falls short of the share of its SLO the error budget asks for now."""
        pool = obs.pools[role]
        target = 1 - self.miss_share
        judged, met = (obs.first_tokens, obs.ttft_met) if role == "prefill" else (obs.finished, obs.tpot_met)
        recent = self._recent_attainment(role, obs.time_s, judged, met)
        if judged >= _MIN_SAMPLES and met / judged < target and recent < target:
            phase = "TTFT" if role == "prefill" else "TPOT"
            self.shortfall = max(self.shortfall, target - recent)
            return f"{phase} attainment {met / judged:.0%} (last {self.policy.startup_s:.0f} s: {recent:.0%}) < {target:.0%}"
        why = ""
        if role == "prefill" and obs.ttft_overdue >= _MIN_SAMPLES:
            why = f"{obs.ttft_overdue} requests waiting past the TTFT target"
        if role == "decode" and pool.queued and pool.kv_usage >= _KV_PRESSURE:
            why = f"KV {pool.kv_usage:.0%} full with {pool.queued} requests waiting"
        if why:  # about to miss: short of the target by at least its recent gap
            self.shortfall = max(self.shortfall, target - recent, _QUEUE_SHORTFALL)
        return why

    def _recent_attainment(self, role: str, time_s: float, judged: int, met: int) -> float:
        """``role``'s SLO share over the last ``startup_s``, this interval included.

        One bad interval in a start-up that met the target is not answered with a worker: a
        dip shorter than a start-up is over before the worker serves, and the error budget is
        spent by the hour, not by the interval."""
        attained = self.pools[role].attained
        attained.append((time_s, judged, met))
        while attained[0][0] <= time_s - max(self.policy.startup_s, self.policy.interval_s):
            attained.popleft()
        total = sum(j for _, j, _ in attained)
        return sum(m for _, _, m in attained) / total if total else 1.0

    def _within_budget(
        self, wanted: dict[str, tuple[int, str, bool]], obs: Observation
    ) -> tuple[dict[str, tuple[int, str, bool]], set[str]]:
        """Clamp to each pool's bounds, then trim the pools not under pressure (larger first)
        until the total fits the budget; never below a pool's minimum or current size. A shared
        budget below what the pools hold asks for units back (:meth:`_give_back`). Returns the
        sizes and the pools giving units back."""
        sized = {}
        for role, (size, why, pressure) in wanted.items():
            limits = self.policy.limits(role)
            clamped = min(max(size, limits.min), limits.max)
            if clamped != size:
                why += f" (clamped to {'max' if size > limits.max else 'min'} {clamped})"
            sized[role] = [clamped, why, pressure]
        self.asked = 0
        budgets = [b for b in (self.policy.budget, obs.budget_units) if b is not None]
        if not budgets:
            return {role: tuple(v) for role, v in sized.items()}, set()  # type: ignore[misc]
        budget = max(0, min(budgets) - obs.other_units)
        shared = obs.budget_units is not None and (self.policy.budget is None or obs.budget_units < self.policy.budget)
        held = {role: obs.pools[role].active for role in ROLES}
        if shared and budget < self._units(held):
            return self._give_back(sized, held, budget, obs.budget_to)
        def used() -> int:
            return self._units({role: sized[role][0] for role in ROLES})

        wanted_units = used()
        while used() > budget:
            floors = {role: max(self.policy.limits(role).min, min(held[role], sized[role][0])) for role in ROLES}
            candidates = [role for role in ROLES if sized[role][0] > floors[role]]
            if not candidates:
                break
            role = max(candidates, key=lambda r: (not sized[r][2], sized[r][0] - floors[r]))
            sized[role][0] -= 1
            reason = f"trimmed to fit the budget of {budget}{' the other models leave' if shared else ''}"
            if obs.budget_to:
                reason += f"; units held for {obs.budget_to}, further below its SLO"
            sized[role][1] = f"{sized[role][1]} ({reason})"
        self.asked = max(0, wanted_units - used())
        return {role: tuple(v) for role, v in sized.items()}, set()  # type: ignore[misc]

    def _give_back(
        self, sized: dict[str, list], held: dict[str, int], budget: int, to_model: str
    ) -> tuple[dict[str, tuple[int, str, bool]], set[str]]:
        """Shrink to a shared ``budget`` below what the pools hold: from the pools as they are
        (the model's own shrinking waits for its window), first from a pool not under pressure
        that the model wants smaller, never below a pool's minimum. The other pools hold, or
        shrink as they would."""
        sizes = dict(held)
        giving: set[str] = set()
        while self._units(sizes) > budget:
            candidates = [role for role in ROLES if sizes[role] > self.policy.limits(role).min]
            if not candidates:
                break
            role = max(candidates, key=lambda r: (not sized[r][2], sized[r][0] < held[r], sizes[r] - self.policy.limits(r).min))
            sizes[role] -= 1
            giving.add(role)
        for role in ROLES:
            if role in giving:
                because = f"giving a unit back to {to_model}, further below its SLO" if to_model else "over the shared budget"
                sized[role] = [sizes[role], f"{sized[role][1]} ({because})", sized[role][2]]
            else:
                sized[role][0] = min(sized[role][0], held[role])
        return {role: tuple(v) for role, v in sized.items()}, giving  # type: ignore[misc]

    def _units(self, sizes: dict[str, int]) -> int:
        """Units (GPUs, or cores) pools of these sizes hold."""
        return sum(size * self.policy.limits(role).units for role, size in sizes.items())

    def _remember_load(self, obs: Observation) -> None:
        """Keep this interval's load (prompt lengths as they arrived) for the scale-down window."""
        if self.prompt_len.value is None:
            return
        prompt = obs.prompt_tokens / obs.arrivals if obs.arrivals else self.prompt_len.value
        prompt_sq = obs.prompt_tokens_sq / obs.arrivals if obs.arrivals else self.prompt_sq.value or prompt**2
        output = self.output_len.value if self.output_len.value is not None else 1.0
        self.loads.append((obs.time_s, Load(obs.arrivals, obs.arrivals / obs.window_s, prompt, prompt_sq, output)))
        while self.loads[0][0] <= obs.time_s - self.policy.scale_down.delay_s:
            self.loads.popleft()

    def _damped(self, role: str, obs: Observation, size: int, why: str, pressure: bool, giving_back: bool = False) -> Decision:
        """Scale up at once; down only to what the pool keeps, a step at a time (a unit given
        back to another model of a shared budget: at once)."""
        current = obs.pools[role].active
        state = self.pools[role]
        if state.since_s is None:
            state.since_s = obs.time_s
        if giving_back:
            state.wanted.clear()  # what it wanted before is what it gives up
            state.wanted.append((obs.time_s, size, False))
            return Decision(role, current, size, why)
        state.wanted.append((obs.time_s, size, False))
        if size >= current:
            return Decision(role, current, size, why)
        if pressure:
            return Decision(role, current, current, f"{why}; not shrinking under pressure")
        window = f"{self.policy.scale_down.delay_s:.0f} s"
        if obs.time_s - state.since_s < self.policy.scale_down.delay_s:
            return Decision(role, current, current, f"{why}; holding until a whole {window} is seen")
        floor, because = max(self._kept(role, obs.time_s), self._keeps(role))
        if floor >= current:
            return Decision(role, current, current, f"{why}; holding: {because}")
        target = max(floor, size, current - self.policy.scale_down.step, self.policy.limits(role).min)
        return Decision(role, current, target, f"{why}; draining {current - target} ({because})")

    def _kept(self, role: str, time_s: float) -> tuple[int, str]:
        """The largest size the pool's recent wishes hold it at, and why.

        Without a latency model, every size wanted over ``scale_down.delay_s``. With one, the
        model's sizing already looks back over that window, so only the sizes observed misses
        asked for are kept that long (the model did not see them coming); the model's own
        wishes are kept for ``startup_s + settle_s``, as long as a growth takes to show, so a
        size is not reversed before it could be judged."""
        state = self.pools[role]
        window = self.policy.scale_down.delay_s
        while state.wanted and state.wanted[0][0] <= time_s - window:
            state.wanted.popleft()
        judged = self.policy.startup_s + self.policy.settle_s
        observed = max((size for _, size, seen in state.wanted if seen or self.capacity is None), default=0)
        modelled = max((size for at, size, _ in state.wanted if at > time_s - judged), default=0)
        if observed >= modelled:
            return observed, f"{observed} wanted in the last {window:.0f} s"
        return modelled, f"{modelled} wanted in the last {judged:.0f} s"

    def _keeps(self, role: str) -> tuple[int, str]:
        """The size the latency model keeps the pool at, and why: the one whose late share over
        the window and the horizon stays within half the allowance the pool grows for. Growing
        past one bound and shrinking past another leaves a band in which the forecast's noise
        moves nothing."""
        if self.capacity is None or self.prompt_len.value is None:
            return 0, ""
        allowance = self.miss_share / 4
        keeps = math.ceil(self._reserve(role, allowance, self._ahead()) * self.pools[role].correction - 1e-9)
        return keeps, f"{keeps} keep under {allowance:.1%} late"

    def _hold(self, obs: Observation, why: str) -> list[Decision]:
        return [Decision(role, obs.pools[role].active, obs.pools[role].active, why) for role in ROLES]
