"""Live migration on real vLLM workers: a drained decode worker hands its streams on with their KV.

The session deployment (one prefill and one decode worker, NIXL) grows a second decode worker;
streams run on both; draining the new one must move its streams to decode-0 with their KV
(worker_runtime/kv_migration.py): every stream completes token-identical to a colocated engine,
and decode-0 pulls those streams' contexts instead of computing them (vLLM's own count of
prompt tokens by source), computing one token per moved stream (the last one streamed, whose
KV its source had not computed yet); the two decode engines handshake over NIXL as the second one joins, before
any move. ``duet status`` and Prometheus count the moves, by worker and method. A
source that dies between giving its streams up and their pull costs recomputing, not a stream;
so does a target that dies as they arrive (they resume on its replacement).
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from dataclasses import dataclass

import psutil
import ray
from prometheus_client.parser import text_string_to_metric_families

from duet.benchmarks.rebalance import Pinned
from duet.router.client import build_request
from duet.router.rebalancer import Rebalancer
from test_elastic_pools import _wait_settled
from waiting import wait_for

STREAMS = 6
# Long enough that streams are still decoding when the drain arrives, however the streams were
# spread and however fast the machine runs: with 800, six streams on one worker (~1 ms a token
# each on a fast spell) had all but one finished by then, and a CI run moved none.
MAX_TOKENS = 1600
_TRANSFERRED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
_COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"


@dataclass
class _DrainUnderLoad:
    """Streams on two decode workers, the second of which is drained mid-stream; what each
    stream received, and the survivor's (decode-0's) engine counters across the drain."""

    grown: str
    moving: int  # the streams on the drained worker when it was drained
    tokens: list[list[int]]
    arrivals: list[list[float]]  # when each message came
    drained_at: float
    pulled: float  # prompt tokens decode-0 pulled over NIXL meanwhile
    computed: float  # prompt tokens decode-0 computed meanwhile
    counted: dict  # the Prometheus migration samples' change


def _drain_under_load(deployment, client, reference, seed: int, skew: bool = False, before_drain=None) -> _DrainUnderLoad:
    """Grow the decode pool to two workers, start STREAMS greedy streams (with ``skew``, all on
    the new worker), drain the new worker once every stream decodes (``before_drain(worker)``
    first), and check what must hold whatever the drain met: every stream completes
    token-identical to a colocated engine, and the pool is back to decode-0."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 700) for _ in range(rng.randrange(200, 500))] for _ in range(STREAMS)]
    expected = reference.greedy(prompts, MAX_TOKENS, ignore_eos=True)
    grown = f"decode-{deployment.managers['decode']._next_index}"
    client.scale("decode", 2)
    assert _wait_settled(client)["decode"] == ["decode-0", grown]
    survivor = deployment.decode.find("decode-0")
    leaving = deployment.decode.find(grown)
    # The two decode engines' NIXL agents handshake as the new one joins, not at the first move.
    wait_for(lambda: _handshaken(deployment, survivor, leaving) and _handshaken(deployment, leaving, survivor), 15,
             "the decode engines handshaken with each other ahead of any move")

    tokens: list[list[int]] = [[] for _ in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        try:
            request = build_request(prompt_token_ids=prompts[index], max_tokens=MAX_TOKENS, ignore_eos=True)
            for message in client.stream(request, timeout=600):
                tokens[index].extend(message.token_ids)
                arrivals[index].append(time.monotonic())
        except BaseException as error:  # asserted on below
            errors.append(error)

    counted_before = _migration_samples(client)
    policy = deployment.decode.policy
    if skew:
        deployment.decode.policy = Pinned(grown)
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(len(t) >= 20 for t in tokens) or errors, 300, "every stream decoding")
    finally:
        deployment.decode.policy = policy
    moving = leaving.inflight
    assert moving, "no stream landed on the new decode worker"
    before = deployment.background.run(survivor.engine.status(), timeout=30).engine_metrics
    if before_drain is not None:
        before_drain(leaving)
    drained_at = time.monotonic()
    assert client.drain(grown) == [f"{grown}: draining"]
    for thread in threads:
        thread.join(600)
    assert not errors, errors[:3]
    assert tokens == expected, "a stream differs from the colocated engine"
    assert _wait_settled(client)["decode"] == ["decode-0"]
    after = deployment.background.run(survivor.engine.status(), timeout=30).engine_metrics
    return _DrainUnderLoad(
        grown=grown,
        moving=moving,
        tokens=tokens,
        arrivals=arrivals,
        drained_at=drained_at,
        pulled=after.get(_TRANSFERRED, 0) - before.get(_TRANSFERRED, 0),
        computed=after.get(_COMPUTED, 0) - before.get(_COMPUTED, 0),
        counted={key: value - counted_before.get(key, 0) for key, value in _migration_samples(client).items()},
    )


