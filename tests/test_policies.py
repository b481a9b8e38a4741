"""Routing policies and conditional disaggregation's choice, on pool members (pure: the members'
load figures are set directly)."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest

from duet.router.lifecycle import RequestLifecycle, _Round
from duet.router.local_prefill import LocalPrefillGuard
from duet.router.pool_fetch import PROBE_EVERY, FetchChoice, PlannedFetch
from duet.router.prompt_cost import PromptCost
from duet.router.policies import LeastKvLoad, LeastPromptTokens, LeastRequests, PrefixAffinity
from duet.router.pools import PoolMember, WorkerPool
from duet.worker_runtime.worker_api import PrefillResult, SamplingSpec


def _members(*outstanding: int) -> list[PoolMember]:
    return [PoolMember(f"prefill-{i}", actor=None, outstanding_tokens=tokens) for i, tokens in enumerate(outstanding)]


def test_least_prompt_tokens_weighs_tokens_not_requests():
    busy_by_count, busy_by_tokens = _members(100, 4000)
    busy_by_count.inflight, busy_by_tokens.inflight = 3, 1
    assert LeastPromptTokens().choose([busy_by_count, busy_by_tokens], []) is busy_by_count


def test_least_kv_load_prefers_free_kv_then_fewer_sequences():
    members = _members(0, 0, 0)
    members[0].kv_usage, members[1].kv_usage, members[2].kv_usage = 0.70, 0.10, 0.10
    members[1].running, members[2].running = 9, 2
    assert LeastKvLoad().choose(members, []) is members[2]


def test_least_kv_load_spreads_a_burst_whose_kv_has_not_arrived():
    """Requests chosen for while their prompts are computed elsewhere count on their decode
    worker at once: a burst is spread before any load report reflects it, by KV share where
    the engine's capacity is known (else only among workers whose reported use ties)."""

    class Engine:
        kv_capacity_tokens = 100_000

    for engine, usage in ((Engine(), (0.004, 0.006)), (None, (0.0, 0.0))):
        members = [PoolMember(f"decode-{i}", actor=None, engine=engine, kv_usage=use) for i, use in enumerate(usage)]
        with ExitStack() as burst:
            chosen = []
            for _ in range(20):
                member = LeastKvLoad().choose(members, [])
                burst.enter_context(member.assign(3_000))
                chosen.append(member.name)
            # 0.004 rounds to 0.00 and 0.006 to 0.01: without the burst's own share decode-0
            # would take all of it; with equal use, a random tie-break only roughly halves it.
            assert sorted(chosen.count(m.name) for m in members) == [10, 10], chosen
        assert [(m.assigned, m.assigned_tokens) for m in members] == [(0, 0), (0, 0)]  # released


def test_prefix_affinity_follows_the_longest_cached_prefix():
    policy = PrefixAffinity(block_size=4, load_factor=1.5, slack_tokens=0)
    members = _members(0, 0)
    system_prompt = list(range(100, 116))  # four blocks
    first = policy.choose(members, system_prompt + [1, 2, 3, 4])
    other = members[1] if first is members[0] else members[0]
    # A different prompt goes elsewhere on load (least prompt tokens), then the shared prefix
    # brings the next request back to the worker that holds it.
    first.outstanding_tokens = 20
    assert policy.choose(members, [9] * 12) is other
    first.outstanding_tokens = other.outstanding_tokens = 10
    assert policy.choose(members, system_prompt + [7, 7, 7, 7]) is first
    assert policy.cached_blocks(first.name, policy.block_hashes(system_prompt)) == 4


def test_prefix_affinity_load_guard_skips_an_overloaded_worker():
    policy = PrefixAffinity(block_size=4, load_factor=1.5, slack_tokens=0)
    hot, cold = _members(0, 0)
    prompt, other_prompt = list(range(40)), list(range(100, 140))
    policy._remember(hot.name, policy.block_hashes(prompt))
    policy._remember(hot.name, policy.block_hashes(other_prompt))
    hot.outstanding_tokens, cold.outstanding_tokens = 4000, 100  # hot: ~2x the mean
    assert policy.choose([hot, cold], prompt) is cold
    hot.outstanding_tokens = 120  # within 1.5x of the mean again: affinity beats a small imbalance
    assert policy.choose([hot, cold], other_prompt) is hot


