"""The control plane apart: its death under load fails no request, restarts no engine, and the
control plane that comes back takes the running deployment over.

``duet serve --front-ends 2`` as it runs (cluster/control_plane.py): the control plane in a Ray
actor, two front-door actors and the prefill and decode workers, all detached; real vLLM
engines. The control plane's process is SIGKILLed while 8 streams run through the front
doors. Every stream must complete token for token as an uninterrupted run; Ray restarts the
control plane, which must find the same worker and front-door actors (same names: nothing
restarted) and serve Admin again: a scale-up must work afterwards. A model added while the
deployment ran (SIMULATED workers: they start in seconds) is taken over too, as every front door
still serves it: its workers are found under their names and it serves on.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import grpc
import pytest
import ray
import yaml

from duet.cluster.actor_names import named_actors
from duet.router.client import DuetClient, build_request
from duet.worker_runtime.simulated_engine import simulated_tokens
from duet.worker_runtime.simulated_host import simulated_model_shape
from simulated_models import simulated_model
from waiting import wait_for

STREAMS = 8
MAX_TOKENS = 300
ADDED = "duet-tiny-simulated"  # the model added while it runs


@pytest.fixture(scope="module")
def control_plane_apart(ray_session, duet_config, background_loop):
    from duet.cluster.control_plane import RemoteControlPlane

    server = duet_config.server.model_copy(update={"front_ends": 2, "port": 0, "http_port": 0})
    control = background_loop.run(RemoteControlPlane(duet_config.model_copy(update={"server": server})).start(), timeout=900)
    try:
        yield control
    finally:
        background_loop.run(control.stop(), timeout=180)


def test_control_plane_killed_under_load_fails_nothing_and_comes_back(control_plane_apart, reference, duet_config):
    import threading

    control = control_plane_apart
    target = f"127.0.0.1:{control.serving['port']}"
    with DuetClient(target) as client:
        assert client.add_model(yaml.safe_dump(simulated_model(ADDED)), timeout=300) == [
            f"{ADDED}: serving ({ADDED}/prefill-0, {ADDED}/decode-0)"
        ]
    actors_before = named_actors(control.deployment_id)
    assert len(actors_before) == 6, actors_before  # prefill, decode, the added model's two, two front doors
    prompts = [[(11 * index + offset) % 3000 + 10 for offset in range(50 + index)] for index in range(STREAMS)]
    expected = reference.greedy(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, list[int] | BaseException] = {}
    started = threading.Barrier(STREAMS + 1)

    def stream(index: int) -> None:
        with DuetClient(target) as client:
            tokens: list[int] = []
            try:
                messages = client.generate(build_request(prompt_token_ids=prompts[index], max_tokens=MAX_TOKENS, ignore_eos=True), timeout=600)
                for count, message in enumerate(messages):
                    tokens.extend(message.token_ids)
                    if count == 0:
                        started.wait(120)
                results[index] = tokens
            except BaseException as error:  # noqa: BLE001 - recorded and asserted below
                results[index] = error

    threads = [threading.Thread(target=stream, args=(index,), daemon=True) for index in range(STREAMS)]
    for thread in threads:
        thread.start()
    started.wait(300)  # every stream has its first token
    pid = ray.get(control.actor.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # While it is down (and after), the front doors serve new requests too.
    with DuetClient(target) as client:
        ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=8, ignore_eos=True), timeout=120)
    assert ids == expected[0][:8]
    for thread in threads:
        thread.join(600)
    for index in range(STREAMS):
        assert results[index] == expected[index], f"stream {index} failed or changed: {results[index]!r}"[:300]

    wait_for(lambda: control.restarts >= 1, 300, "the control plane back")
    back_s = time.monotonic() - killed_at
    assert control.serving["adopted"], "the control plane started anew instead of taking over"
    assert named_actors(control.deployment_id) == actors_before, "a worker or front door was restarted"
    with DuetClient(target) as client:
        status = client.status()
        assert {w.name: w.state for pool in status.pools for w in pool.workers} == {
            "prefill-0": "ready", "decode-0": "ready",
            f"{ADDED}/prefill-0": "ready (SIMULATED engine)", f"{ADDED}/decode-0": "ready (SIMULATED engine)",
        }
        assert list(status.served_models)[1:] == [ADDED]
        assert [door.state for door in status.front_ends] == ["ready", "ready"]
        ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=8, ignore_eos=True, model=ADDED), timeout=120)
        assert ids == simulated_tokens(prompts[0], 8, simulated_model_shape(duet_config)[1])
        # Scaling works again: the new control plane owns the pools.
        assert client.scale("decode", 2) == ["decode-1: starting"]
    wait_for(
        lambda: any(w.name == "decode-1" and w.state == "ready" for p in DuetClient(target).status().pools for w in p.workers),
        600, "decode-1 ready",
    )
    with DuetClient(target) as client:
        assert client.scale("decode", 1) == ["decode-1: draining"]
        # The taken-over model is the new control plane's to remove, on every front door.
        assert client.remove_model(ADDED) == [f"{ADDED}: removed ({ADDED}/prefill-0, {ADDED}/decode-0)"]
        with pytest.raises(grpc.RpcError) as refused:
            client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=2, model=ADDED), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    print(f"control plane killed: {STREAMS} streams completed exactly; back and in charge {back_s:.1f} s later")


def test_a_short_chaos_run_loses_duplicates_and_alters_nothing(control_plane_apart):
    """``duet bench chaos`` in small (benchmarks/chaos.py): 30 requests replayed without faults,
    then again while a front door and then the decode engine are SIGKILLed. Every request ends
    with the fault-free run's tokens or an explicit status, none lost or altered; the cluster is
    back at full capacity after each fault, and no process is left stopped."""
    from duet.benchmarks.apart_cluster import ClusterProcesses
    from duet.benchmarks.chaos import inject, run_chaos
    from duet.benchmarks.loadgen import build_requests
    from duet.cluster.placement.trace import synthetic

    control = control_plane_apart
    target = f"127.0.0.1:{control.serving['port']}"
    trace = synthetic(30, rate=1.0, lengths="uniform:300:40", seed=3)
    arrivals = [float(t - trace.arrival_s[0]) for t in trace.arrival_s]
    schedule = [(3.0, "kill-front-door"), (2.0, "kill-decode-engine")]
    processes = ClusterProcesses(control, target)
    report = run_chaos(processes, partial(inject, processes), build_requests(trace, seed=3), arrivals, schedule, recovery_timeout_s=300)

    assert sum(report.outcomes.values()) == 30
    assert report.altered_or_lost == 0, report.outcomes
    assert [fault.kind for fault in report.faults] == ["kill-front-door", "kill-decode-engine"], "the load ended too soon"
    assert all(fault.recovered_s is not None for fault in report.faults), report.faults
    assert report.stopped_processes_left == []
    print(f"chaos: {report.outcomes}, {report.resumed} resumed; recovered in {[f.recovered_s for f in report.faults]} s")
