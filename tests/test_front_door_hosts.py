"""Front doors on hosts of their own: the KubeRay manifests' commands (`duet deploy render
--front-doors 2`) on virtual hosts, a front door killed mid-stream.

Five network namespaces on one machine (deploy/hosts.py): the head runs Ray's head and duet's
control plane, two front-door hosts each run a Ray node advertising ``duet_front_end`` (on
which the control plane starts a front door), prefill and decode run on hosts of their own; the
client is this process, a host of its own. Every token between a worker and a front door
crosses the shaped links. One front door's process is SIGKILLed while streams run through
``DuetClient`` with both front doors' addresses: every stream must complete token-identical to
a colocated engine, the engines must not restart, and the dead front door's replacement must
come back on a front-door host at new addresses (the engine cores' client moved there,
worker_runtime/engine_clients.py) and serve exactly. OpenAI clients (HTTP, the ``openai`` SDK)
streaming at the same time, on each front door: only those on the dead one fail, each with a
connection error (what the SDK retries, and the caller resends: docs/concepts/failures.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from duet.deploy.hosts import HostsUnavailable, LinkShape
from duet.deploy.render import RenderOptions
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts
from duet.router.client import DuetClient, build_request
from waiting import wait_for

STREAMS = 8
MAX_TOKENS = 400  # seconds of decoding: the streams are in flight when the front door dies


def _prompt(index: int) -> list[int]:
    return [(13 * index + offset) % 690 + 3 for offset in range(30 + 7 * index)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[VirtualCluster]:
    try:
        with serve_on_hosts({}, LinkShape(rate_mbit=1000), options=RenderOptions(front_doors=2)) as running:
            yield running
    except HostsUnavailable as error:
        pytest.skip(f"network namespaces cannot be made here: {error}")


class Stream(threading.Thread):
    """One resuming stream with both front doors' addresses, first ``targets[0]``."""

    def __init__(self, cluster: VirtualCluster, targets: list[str], prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.client = DuetClient(targets, api_key=cluster.secrets.api_key)
        self.prompt = prompt
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.started = threading.Event()
        self.longest_gap_s = 0.0  # between two messages: a resumed stream's pause

    def run(self) -> None:
        request = build_request(prompt_token_ids=self.prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        last = time.monotonic()
        try:
            for message in self.client.stream(request, timeout=600):
                self.tokens.extend(message.token_ids)
                self.longest_gap_s = max(self.longest_gap_s, time.monotonic() - last)
                last = time.monotonic()
                self.started.set()
        except Exception as error:  # asserted on below
            self.error = error
        finally:
            self.started.set()
            self.client.close()


class OpenAIStream(threading.Thread):
    """One streamed completion through the ``openai`` SDK, on one front door's HTTP port."""

    def __init__(self, cluster: VirtualCluster, host: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        port = cluster.launch.head_config.config.server.http_port
        # No retries: the test sees what a broken stream gives the caller.
        self.sdk = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=cluster.secrets.api_key, max_retries=0)
        self.model = cluster.launch.head_config.config.model.name
        self.prompt = prompt
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.sdk.completions.create(
                model=self.model, prompt=self.prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}, timeout=600,
            ):
                if chunk.choices:
                    self.tokens.extend(chunk.choices[0].model_extra["token_ids"])
                    self.started.set()
        except Exception as error:  # asserted on below
            self.error = error
        finally:
            self.started.set()
            self.sdk.close()


def test_front_doors_run_on_their_own_hosts(cluster: VirtualCluster) -> None:
    with cluster.client() as client:
        doors = client.status().front_ends
    addresses = {cluster.network[host].address for host in cluster.serving_hosts}
    assert cluster.serving_hosts == ["front-door-0", "front-door-1"]
    assert [door.state for door in doors] == ["ready", "ready"]
    assert {door.host for door in doors} == addresses, "each front door serves on a front-door host of its own"


def test_front_door_killed_mid_stream_loses_no_request(cluster: VirtualCluster, reference) -> None:
    prompts = [_prompt(i) for i in range(STREAMS)]
    expected = reference.greedy(prompts, MAX_TOKENS, ignore_eos=True)
    http_prompts = prompts[:4]  # two on each front door, with the same prompts as gRPC streams
    first, second = cluster.targets
    with cluster.client() as client:
        doors = client.status().front_ends
        restarts_before = {w.name: w.restarts for pool in client.status().pools for w in pool.workers}
    victim = next(door for door in doors if door.host == first.rsplit(":", 1)[0])
    streams = [Stream(cluster, [first, second] if i % 2 == 0 else [second, first], p) for i, p in enumerate(prompts)]
    http_streams = [
        OpenAIStream(cluster, (first if i % 2 == 0 else second).rsplit(":", 1)[0], p) for i, p in enumerate(http_prompts)
    ]
    for stream in [*streams, *http_streams]:
        stream.start()
    for stream in [*streams, *http_streams]:
        assert stream.started.wait(120), "a stream got no token"
    # The victim's streams still well short of their end (under load, the first may be nearly
    # done by the time the last has started: one finished before the kill in a CI run).
    in_flight = [stream for stream in streams[0::2] if len(stream.tokens) < MAX_TOKENS - 40]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for stream in streams:
        stream.join(600)
    drained_s = time.monotonic() - killed_at
    assert [s.error for s in streams] == [None] * STREAMS, "a stream ended in an error"
    assert in_flight, "every stream on the killed front door was done before it died: nothing resumed"
    assert all(s.client.resumes for s in in_flight), "the streams on the killed front door did not resume on the other"
    resumed = sum(s.client.resumes for s in streams)
    pause_s = max(s.longest_gap_s for s in streams if s.client.resumes)
    for stream, want in zip(streams, expected):
        assert stream.tokens == want, "a stream differs from the colocated engine"
    for stream in http_streams:
        stream.join(600)
    on_victim, on_survivor = http_streams[0::2], http_streams[1::2]
    # The dead front door's HTTP streams broke with a connection error (no [DONE], nothing more);
    # the survivor's completed exactly.
    for stream in on_victim:
        assert isinstance(stream.error, (openai.APIConnectionError, httpx.TransportError)), repr(stream.error)
        assert stream.tokens == expected[http_streams.index(stream)][: len(stream.tokens)], "a broken stream sent a wrong token"
    for stream in on_survivor:
        assert stream.error is None, repr(stream.error)
        assert stream.tokens == expected[http_streams.index(stream)], "an OpenAI stream on the survivor differs"

    def replaced() -> bool:
        with cluster.client() as client:  # its first address is the dead front door's: status fails over
            door = client.status().front_ends[victim.index - 1]
        return door.state == "ready" and door.pid != victim.pid

    wait_for(replaced, 180, "the killed front door's replacement")
    back_s = time.monotonic() - killed_at
    wait_for(lambda: cluster.serves(first), 60, "the replacement serving on its host's port")
    with DuetClient(first, api_key=cluster.secrets.api_key) as client:
        try:
            got, last = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120)
        except grpc.RpcError as error:  # once in CI (stop 67): it hung; what the processes saw, for next time
            pytest.fail(f"the replacement front door did not serve: {error.code()}\n{cluster.warnings()}")
        status = client.status()
    assert got == expected[0], "the replacement front door did not serve exactly"
    restarts_after = {w.name: w.restarts for pool in status.pools for w in pool.workers}
    assert restarts_after == restarts_before, "an engine was restarted"
    assert status.front_ends[victim.index - 1].restarts == 1
    assert f"front door {victim.index} (pid {victim.pid}) died" in cluster.warnings(1000), "the report has the control plane's warning"
    print(
        f"front door on {victim.host} killed under {STREAMS} streams: {resumed} resumed on the other host "
        f"(longest pause {pause_s:.2f} s), all {STREAMS} token-identical; OpenAI streams: "
        f"{[type(s.error).__name__ for s in on_victim]} on it, {len(on_survivor)} exact on the other; streams done {drained_s:.1f} s after the kill; "
        f"replacement ready {back_s:.1f} s after it; 0 engines restarted"
    )