def test_prefix_affinity_weighs_a_cached_prefix_against_the_queue_before_it():
    """A cached prefix saves its tokens' compute: it wins over a shorter queue only by less
    than that (so a prompt never waits behind more work than its cache hit saves)."""
    policy = PrefixAffinity(block_size=4, load_factor=100.0, slack_tokens=10**6)
    holder, other = _members(0, 0)
    prompt = list(range(40))  # ten blocks, all cached on the holder: 40 tokens saved
    policy._remember(holder.name, policy.block_hashes(prompt))
    holder.outstanding_tokens, other.outstanding_tokens = 139, 100
    assert policy.choose([holder, other], prompt) is holder  # 99 tokens ahead against 100
    holder.outstanding_tokens = 141
    assert policy.choose([holder, other], prompt) is other  # 101 against 100


def test_with_the_host_kv_pool_a_prefix_is_reachable_from_every_worker_on_its_host():
    """A prefix computed on one worker is in its host's pool: another worker on that host loads
    it too, so the choice is by load; a worker on another host would compute it."""
    policy = PrefixAffinity(block_size=4, load_factor=100.0, slack_tokens=10**6, shared_pool=True)
    computed_it, same_host, other_host = _members(0, 0, 0)
    computed_it.kv_endpoint, same_host.kv_endpoint, other_host.kv_endpoint = "10.0.0.1:5600", "10.0.0.1:5601", "10.0.0.2:5600"
    prompt = list(range(40))  # ten blocks
    assert policy.choose([computed_it], prompt) is computed_it
    hashes = policy.block_hashes(prompt)
    assert [policy.reachable_blocks(m, hashes) for m in (computed_it, same_host, other_host)] == [10, 10, 0]
    # Equal load: the worker holding it in its own engine (it skips even the copy).
    computed_it.outstanding_tokens = same_host.outstanding_tokens = 10
    assert policy.choose([computed_it, same_host, other_host], prompt) is computed_it
    # Busier: the same host's other worker (its pool), though the other host's is idle and the
    # prefix is 40 tokens: 30 - 40 ahead against 10 - 40 and 0.
    computed_it.outstanding_tokens, other_host.outstanding_tokens = 30, 0
    assert policy.choose([computed_it, same_host, other_host], prompt) is same_host
    # Without the pool, only the engine that computed it counts.
    assert PrefixAffinity(block_size=4).reachable_blocks(same_host, hashes) == 0


def test_prefix_affinity_breaks_ties_by_load():
    policy = PrefixAffinity(block_size=4, slack_tokens=0)
    a, b = _members(300, 200)
    system_prompt = list(range(8))
    for member in (a, b):  # both hold the shared system prompt
        policy._remember(member.name, policy.block_hashes(system_prompt))
    assert policy.choose([a, b], system_prompt + [50, 51, 52, 53]) is b


def test_front_doors_spread_ties_instead_of_picking_the_first_worker():
    """Two front doors, each with its own policy and counts, sending requests that no worker
    holds a prefix of: both workers get some from each (a first-listed tie-break sent them
    all to one)."""
    for policy_class in (lambda: PrefixAffinity(block_size=4), LeastPromptTokens, LeastRequests, LeastKvLoad):
        chosen = set()
        for _door in range(2):
            policy, members = policy_class(), _members(0, 0)
            chosen |= {(_door, policy.choose(members, [n] * 8).name) for n in range(40)}
        assert chosen == {(door, name) for door in range(2) for name in ("prefill-0", "prefill-1")}


def test_block_hashes_name_the_whole_prefix():
    policy = PrefixAffinity(block_size=2)
    a, b = policy.block_hashes([1, 2, 3, 4, 5]), policy.block_hashes([9, 2, 3, 4])
    assert len(a) == 2 and len(b) == 2  # partial blocks are not cached by the engine either
    assert a[1] != b[1]  # same second block, different prefix


