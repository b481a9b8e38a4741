"""Failures end as designed, within a bound, and the next requests succeed.

These kill real worker actors of the shared deployment; the router replaces them (a new actor
and engine), so the tests that follow still have a full deployment.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import threading
import time
from dataclasses import replace

import grpc
import ray

from duet.worker_runtime.worker_api import SamplingSpec
from duet.router.client import build_request
from duet.router.engine_front_end import _RECENT_OUTPUT_S

COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(length)]


async def _decode_on(member, request_id, prompt, spec, prefill) -> list[int]:
    """Run the decode half of a request on ``member``'s engine, as the router does."""
    tokens: list[int] = []
    async for chunk in member.engine.decode(
        request_id, prompt, spec, prefill.kv_transfer_params, prefill.first_token_id, prefill.first_text
    ):
        tokens += chunk.token_ids
    return tokens


def _processes_of(threads: dict[int, float] | None) -> list[int]:
    """The process ids among an engine's thread ids (a process's main thread has its id)."""
    pids = []
    for tid in threads or {}:
        with contextlib.suppress(OSError):
            status = open(f"/proc/{tid}/status").read()
            if f"\nTgid:\t{tid}\n" in status:
                pids.append(tid)
    assert pids, "no engine process found"
    return pids


def _wait_replaced(member, restarts: int, timeout_s: float = 300) -> None:
    """Wait until the router has replaced ``member`` since it had ``restarts``: how soon it
    notices a failure and how long a replacement takes to start vary with the machine's speed."""
    deadline = time.monotonic() + timeout_s
    while not (member.restarts > restarts and member.state == "ready"):
        assert time.monotonic() < deadline, f"{member.name} was not replaced: {member.state} {member.error}"
        time.sleep(0.5)


def test_prefill_killed_before_decode_pulls(client, deployment, reference, worker_status):
    """Decode recomputes the prompt (kv_load_failure_policy=recompute), then the router replaces the worker."""
    prompt = _prompt(700, seed=1)
    spec = SamplingSpec(max_tokens=16, ignore_eos=True)
    expected = reference.greedy([prompt], max_tokens=16, ignore_eos=True)[0]
    prefill = deployment.prefill.members[0]
    restarts = prefill.restarts
    result = deployment.background.run(prefill.engine.prefill("fault-prefill", prompt, spec, None), timeout=60)
    engine_processes = _processes_of(deployment.background.run(prefill.engine.threads_cpu_wait(), timeout=30))
    ray.kill(prefill.actor, no_restart=True)
    # The engine core outlives its actor by a moment (it notices its parent's death): a pull in
    # that moment succeeds, and there would be nothing to recompute. Wait until it is gone.
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in engine_processes):
        assert time.monotonic() < deadline, "the prefill engine core outlived its actor by 30 s"
        time.sleep(0.1)

    decode = deployment.decode.members[0]
    computed_before = worker_status("decode").engine_metrics.get(COMPUTED, 0)
    started = time.monotonic()
    decoded = deployment.background.run(_decode_on(decode, "fault-prefill", prompt, spec, result), timeout=60)
    tokens = [result.first_token_id] + decoded
    elapsed = time.monotonic() - started
    assert tokens == expected
    assert elapsed < 15, f"decode took {elapsed:.1f} s to give up on the dead prefill worker"
    computed = worker_status("decode").engine_metrics.get(COMPUTED, 0) - computed_before
    assert computed > 0, "decode claims it pulled KV from a dead worker"

    # The next request is served exactly (by the replacement, or by the dead actor's engine core
    # in the moment before Ray reaps it), and the dead worker is replaced.
    ids, last = client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True), timeout=600)
    assert ids == expected
    _wait_replaced(prefill, restarts)
    assert prefill.restarts == restarts + 1
    assert worker_status("prefill").state == "ready"


def test_decode_killed_during_handoff_resumes_on_replacement(client, deployment, reference, stream_killing_worker):
    """The worker is killed as the first token arrives; 256 tokens (4,056 with the prompt,
    within the model's 4,096) take seconds to decode even on a fast spell, so the stream
    outlives the kill and resumes on the replacement."""
    prompt = _prompt(3800, seed=2)
    decode = deployment.decode.members[0]
    restarts = decode.restarts
    request = build_request(prompt_token_ids=prompt, max_tokens=256, ignore_eos=True)
    received = stream_killing_worker(client, request, decode)
    expected = reference.greedy([prompt], max_tokens=256, ignore_eos=True)[0]
    assert received == expected, "the resumed stream differs from an uninterrupted one"
    _wait_replaced(decode, restarts)
    assert decode.restarts == restarts + 1