def test_a_rebalanced_then_drained_decode_worker_moves_its_streams_with_their_kv(deployment, client, reference):
    """Every stream lands on the new worker (a skewed load); rebalancing moves the longest of
    them to decode-0, which had none, and draining the new worker moves the rest."""
    rebalanced: list[int] = []

    def rebalance(worker) -> None:
        # The two workers' KV use differs by under 1% here (the built-in model's KV is small).
        rebalancer = Rebalancer(deployment.service.lifecycle, gap=0.001, interval_s=1.0)
        rebalanced.append(deployment.background.run(rebalancer.rebalance(), timeout=60))
        wait_for(lambda: worker.inflight <= STREAMS - rebalanced[0], 60, "the rebalanced streams leaving")
        # Once decode-0 has read a moved stream's KV, the source frees it: its engine holds only
        # the streams still on it. Within 15 s, under the 30-s lease: the read's notice freed it
        # (a moved request used to stay until its worker was removed; a drain waited it out).
        wait_for(lambda: _engine_requests(deployment, worker) == worker.inflight, 15, "the source freeing the moved streams' KV")

    drain = _drain_under_load(deployment, client, reference, seed=37, skew=True, before_drain=rebalance)
    assert drain.moving == STREAMS
    assert 1 <= rebalanced[0] < STREAMS, f"rebalancing moved {rebalanced[0]} of {STREAMS} streams"
    moving, counted = drain.moving, drain.counted
    # Each moved stream's context (its prompt and 20+ tokens) came over NIXL; decode-0 computed
    # only each one's last token. Recomputing would have cost it the whole contexts.
    assert drain.pulled >= 200 * moving, (drain.pulled, moving)
    assert drain.computed <= 2 * moving, (drain.computed, moving)
    # Every move counted where operators look: status (its workers, by method) and Prometheus.
    shown = {worker.name: worker for pool in client.status().pools for worker in pool.workers}
    assert shown["decode-0"].migrations_in_kv >= moving  # (earlier tests may have moved some too)
    assert counted[("duet_migrations_total", drain.grown, "out", "kv")] == moving, counted
    assert counted[("duet_migrations_total", "decode-0", "in", "kv")] == moving, counted
    assert counted[("duet_migration_stall_seconds_count", None, None, "kv")] == moving, counted
    assert 0 < counted[("duet_migration_stall_seconds_sum", None, None, "kv")] < 30 * moving, counted
    # Each stall split where it went: the source giving the request up, the router handing it
    # on, the target resuming it; the parts add up to the stall.
    phases = {phase: counted[("duet_migration_phase_seconds_sum", phase, None, "kv")] for phase in ("give_up", "hand_off", "resume")}
    assert all(counted[("duet_migration_phase_seconds_count", phase, None, "kv")] == moving for phase in phases), counted
    assert phases["resume"] > 0, phases
    assert abs(sum(phases.values()) - counted[("duet_migration_stall_seconds_sum", None, None, "kv")]) < 0.001 * moving, phases
    # The longest pause any stream saw after the drain: a moved stream's stall.
    stall = max(b - a for times in drain.arrivals for a, b in zip(times, times[1:]) if b > drain.drained_at)
    print(f"rebalanced {rebalanced[0]} of {moving} streams off {drain.grown}, then drained it: all moved with {drain.pulled:.0f} prompt tokens pulled, "
          f"{drain.computed:.0f} computed; all {STREAMS} streams exact; longest pause after the drain {stall * 1000:.0f} ms")


def _handshaken(deployment, worker, other) -> bool:
    """Whether ``worker``'s NIXL agent has handshaken with ``other``'s (trivially, over a
    transport without NIXL: duet's push connector connects as it sends)."""
    mine, theirs = (deployment.background.run(member.engine.kv_peer(), timeout=30) for member in (worker, other))
    if mine is None and theirs is None:
        return True
    return theirs["engine_id"] in mine["connected"]


def _engine_pid(worker) -> int:
    return ray.get(worker.actor.__ray_call__.remote(lambda actor: actor._engine_processes.processes[0].pid), timeout=30)


def _kill_at_first_move(lifecycle, engine_pid: int, killed: list[int]) -> None:
    """Make the first moved round SIGKILL the engine core ``engine_pid`` (and its workers)
    before it goes on; on the event loop's thread, so no moved round reaches a worker (and no
    pull starts) before that engine is dead. Popping ``_moved_round`` from the lifecycle's ``__dict__`` undoes it."""
    move_on = lifecycle._moved_round

    def killing_first(round_, decode_worker, ticket):
        if not killed:
            engine = psutil.Process(engine_pid)
            doomed = [engine, *engine.children(recursive=True)]
            for process in doomed:
                process.kill()
            psutil.wait_procs(doomed, timeout=10)
            killed.append(engine_pid)
        return move_on(round_, decode_worker, ticket)

    lifecycle._moved_round = killing_first


def _moved_out(counted: dict, worker: str) -> float:
    return sum(counted.get(("duet_migrations_total", worker, "out", method), 0) for method in ("kv", "replay"))