def _conditional(threshold: int, max_tokens: int = 0) -> RequestLifecycle:
    prefill = WorkerPool("prefill", members=_members(3000, 2000))
    return RequestLifecycle(prefill, WorkerPool("decode"), local_prefill_max_tokens=max_tokens, local_prefill_queue_tokens=threshold)


def test_a_long_prefill_queue_sends_prompts_to_a_decode_worker_with_a_shorter_one():
    lifecycle, decode = _conditional(threshold=1024), PoolMember("decode-0", actor=None)
    assert not lifecycle._prefill_remotely(decode, 500)  # every prefill queue holds 2000+ tokens
    decode.local_prefill_tokens = 1999
    assert not lifecycle._prefill_remotely(decode, 500)
    decode.local_prefill_tokens = 2000  # no shorter than the shortest prefill queue
    assert lifecycle._prefill_remotely(decode, 500)


def test_the_queue_condition_needs_every_prefill_worker_past_the_threshold():
    lifecycle, decode = _conditional(threshold=2000), PoolMember("decode-0", actor=None)
    assert lifecycle._prefill_remotely(decode, 500)  # one prefill queue is at 2000, not over
    lifecycle.prefill_pool.members[1].state = "draining"  # only the 3000-token queue is in rotation
    assert not lifecycle._prefill_remotely(decode, 500)
    assert _conditional(threshold=0)._prefill_remotely(decode, 500)  # 0: off
    assert not _conditional(threshold=0, max_tokens=600)._prefill_remotely(decode, 500)  # short prompt


def test_local_prefill_waits_while_it_would_push_a_stream_past_its_tpot():
    lifecycle, decode = _conditional(threshold=1024), PoolMember("decode-0", actor=None)
    guard = lifecycle.local_prefill_guard
    guard.tpot_target_s = 0.04
    assert not lifecycle._prefill_remotely(decode, 500)  # nothing decoding there: nothing to stall
    now = time.perf_counter()
    guard.stream_started("decode-0", "r1", tokens=1, max_tokens=101, now=now)
    assert lifecycle._prefill_remotely(decode, 500)  # its pace and a prompt's cost not known yet
    guard.prefilled(1000, 0.1)  # 0.1 ms a prompt token
    for _ in range(50):
        guard.streamed("decode-0", "another", 2, 0.02)  # the worker's streams: 10 ms a token
    assert guard.pace_s("decode-0") == pytest.approx(0.01)
    # Just started, 100 tokens to come at 10 ms: 10 ms a token; a 5,000-token prompt stalls it
    # 0.5 s, 5 ms a token more: inside 0.9 x 40 ms.
    assert not lifecycle._prefill_remotely(decode, 5000)
    # 30,000 tokens: 3 s, 30 ms a token more, past it.
    assert lifecycle._prefill_remotely(decode, 30000)
    # What it already prefills counts: 26,000 tokens in progress and 4,000 more.
    decode.local_prefill_tokens = 26000
    assert lifecycle._prefill_remotely(decode, 4000)
    decode.local_prefill_tokens = 0
    # A stream near its end with a little room: a small stall fits, a larger one does not.
    guard.stream_ended("decode-0", "r1")
    guard.stream_started("decode-0", "r2", tokens=90, max_tokens=101, now=now - 2.7)
    assert not lifecycle._prefill_remotely(decode, 6000)  # (2.7 + 0.6 + 11 x 0.01) / 100 = 34 ms
    assert lifecycle._prefill_remotely(decode, 9000)  # (2.7 + 0.9 + 0.11) / 100 = 37 ms, past 36
    # A stream already past the target holds every local prefill back: under load a guard that
    # wrote such streams off let every prompt through.
    guard.stream_started("decode-0", "late", tokens=1, max_tokens=11, now=now - 1.0)  # 1 s for its first 10 gaps
    assert lifecycle._prefill_remotely(decode, 200)
    guard.stream_ended("decode-0", "r2")
    guard.stream_ended("decode-0", "late")
    assert not lifecycle._prefill_remotely(decode, 30000)  # no stream left to stall


