"""The SIMULATED engine (control-plane scale tests only): its scheduler alone, then dozens of
simulated workers behind the real router, pools and Admin API."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from duet.config import ConfigError, load_config, parse_config
from duet.cluster.placement.latency_model import DecodePerf, EnginePerf, PrefillPerf
from duet.worker_runtime.simulated_engine import SimulatedEngine, SimulatedParams, simulated_tokens
from duet.worker_runtime.worker_api import SamplingSpec
from duet.router.client import DuetClient, build_request


def _perf(kv_capacity_tokens: int = 100_000) -> EnginePerf:
    # 1 ms + 0.01 ms per prompt token per prefill; 2 ms per decode step.
    return EnginePerf(1, 1, PrefillPerf((1.0, 0.01, 0.0)), DecodePerf((2.0, 0.0, 0.0), (2.0, 0.0, 0.0), 1), kv_capacity_tokens)


async def _generate(engine: SimulatedEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SimulatedParams(SamplingSpec(max_tokens=max_tokens))
    return [t for out in [o async for o in engine.generate({"prompt_token_ids": prompt}, params, request_id)] for t in out.outputs[0].token_ids]


def test_simulated_engine_batches_and_times_like_its_model():
    async def run() -> tuple[list[list[int]], float]:
        engine = SimulatedEngine(_perf(), max_model_len=4096, vocab_size=1000)
        started = time.perf_counter()
        outputs = await asyncio.gather(*(_generate(engine, f"r{i}", [i + 5] * 100, 20) for i in range(8)))
        engine.shutdown()
        return outputs, time.perf_counter() - started

    outputs, elapsed = asyncio.run(run())
    for i, ids in enumerate(outputs):
        assert ids == simulated_tokens([i + 5] * 100, 20, 1000)
    # One batched prefill (1 + 8 ms) and 19 decode steps of 2 ms for all eight together: about
    # 50 ms, far from the 8 x 19 steps of running them one by one.
    assert 0.045 <= elapsed < 0.25


def test_simulated_engine_merges_outputs_like_a_duet_engine_core():
    """With an output interval the serving path gets what a duet engine core sends it: the first
    and last tokens at once, the ones between merged at most once per interval, none lost."""

    async def run() -> list[list[int]]:
        engine = SimulatedEngine(_perf(), max_model_len=4096, vocab_size=1000, output_interval_s=0.02)
        params = SimulatedParams(SamplingSpec(max_tokens=60))
        outputs = [o.outputs[0].token_ids async for o in engine.generate({"prompt_token_ids": [9] * 50}, params, "r")]
        engine.shutdown()
        return outputs

    outputs = asyncio.run(run())
    assert [t for tokens in outputs for t in tokens] == simulated_tokens([9] * 50, 60, 1000)
    assert len(outputs[0]) == 1, "the first token waits for nothing"
    # 59 decode steps of 2 ms (about 120 ms): one message per 20 ms, not one per step.
    assert 3 <= len(outputs) <= 15
    assert max(len(tokens) for tokens in outputs) > 1


def test_simulated_engine_queues_what_its_kv_cannot_hold():
    async def run() -> float:
        engine = SimulatedEngine(_perf(kv_capacity_tokens=150), max_model_len=4096, vocab_size=1000)
        assert engine.load() == (0.0, 0)
        first = asyncio.create_task(_generate(engine, "a", [7] * 100, 10))
        await asyncio.sleep(0.005)
        assert engine.load()[1] == 1  # running, holding 110 of 150 tokens
        started = time.perf_counter()
        await _generate(engine, "b", [8] * 100, 1)  # needs 101: waits for "a" to finish
        waited = time.perf_counter() - started
        await first
        engine.shutdown()
        return waited

    assert asyncio.run(run()) >= 0.01  # at least the rest of "a"'s decode steps


def test_a_stopped_simulated_scheduler_fails_the_health_check():
    """A scheduler loop that died leaves its requests waiting while the actor still answers:
    the health ping (SimulatedHost.ping calls check_scheduler) must fail so the worker is replaced."""

    async def run() -> str:
        engine = SimulatedEngine(_perf(), max_model_len=4096, vocab_size=1000)
        engine.check_scheduler()  # not started yet: healthy
        await _generate(engine, "a", [5] * 10, 2)
        engine.check_scheduler()  # started and idle: healthy

        perf = engine.perf

        class BrokenDecodeTiming:
            def __getattr__(self, name: str) -> object:
                return getattr(perf, name)

            def decode_step_s(self, *args: object) -> float:
                raise ValueError("no decode timing")

        engine.perf = BrokenDecodeTiming()  # type: ignore[assignment]
        stuck = asyncio.create_task(_generate(engine, "b", [6] * 10, 3))
        await asyncio.sleep(0.05)
        assert not stuck.done()  # waits for a step that will never come
        try:
            engine.check_scheduler()
        except RuntimeError as error:
            return str(error)
        finally:
            stuck.cancel()
        return ""

    assert "no decode timing" in asyncio.run(run())


def test_simulated_engines_need_the_pull_hand_off():
    with pytest.raises(ConfigError, match="kv_transfer.transport"):
        parse_config({"decode": {"engine": "simulated"}, "kv_transfer": {"transport": "nccl"}})


@pytest.fixture(scope="module")
def simulated_deployment(running_deployment):
    data = load_config().model_dump()
    for role, replicas in (("prefill", 8), ("decode", 8)):
        data[role].update(engine="simulated", replicas=replicas, num_cpus=0.01, cpu_cores=None)
    data["server"].update(metrics_port=None, http_port=0)
    with running_deployment(parse_config(data, "simulated test")) as deployment:
        yield deployment


def test_sixteen_simulated_workers_serve_through_the_real_router(simulated_deployment):
    """The requests are spread over the pools because they are in flight together: 64 tokens
    are over a second of simulated decode steps (wall-clock time, whatever the CPU's speed),
    far longer than sending the 64 requests takes, so they overlap on a slow machine too."""
    deployment = simulated_deployment
    prompts = [[(i * 7) % 600 + 3] * (50 + i) for i in range(64)]
    with DuetClient(f"127.0.0.1:{deployment.port}") as client:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda p: client.generate_ids(build_request(prompt_token_ids=p, max_tokens=64), timeout=60), prompts))
        vocab = deployment.service.limits.vocab_size
        for prompt, (ids, last) in zip(prompts, results):
            assert ids == simulated_tokens(prompt, 64, vocab)
        used = {last.usage.prefill_worker for _, last in results} | {last.usage.decode_worker for _, last in results}
        assert len(used) >= 8  # spread over the pools
        status = client.status()
        states = {w.state for pool in status.pools for w in pool.workers}
        assert states == {"ready (SIMULATED engine)"}
        started = time.monotonic()
        assert len(client.scale("decode", 24)) == 16
        while sum(1 for w in client.list_workers().pools[1].workers if w.state.startswith("ready")) < 24:
            assert time.monotonic() - started < 60
            time.sleep(0.2)
        ids, _ = client.generate_ids(build_request(prompt_token_ids=prompts[0], max_tokens=4), timeout=60)
        assert ids == simulated_tokens(prompts[0], 4, vocab)


def test_streams_survive_a_simulated_worker_killed_mid_request(simulated_deployment, caplog):
    """A SIMULATED worker's requests travel over its channel, not Ray calls: when its actor is
    killed mid-stream, the closed connection ends its requests at once and they resume on the
    other workers, every stream complete and exact."""
    import ray

    deployment = simulated_deployment
    prompts = [[(i * 11) % 500 + 3] * (40 + i) for i in range(48)]
    with DuetClient(f"127.0.0.1:{deployment.port}") as client:
        vocab = deployment.service.limits.vocab_size
        with ThreadPoolExecutor(48) as pool:
            streams = [pool.submit(client.generate_ids, build_request(prompt_token_ids=p, max_tokens=200), timeout=120) for p in prompts]
            deadline = time.monotonic() + 30
            while not (busy := [m for m in deployment.decode.members if m.state == "ready" and m.inflight > 0]):
                assert time.monotonic() < deadline, "no decode worker took a request"
                time.sleep(0.01)
            victim = busy[0]
            ray.kill(victim.actor, no_restart=True)
            results = [stream.result() for stream in streams]
        for prompt, (ids, _) in zip(prompts, results):
            assert ids == simulated_tokens(prompt, 200, vocab)
    resumed = [r.args[2] for r in caplog.records if "resuming after" in r.getMessage() and f"worker {victim.name} failed" in r.getMessage()]
    assert any(tokens > 0 for tokens in resumed), "no request was cut off mid-stream and resumed"
    while victim.restarts < 1:
        assert time.monotonic() < deadline + 60, "the killed worker was not replaced"
        time.sleep(0.1)
