"""Replay a trace against an autoscaled cluster on a simulated clock (SIMULATED engines).

The cluster is the placement simulator's (:mod:`duet.cluster.placement.simulator`: prefill
queues, KV hand-off over a link, continuous decode batching, all timed by the latency model);
this module makes its pools elastic and puts the unchanged :class:`Autoscaler` in charge. Every
``interval_s`` of simulated time the autoscaler sees the same :class:`Observation` the live
driver builds from the router, and its targets are carried out the way the pool manager does:
a new worker serves only ``startup_s`` after it was asked for; a removed worker first leaves
rotation, finishes what it holds, and only then stops costing. An hour of trace replays in
seconds, which is what lets a policy be compared with static deployments on a whole day.

A metrics outage can be injected: during it the autoscaler is shown ``fresh=False``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from duet.cluster.autoscaler.core import Autoscaler, Decision, Observation, PoolObservation
from duet.cluster.autoscaler.policy import SloProfile
from duet.cluster.placement.latency_model import EnginePerf
from duet.cluster.placement.simulator import SimConfig, SimResult, _DecodeServer, _PrefillServer, _Run
from duet.cluster.placement.trace import Trace


@dataclass(frozen=True)
class Tick:
    """One decision interval, for reports and plots."""

    time_s: float
    arrival_rate: float
    ready: dict[str, int]
    active: dict[str, int]
    units_held: int
    first_tokens: int
    ttft_met: int
    finished: int
    tpot_met: int
    fresh: bool


@dataclass
class ReplayResult:
    result: SimResult
    unit_seconds: float
    ticks: list[Tick]
    decisions: list[tuple[float, Decision]]

    def direction_changes(self, role: str) -> int:
        """How often ``role``'s pool reversed direction (grew after shrinking or the reverse)."""
        moves = [d.direction for _, d in self.decisions if d.role == role and d.direction != "hold"]
        return sum(1 for a, b in zip(moves, moves[1:]) if a != b)

    def resizes(self, role: str) -> int:
        return sum(1 for _, d in self.decisions if d.role == role and d.direction != "hold")

    def min_active_during(self, role: str, start_s: float, end_s: float) -> int:
        return min((t.active[role] for t in self.ticks if start_s <= t.time_s <= end_s), default=0)


@dataclass
class _Window:
    """Counters the next observation reports, reset at each tick."""

    arrivals: int = 0
    prompt_tokens: int = 0
    prompt_tokens_sq: int = 0
    first_tokens: int = 0
    ttft_met: int = 0
    finished: int = 0
    output_tokens: int = 0
    tpot_met: int = 0


class _ObservedRun(_Run):
    """The simulator's run, counting first tokens and completions against the SLO as they happen."""

    def __init__(self, trace: Trace, slo: SloProfile) -> None:
        super().__init__(trace, None)
        self.targets = slo
        self.window = _Window()
        self.completed = 0

    def first_token_at(self, i: int) -> None:
        super().first_token_at(i)
        self.window.first_tokens += 1
        self.window.ttft_met += self.now - self.arrival[i] <= self.targets.ttft_s
        if self.out[i] <= 1:
            self._completed(i, 0.0)

    def finished(self, i: int) -> None:
        super().finished(i)
        self._completed(i, (self.now - self.first_token[i]) / (self.out[i] - 1))

    def never(self, i: int) -> None:
        super().never(i)
        self.completed += 1

    def _completed(self, i: int, tpot: float) -> None:
        self.completed += 1
        self.window.finished += 1
        self.window.output_tokens += self.out[i]
        self.window.tpot_met += tpot <= self.targets.tpot_s


@dataclass
class _ElasticPool:
    """One pool's simulated workers: ready ones take requests, draining ones finish theirs."""

    role: str
    units: int
    make: Callable[[], object]
    ready: list = field(default_factory=list)
    starting: list[list[bool]] = field(default_factory=list)  # [cancelled] flags
    draining: list = field(default_factory=list)

    @property
    def active(self) -> int:
        return len(self.ready) + len(self.starting)

    @property
    def held(self) -> int:
        return (self.active + len(self.draining)) * self.units

    def resize(self, run: _Run, target: int, startup_s: float) -> None:
        while self.active < target:
            flag = [False]
            self.starting.append(flag)
            run.at(run.now + startup_s, self._started, flag)
        while self.active > target:
            if self.starting:  # a worker not serving yet leaves first, as in the pool manager
                self.starting.pop()[0] = True
            else:
                self.draining.append(self.ready.pop())

    def _started(self, flag: list[bool]) -> None:
        if not flag[0]:
            self.starting.remove(flag)
            self.ready.append(self.make())

    def reap(self, idle: Callable[[object], bool]) -> None:
        self.draining = [server for server in self.draining if not idle(server)]