def test_decode_engine_hung_mid_stream_is_found_and_the_stream_resumes(client, deployment, reference):
    """A stream spares its decode engine the health ping's round trip (its outputs show that it
    steps). An engine core that stops stepping while alive (SIGSTOP: hung, not exited) stops
    delivering; the pings resume, time out (router.health_failures in a row), and the worker is
    replaced; the stream resumes on
    the replacement, token-exact."""
    prompt = _prompt(300, seed=5)
    decode = deployment.decode.members[0]
    restarts = decode.restarts
    replays = _replays(client, decode.name)
    router = deployment.config.router
    # Found by design within the recent-output window (the stream's last output must age), the
    # next ping and its timeout; the slack is for a loaded machine. The error says a ping found it.
    notice_bound_s = _RECENT_OUTPUT_S + router.health_failures * (router.health_interval_s + router.health_timeout_s) + 10
    engine_pid = _engine_pid(decode)
    request = build_request(prompt_token_ids=prompt, max_tokens=160, ignore_eos=True)
    received: list[int] = []
    streaming = threading.Event()

    def consume() -> None:
        for message in client.generate(request, timeout=600):
            received.extend(message.token_ids)
            if len(received) >= 16:
                streaming.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        assert streaming.wait(120), "the stream never got going"
        os.kill(engine_pid, signal.SIGSTOP)
        hung_at = time.monotonic()
        while decode.state == "ready" and time.monotonic() - hung_at < notice_bound_s:
            time.sleep(0.05)
        noticed_s = time.monotonic() - hung_at
        error = decode.error
        consumer.join(600)
    finally:
        # No stopped engine core is left behind, whatever happened (its removal kills it).
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)
    assert noticed_s < notice_bound_s, f"the hung engine was not noticed within {notice_bound_s:g} s"
    assert "WorkerUnresponsive" in error, error
    assert not consumer.is_alive(), "the stream did not finish after its engine hung"
    assert received == reference.greedy([prompt], max_tokens=160, ignore_eos=True)[0]
    _wait_replaced(decode, restarts)
    assert decode.restarts == restarts + 1
    # Status counts the stream's move from the hung engine to its replacement, as a replay.
    assert _replays(client, decode.name) == (replays[0] + 1, replays[1] + 1)


def _engine_pid(member) -> int:
    """The process id of ``member``'s engine core (under its worker actor)."""
    return ray.get(member.actor.__ray_call__.remote(lambda actor: actor._engine_processes.processes[0].pid), timeout=30)


def _crash(pid: int) -> None:
    """Kill ``pid`` as a fault in its own code would (SIGSEGV: a kernel's bad memory access),
    without leaving a core file behind."""
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    os.kill(pid, signal.SIGSEGV)


def test_a_request_held_by_two_crashing_engines_is_not_retried_on_a_third(client, deployment, reference):
    """A query of death, as a fault signal of the engine core that holds the request. The first
    crash is survived as any failure is: the worker is replaced and the stream resumes on it,
    token-exact. When that engine crashes too (router.max_engine_crashes, 2), the request ends
    with INTERNAL, a status clients do not retry, instead of taking a third engine down; both
    crashed workers are replaced and the next request is served."""
    prompt = _prompt(200, seed=7)
    decode = deployment.decode.members[0]
    restarts = decode.restarts
    # Long enough (seconds of decoding even on a fast spell) that each crash lands mid-stream:
    # with 1,024 tokens, a replacement that took over late once finished the stream between its
    # start and the test's lookup of its pid.
    max_tokens = 3072
    expected = reference.greedy([prompt], max_tokens=max_tokens, ignore_eos=True)[0]
    request = build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    received: list[int] = []
    errors: list[grpc.RpcError] = []

    def consume() -> None:
        try:
            for message in client.generate(request, timeout=600):
                received.extend(message.token_ids)
        except grpc.RpcError as error:
            errors.append(error)

    def wait_for_tokens(count: int) -> None:
        deadline = time.monotonic() + 300
        while len(received) < count:
            assert consumer.is_alive() and time.monotonic() < deadline, f"the stream stopped at {len(received)} tokens: {errors}"
            time.sleep(0.01)

    # Each engine's pid is looked up before the tokens are awaited, so that each crash lands
    # within microseconds of its token (a lookup through Ray after it let a fast spell finish
    # the whole stream before the second crash).
    first_engine = _engine_pid(decode)
    consumer = threading.Thread(target=consume)
    consumer.start()
    wait_for_tokens(16)
    _crash(first_engine)
    _wait_replaced(decode, restarts)
    second_engine = _engine_pid(decode)
    # Every token the first engine made has reached the client by now; 16 more come from its
    # replacement, which holds the resumed request.
    before_second = len(received)
    wait_for_tokens(before_second + 16)
    _crash(second_engine)
    consumer.join(300)
    assert not consumer.is_alive(), "the stream did not end after the second crash"
    assert errors and errors[0].code() == grpc.StatusCode.INTERNAL, errors or f"finished with {len(received)} tokens"
    assert "2 engines crashed while they held this request" in errors[0].details()
    assert before_second + 16 <= len(received) < max_tokens
    assert received == expected[: len(received)], "the stream resumed after the first crash differs"
    _wait_replaced(decode, restarts + 1)
    ids, _ = client.generate_ids(build_request(prompt_token_ids=prompt[:100], max_tokens=4, ignore_eos=True), timeout=120)
    assert ids == reference.greedy([prompt[:100]], max_tokens=4, ignore_eos=True)[0]


def _replays(client, worker: str) -> tuple[int, int]:
    """``worker``'s requests moved out and in by token replay, as ``duet status`` counts them."""
    shown = next(state for pool in client.status().pools for state in pool.workers if state.name == worker)
    return shown.migrations_out_replay, shown.migrations_in_replay


def test_transfer_timeout_falls_back_to_recompute(client, deployment, reference, worker_status):
    lifecycle = deployment.service.lifecycle
    policy = lifecycle.policy
    lifecycle.policy = replace(policy, transfer_timeout_s=0.0)  # every hand-off exceeds it
    try:
        prompt = _prompt(1000, seed=3)
        started = time.monotonic()
        ids, last = client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True), timeout=120)
        elapsed = time.monotonic() - started
    finally:
        lifecycle.policy = policy
    assert ids == reference.greedy([prompt], max_tokens=16, ignore_eos=True)[0]
    assert elapsed < 30
    for role in ("prefill", "decode"):
        deadline = time.monotonic() + 20
        while (status := worker_status(role)).engine_unfinished or status.requests_inflight:
            assert time.monotonic() < deadline, f"{role} still holds the timed-out request"
            time.sleep(0.1)
    ids, _ = client.generate_ids(build_request("next one", max_tokens=4, ignore_eos=True), timeout=60)
    assert len(ids) == 4
