"""Rebalancing's plan (router/rebalancer.py): which requests leave an overfull decode worker.

The moves themselves run on real engines in tests/test_live_migration.py; here, the choice over
the states a pool can be in, and the config that switches it on.
"""

from __future__ import annotations

import pytest

from duet.config import ConfigError, parse_config
from duet.router.lifecycle import Decoding
from duet.router.pools import PoolMember
from duet.router.rebalancer import plan_moves

WORKERS = {name: PoolMember(name, actor=None) for name in ("decode-0", "decode-1", "decode-2")}


def _rounds(*held: tuple[str, int]) -> list[Decoding]:
    """Decode rounds, one per (worker, context tokens), with ids r0, r1, ..."""
    return [Decoding(f"r{i}", WORKERS[worker], engine=None, context_tokens=tokens) for i, (worker, tokens) in enumerate(held)]


def test_the_fullest_worker_gives_up_its_longest_requests_down_to_the_mean() -> None:
    rounds = _rounds(("decode-0", 3000), ("decode-0", 500), ("decode-0", 2000), ("decode-0", 1500), ("decode-1", 800))
    # decode-0 at 0.70 against a mean of 0.40: 3/7 of its 7,000 context tokens (3,000) should go.
    assert plan_moves({"decode-0": 0.7, "decode-1": 0.1}, rounds, gap=0.2) == ("decode-0", ["r0"])
    # At 0.9 against 0.5, 4/9 of 7,000 (3,111): the longest, then whatever still fits.
    assert plan_moves({"decode-0": 0.9, "decode-1": 0.1}, rounds, gap=0.2) == ("decode-0", ["r0"])
    # Three workers, mean 0.4: 0.5/0.9 of 7,000 (3,889): 3,000, then 500 (2,000 and 1,500 overshoot).
    assert plan_moves({"decode-0": 0.9, "decode-1": 0.2, "decode-2": 0.1}, rounds, gap=0.2) == ("decode-0", ["r0", "r1"])


def test_nothing_moves_below_the_gap_or_when_one_request_would_only_move_the_peak() -> None:
    rounds = _rounds(("decode-0", 3000), ("decode-1", 1000))
    assert plan_moves({"decode-0": 0.5, "decode-1": 0.3}, rounds, gap=0.2) is None  # 0.1 above the mean
    # One long request alone on the fullest worker: moving it makes the other one the fullest.
    assert plan_moves({"decode-0": 0.6, "decode-1": 0.0}, rounds, gap=0.2) is None
    assert plan_moves({"decode-0": 0.9}, rounds, gap=0.2) is None  # no other worker to take it
    # The fullest worker runs none of this front door's requests (another front door's): none to move.
    assert plan_moves({"decode-0": 0.1, "decode-1": 0.9}, _rounds(("decode-0", 100)), gap=0.2) is None


def test_rebalancing_needs_disaggregated_serving(duet_config) -> None:
    """Either transport moves requests with their KV (nixl pulls it, nccl pushes it); colocated
    workers have no decode pool of their own to rebalance."""
    data = duet_config.model_dump()
    data["router"]["rebalance_kv_gap"] = 0.25
    assert parse_config(data, "test").router.rebalance_kv_gap == 0.25
    data["kv_transfer"]["transport"] = "nccl"
    assert parse_config(data, "test").router.rebalance_kv_gap == 0.25
    data["mode"] = "colocated"
    with pytest.raises(ConfigError, match="router.rebalance_kv_gap: rebalancing moves requests with their KV"):
        parse_config(data, "test")


def test_a_request_that_just_moved_in_stays_a_while() -> None:
    """No ping-pong: a round that arrived by a move after ``settled_before`` is not moved again;
    once settled, it may move like any other."""
    rounds = [
        Decoding("r0", WORKERS["decode-0"], engine=None, context_tokens=1000, moved_in_at=100.0),
        Decoding("r1", WORKERS["decode-0"], engine=None, context_tokens=500),
    ]
    usage = {"decode-0": 0.9, "decode-1": 0.0, "decode-2": 0.0}  # 2/3 of its 1,500 tokens should go
    assert plan_moves(usage, rounds, gap=0.2) == ("decode-0", ["r0"])
    assert plan_moves(usage, rounds, gap=0.2, settled_before=90.0) == ("decode-0", ["r1"])
    assert plan_moves(usage, rounds, gap=0.2, settled_before=110.0) == ("decode-0", ["r0"])


def test_requests_moving_together_over_a_push_transport_are_spread_over_the_targets() -> None:
    """With a push transport (nccl) each moving request's target is picked before its KV leaves;
    while one is being given up it counts as its target's, so the decode policy spreads twelve
    requests leaving a drained worker at once over both others: each second pick goes to the
    worker the one before did not take. (Picked from the same state, they went wherever the
    random tie-break sent them, all twelve to one worker at times.)"""
    import asyncio

    from duet.router.lifecycle import RequestLifecycle
    from duet.router.pools import WorkerPool
    from duet.router.worker_engines import MigrationTicket

    targets: list[str] = []

    class _LeavingEngine:
        """The drained worker's engine front end, as the lifecycle calls it: gives each request up."""

        async def migrate_out(self, request_id: str, target: PoolMember | None = None) -> MigrationTicket:
            assert target is not None, "a push transport names the target"
            targets.append(target.name)
            await asyncio.sleep(0.01)  # the engine core's answer comes later: all are asked first
            return MigrationTicket("decode-0", [1, 2], {"p2p_transfer_id": request_id}, target.name, target.engine)

    members = [PoolMember(f"decode-{i}", actor=None, state="ready") for i in range(3)]
    leaving = members[0]
    leaving.state = "draining"
    lifecycle = RequestLifecycle(WorkerPool("prefill"), WorkerPool("decode", members=members), prefill_pushes_kv=True)
    for i in range(12):
        lifecycle._decoding[f"r{i}"] = Decoding(f"r{i}", leaving, _LeavingEngine(), context_tokens=1000)
    assert asyncio.run(lifecycle.migrate(leaving)) == 12
    assert all(first != second for first, second in zip(targets[::2], targets[1::2])), targets
    assert all(member.assigned == 0 for member in members), "an assignment outlived its move"