def test_a_request_counts_from_its_assignment_so_its_pull_is_protected():
    """A remotely prefilled request's first token (its TPOT's start) comes before its decode
    worker's first chunk: a stall meanwhile lands on its few remaining gaps, and the guard
    counts it from its assignment (the code slice: 1,800-token prompts, 6-10 output tokens),
    less what passes before its first token can come."""
    lifecycle, decode = _conditional(threshold=1024), PoolMember("decode-0", actor=None)
    guard = lifecycle.local_prefill_guard
    guard.tpot_target_s = 0.04
    guard.prefilled(1000, 0.5)  # 0.5 ms a prompt token: 1,800 tokens stall 0.9 s
    for _ in range(50):
        guard.streamed("decode-0", "another", 1, 0.01)  # 10 ms a token
    assert not lifecycle._prefill_remotely(decode, 1800)  # nothing assigned to it: nothing to stall
    guard.stream_assigned("decode-0", "short", max_tokens=8)  # still being prefilled elsewhere
    assert lifecycle._prefill_remotely(decode, 1800)  # (0.9 + 7 x 0.01) / 7 = 139 ms a token
    assert not lifecycle._prefill_remotely(decode, 100)  # 0.05 s: (0.05 + 0.07) / 7 = 17 ms
    now = time.perf_counter()
    guard.first_token("decode-0", "short", now=now - 0.1)  # its KV is being pulled
    assert lifecycle._prefill_remotely(decode, 200)  # (0.1 + 0.1 + 0.07) / 7 = 39 ms, past 36
    guard.stream_started("decode-0", "short", tokens=6, max_tokens=8, now=now)  # its first chunk
    # Its first chunk's 6 tokens count (1 to come): (0.1 + 0.1 + 0.01) / 7 = 30 ms fits ...
    assert not lifecycle._prefill_remotely(decode, 200)
    # ... and its clock still runs from the first token: (0.1 + 0.2 + 0.01) / 7 = 44 ms.
    assert lifecycle._prefill_remotely(decode, 400)
    guard.stream_ended("decode-0", "short")
    # Queued on a prefill worker behind 1,000 prompt tokens: its first token is 0.5 s away at the
    # soonest, so a stall reaches it only past that.
    guard.stream_assigned("decode-0", "queued", max_tokens=8)
    assert lifecycle._prefill_remotely(decode, 1000)  # not yet queued: (0.5 + 0.07) / 7 = 81 ms
    guard.queued_behind("decode-0", "queued", prompt_tokens_ahead=1000, now=now)
    assert not lifecycle._prefill_remotely(decode, 1000)  # over before its first token: 10 ms
    assert lifecycle._prefill_remotely(decode, 1800)  # 0.4 s past it: (0.4 + 0.07) / 7 = 67 ms
    guard.stream_ended("decode-0", "queued")
    guard.stream_assigned("decode-0", "one", max_tokens=1)  # one token: no TPOT to spoil
    assert not lifecycle._prefill_remotely(decode, 1800)


def test_without_a_tpot_target_the_queue_threshold_alone_decides():
    lifecycle, decode = _conditional(threshold=1024), PoolMember("decode-0", actor=None)
    lifecycle.local_prefill_guard.tpot_target_s = None
    lifecycle.local_prefill_guard.stream_started("decode-0", "r1", tokens=1, max_tokens=100)
    assert not lifecycle._prefill_remotely(decode, 500)


def test_short_prompts_do_not_set_the_prompt_cost():
    guard = LocalPrefillGuard(0.04)
    guard.prefilled(20, 0.05)
    assert not guard.prompt_cost.known
    guard.prefilled(200, 0.02)
    guard.prefilled(200, 0.04)
    assert guard.prompt_cost.stall_s(1000) == pytest.approx(0.15)  # 0.06 s over 400 tokens