def replay(
    trace: Trace,
    autoscaler: Autoscaler,
    prefill: EnginePerf,
    decode: EnginePerf,
    kv_bytes_per_token: int,
    transfer_bytes_per_s: float = math.inf,
    initial: dict[str, int] | None = None,
    outage: tuple[float, float] | None = None,
    cfg: SimConfig = SimConfig(),
) -> ReplayResult:
    """Serve ``trace`` with pools the autoscaler sizes; ``initial`` sizes are ready at t=0."""
    policy = autoscaler.policy
    run = _ObservedRun(trace, autoscaler.slo)
    decode_pool = _ElasticPool(
        "decode", policy.decode.units, lambda: _DecodeServer(run, decode, cfg, transfer_bytes_per_s, kv_bytes_per_token)
    )

    def to_decode(i: int) -> None:
        min(decode_pool.ready or decode_pool.draining, key=lambda d: d.load).pull(i)

    prefill_pool = _ElasticPool("prefill", policy.prefill.units, lambda: _PrefillServer(run, prefill, cfg, to_decode))
    pools = {"prefill": prefill_pool, "decode": decode_pool}
    for role, pool in pools.items():
        count = (initial or {}).get(role, policy.limits(role).min)
        pool.ready = [pool.make() for _ in range(count)]
    waiting_first: deque[int] = deque()

    def arrive(i: int) -> None:
        run.window.arrivals += 1
        run.window.prompt_tokens += run.inp[i]
        run.window.prompt_tokens_sq += run.inp[i] ** 2
        waiting_first.append(i)
        min(prefill_pool.ready, key=lambda p: p.queued_tokens).submit(i)

    for i, t in enumerate(run.arrival):
        run.at(t, arrive, i)

    ticks: list[Tick] = []
    decisions: list[tuple[float, Decision]] = []
    unit_seconds = [0.0]
    last_arrival = run.arrival[-1] if run.arrival else 0.0

    def overdue() -> int:
        while waiting_first and math.isfinite(run.first_token[waiting_first[0]]):
            waiting_first.popleft()
        late = run.now - autoscaler.slo.ttft_s
        count = 0
        for i in waiting_first:
            if run.arrival[i] > late:
                break
            count += not math.isfinite(run.first_token[i])
        return count

    def tick() -> None:
        prefill_pool.reap(lambda s: not s.busy and not s.queue)
        decode_pool.reap(lambda s: s.reserved == 0 and not s.pulls)
        held = sum(pool.held for pool in pools.values())
        unit_seconds[0] += held * policy.interval_s
        window = run.window
        fresh = not (outage and outage[0] <= run.now < outage[1])
        obs = Observation(
            time_s=run.now,
            window_s=policy.interval_s,
            arrivals=window.arrivals,
            prompt_tokens=window.prompt_tokens,
            prompt_tokens_sq=window.prompt_tokens_sq,
            first_tokens=window.first_tokens,
            ttft_met=window.ttft_met,
            finished=window.finished,
            output_tokens=window.output_tokens,
            tpot_met=window.tpot_met,
            ttft_overdue=overdue(),
            pools={
                "prefill": PoolObservation(
                    ready=len(prefill_pool.ready),
                    starting=len(prefill_pool.starting),
                    draining=len(prefill_pool.draining),
                    queued=sum(s.queued_tokens for s in prefill_pool.ready + prefill_pool.draining),
                ),
                "decode": PoolObservation(
                    ready=len(decode_pool.ready),
                    starting=len(decode_pool.starting),
                    draining=len(decode_pool.draining),
                    queued=sum(len(s.pulls) for s in decode_pool.ready),
                    kv_usage=sum(s.reserved / s.capacity for s in decode_pool.ready) / max(len(decode_pool.ready), 1),
                ),
            },
            fresh=fresh,
        )
        ticks.append(
            Tick(
                run.now, window.arrivals / policy.interval_s,
                {r: len(p.ready) for r, p in pools.items()}, {r: p.active for r, p in pools.items()},
                held, window.first_tokens, window.ttft_met, window.finished, window.tpot_met, fresh,
            )
        )
        run.window = _Window()
        for decision in autoscaler.decide(obs):
            decisions.append((run.now, decision))
            pools[decision.role].resize(run, decision.target, policy.startup_s)
        if run.now < last_arrival or run.completed < len(run.arrival):
            run.at(run.now + policy.interval_s, tick)

    run.at(policy.interval_s, tick)
    return ReplayResult(run.run(), unit_seconds[0], ticks, decisions)