def test_a_move_whose_source_dies_before_the_pull_completes_by_recomputing(deployment, client, reference):
    """The drained worker's engine is killed after it gave its streams up with their KV and
    before decode-0 has pulled any: each pull fails, decode-0 recomputes that stream's context
    (vLLM's kv_load_failure_policy: recompute), and every stream still completes exactly, with
    no error; the dead worker, already draining, is simply gone."""
    lifecycle = deployment.service.lifecycle
    restarts = deployment.decode.find("decode-0").restarts
    killed: list[int] = []
    try:
        # Skewed: every stream on the worker that dies, so several are still decoding (and move)
        # when the drain comes, however fast the machine runs; spread by load, a lone stream
        # there could finish first.
        drain = _drain_under_load(
            deployment, client, reference, seed=38, skew=True,
            before_drain=lambda worker: _kill_at_first_move(lifecycle, _engine_pid(worker), killed),
        )
    finally:
        lifecycle.__dict__.pop("_moved_round", None)  # the class's own again (if the drain got that far)
    assert killed, "no stream was moved"
    moving, counted = drain.moving, drain.counted
    # Every moved context reached decode-0: recomputed where the pull failed (on one host, UCX
    # may still read what the dead process left in shared memory: one run counted a pull).
    assert drain.computed + drain.pulled >= 200 * moving, (drain.computed, drain.pulled, moving)
    assert drain.computed > 2 * moving, "no pull failed: the source was not dead"
    assert _moved_out(counted, drain.grown) == moving, counted
    assert deployment.decode.find("decode-0").restarts == restarts, "the target was replaced"
    print(f"source of {moving} moves killed before the pull: decode-0 recomputed {drain.computed:.0f} prompt tokens "
          f"and pulled {drain.pulled:.0f}; all {STREAMS} streams exact")


def test_a_move_whose_target_dies_resumes_by_replay_on_its_replacement(deployment, client, reference):
    """decode-0, the only worker a drained worker's streams can move to, has its engine killed
    as the first of them arrives: no stream is lost or altered. decode-0 is replaced and every
    stream continues there (the source, draining, takes none back): those whose moved round met
    the dead engine by token replay, the others by pulling their KV from the source, which still
    holds it within its lease when the replacement is up."""
    lifecycle = deployment.service.lifecycle
    target = deployment.decode.find("decode-0")
    restarts = target.restarts
    target_pid = _engine_pid(target)  # asked before the streams, so the drain comes at once
    killed: list[int] = []
    try:
        drain = _drain_under_load(
            deployment, client, reference, seed=39, skew=True,
            before_drain=lambda worker: _kill_at_first_move(lifecycle, target_pid, killed),
        )
    finally:
        lifecycle.__dict__.pop("_moved_round", None)
    assert killed, "no stream was moved"
    assert target.restarts == restarts + 1, "the target was not replaced"
    moving, counted = drain.moving, drain.counted
    assert _moved_out(counted, drain.grown) == moving, counted
    # Counted by how each stream did continue on the replacement; the round that met the dead
    # engine (at least the first) by replay.
    replayed = counted.get(("duet_migrations_total", "decode-0", "in", "replay"), 0)
    pulled = counted.get(("duet_migrations_total", "decode-0", "in", "kv"), 0)
    assert replayed >= 1 and replayed + pulled == moving, counted
    print(f"target of {moving} moves killed as they came: replaced; {replayed:.0f} streams resumed there by replay, "
          f"{pulled:.0f} by pulling their KV; all {STREAMS} streams exact")


def _engine_requests(deployment, worker) -> int:
    """The requests ``worker``'s engine core holds, every front door's together."""
    return sum(deployment.background.run(worker.engine.requests_by_client(), timeout=30).values())


def _migration_samples(client, metrics_url: str | None = None) -> dict[tuple[str, str | None, str | None, str | None], float]:
    """The deployment's Prometheus samples of moved requests, by (name, worker or stall phase,
    direction, method), from ``metrics_url`` or the endpoint its status names."""
    metrics_url = metrics_url or f"http://{client.status().metrics_endpoint}/metrics"
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return {
        (sample.name, sample.labels.get("worker", sample.labels.get("phase")), sample.labels.get("direction"), sample.labels.get("method")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("duet_migration")
        for sample in family.samples
    }


def test_drain_moves_kv_decides_whether_a_drain_moves_requests(duet_config):
    """Only a disaggregated deployment with ``router.drain_moves_kv`` hands a draining decode
    worker's requests on, over either transport (colocated workers have no KV to hand on)."""
    from duet.config import parse_config
    from duet.router.assembly import request_service
    from duet.router.auth import Gatekeeper
    from duet.router.pools import WorkerPool
    from duet.router.status import ClusterView

    def hooks(overrides: dict, colocated: bool = False) -> int:
        data = duet_config.model_dump()
        for section, values in overrides.items():
            data[section].update(values)
        config = parse_config(data, "test")
        prefill, decode = (None if colocated else WorkerPool("prefill")), WorkerPool("decode")
        pools = [pool for pool in (prefill, decode) if pool is not None]
        request_service(config, prefill, decode, (4096, 1000, 16), ClusterView("m", "nixl", pools), Gatekeeper([]))
        return len(decode.on_draining)

    assert hooks({}) == 1
    assert hooks({"router": {"drain_moves_kv": False}}) == 0
    assert hooks({"kv_transfer": {"transport": "nccl"}}) == 1
    assert hooks({}, colocated=True) == 0
