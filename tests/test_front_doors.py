"""Several front doors on one port: a front door's death loses only its own requests.

A real deployment with two front doors (``server.front_ends: 2``: the control plane's process
and one front-door actor, both listening on the same gRPC port) and real vLLM prefill and
decode workers. Streams arrive on connections of their own, which the kernel spreads over the
two front doors; the front-door actor's process is SIGKILLed while it streams. What must hold:
every stream on the other front door completes token for token as an uninterrupted run; every
stream of the dead one ends with UNAVAILABLE (retriable), none silently short; no engine is
restarted; the engines abort the dead front door's requests; new connections to the same port
are served at once; and the replacement front door (a new process) serves exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest

from duet.router.client import DuetClient, build_request
from duet.router.proto import duet_api_pb2 as pb

STREAMS = 12
MAX_TOKENS = 300  # seconds of decoding: the streams are in flight when the front door dies
# The engines see a dead front door's connections close at once on one host; this only keeps
# a broken abort from hanging the test.
ABORT_WITHIN_S = 15.0


def _prompt(index: int) -> list[int]:
    return [(7 * index + offset) % 3000 + 10 for offset in range(40 + index)]


class Stream(threading.Thread):
    """One request on a connection of its own; keeps what it received and how it ended."""

    def __init__(self, target: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client = DuetClient(target)
        self.prompt = prompt
        self.tokens: list[int] = []
        self.finish = pb.FINISH_REASON_UNSPECIFIED
        self.error: grpc.StatusCode | None = None
        self.started = threading.Event()

    def run(self) -> None:
        request = build_request(prompt_token_ids=self.prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        try:
            for message in self.client.generate(request, timeout=600):
                self.tokens.extend(message.token_ids)
                self.finish = message.finish_reason
                self.started.set()
        except grpc.RpcError as error:
            self.error = error.code()
        finally:
            self.started.set()
            self.client.close()


def _front_doors(target: str) -> list[pb.FrontEnd]:
    with DuetClient(target) as client:
        return list(client.status().front_ends)


def _wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(0.2)
    return result


@pytest.fixture(scope="module")
def two_front_doors(running_deployment, duet_config):
    config = duet_config.model_copy(update={"server": duet_config.server.model_copy(update={"front_ends": 2})})
    with running_deployment(config) as deployment:
        yield deployment


def test_status_lists_both_front_doors(two_front_doors):
    doors = _front_doors(f"127.0.0.1:{two_front_doors.port}")
    assert [door.index for door in doors] == [0, 1]
    assert all(door.state == "ready" and door.pid > 0 for door in doors)
    assert doors[0].pid == os.getpid() and doors[1].pid != doors[0].pid, "the front-door actor is a process of its own"


def test_front_door_killed_under_load_loses_only_its_own_requests(two_front_doors, reference):
    deployment = two_front_doors
    target = f"127.0.0.1:{deployment.port}"
    workers = deployment.prefill.members + deployment.decode.members
    restarts_before = {member.name: member.restarts for member in workers}
    victim = _front_doors(target)[1]
    prompts = [_prompt(index) for index in range(STREAMS)]
    expected = reference.greedy(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)

    streams = [Stream(target, prompt) for prompt in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(300), "a stream never got its first token"
    # Both front doors must have streams in flight when one dies, or the test proves nothing.
    def both_streaming() -> list[pb.FrontEnd] | None:
        doors = _front_doors(target)
        return doors if all(door.requests_inflight > 0 for door in doors) else None

    doors = _wait_for(both_streaming, 60, "both front doors streaming")
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # New connections are served at once, by the survivor (the kernel drops the dead listener).
    with DuetClient(target) as client:
        ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=8, ignore_eos=True), timeout=120)
    assert ids == expected[0][:8]

    for stream in streams:
        stream.join(600)
    lost = [s for s in streams if s.error is not None]
    completed = [s for s in streams if s.error is None]
    assert {s.error for s in lost} == {grpc.StatusCode.UNAVAILABLE}, "a dead front door's stream must end retriably"
    assert 0 < len(lost) <= doors[1].requests_inflight, "only the dead front door's streams may fail"
    for stream in completed:
        assert stream.finish == pb.FINISH_REASON_LENGTH
        assert stream.tokens == expected[prompts.index(stream.prompt)], "a surviving stream changed"

    # The engines abort what the dead front door left: no request of client 1 remains.
    def client_one_gone() -> bool:
        held = [deployment.background.run(m.engine.requests_by_client(), timeout=30) for m in workers]
        return all(1 not in by_client for by_client in held)

    _wait_for(client_one_gone, ABORT_WITHIN_S, "the dead front door's requests aborted in the engines")
    aborted_s = time.monotonic() - killed_at
    assert {m.name: m.restarts for m in workers} == restarts_before, "an engine was restarted"
    assert all(m.state == "ready" for m in workers)

    def replacement_ready() -> pb.FrontEnd | None:
        door = _front_doors(target)[1]
        return door if door.state == "ready" else None

    replacement = _wait_for(replacement_ready, 300, "the replacement front door ready")
    assert replacement.pid != victim.pid and replacement.restarts == 1
    # New connections until one lands on the replacement; it must serve exactly.
    for attempt in range(40):
        with DuetClient(target) as client:
            ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[1], max_tokens=16, ignore_eos=True), timeout=120)
        assert ids == expected[1][:16]
        if _front_doors(target)[1].requests_served > 0:
            break
    else:
        pytest.fail("40 new connections, none served by the replacement front door")
    print(f"front door killed: {len(lost)} stream(s) lost, {len(completed)} completed; aborted in the engines within {aborted_s:.1f} s")


def test_admin_and_status_answer_on_every_front_door(two_front_doors):
    """Fresh connections land on either front door; each answers Admin and status (the
    control plane's view, carried over its private socket by the front-door actor)."""
    target = f"127.0.0.1:{two_front_doors.port}"
    for _ in range(8):
        with DuetClient(target) as client:
            listed = client.list_workers()
            assert {pool.role for pool in listed.pools} == {"prefill", "decode"}
            assert len(listed.front_ends) == 2
            with pytest.raises(grpc.RpcError) as refused:
                client.scale("prefill", 0)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at least 1 worker" in refused.value.details()