def _profile_prefill_s(tokens: int) -> float:
    """The built-in model's prefill on one core (tiny-cpu-core.profile.yaml), plus a 3 ms call."""
    return 0.003 + (7.9 + 0.0247 * tokens + 2.67e-5 * tokens * tokens) / 1000


def test_a_prompts_stall_is_the_part_of_its_time_that_grows_with_it():
    """Timed prefills include the step's fixed overhead and the call's round trip, which a prompt
    joining a decode step does not add: the fit keeps the parts that grow with the prompt."""
    cost = PromptCost()
    for tokens in [128, 400, 900, 1800, 250, 600, 1200, 1500]:
        cost.timed(tokens, _profile_prefill_s(tokens))
    assert cost.stall_s(400) == pytest.approx((0.0247 * 400 + 2.67e-5 * 400 * 400) / 1000, rel=0.01)  # 14 ms of 25
    assert cost.stall_s(1800) == pytest.approx((0.0247 * 1800 + 2.67e-5 * 1800 * 1800) / 1000, rel=0.01)
    # A queue of prompts pays each one's fixed part: timed at the timings' seconds per token.
    seconds_per_token = sum(map(_profile_prefill_s, [128, 400, 900, 1800, 250, 600, 1200, 1500])) / 6778
    assert cost.at_least_s(4000) == pytest.approx(4000 * seconds_per_token)
    # Attention's square alone: a 2,000-token prompt costs more than two of 1,000.
    assert cost.stall_s(2000) > 2 * cost.stall_s(1000)


def test_the_prompt_cost_is_total_over_total_until_a_fit_holds():
    cost = PromptCost()
    for _ in range(10):  # one length only: nothing to fit a slope to
        cost.timed(1000, 0.05)
    assert cost.stall_s(500) == pytest.approx(0.025)
    cost = PromptCost()
    # Timings that fall with the prompt's length (noise): no negative cost, total over total.
    for tokens, seconds in [(200, 0.06), (400, 0.05), (800, 0.04), (1600, 0.03)] * 2:
        cost.timed(tokens, seconds)
    assert cost.stall_s(1000) == pytest.approx(1000 * 0.36 / 6000)
    # Timings that bend down (noise): the square comes out negative and is dropped, a line is fitted.
    cost = PromptCost()
    for tokens in [200, 400, 800, 1600] * 2:
        cost.timed(tokens, 0.01 + 5e-5 * tokens - 5e-9 * tokens * tokens)
    assert cost.stall_s(2000) == pytest.approx(2 * cost.stall_s(1000)) and 0.03 < cost.stall_s(1000) < 0.05


def test_prefix_affinity_keys_prefixes_by_adapter_and_prefers_workers_holding_it():
    """An adapter's prefix is another cache entry than the base model's (vLLM keys blocks by
    adapter); a worker that recently served the adapter (it need not load it) is credited one
    block, which decides between workers about as busy but never outweighs a longer queue,
    until the adapter falls out of the last ``adapters_held`` sent there."""
    policy = PrefixAffinity(block_size=4, slack_tokens=16, adapters_held=2)
    a, b = PoolMember("a", actor=None), PoolMember("b", actor=None)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    assert policy.block_hashes(prompt, "lora-x") != policy.block_hashes(prompt)
    policy._remember(a.name, policy.block_hashes(prompt))  # a holds the base model's prefix
    b.outstanding_tokens = 10  # a is also the less loaded
    assert policy.choose([a, b], prompt, "lora-x") is a  # nobody holds the adapter: least loaded
    assert policy.adapters.holds("a", "lora-x") and not policy.adapters.holds("b", "lora-x")
    a.outstanding_tokens = 12  # now a is the busier by less than a block, and holds lora-x
    assert policy.choose([a, b], [1, 2, 3], "lora-x") is a
    a.outstanding_tokens = 40  # more than a block busier: the queue wins over the adapter
    assert policy.choose([a, b], [1, 2, 3], "lora-x") is b
    a.outstanding_tokens = 12
    assert policy.choose([a, b], [1, 2, 3], "lora-y") is b  # nobody holds lora-y: the less loaded
    policy.choose([a], [1, 2, 3], "lora-y")  # a holds lora-x, lora-y
    assert policy.adapters.holds("a", "lora-x")
    policy.choose([a], [1, 2, 3], "lora-z")  # a's third adapter pushes out the least recent
    assert not policy.adapters.holds("a", "lora-x") and policy.adapters.holds("a", "lora-z")


