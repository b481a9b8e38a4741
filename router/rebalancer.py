"""Rebalancing the decode pool: a worker whose KV cache is far fuller than the others' hands its
longest requests on with their KV (``router.rebalance_kv_gap``; off by default).

Where a request decodes is decided once, when it arrives, on the load of that moment; a decode
worker that got the long requests keeps them, and its steps stay slower (attention reads every
token of every context each step) while another worker idles. Llumnix moves running requests
to even this out; duet does it with the move a drain makes (router/lifecycle.py,
worker_runtime/kv_migration.py): the engine gives the request up between two steps, another
decode worker pulls its KV and decodes on, and the client's stream only pauses.

Every ``rebalance_interval_s`` each front door asks every ready decode engine for its KV cache
use. When the fullest is ``rebalance_kv_gap`` above the pool's mean, the front door moves its
own longest requests off it, as many as carry that worker's excess (by context length, each
front door its share), never so many that the worker would fall below the mean: a single
request too large to move without making its target the fullest stays. A request that arrived
by a move stays where it is for ``_SETTLE_INTERVALS`` rounds: with a small gap, the noise in two
workers' use after a move would otherwise send requests back and forth, each move a stall.
"""

from __future__ import annotations

import asyncio
import logging
import time

from duet.router.lifecycle import Decoding, RequestLifecycle

logger = logging.getLogger(__name__)

# A decode engine that does not say how full it is within this is left out of that comparison.
_PING_TIMEOUT_S = 5.0
# Rebalancing rounds a moved request stays on its new worker before it may move again.
_SETTLE_INTERVALS = 5


def plan_moves(
    kv_usage: dict[str, float], decoding: list[Decoding], gap: float, settled_before: float | None = None
) -> tuple[str, list[str]] | None:
    """Which of ``decoding`` (this front door's decode rounds) to move, and off which worker:
    None when no worker's KV cache use (``kv_usage``, by worker name, 0 to 1) is ``gap`` above
    the pool's mean, or no request of this front door can carry the excess without overshooting.

    The rounds on the fullest worker are taken longest first while their contexts add up to at
    most its excess share of them: excess / use, the fraction of its KV that would bring it to
    the mean. Rounds that moved in after ``settled_before`` (a monotonic time) are not moved."""
    if len(kv_usage) < 2:
        return None
    mean = sum(kv_usage.values()) / len(kv_usage)
    fullest = max(kv_usage, key=lambda name: kv_usage[name])
    excess = kv_usage[fullest] - mean
    if excess < gap:
        return None
    on_fullest = sorted(
        (round_ for round_ in decoding if round_.worker.name == fullest), key=lambda round_: round_.context_tokens, reverse=True
    )
    budget = sum(round_.context_tokens for round_ in on_fullest) * excess / kv_usage[fullest]
    chosen: list[str] = []
    for round_ in on_fullest:
        settling = settled_before is not None and round_.moved_in_at is not None and round_.moved_in_at > settled_before
        if round_.context_tokens <= budget and not settling:
            chosen.append(round_.request_id)
            budget -= round_.context_tokens
    return (fullest, chosen) if chosen else None


class Rebalancer:
    """Runs :func:`plan_moves` over ``lifecycle``'s decode pool every ``interval_s``."""

    def __init__(self, lifecycle: RequestLifecycle, gap: float, interval_s: float) -> None:
        self.lifecycle = lifecycle
        self.gap = gap
        self.interval_s = interval_s
        self.moved = 0  # requests this front door began to move

    async def run(self) -> None:
        """Rebalance until cancelled; a failed round is logged and the next one tried."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.moved += await self.rebalance()
            except Exception as error:  # a worker that went away mid-round: the next round sees
                logger.warning("rebalancing the decode pool: %s: %s", type(error).__name__, error)

    async def rebalance(self) -> int:
        """One comparison, and the moves it calls for; returns how many requests began to move.

        The engines are asked for their use here, not read from the health watcher's last
        ping: a round must see the effect of the previous round's moves, which a ping up to
        ``health_interval_s`` old may not (and with front doors apart, only the control plane
        pings)."""
        pool = self.lifecycle.decode_pool
        ready = [member for member in pool.ready() if member.engine is not None]
        if len(ready) < 2:
            return 0
        answers = await asyncio.gather(
            *(asyncio.wait_for(member.engine.ping(), _PING_TIMEOUT_S) for member in ready), return_exceptions=True
        )
        kv_usage = {member.name: answer[0] for member, answer in zip(ready, answers) if not isinstance(answer, BaseException)}
        settled_before = time.monotonic() - _SETTLE_INTERVALS * self.interval_s
        plan = plan_moves(kv_usage, self.lifecycle.decoding(), self.gap, settled_before)
        if plan is None:
            return 0
        fullest, request_ids = plan
        worker = pool.find(fullest)
        if worker is None or worker.state != "ready":
            return 0
        moved = await self.lifecycle.migrate(worker, request_ids)
        logger.info(
            "rebalancing: %s uses %.0f%% of its KV cache against the pool's %.0f%%; moved %d of %d requests off it",
            fullest, kv_usage[fullest] * 100, sum(kv_usage.values()) / len(kv_usage) * 100, moved, len(request_ids),
        )
        return moved
