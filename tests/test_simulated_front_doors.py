"""Several front doors over SIMULATED workers: each worker has a channel to every front door.

SIMULATED engines exist for control-plane scale tests and what-if planning
(worker_runtime/simulated_engine.py); this is what lets ``duet bench router`` measure the
serving path with more than one front door. A real deployment (real front-door actors, the
real control plane and router, real SIMULATED worker actors and their channels) with two front
doors: both serve; when one's process is SIGKILLed mid-stream, a resuming client's streams
complete token for token (a SIMULATED engine's tokens are a function of the prompt), the
workers abort what came over the dead front door's channels (nothing is left running in
them), no worker is restarted, and the replacement front door, listening where the dead one
did, is dialled again by every worker and serves.

It serves two models (``models:``), and every front door serves both: each model's requests
go to its own workers whichever front door they reach; a third model added through the Admin
API while the others serve is served by every front door, the replacement included, and once
removed it is refused by every one.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml

from duet.config import MODEL_SECTIONS, load_config, parse_config
from duet.router.client import DuetClient, build_request
from duet.worker_runtime.simulated_engine import simulated_tokens
from simulated_models import simulated_model
from waiting import front_doors, wait_for

STREAMS = 24
MAX_TOKENS = 400  # several seconds of simulated decode steps: in flight when the front door dies


OTHER = "simulated-other"  # the second model listed
ADDED = "simulated-added"  # the model added while the deployment runs


@pytest.fixture(scope="module")
def simulated_front_doors(running_deployment):
    data = {key: value for key, value in load_config().model_dump().items() if key not in MODEL_SECTIONS}
    data["models"] = [simulated_model(load_config().model.name, 2), simulated_model(OTHER, 1)]
    data["server"].update(metrics_port=None, http_port=None, front_ends=2)
    with running_deployment(parse_config(data, "simulated front doors test")) as deployment:
        yield deployment


def _stream(target: str, prompt: list[int]) -> tuple[list[int], int]:
    """One resuming stream on a connection of its own: (tokens, resumes)."""
    with DuetClient(target) as client:
        request = build_request(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = [token for message in client.stream(request, timeout=120) for token in message.token_ids]
        return tokens, client.resumes


def test_a_simulated_front_door_dies_and_its_replacement_is_dialled_again(simulated_front_doors):
    deployment = simulated_front_doors
    target = f"127.0.0.1:{deployment.port}"
    vocab = deployment.service.limits.vocab_size
    workers = deployment.prefill.members + deployment.decode.members
    restarts_before = {member.name: member.restarts for member in workers}
    victim, survivor = front_doors(target)
    prompts = [[(index * 13) % 500 + 3] * (30 + index) for index in range(STREAMS)]

    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(_stream, target, prompt) for prompt in prompts]
        # Every stream placed (so none can still land on the victim after the count is read),
        # and both front doors carrying some.
        doors = wait_for(
            lambda: (d := front_doors(target))
            and sum(door.requests_inflight for door in d) == STREAMS
            and all(door.requests_inflight > 0 for door in d)
            and d,
            60, "every stream in flight, on both front doors",
        )
        os.kill(victim.pid, signal.SIGKILL)
        results = [stream.result() for stream in streams]

    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == simulated_tokens(prompt, MAX_TOKENS, vocab), "a stream changed"
    resumed = sum(1 for _, resumes in results if resumes)
    assert 0 < resumed <= doors[0].requests_inflight, "only the dead front door's streams resume"

    # The workers aborted what came over the dead front door's channels: nothing is left.
    def idle() -> bool:
        statuses = [deployment.background.run(m.engine.status(), timeout=30) for m in workers]
        return all(s.requests_inflight == 0 and s.engine_unfinished == 0 for s in statuses)

    wait_for(idle, 15, "no request left in the SIMULATED workers")
    assert {m.name: m.restarts for m in workers} == restarts_before, "a worker was restarted"
    assert front_doors(target)[1].pid == survivor.pid

    replacement = wait_for(
        lambda: (door := front_doors(target)[0]).state == "ready" and door, 300, "the replacement front door ready"
    )
    assert replacement.pid != victim.pid and replacement.restarts == 1
    for _ in range(40):  # new connections until one lands on the replacement
        tokens, _ = _stream(target, prompts[0])
        assert tokens == simulated_tokens(prompts[0], MAX_TOKENS, vocab)
        if front_doors(target)[0].requests_served > 0:
            break
    else:
        pytest.fail("40 new connections, none served by the replacement front door")


def _served_by_both_front_doors(target: str, model: str, vocab: int) -> None:
    """Requests naming ``model`` on new connections until both front doors served one; each
    must come back with the SIMULATED engine's tokens (a front door that did not serve the
    model would refuse it as unknown)."""
    served_before = [door.requests_served for door in front_doors(target)]
    for index in range(40):
        prompt = [index % 7 + 3] * 20
        with DuetClient(target) as client:
            ids, _ = client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True, model=model), timeout=60)
        assert ids == simulated_tokens(prompt, 6, vocab), f"{model} changed a stream"
        if all(door.requests_served > before for door, before in zip(front_doors(target), served_before)):
            return
    pytest.fail(f"40 connections naming {model}: not both front doors served it")


def _served_counts(target: str) -> dict[str, int]:
    with DuetClient(target) as client:
        return {worker.name: worker.requests_served for pool in client.status().pools for worker in pool.workers}


def test_every_front_door_serves_every_model_and_one_added_then_removed(simulated_front_doors):
    deployment = simulated_front_doors
    target = f"127.0.0.1:{deployment.port}"
    vocab = deployment.service.limits.vocab_size
    before = _served_counts(target)
    _served_by_both_front_doors(target, OTHER, vocab)
    grew = {name for name, count in _served_counts(target).items() if count > before.get(name, 0)}
    assert grew == {f"{OTHER}/prefill-0", f"{OTHER}/decode-0"}, "a request went to another model's workers"

    with DuetClient(target) as client:  # through a front door, carried to the control plane
        assert client.add_model(yaml.safe_dump(simulated_model(ADDED, 1)), timeout=120) == [
            f"{ADDED}: serving ({ADDED}/prefill-0, {ADDED}/decode-0)"
        ]
        assert list(client.status().served_models) == [load_config().model.name, OTHER, ADDED]
    _served_by_both_front_doors(target, ADDED, vocab)

    with DuetClient(target) as client:
        assert client.remove_model(ADDED) == [f"{ADDED}: removed ({ADDED}/prefill-0, {ADDED}/decode-0)"]
    for index in range(10):  # new connections: both front doors refuse it
        with DuetClient(target) as client, pytest.raises(grpc.RpcError) as error:
            client.generate_ids(build_request(prompt_token_ids=[3] * 20, max_tokens=2, model=ADDED), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ADDED in error.value.details()
    assert not any(name.startswith(f"{ADDED}/") for name in _served_counts(target))
    _served_by_both_front_doors(target, OTHER, vocab)  # the others serve on
