"""Pools that change while serving, on real vLLM workers: scale up and back down under load,
health watching without traffic, and the Admin API's errors."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psutil
import pytest
import ray

from duet.config import ConfigError, parse_config
from duet.kv_transfer.ports import is_bindable
from duet.router.client import DuetClient, build_request

# Streams in flight at once: enough to keep both workers of each pool busy; more (it was 32) only
# slowed the new engines' start-up on two cores, with the router answering them all.
STREAMS = 12


def _engine_processes() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name", "cmdline"]) if "EngineCore" in " ".join(p.info["cmdline"] or []) + (p.info["name"] or "")}


def _wait_settled(client: DuetClient, timeout_s: float = 600) -> dict[str, list[str]]:
    """Wait until no worker is starting or draining; the pools' worker names by role."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.list_workers()
        states = [w.state for pool in status.pools for w in pool.workers]
        if not {"starting", "draining", "restarting"} & set(states):
            assert set(states) == {"ready"}, [f"{w.name}: {w.state} {w.error}" for pool in status.pools for w in pool.workers]
            return {pool.role: [w.name for w in pool.workers] for pool in status.pools}
        assert time.monotonic() < deadline, f"pools did not settle: {status}"
        time.sleep(0.5)


def test_scale_up_and_down_while_streaming_is_exact(deployment, client, reference):
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 700) for _ in range(rng.randrange(40, 400))] for _ in range(16)]
    expected = reference.greedy(prompts, max_tokens=48, ignore_eos=True)
    engines_before = _engine_processes()
    results: list[tuple[int, list[int]]] = []
    served: list[tuple[float, float, str]] = []  # (sent at, finished at, prefill worker) of every request
    failures: list[BaseException] = []
    stop = threading.Event()

    def stream(worker: int) -> None:
        index = worker
        while not stop.is_set():
            try:
                sent = time.monotonic()
                ids, last = client.generate_ids(build_request(prompt_token_ids=prompts[index % 16], max_tokens=48, ignore_eos=True), timeout=300)
                served.append((sent, time.monotonic(), last.usage.prefill_worker))
                results.append((index % 16, ids))
            except BaseException as error:  # recorded: the test fails on any
                failures.append(error)
                return
            index += STREAMS

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    try:
        # Names count up per pool over the deployment's life (other tests may have added workers).
        grown = {role: f"{role}-{manager._next_index}" for role, manager in deployment.managers.items()}
        assert sorted(client.scale("prefill", 2) + client.scale("decode", 2)) == [
            f"{grown['decode']}: starting", f"{grown['prefill']}: starting"
        ]
        pools = _wait_settled(client)
        assert pools == {role: [f"{role}-0", grown[role]] for role in ("prefill", "decode")}
        served_before = len(results)
        time.sleep(10)  # requests now spread over both workers of each pool
        new_members = {role: pool.members[1] for role, pool in (("prefill", deployment.prefill), ("decode", deployment.decode))}
        # Under load, with two workers per pool, kill one: the others take every request, and no
        # request waits for the replacement's start-up. Requests sent once it was out of rotation
        # finish while the replacement starts, none on the victim; that holds at any machine
        # speed, where comparing their latency with the start-up's would not.
        victim = new_members["prefill"]
        _wait_noticed(victim, _kill_process(victim))
        noticed_at = time.monotonic()
        still_restarting_at = _wait_replaced(victim)
        _wait_settled(client)
        meanwhile = [worker for sent, finished, worker in served if noticed_at < sent and finished < still_restarting_at]
        assert meanwhile, "no request sent after the kill was noticed finished before the replacement was ready"
        assert victim.name not in meanwhile, meanwhile
        assert victim.restarts == 1
        new_endpoint = new_members["prefill"].kv_endpoint
        assert sorted(client.scale("prefill", 1) + client.scale("decode", 1)) == [
            f"{grown['decode']}: draining", f"{grown['prefill']}: draining"
        ]
        assert _wait_settled(client) == {"prefill": ["prefill-0"], "decode": ["decode-0"]}
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)
    assert not failures, failures[:3]
    assert len(results) > served_before > STREAMS
    wrong = [index for index, ids in results if ids != expected[index]]
    assert not wrong, f"{len(wrong)} of {len(results)} streams differ from colocated vLLM"
    # The removed workers are gone: actors dead, engine processes exited, ports free again.
    for member in new_members.values():
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(member.actor.status.remote(), timeout=30)
    deadline = time.monotonic() + 30
    while _engine_processes() - engines_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _engine_processes() - engines_before, "a removed worker's engine is still running"
    host, port = new_endpoint.rsplit(":", 1)
    assert is_bindable(host, int(port)), f"the removed prefill worker's KV port {port} is still taken"


