"""A colocated deployment (``mode: colocated``): the same router and API, workers that run whole
requests. It is the baseline ``duet bench serve`` measures disaggregation against, so it must be
exact and clean up like the disaggregated path."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pytest

from duet.config import COLOCATED_CONFIG_PATH, load_config, parse_config
from duet.cluster.deployment import Deployment
from duet.kv_transfer.metrics import POOL_CORRUPT
from duet.kv_transfer.pool_blocks import read_block
from duet.router.client import DuetClient, build_request


@pytest.fixture(scope="module")
def colocated(running_deployment) -> Iterator[tuple[Deployment, DuetClient]]:
    data = load_config(COLOCATED_CONFIG_PATH).model_dump()
    data["server"]["metrics_port"] = 0
    data["kv_pool"].update(enabled=True, directory=tempfile.mkdtemp(prefix="duet-test-kv-pool-", dir="/dev/shm"))
    with running_deployment(parse_config(data)) as deployment:
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            yield deployment, client
    shutil.rmtree(data["kv_pool"]["directory"], ignore_errors=True)


def _worker_states(deployment: Deployment) -> list[Any]:
    return [deployment.background.run(member.engine.status(), timeout=30) for member in deployment.decode.members]


def test_colocated_requests_match_a_single_engine_and_use_both_workers(colocated, reference):
    deployment, client = colocated
    status = client.status()
    assert [pool.role for pool in status.pools] == ["colocated"]
    assert [w.name for w in status.pools[0].workers] == ["colocated-0", "colocated-1"]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 700) for _ in range(rng.randint(5, 1200))] for _ in range(8)]

    def run(prompt: list[int]) -> tuple[list[int], Any]:
        return client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True), timeout=300)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, prompts))
    assert [ids for ids, _ in results] == reference.greedy(prompts, max_tokens=24, ignore_eos=True)
    served_by = {last.usage.decode_worker for _, last in results}
    assert served_by == {"colocated-0", "colocated-1"}, f"requests were not spread: {served_by}"
    assert all(last.usage.prefill_worker == last.usage.decode_worker for _, last in results)


def test_colocated_cancel_frees_the_worker(colocated):
    deployment, client = colocated
    stream = client.generate(build_request(prompt_token_ids=list(range(10, 300)), max_tokens=3000, ignore_eos=True), timeout=120)
    received = 0
    for message in stream:
        received += len(message.token_ids)
        if received >= 8:
            break
    stream.cancel()
    deadline = time.monotonic() + 20
    while any(s.requests_inflight or s.engine_unfinished for s in _worker_states(deployment)):
        assert time.monotonic() < deadline, "a colocated worker still holds the cancelled request"
        time.sleep(0.1)
    ids, _ = client.generate_ids(build_request("still serving?", max_tokens=4, ignore_eos=True), timeout=60)
    assert len(ids) == 4


def _sequences_with_logprobs(client: DuetClient, request: Any) -> dict[int, tuple[list[int], list[float]]]:
    got: dict[int, tuple[list[int], list[float]]] = {}
    for message in client.generate(request, timeout=300):
        ids, logprobs = got.setdefault(message.index, ([], []))
        ids += message.token_ids
        logprobs += [position.entries[0].logprob for position in message.logprobs]
    return got


def test_disaggregated_equals_colocated_for_every_feature(colocated, client):
    """The same feature requests (penalties, logit bias, min_tokens, a grammar, seeded n = 2,
    logprobs) on the colocated deployment and the disaggregated one: the same tokens, and
    logprobs within 1e-4 (tests/test_api_parity.py compares the disaggregated one with vLLM's
    own server)."""
    from duet.router.proto import duet_api_pb2 as pb

    _, colocated_client = colocated
    prompt = random.Random(4).choices(range(3, 700), k=300)
    cases = [
        dict(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.1, min_tokens=20, logit_bias={17: 5.0}),
        dict(temperature=0.8, seed=9, n=2, min_p=0.05),
        dict(temperature=1.0, seed=3, structured_output=pb.StructuredOutput(regex="[a-z]{2,6}( [a-z]{2,6}){4,12}")),
    ]
    for fields in cases:
        request = build_request(prompt_token_ids=prompt, max_tokens=24, logprobs=2, **fields)
        ours, theirs = _sequences_with_logprobs(client, request), _sequences_with_logprobs(colocated_client, request)
        assert ours.keys() == theirs.keys()
        for index in ours:
            assert ours[index][0] == theirs[index][0], (fields, index)
            assert all(abs(a - b) <= 1e-4 for a, b in zip(ours[index][1], theirs[index][1])), (fields, index)


def test_each_colocated_engine_computes_on_its_own_core(colocated):
    """``cpu_cores: [0, 1]`` holds without a KV connector too: vLLM binds nothing for its
    one-process executor, and both engines once ran on both cores (kv_transfer/vllm_plugin.py)."""
    from duet.benchmarks.engine_cores import EngineCoreSampler

    _, client = colocated
    requests = [build_request(f"pinned {i} " * 60, max_tokens=32, ignore_eos=True) for i in range(8)]
    with EngineCoreSampler(os.getpid()) as sampler, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda request: client.generate_ids(request, timeout=300), requests))
    engines = [p for label, p in sampler.report().items() if "under ray::ColocatedWorker" in label]
    assert sorted(p["affinity"] for p in engines) == ["0", "1"], sampler.report()
    for process in engines:
        by_core = process["cpu_s_by_core"]
        assert by_core.get(process["affinity"], 0.0) > 0.9 * sum(by_core.values()), process


POOL_HITS = "vllm:kv_offload_tiering_chunk_hits_total{tier=1:HostPoolTier}"
LOADED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


def _pool_files(deployment: Deployment) -> set[Path]:
    return set(Path(deployment.config.kv_pool.directory).rglob("*.bin"))


class _AnyWorkerBut:
    """A routing policy that keeps a pool's own but never chooses the worker named ``name`` while
    another is ready: the pool tests need the engine that did not compute a prefix to serve it,
    which a policy left to itself may never do (it may keep finding that engine the busier)."""

    def __init__(self, name: str, policy: Any) -> None:
        self.name, self.policy = name, policy

    def choose(self, ready: list[Any], prompt: list[int], adapter: str = "") -> Any:
        return self.policy.choose([m for m in ready if m.name != self.name] or ready, prompt, adapter)

    def describe(self) -> str:
        return self.policy.describe()


def _computed_then_served_by_the_other(
    deployment: Deployment, client: DuetClient, prompt: list[int], expected: list[int],
    between: Callable[[set[Path]], None] = lambda files: None,
) -> tuple[Any, Any]:
    """Send ``prompt`` twice: the first engine computes it and stores its whole blocks in the pool
    (``between`` is called with their files then); the router is then steered to the other engine,
    whose first request for it finds it in the pool (its own cache and host tier never held it).
    Returns the other engine's worker state from before that request and after it."""
    request = build_request(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
    files_before = _pool_files(deployment)
    before = {w.name: w for w in _worker_states(deployment)}
    ids, last = client.generate_ids(request, timeout=120)
    assert ids == expected
    computed_by = last.usage.decode_worker
    blocks = len(prompt) // 128  # vLLM's KV block on CPU
    deadline = time.monotonic() + 20
    while len(stored := _pool_files(deployment) - files_before) < blocks:  # stored after the request, in the background
        assert time.monotonic() < deadline, "the prompt's blocks never reached the pool"
        time.sleep(0.1)
    between(stored)
    policy = deployment.decode.policy
    deployment.decode.policy = _AnyWorkerBut(computed_by, policy)
    try:
        ids, last = client.generate_ids(request, timeout=120)
    finally:
        deployment.decode.policy = policy
    assert ids == expected
    loads = [(m.name, m.state, m.kv_usage, m.running, m.inflight) for m in deployment.decode.members]
    assert last.usage.decode_worker != computed_by, f"(name, state, kv_usage, running, inflight): {loads}"
    other = last.usage.decode_worker
    return before[other], {w.name: w for w in _worker_states(deployment)}[other]


def test_a_prefix_one_engine_computed_is_loaded_by_the_other_from_the_host_pool(colocated, reference):
    """The host KV pool is every engine's on the host: the engine that did not compute a prefix
    loads it from there on its first request for it."""
    deployment, client = colocated
    prompt = random.Random(540).choices(range(3, 700), k=1000)  # 7 whole 128-token blocks
    expected = reference.greedy([prompt], max_tokens=12, ignore_eos=True)[0]
    before, after = _computed_then_served_by_the_other(deployment, client, prompt, expected)
    assert after.engine_metrics.get(POOL_HITS, 0) - before.engine_metrics.get(POOL_HITS, 0) == 7
    assert after.engine_metrics.get(LOADED, 0) - before.engine_metrics.get(LOADED, 0) == 7 * 128


def test_a_corrupt_block_in_the_host_pool_is_computed_not_served(colocated, reference):
    """A bit flipped in every pool file of a prefix (kv_transfer/pool_blocks.py checks each block
    it loads): the other engine computes the prefix instead, its output is the reference's, the
    corrupt files are counted and replaced by sound ones."""
    deployment, client = colocated
    prompt = random.Random(541).choices(range(3, 700), k=1000)
    expected = reference.greedy([prompt], max_tokens=12, ignore_eos=True)[0]
    damaged: dict[Path, bytes] = {}

    def flip_a_bit(files: set[Path]) -> None:
        for path in files:
            data = bytearray(path.read_bytes())
            data[len(data) // 3] ^= 0x04
            path.write_bytes(bytes(data))
            damaged[path] = bytes(data)

    before, after = _computed_then_served_by_the_other(deployment, client, prompt, expected, between=flip_a_bit)
    assert len(damaged) == 7
    assert after.engine_metrics.get(LOADED, 0) == before.engine_metrics.get(LOADED, 0)  # nothing loaded

    def counted_corrupt(state: Any) -> float:
        return sum(v for k, v in state.engine_metrics.items() if k.startswith(POOL_CORRUPT + "_total"))

    def newly_counted() -> float:  # the engine counts them in its next stats report
        return counted_corrupt({w.name: w for w in _worker_states(deployment)}[after.name]) - counted_corrupt(before)

    deadline = time.monotonic() + 10
    while (counted := newly_counted()) < 7 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counted == 7
    deadline = time.monotonic() + 20  # the recomputed blocks are stored again
    while not all(path.exists() and path.read_bytes() != data for path, data in damaged.items()):
        assert time.monotonic() < deadline, "the corrupt blocks were not replaced"
        time.sleep(0.1)
    for path in damaged:
        block = bytearray(path.stat().st_size - 4)
        read_block(str(path), memoryview(block))  # raises if it does not match its checksum
