"""Sizing the encode pool (E+P+D) from the encodes in flight.

The prefill and decode pools are sized against the SLO with a latency model of the engines
(capacity.py, core.py). An encode worker's work is different: each request with new images
waits for one encode request, and what that wait costs is the encode pool's queue. So the pool
is sized by Little's law: the seconds requests waited on the encode pool over an interval,
divided by the interval's length, is the mean number of encodes in flight; each worker is sized
for ``in_flight_per_worker`` of them. Images left to the prefill engines (no encode worker ready)
ask for one worker when the pool has none. The pool grows at once and shrinks one worker per
interval, within the policy's ``encode`` bounds.
"""

from __future__ import annotations

import math

from duet.cluster.autoscaler.core import Decision
from duet.cluster.autoscaler.policy import EncodeLimits


def encode_decision(
    limits: EncodeLimits, active: int, encode_wait_s: float, image_fallbacks: int, window_s: float, room: int | None = None
) -> Decision:
    """The encode pool's target for an interval of ``window_s`` seconds in which requests
    waited ``encode_wait_s`` seconds on it and ``image_fallbacks`` images went to prefill;
    ``active`` is its workers, starting ones included. ``room``: the most workers (one unit
    each) the budget leaves once prefill and decode have theirs (None: no budget); the pool
    grows no further than that, and past it gives one worker back an interval (never below
    its minimum), since its images fall back to the prefill engines where it lacks a worker,
    while a missing prefill or decode worker misses the SLO."""
    in_flight = encode_wait_s / max(window_s, 1e-3)
    wanted = math.ceil(in_flight / limits.in_flight_per_worker - 1e-9)
    reason = f"{in_flight:.2f} encodes in flight ({limits.in_flight_per_worker:g} a worker)"
    if image_fallbacks and not active:
        wanted, reason = max(wanted, 1), f"{image_fallbacks} images encoded by prefill engines: no encode worker"
    if wanted < active:
        wanted = active - 1  # one at a time: a worker removed in a lull is a start-up at the next burst
    target = min(max(wanted, limits.min), limits.max)
    if room is not None and target > max(room, 0):
        target = max(limits.min, min(target, max(room, active - 1)))
        reason = f"{reason}; held to the {max(room, 0)} units the budget leaves after prefill and decode"
    return Decision("encode", active, target, reason)
