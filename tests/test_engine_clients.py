"""One engine core, several front doors: a front door killed mid-stream loses nothing else and
leaves nothing behind in the engine, and its replacement attaches to the running engine.

A real worker actor launches a real vLLM engine core (the built-in tiny model, float32) with two
clients: front end 0 in this process and front end 1 in a process of its own
(tests/engine_client_process.py), as two front doors hold them. Front end 1's process is
SIGKILLed while it streams a long request; the engine must abort that request (its KV freed)
while front end 0's stream goes on unchanged, and a new process that listens on the dead one's
addresses must attach as client 1 and stream exactly what front end 0 does; so must one that
listens elsewhere (a front door replaced on another host) once front end 0 moves client 1 there;
the engine is never restarted (worker_runtime/engine_clients.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from duet.config import DuetConfig
from duet.worker_runtime.worker_api import EngineAddresses, SamplingSpec
from duet.router.engine_front_end import EngineFrontEnd, FrontEndListeners

CLIENT_PROCESS = Path(__file__).with_name("engine_client_process.py")
PREFIX = "duet-client: "  # engine_client_process.PREFIX
PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
# Long enough to outlast the whole test at any speed: a request that ends by itself proves
# nothing about the abort.
ORPHAN_TOKENS = 3_000
STREAM_TOKENS = 300
# A front door's death is seen at once on one host (the kernel closes its connections); this
# only keeps a broken abort from hanging the test.
ABORT_WITHIN_S = 15.0


class ClientProcess:
    """tests/engine_client_process.py, started and read line by line."""

    def __init__(self, client: int, count: int, addresses: EngineAddresses | None = None) -> None:
        args = [sys.executable, str(CLIENT_PROCESS), str(client), str(count)]
        if addresses is not None:
            args.append(json.dumps({"input": addresses.input, "output": addresses.output}))
        # A replacement that never hears the engine's greeting must fail, not wait 10 minutes.
        env = {**os.environ, "VLLM_ENGINE_READY_TIMEOUT_S": "60"}
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.addresses = EngineAddresses(**json.loads(self.readline()))

    def readline(self) -> str:
        """Its next line (vLLM's log lines, also on standard output, skipped)."""
        while True:
            line = self.process.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"the front end process exited ({self.process.wait()})")
            if line.startswith(PREFIX):
                return line[len(PREFIX):].strip()

    def stream(self, config_path: Path, request_id: str, max_tokens: int) -> None:
        request = {"id": request_id, "prompt": PROMPT, "max_tokens": max_tokens}
        self.process.stdin.write(f"{config_path}\n{json.dumps(request)}\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        assert self.readline() == "connected"

    def tokens(self) -> list[int]:
        """Every token it prints until ``done``."""
        tokens: list[int] = []
        while (line := self.readline()) != "done":
            tokens.extend(json.loads(line))
        return tokens

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()


async def _collect(front_end: EngineFrontEnd, request_id: str, max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async for chunk in front_end.decode(request_id, PROMPT, SamplingSpec(max_tokens=max_tokens, ignore_eos=True), None, None, ""):
        tokens.extend(chunk.token_ids)
    return tokens


async def _requests_by_client(front_end: EngineFrontEnd) -> dict[int, int]:
    return await front_end.engine.engine_core.call_utility_async("duet_requests_by_client")


async def _front_door_dies_and_is_replaced(actor: Any, config_path: Path, own: FrontEndListeners, dead: ClientProcess) -> dict[str, Any]:
    import ray

    vllm_config = await actor.engine_config.remote()
    front_end = await EngineFrontEnd.connect("worker", actor, vllm_config, own, DuetConfig().kv_transfer, client=(0, 2))
    try:
        reference = await _collect(front_end, "reference", STREAM_TOKENS)
        dead.stream(config_path, "orphan", ORPHAN_TOKENS)
        assert json.loads(dead.readline()), "the orphan's first chunk"
        ours = asyncio.create_task(_collect(front_end, "ours", STREAM_TOKENS))
        while (await _requests_by_client(front_end)).get(0) is None:
            await asyncio.sleep(0.01)
        before_kill = await _requests_by_client(front_end)
        dead.kill()
        killed_at = time.monotonic()
        while 1 in (after := await _requests_by_client(front_end)) and time.monotonic() - killed_at < ABORT_WITHIN_S:
            await asyncio.sleep(0.05)
        aborted_s = time.monotonic() - killed_at
        survivor = await ours
        replacement = await asyncio.to_thread(ClientProcess, 1, 2, dead.addresses)
        try:
            await asyncio.to_thread(replacement.stream, config_path, "replacement", STREAM_TOKENS)
            replaced = await asyncio.to_thread(replacement.tokens)
        finally:
            replacement.kill()
        elsewhere = await asyncio.to_thread(ClientProcess, 1, 2)  # new ports: "another host"
        try:
            await front_end.move_client(1, elsewhere.addresses)
            await asyncio.to_thread(elsewhere.stream, config_path, "moved", STREAM_TOKENS)
            moved = await asyncio.to_thread(elsewhere.tokens)
            after_move = await _collect(front_end, "after-move", STREAM_TOKENS)
        finally:
            elsewhere.kill()
        status = ray.get(actor.status.remote())
        return {
            "reference": reference, "survivor": survivor, "replaced": replaced, "before_kill": before_kill,
            "after": after, "aborted_s": aborted_s, "idle": await _requests_by_client(front_end),
            "state": status.state, "addresses": replacement.addresses, "moved": moved,
            "moved_addresses": elsewhere.addresses, "after_move": after_move,
        }
    finally:
        front_end.close()


def test_front_door_killed_mid_stream_is_aborted_in_the_engine_and_replaced(ray_session, duet_config, tmp_path):
    import cloudpickle
    import ray

    from duet.decode_worker.worker import ColocatedWorker

    actor = ray.remote(ColocatedWorker).options(max_concurrency=ColocatedWorker.max_concurrency, num_cpus=0).remote(
        "colocated-clients", duet_config, None
    )
    dead = ClientProcess(1, 2)
    own = FrontEndListeners.bind("127.0.0.1")
    try:
        ray.get(actor.start.remote([own.addresses, dead.addresses]), timeout=300)
        config_path = tmp_path / "vllm_config.pkl"
        config_path.write_bytes(cloudpickle.dumps(ray.get(actor.engine_config.remote())))
        result = asyncio.run(_front_door_dies_and_is_replaced(actor, config_path, own, dead))
    finally:
        dead.kill()
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor, no_restart=True)
    assert result["before_kill"] == {0: 1, 1: 1}, "each front door's request is the engine's, by client"
    assert 1 not in result["after"], f"the dead front door's request still held {result['aborted_s']:.1f} s later"
    assert len(result["reference"]) == STREAM_TOKENS
    assert result["survivor"] == result["reference"], "the other front door's stream changed"
    assert result["addresses"] == dead.addresses, "the replacement listens where the dead front door did"
    assert result["replaced"] == result["reference"], "the replacement did not serve exactly"
    assert result["moved_addresses"] != dead.addresses
    assert result["moved"] == result["reference"], "the front door at new addresses did not serve exactly"
    assert result["after_move"] == result["reference"], "client 0 was disturbed by the move"
    assert result["idle"] == {}, "a request was left in the engine"
    assert result["state"] == "ready", "the engine core was restarted or lost"


def test_client_connections_greet_only_after_a_drop():
    import zmq

    from duet.worker_runtime.engine_clients import ClientConnections

    connections = ClientConnections(2)
    assert connections.on_event(0, zmq.EVENT_HANDSHAKE_SUCCEEDED) is None  # vLLM's own greeting
    assert connections.on_event(0, zmq.EVENT_DISCONNECTED) == "abort"
    assert connections.on_event(0, zmq.EVENT_DISCONNECTED) is None  # aborted once
    assert connections.on_event(1, zmq.EVENT_HANDSHAKE_SUCCEEDED) is None  # the other client is untouched
    assert connections.on_event(0, zmq.EVENT_HANDSHAKE_SUCCEEDED) == "greet"
    assert connections.on_event(0, zmq.EVENT_HANDSHAKE_SUCCEEDED) is None


def test_scheduler_statistics_go_to_the_control_plane_client():
    """A step's scheduler statistics ride on the outputs of whichever client had some; with
    several clients, counts go to client 0 (the control plane's front end) as a message of their
    own, right after, and gauges at most once a second; the outputs go on to their client."""
    import queue

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    from duet.worker_runtime.engine_clients import StatsToFirstClient

    def step(client: int, stats: SchedulerStats) -> tuple[int, EngineCoreOutputs]:
        return client, EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5])], scheduler_stats=stats)

    inner: queue.Queue = queue.Queue()
    gauges, later_gauges = SchedulerStats(num_running_reqs=3), SchedulerStats(num_running_reqs=2)
    counts = SchedulerStats(kv_connector_stats={"transfers": 1})
    for item in (step(1, gauges), step(2, later_gauges), step(1, counts), (0, EngineCoreOutputs(scheduler_stats=SchedulerStats()))):
        inner.put(item)
    outputs = StatsToFirstClient(inner)
    client, first = outputs.get()
    assert client == 1 and first.outputs[0].new_token_ids == [5] and first.scheduler_stats is None
    client, moved = outputs.get_nowait()
    assert client == 0 and moved.scheduler_stats is gauges and not moved.outputs
    client, kept = outputs.get(timeout=1)
    assert client == 2 and kept.scheduler_stats is later_gauges, "gauges again within the second stay where they were"
    client, third = outputs.get()
    assert client == 1 and third.scheduler_stats is None
    client, moved_counts = outputs.get()
    assert client == 0 and moved_counts.scheduler_stats is counts, "counts always go to client 0"
    client, own = outputs.get()
    assert client == 0 and own.scheduler_stats is not None
    with pytest.raises(queue.Empty):
        outputs.get_nowait()
