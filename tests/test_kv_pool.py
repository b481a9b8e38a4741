"""The host KV pool on the suite's deployment (real engines): a prefix the prefill engine dropped
from its KV cache is loaded instead of computed, with the same tokens as a plain vLLM engine, and
the pool is reported. (Another engine loading a prefix from the pool: tests/test_colocated.py.)"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from duet.router.client import build_request

LOADED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(length)]


def _pool_blocks(directory: str) -> int:
    return sum(1 for _ in Path(directory).rglob("*.bin"))


def _wait_for_blocks(directory: str, at_least: int, timeout_s: float = 20.0) -> None:
    """Stores reach the pool after the request ends (through the engine's host tier)."""
    deadline = time.monotonic() + timeout_s
    while _pool_blocks(directory) < at_least:
        assert time.monotonic() < deadline, f"the pool holds {_pool_blocks(directory)} blocks, not {at_least}"
        time.sleep(0.1)


def _prefill_metrics(deployment) -> dict[str, float]:
    """Every prefill worker's engine metrics, summed (earlier tests may have scaled the pool)."""

    async def read() -> list[dict[str, float]]:
        return [(await member.engine.status()).engine_metrics for member in deployment.prefill.members]

    summed: dict[str, float] = {}
    for metrics in deployment.background.run(read(), timeout=30):
        for key, value in metrics.items():
            summed[key] = summed.get(key, 0.0) + value
    return summed


def test_a_prefix_the_prefill_engine_dropped_is_loaded_not_computed(deployment, client, reference, wait_until_idle):
    directory = deployment.config.kv_pool.directory
    prompt = _prompt(1000, seed=54)
    block = 128  # vLLM's KV block on CPU: the pool keeps whole blocks, 7 of this prompt
    request = build_request(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
    before = _pool_blocks(directory)
    first, _ = client.generate_ids(request, timeout=120)
    wait_until_idle("prefill")
    _wait_for_blocks(directory, before + len(prompt) // block)

    # The engine forgets the prefix; its own host tier (vLLM's primary tier, in front of the
    # host's pool) still holds it.
    async def forget() -> None:
        await asyncio.gather(*(member.engine.reset_prefix_cache() for member in deployment.prefill.members))

    deployment.background.run(forget(), timeout=60)
    counted = _prefill_metrics(deployment)
    second, last = client.generate_ids(request, timeout=120)

    def prompt_tokens(metrics: dict[str, float]) -> float:
        return sum(metrics.get(key, 0) - counted.get(key, 0) for key in (LOADED, COMPUTED))

    deadline = time.monotonic() + 20
    while prompt_tokens(after := _prefill_metrics(deployment)) < len(prompt):  # stats come with a later step
        assert time.monotonic() < deadline, f"the prefill engines counted {prompt_tokens(after)} prompt tokens"
        time.sleep(0.2)
    assert last.usage.prefill_worker.startswith("prefill-")  # not prefilled on the decode worker

    assert after.get(LOADED, 0) - counted.get(LOADED, 0) == (len(prompt) // block) * block
    assert after.get(COMPUTED, 0) - counted.get(COMPUTED, 0) == len(prompt) % block
    assert first == second == reference.greedy([prompt], max_tokens=12, ignore_eos=True)[0]

    # duet status: the host's pool, and the prefill worker's lookups there.
    status = client.status()
    (kv_pool,) = status.kv_pools
    assert kv_pool.capacity_bytes == deployment.config.kv_pool.capacity_gib * 2**30
    assert kv_pool.blocks >= len(prompt) // block and kv_pool.bytes >= kv_pool.blocks * 128 * 4096
    assert kv_pool.misses >= 1 and kv_pool.evictions == 0  # the first request's lookup
    prefill_states = [w for pool in status.pools if pool.role == "prefill" for w in pool.workers]
    assert {w.kv_pool_host for w in prefill_states} == {kv_pool.host}
    assert sum(w.kv_pool_misses for w in prefill_states) == kv_pool.misses
    assert all(not w.kv_pool_host for pool in status.pools if pool.role == "decode" for w in pool.workers)
