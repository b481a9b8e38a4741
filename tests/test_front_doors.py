"""Several front doors on one port: a front door's death loses only its own requests.

A real deployment with two front doors (``server.front_ends: 2``: two front-door actors, both
listening on the same gRPC and HTTP ports; the control plane, this test's process, serves no
API) and real vLLM prefill and decode workers. Streams arrive on connections of their own,
which the kernel spreads over the two front doors; one front door's process is SIGKILLed while
it streams. What must hold:
every stream on the other front door completes token for token as an uninterrupted run; every
plain stream of the dead one ends with UNAVAILABLE (retriable), none silently short, and every
stream of a resuming client (``DuetClient.stream``) completes token-identical on the survivor;
no engine is restarted; the engines abort the dead front door's requests; new connections to
the same port are served at once; and the replacement front door (a new process) serves exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from duet.router.client import DuetClient, build_request
from duet.router.proto import duet_api_pb2 as pb
from waiting import front_doors, wait_for

# Every fourth plain (it must end UNAVAILABLE if its front door dies), the rest resilient (they
# must resume exactly); spread by the kernel over two front doors, some of each land on both.
STREAMS = 16
MAX_TOKENS = 300  # seconds of decoding: the streams are in flight when the front door dies
# The engines see a dead front door's connections close at once on one host; this only keeps
# a broken abort from hanging the test.
ABORT_WITHIN_S = 15.0


def _prompt(index: int) -> list[int]:
    return [(7 * index + offset) % 3000 + 10 for offset in range(40 + index)]


class Stream(threading.Thread):
    """One request on a connection of its own; keeps what it received and how it ended.
    A ``resilient`` one resumes on another front door when its stream breaks
    (:meth:`DuetClient.stream`), a plain one does not."""

    def __init__(self, target: str, prompt: list[int], resilient: bool = False, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.client = DuetClient(target)
        self.prompt = prompt
        self.resilient = resilient
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.finish = pb.FINISH_REASON_UNSPECIFIED
        self.error: grpc.StatusCode | None = None
        self.started = threading.Event()

    def run(self) -> None:
        request = build_request(prompt_token_ids=self.prompt, max_tokens=self.max_tokens, ignore_eos=True)
        try:
            messages = self.client.stream if self.resilient else self.client.generate
            for message in messages(request, timeout=600):
                self.tokens.extend(message.token_ids)
                self.finish = message.finish_reason
                self.started.set()
        except grpc.RpcError as error:
            self.error = error.code()
        finally:
            self.started.set()
            self.client.close()


@pytest.fixture(scope="module")
def two_front_doors(running_deployment, duet_config):
    # A batch job's lease of 3 s: a dead front door's job is taken over within seconds.
    batches = duet_config.server.batches.model_copy(update={"lease_s": 3.0})
    config = duet_config.model_copy(update={"server": duet_config.server.model_copy(update={"front_ends": 2, "batches": batches})})
    with running_deployment(config) as deployment:
        yield deployment


def test_status_lists_both_front_doors(two_front_doors):
    doors = front_doors(f"127.0.0.1:{two_front_doors.port}")
    assert [door.index for door in doors] == [1, 2]
    assert all(door.state == "ready" and door.pid > 0 for door in doors)
    assert len({door.pid for door in doors} | {os.getpid()}) == 3, "each front door is a process of its own"


def test_the_autoscaler_sees_every_front_doors_load(two_front_doors):
    """The control plane serves no request itself: its autoscaler's load is every front
    door's window of its model, summed (cluster/front_doors.py, FrontDoorSet.sample)."""
    deployment = two_front_doors
    load = deployment.front_doors.load_of(deployment.default.name)  # what its autoscaler reads
    deployment.background.run(load.sample(60.0), timeout=30)  # a fresh window
    sent = 6
    for index in range(sent):  # a connection each: the kernel spreads them over both front doors
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            client.generate_ids(build_request(prompt_token_ids=_prompt(index), max_tokens=4, ignore_eos=True), timeout=120)
    window, overdue = deployment.background.run(load.sample(60.0), timeout=30)
    assert (window.arrivals, len(window.ttfts_s), len(window.finished), overdue) == (sent, sent, sent, 0)
    assert window.prompt_tokens == sum(len(_prompt(index)) for index in range(sent))