@pytest.mark.quick
def test_decode_workers_holding_the_adapter_are_preferred_within_the_load_guard():
    """A decode engine applies the adapter too: ``least_kv_load`` sends a request to a worker
    that recently decoded its adapter while that worker is within 5 points of KV usage and one
    sequence of the least loaded, and to the least loaded otherwise (which then holds it too)."""
    policy = LeastKvLoad(adapters_held=1)
    a, b = PoolMember("a", actor=None), PoolMember("b", actor=None)
    a.kv_usage, b.kv_usage = 0.10, 0.20
    assert policy.choose([a, b], [1], "lora-x") is a  # nobody holds it: the least loaded
    a.kv_usage, b.kv_usage = 0.23, 0.20
    assert policy.choose([a, b], [1], "lora-x") is a  # b is lighter, by less than the guard
    assert policy.choose([a, b], [1]) is b  # the base model: the least loaded
    a.kv_usage = 0.30  # 10 points more than b: past the guard
    assert policy.choose([a, b], [1], "lora-x") is b
    assert policy.adapters.holds("b", "lora-x")
    policy.choose([a], [1], "lora-y")  # a keeps one adapter: lora-y pushes lora-x out
    assert not policy.adapters.holds("a", "lora-x") and policy.adapters.holds("a", "lora-y")
    a.kv_usage, b.kv_usage = 0.10, 0.12
    assert policy.choose([a, b], [1], "lora-x") is b  # the holder, within the guard
    b.running = 2  # ... but not with two sequences more than a
    assert policy.choose([a, b], [1], "lora-x") is a


def test_a_prefix_pooled_on_another_host_is_fetched_from_an_engine_there():
    """Pools reachable across hosts: the worker chosen for a prompt is told to fetch it from an
    engine on the host whose pool holds more of it than the worker reaches (that engine's p2p
    tier, the port after its KV channel's), and only then; the choice itself is by load."""
    policy = PrefixAffinity(
        block_size=4, load_factor=100.0, slack_tokens=10**6, shared_pool=True,
        peer_endpoint=lambda kv_endpoint: f"peer-of-{kv_endpoint}",  # type: ignore[arg-type,return-value]
    )
    computed_it, other_host, third_host = _members(0, 0, 0)
    computed_it.kv_endpoint, other_host.kv_endpoint, third_host.kv_endpoint = "10.0.0.1:5600", "10.0.0.2:5600", "10.0.0.3:5600"
    prompt = list(range(40))  # ten blocks
    assert policy.choose([computed_it], prompt) is computed_it
    assert policy.kv_source(computed_it, prompt) is None  # computed there: nothing to fetch
    computed_it.outstanding_tokens = 100  # busy: the idle host gets the prompt
    assert policy.choose([computed_it, other_host], prompt) is other_host
    assert policy.kv_source(other_host, prompt) == PlannedFetch("peer-of-10.0.0.1:5600", "10.0.0.1", 0, 40)  # type: ignore[arg-type]
    assert policy.kv_source(other_host, prompt) is None  # one fetch per choice
    # The fetched blocks are not in the other host's pool (vLLM stores what an engine computed):
    # a third worker there would still fetch them. Its engine holds them, though.
    hashes = policy.block_hashes(prompt)
    assert policy.cached_blocks(other_host.name, hashes) == 10
    assert policy.reachable_blocks(third_host, hashes) == 0
    # A longer prompt on the second host: its engine holds the first ten blocks and computes the
    # two after them. The router counts all twelve as in that host's pool (the ten fetched ones
    # are in its engine, which serves a peer's lookup from its own tiers too), so a worker on a
    # third host fetches the whole prompt from the second.
    longer = prompt + list(range(100, 108))
    assert policy.choose([computed_it, other_host], longer) is other_host
    assert policy.kv_source(other_host, longer) is None  # its engine holds the ten blocks
    other_host.outstanding_tokens = 100
    assert policy.choose([computed_it, other_host, third_host], longer) is third_host
    assert policy.kv_source(third_host, longer) == PlannedFetch("peer-of-10.0.0.2:5600", "10.0.0.2", 0, 48)  # type: ignore[arg-type]