def _kill_process(member) -> float:
    """SIGKILL a worker's actor process; when it was killed."""
    pid = ray.get(member.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _wait_noticed(member, killed_at: float, within_s: float = 30) -> None:
    """Wait until the router has taken ``member`` out of rotation, no request sent. ``within_s``
    is generous, for a loaded machine: which check found the failure, its error says."""
    while member.state == "ready":
        assert time.monotonic() - killed_at < within_s, f"the dead worker was not noticed within {within_s:g} s"
        time.sleep(0.05)


def _wait_replaced(member, timeout_s: float = 600) -> float:
    """Wait until the replacement of ``member`` (out of rotation when called) is ready; the last
    moment it was seen not ready yet, before which no request could have reached it."""
    not_ready_at = time.monotonic()
    deadline = not_ready_at + timeout_s
    while True:
        now = time.monotonic()  # taken before the look: a member found not ready was not ready now
        if member.state == "ready":
            return not_ready_at
        not_ready_at = now
        assert now < deadline, f"{member.name} was not replaced: {member.state} {member.error}"
        time.sleep(0.05)


def test_a_killed_idle_worker_is_replaced_without_any_request(deployment, client):
    member = deployment.decode.members[0]
    restarts = member.restarts
    _wait_noticed(member, _kill_process(member))
    assert member.state == "restarting"
    # Found at once (Ray fails its watch's pending call), not by waiting out a health ping's timeout.
    assert "WorkerUnresponsive" not in member.error, member.error
    _wait_settled(client)
    assert member.restarts == restarts + 1
    ids, _ = client.generate_ids(build_request("after the restart", max_tokens=4, ignore_eos=True), timeout=120)
    assert len(ids) == 4


def test_an_exited_engine_core_is_replaced_at_once_without_any_request(deployment, client):
    """The actor lives on but its engine core process is gone: the worker's watch ends at once
    (no ping timeout to wait out) and the worker is replaced. A call to the engine core that was
    under way when it died (here, asked while it was stopped) fails then, instead of waiting
    for ever for an answer (a drain that asked so once hung with its worker listed as failed)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    member = deployment.prefill.members[0]
    restarts = member.restarts
    pid = ray.get(member.actor.__ray_call__.remote(lambda actor: actor._engine_processes.processes[0].pid), timeout=30)
    os.kill(pid, signal.SIGSTOP)  # it cannot answer: the call below is pending when it dies
    pending = asyncio.run_coroutine_threadsafe(member.engine.requests_by_client(), deployment.background.loop)
    time.sleep(0.5)
    assert not pending.done(), pending
    os.kill(pid, signal.SIGKILL)
    _wait_noticed(member, time.monotonic())
    assert "WorkerExited" in member.error and "engine core exited" in member.error  # the watch found it
    with pytest.raises(EngineDeadError):
        pending.result(timeout=10)
    _wait_settled(client)
    assert member.restarts == restarts + 1
    ids, _ = client.generate_ids(build_request("after the engine restart", max_tokens=4, ignore_eos=True), timeout=120)
    assert len(ids) == 4


def test_a_serving_workers_actor_leaves_its_main_thread_asleep(deployment, client):
    """While its engine core runs, a vLLM worker's actor holds its main thread in its watch
    (worker_runtime/engine_host.py), so Ray's 10 ms signal check cannot run there: a few wakeups per
    watch call (one call every WATCH_HOLD_S), where the timer would make about 400 in 4 s.
    The worker still answers its actor calls, and still serves."""
    _wait_settled(client)
    member = deployment.decode.members[0]
    pid = ray.get(member.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)

    def main_thread_wakeups() -> int:
        with open(f"/proc/{pid}/task/{pid}/status") as status:
            return int(status.read().split("voluntary_ctxt_switches:")[1].split()[0])

    before = main_thread_wakeups()
    time.sleep(4)
    wakeups = main_thread_wakeups() - before
    assert wakeups < 100, f"{wakeups} wakeups of the actor's main thread in 4 s: Ray's signal timer is running"
    assert ray.get(member.actor.status.remote(), timeout=30).state == "ready"
    ids, _ = client.generate_ids(build_request("still serving", max_tokens=4, ignore_eos=True), timeout=120)
    assert len(ids) == 4


@pytest.mark.parametrize(
    "call, code, field",
    [
        (lambda c: c.scale("decode", -1), grpc.StatusCode.INVALID_ARGUMENT, "replicas"),
        (lambda c: c.scale("decode", 0), grpc.StatusCode.INVALID_ARGUMENT, "replicas"),
        (lambda c: c.scale("embedder", 2), grpc.StatusCode.INVALID_ARGUMENT, "role"),
        (lambda c: c.scale("decode", 500), grpc.StatusCode.RESOURCE_EXHAUSTED, "CPU"),
        (lambda c: c.drain("decode-42"), grpc.StatusCode.INVALID_ARGUMENT, "worker"),
        (lambda c: c.drain("decode-0"), grpc.StatusCode.INVALID_ARGUMENT, "last active"),
        (lambda c: c.drain("decode-0", timeout_s=-1), grpc.StatusCode.INVALID_ARGUMENT, "timeout_s"),
    ],
    ids=["negative", "zero", "unknown-role", "beyond-resources", "unknown-worker", "last-worker", "negative-timeout"],
)
def test_bad_admin_requests_are_clear_errors(client, call, code, field):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        call(client)
    assert raised.value.code() == code and field in raised.value.details()
    assert time.monotonic() - started < 5  # fails fast, never waits for resources
    assert [w.state for pool in client.list_workers().pools for w in pool.workers] == ["ready", "ready"]
    ids, _ = client.generate_ids(build_request("still serving", max_tokens=2, ignore_eos=True), timeout=60)
    assert len(ids) == 2


def test_unknown_policy_name_names_the_field():
    with pytest.raises(ConfigError, match=r"router\.prefill_policy"):
        parse_config({"router": {"prefill_policy": "round_robin"}})


def test_status_shows_the_routing_policies(client):
    routing = list(client.status().routing)
    assert routing[:2] == ["prefill: least_prompt_tokens", "decode: least_kv_load"]


def test_short_prompts_prefill_on_the_decode_worker(deployment, client, reference):
    """Conditional disaggregation: under the threshold the decode worker computes the prompt."""
    lifecycle = deployment.service.lifecycle
    lifecycle.local_prefill_max_tokens = 64
    try:
        short, long = list(range(20, 50)), list(range(20, 120))
        short_ids, short_last = client.generate_ids(build_request(prompt_token_ids=short, max_tokens=8, ignore_eos=True))
        long_ids, long_last = client.generate_ids(build_request(prompt_token_ids=long, max_tokens=8, ignore_eos=True))
    finally:
        lifecycle.local_prefill_max_tokens = 0
    assert short_last.usage.prefill_worker == short_last.usage.decode_worker == "decode-0"
    assert long_last.usage.prefill_worker == "prefill-0"
    assert [short_ids, long_ids] == reference.greedy([short, long], max_tokens=8, ignore_eos=True)


def test_a_long_prefill_queue_is_relieved_by_the_decode_worker(deployment, client, reference):
    """Conditional disaggregation's queue condition, on real engines: with the prefill worker's
    queue past the threshold, some concurrent prompts are prefilled on the decode worker, and
    every stream still equals colocated generation."""
    lifecycle = deployment.service.lifecycle
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 700) for _ in range(300)] for _ in range(8)]

    def run(prompt: list[int]) -> tuple[list[int], Any]:
        return client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True), timeout=300)

    def prefilled_on_decode() -> float:
        return deployment.cluster.metrics.registry.get_sample_value(
            "duet_prefills_total", {"where": "decode_worker", "model_name": deployment.config.model.name}
        ) or 0.0

    before = prefilled_on_decode()
    # The queue condition alone: the TPOT guard (tests/test_policies.py) would hold these prompts
    # back while the others are assigned to the decode worker and its pace is not yet known.
    guard = lifecycle.local_prefill_guard
    threshold, lifecycle.local_prefill_queue_tokens = lifecycle.local_prefill_queue_tokens, 100
    tpot_target_s, guard.tpot_target_s = guard.tpot_target_s, None
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, prompts))
    finally:
        lifecycle.local_prefill_queue_tokens = threshold
        guard.tpot_target_s = tpot_target_s
    prefilled_by = [last.usage.prefill_worker for _, last in results]
    assert "prefill-0" in prefilled_by and "decode-0" in prefilled_by, prefilled_by
    # What operators see; counted as each request leaves the router, just after its last message.
    deadline = time.monotonic() + 5
    while prefilled_on_decode() - before < prefilled_by.count("decode-0") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefilled_on_decode() - before == prefilled_by.count("decode-0")
    assert [ids for ids, _ in results] == reference.greedy(prompts, max_tokens=8, ignore_eos=True)


def test_the_queue_threshold_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"router\.local_prefill_queue_tokens"):
        parse_config({"router": {"local_prefill_queue_tokens": -1}})