def test_every_front_door_routes_by_the_engines_load(two_front_doors):
    """Front doors apart ping no engine: the control plane's health pings bring them each
    decode engine's KV use and running requests (for ``least_kv_load``), so both front doors
    see a stream that only one of them serves."""
    deployment = two_front_doors
    # 3,000 tokens: seconds of decoding at any speed this machine runs at, several load reports
    # (one per health period, 1 s) while it runs.
    stream = Stream(f"127.0.0.1:{deployment.port}", _prompt(3), max_tokens=3000)
    stream.start()

    def decode_load_per_door() -> list[tuple[float, int]]:
        def load(actor) -> tuple[float, int]:
            member = actor.models[actor.config.model.name].pools["decode"].find("decode-0")
            return member.kv_usage, member.running

        return [ray.get(door.actor.__ray_call__.remote(load), timeout=30) for door in deployment.front_doors.doors]

    try:
        assert stream.started.wait(120) and stream.error is None
        wait_for(lambda: all(kv > 0 and running >= 1 for kv, running in decode_load_per_door()), 30,
                 "both front doors seeing the decode engine's load")
    finally:
        stream.join(600)
    assert stream.error is None and len(stream.tokens) == 3000
    wait_for(lambda: all(running == 0 for _, running in decode_load_per_door()), 30, "both front doors seeing it idle again")


def test_front_door_killed_under_load_loses_only_its_own_requests(two_front_doors, reference):
    deployment = two_front_doors
    target = f"127.0.0.1:{deployment.port}"
    workers = deployment.prefill.members + deployment.decode.members
    restarts_before = {member.name: member.restarts for member in workers}
    victim, survivor = front_doors(target)
    prompts = [_prompt(index) for index in range(STREAMS)]
    expected = reference.greedy(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)

    streams = [Stream(target, prompt, resilient=index % 4 != 0) for index, prompt in enumerate(prompts)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(300), "a stream never got its first token"
    # Both front doors must have streams in flight when one dies, or the test proves nothing.
    def both_streaming() -> list[pb.FrontEnd] | None:
        doors = front_doors(target)
        return doors if all(door.requests_inflight > 0 for door in doors) else None

    doors = wait_for(both_streaming, 60, "both front doors streaming")
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # The engines abort what the dead front door left: no request of its client index runs or
    # waits in any engine (a finished prefill's KV awaiting a pull is the KV lease's).
    def dead_client_gone() -> bool:
        held = [deployment.background.run(m.engine.requests_by_client(), timeout=30) for m in workers]
        return all(victim.index not in by_client for by_client in held)

    wait_for(dead_client_gone, ABORT_WITHIN_S, "the dead front door's requests aborted in the engines")
    aborted_s = time.monotonic() - killed_at

    # New connections are served at once, by the survivor (the kernel drops the dead listener).
    with DuetClient(target) as client:
        ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=8, ignore_eos=True), timeout=120)
    assert ids == expected[0][:8]

    for stream in streams:
        stream.join(600)
    lost = [s for s in streams if s.error is not None]
    completed = [s for s in streams if s.error is None]
    resumed = [s for s in completed if s.client.resumes]
    assert all(s.error == grpc.StatusCode.UNAVAILABLE for s in lost), "a dead front door's stream must end retriably"
    assert resumed, "no resilient stream was on the dead front door (16 streams over two front doors)"
    assert not any(s.resilient for s in lost), "a resilient client's stream was lost"
    assert 0 < len(lost) + len(resumed) <= doors[0].requests_inflight, "only the dead front door's streams may break"
    for stream in completed:
        assert stream.finish == pb.FINISH_REASON_LENGTH
        assert stream.tokens == expected[prompts.index(stream.prompt)], "a surviving or resumed stream changed"

    assert front_doors(target)[1].pid == survivor.pid, "the other front door was restarted"
    assert {m.name: m.restarts for m in workers} == restarts_before, "an engine was restarted"
    assert all(m.state == "ready" for m in workers)

    def replacement_ready() -> pb.FrontEnd | None:
        door = front_doors(target)[0]
        return door if door.state == "ready" else None

    replacement = wait_for(replacement_ready, 300, "the replacement front door ready")
    assert replacement.pid != victim.pid and replacement.restarts == 1
    # New connections until one lands on the replacement; it must serve exactly.
    for attempt in range(40):
        with DuetClient(target) as client:
            ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[1], max_tokens=16, ignore_eos=True), timeout=120)
        assert ids == expected[1][:16]
        if front_doors(target)[0].requests_served > 0:
            break
    else:
        pytest.fail("40 new connections, none served by the replacement front door")
    print(
        f"front door killed: {len(lost)} plain stream(s) lost, {len(resumed)} resilient one(s) resumed exactly, "
        f"{len(completed)} completed; aborted in the engines within {aborted_s:.1f} s"
    )