def test_without_pools_across_hosts_no_fetch_is_planned():
    policy = PrefixAffinity(block_size=4, load_factor=100.0, slack_tokens=10**6, shared_pool=True)
    computed_it, other_host = _members(0, 0)
    computed_it.kv_endpoint, other_host.kv_endpoint = "10.0.0.1:5600", "10.0.0.2:5600"
    prompt = list(range(40))
    policy.choose([computed_it], prompt)
    computed_it.outstanding_tokens = 100
    assert policy.choose([computed_it, other_host], prompt) is other_host
    assert policy.kv_source(other_host, prompt) is None


def test_a_fetch_is_planned_from_the_least_busy_engine_on_the_host_holding_the_prefix():
    """Any engine on a host reads its pool, and each answers fetches between its own steps."""
    policy = PrefixAffinity(
        block_size=4, load_factor=100.0, slack_tokens=10**6, shared_pool=True,
        peer_endpoint=lambda kv_endpoint: f"peer-of-{kv_endpoint}",  # type: ignore[arg-type,return-value]
    )
    computed_it, its_neighbour, elsewhere = _members(0, 0, 0)
    computed_it.kv_endpoint, its_neighbour.kv_endpoint, elsewhere.kv_endpoint = "10.0.0.1:5600", "10.0.0.1:5602", "10.0.0.2:5600"
    prompt = list(range(40))
    assert policy.choose([computed_it], prompt) is computed_it
    computed_it.outstanding_tokens, its_neighbour.outstanding_tokens = 500, 400  # both busier than the other host
    assert policy.choose([computed_it, its_neighbour, elsewhere], prompt) is elsewhere
    assert policy.kv_source(elsewhere, prompt).source == "peer-of-10.0.0.1:5602"  # type: ignore[union-attr]


def _timed_cost(seconds_per_token: float) -> PromptCost:
    """Prefills timed at ``seconds_per_token`` plus 10 ms: a line the fit recovers."""
    cost = PromptCost()
    for tokens in [200, 400, 800, 1600] * 2:
        cost.timed(tokens, 0.01 + seconds_per_token * tokens)
    return cost


def test_a_fetch_is_made_while_it_is_faster_than_computing_and_probed_after():
    """The first fetch from a host is made to time it; then a fetch is made only where its
    tokens are predicted to arrive faster than computing them, with one probe in PROBE_EVERY."""
    cost = _timed_cost(1e-4)  # 0.1 ms per token computed
    assert cost.prefill_s(1000) == pytest.approx(0.11)
    choice = FetchChoice("faster", cost)
    plan = PlannedFetch("peer", "10.0.0.1", reached_tokens=0, tokens=2048)  # type: ignore[arg-type]
    assert choice.take(plan, 2100)  # nothing timed from 10.0.0.1 yet: fetch, and measure it
    # Fetched in 0.5 s, of which the 52 computed tokens took 15 ms: 0.24 ms per token fetched,
    # against 0.1 ms per token computed.
    choice.timed(plan, 2048, 52, 0.5)
    assert choice.token_s["10.0.0.1"] == pytest.approx((0.5 - 0.0152) / 2048)
    decisions = [choice.take(plan, 2100) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[-1]  # the probes
    # A probe finds the link faster (say the source was idle): fetching from there again.
    choice.timed(plan, 2048, 52, 0.05)
    choice.timed(plan, 2048, 52, 0.05)
    assert choice.take(plan, 2100) and choice.take(plan, 2100)
    other = PlannedFetch("peer", "10.0.0.9", reached_tokens=0, tokens=2048)  # type: ignore[arg-type]
    assert choice.take(other, 2100)  # hosts are timed apart
    # A source that gave nothing (it had lost the blocks, or did not answer for 5 s): its time
    # beyond computing counts against the tokens planned, and fetching from it stops.
    choice.timed(other, 0, 2100, 5.2)
    choice.timed(other, 0, 2100, 5.2)
    assert not choice.take(other, 2100)


class _ScriptedPrefill:
    """A prefill engine that answers after ``seconds``, noting the pool source it was given:
    the router's timing and choice are what is tested, not an engine."""

    def __init__(self, seconds: float, cached_tokens: int) -> None:
        self.seconds, self.cached_tokens = seconds, cached_tokens
        self.sources: list[str | None] = []

    async def prefill(self, request_id, prompt_token_ids, sampling, decode_endpoint, pool_source=None) -> PrefillResult:
        self.sources.append(pool_source)
        await asyncio.sleep(self.seconds)
        return PrefillResult(1, "t", len(prompt_token_ids), None, None, "prefill-0", cached_tokens=self.cached_tokens)


def test_the_router_times_a_fetched_prefill_as_a_fetch_and_a_computed_one_as_a_prompt():
    """A fetched prefill sets the host's fetch rate and leaves the prompt cost alone (its time
    is the link's and the source's, not the engine's); ``always`` fetches whatever that rate."""
    lifecycle = RequestLifecycle(WorkerPool("prefill"), WorkerPool("decode"), fetch_when="always")
    lifecycle.local_prefill_guard.prompt_cost = cost = _timed_cost(1e-4)
    lifecycle.pool_fetches.prompt_cost = cost
    engine = _ScriptedPrefill(0.5, cached_tokens=2048)
    worker = PoolMember("prefill-0", actor=None)
    worker.engine = engine
    plan = PlannedFetch("10.0.0.1:5602", "10.0.0.1", reached_tokens=0, tokens=2048)  # type: ignore[arg-type]
    round_ = _Round("r1", list(range(2100)), SamplingSpec(max_tokens=2))
    before = cost.prefill_s(2100)
    asyncio.run(lifecycle._prefill(worker, round_, None, plan))
    assert engine.sources == ["10.0.0.1:5602"]
    assert cost.prefill_s(2100) == before
    assert lifecycle.pool_fetches.token_s["10.0.0.1"] == pytest.approx((0.5 - cost.prefill_s(52)) / 2048, rel=0.25)
    fetch_s, compute_s = lifecycle.pool_fetches.predicted_s(plan, 2100)
    assert fetch_s > 2 * compute_s  # slower than computing by far ...
    assert all(lifecycle.pool_fetches.take(plan, 2100) for _ in range(PROBE_EVERY))  # ... and always fetched
    engine.cached_tokens = 0
    asyncio.run(lifecycle._prefill(worker, _Round("r2", list(range(2100)), SamplingSpec(max_tokens=2)), None))
    assert engine.sources[-1] is None and cost.prefill_s(2100) > before  # computed (0.5 s): timed as a prompt


def test_a_prefill_is_timed_by_the_tokens_its_engine_computed():
    """Tokens found in the engine's prefix cache or loaded from a pool cost no compute: a prompt
    cost fitted to whole prompts would take a cache hit for a fast engine."""
    lifecycle = RequestLifecycle(WorkerPool("prefill"), WorkerPool("decode"))
    worker = PoolMember("prefill-0", actor=None)
    worker.engine = _ScriptedPrefill(0.3, cached_tokens=1500)
    asyncio.run(lifecycle._prefill(worker, _Round("r1", list(range(2100)), SamplingSpec(max_tokens=2)), None))
    cost = lifecycle.local_prefill_guard.prompt_cost
    # 600 tokens computed in about 0.3 s: a prompt computed whole costs 0.5 ms a token, not 0.14 ...
    assert cost.stall_s(1000) == pytest.approx(0.5, rel=0.2)
    # ... while a queue, which counts whole prompts, moves at 2,100 tokens in 0.3 s.
    assert cost.at_least_s(2100) == pytest.approx(0.3, rel=0.2)