def test_admin_and_status_answer_on_every_front_door(two_front_doors):
    """Fresh connections land on either front door; each answers Admin and status (the
    control plane's view, carried over its private socket by the front-door actor)."""
    target = f"127.0.0.1:{two_front_doors.port}"
    # The engines' statistics reach the control plane, though its front end sends no request:
    # the KV transfers of requests the front doors served are counted.
    def decode_transfers() -> int:
        with DuetClient(target) as client:
            client.generate_ids(build_request("count my transfer", max_tokens=4, ignore_eos=True), timeout=120)
            (decode,) = [w for pool in client.status().pools if pool.role == "decode" for w in pool.workers]
        return decode.kv_transfers if decode.kv_transfer_bytes > 0 else 0

    wait_for(decode_transfers, 30, "the front doors' KV transfers counted by the control plane")
    for _ in range(8):
        with DuetClient(target) as client:
            listed = client.list_workers()
            assert {pool.role for pool in listed.pools} == {"prefill", "decode"}
            assert len(listed.front_ends) == 2
            with pytest.raises(grpc.RpcError) as refused:
                client.scale("prefill", 0)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at least 1 worker" in refused.value.details()


def test_openai_http_is_served_by_every_front_door(two_front_doors):
    """The HTTP port is shared as the gRPC one is: requests on fresh connections land on both
    front doors, and each answers exactly."""
    import httpx

    target = f"127.0.0.1:{two_front_doors.port}"
    prompt = "the same prompt on every front door"
    with DuetClient(target) as client:
        expected, _ = client.generate_ids(build_request(prompt, max_tokens=8, ignore_eos=True), timeout=120)
    served_before = [door.requests_served for door in front_doors(target)]
    for _ in range(12):
        reply = httpx.post(  # a new connection each time
            f"http://127.0.0.1:{two_front_doors.http_port}/v1/completions",
            json={
                "model": "duet-tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected
    served = [door.requests_served - before for door, before in zip(front_doors(target), served_before)]
    assert sum(served) == 12 and all(count > 0 for count in served), f"requests per front door: {served}"


def test_load_generator_spreads_its_connections_over_the_front_doors(two_front_doors):
    """`duet bench serve`'s client with several connections (as it drives duet-disagg-2fd):
    the kernel spreads them over both front doors, and every request is served."""
    import asyncio

    from duet.benchmarks.loadgen import replay
    from duet.cluster.placement.trace import synthetic

    target = f"127.0.0.1:{two_front_doors.port}"
    served_before = [door.requests_served for door in front_doors(target)]
    records = asyncio.run(replay(target, synthetic(24, 12.0, lengths="fixed:64:8", seed=3), seed=0, timeout_s=120, connections=8))
    assert all(not record.error for record in records) and len(records) == 24
    served = [door.requests_served - before for door, before in zip(front_doors(target), served_before)]
    assert sum(served) == 24 and all(count > 0 for count in served), f"requests per front door: {served}"


def test_a_batch_job_outlives_the_front_door_running_it(two_front_doors, reference):
    """The front door that holds a batch job's lease is SIGKILLed mid-job: another front door
    takes the job over once the lease is stale and runs only what has no result yet; every
    line is answered once, exactly as the reference engine answers it."""
    import json

    import openai

    from duet.batch.http_api import batch_store_path

    deployment = two_front_doors
    target = f"127.0.0.1:{deployment.port}"
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=2)
    prompts = [_prompt(index) for index in range(48)]  # six waves of the job's 8 in flight, seconds each
    lines = [
        {"custom_id": f"line-{index}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "duet-tiny-llama", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True,
                  "temperature": 0, "return_token_ids": True}}
        for index, prompt in enumerate(prompts)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = sdk.files.create(file=("job.jsonl", content), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    folder = os.path.join(batch_store_path(deployment.config.server.batches, deployment.port), "batches", batch.id)

    def running_with_results() -> int | None:
        try:
            with open(os.path.join(folder, "lease")) as lease, open(os.path.join(folder, "results.jsonl")) as results:
                holder, done = int(lease.read().split(":")[1]), len(results.read().splitlines())
        except (FileNotFoundError, IndexError, ValueError):
            return None
        return holder if 2 <= done < len(lines) - 16 else None

    holder = wait_for(running_with_results, 120, "the job running, a few lines done")
    assert holder in {door.pid for door in front_doors(target)}
    os.kill(holder, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, f"the job was not finished after its front door died: {batch.status}"
        time.sleep(0.5)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
    outputs = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [output["custom_id"] for output in outputs] == [line["custom_id"] for line in lines]
    expected = reference.greedy(prompts, max_tokens=1000, ignore_eos=True)
    for output, tokens in zip(outputs, expected):
        assert output["response"]["body"]["choices"][0]["token_ids"] == tokens, output["custom_id"]
    with open(os.path.join(folder, "results.jsonl")) as results:
        written = [json.loads(line)["line"] for line in results.read().splitlines()]
    assert sorted(written) == list(range(1, len(lines) + 1)), "every line answered once, none again"
    print(f"batch job: {len(written)} results written for {len(lines)} lines after its front door was killed")
