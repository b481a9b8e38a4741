"""Disaggregated generation equals colocated generation, token for token (greedy, float32).

The request goes through the real gRPC server, the prefill actor's engine, NixlConnector and the
decode actor's engine; the reference is a single vLLM engine with the same settings.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest


from duet.router.client import build_request

TRANSFERRED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"


def _random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def _disaggregated(client, prompts: list[list[int]], max_tokens: int, workers: int = 1) -> list[list[int]]:
    def run(prompt: list[int]) -> list[int]:
        ids, last = client.generate_ids(
            build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True), timeout=300
        )
        assert last.finish_reason != 0, "the stream ended without a finish reason"
        return ids

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, prompts))


def test_short_text_prompts_match_colocated(client, reference, tokenizer):
    texts = ["Hello", "The prefill worker sends the cache", "Why is the router so fast?", "a b c d e f"]
    prompts = [tokenizer.encode(text) for text in texts]
    expected = reference.greedy(prompts, max_tokens=32, ignore_eos=True)
    for text, want in zip(texts, expected):
        ids, last = client.generate_ids(build_request(text, max_tokens=32, ignore_eos=True), timeout=120)
        assert ids == want, f"prompt {text!r}"
        assert last.usage.completion_tokens == 32
        assert last.usage.prompt_tokens == len(tokenizer.encode(text))
        assert 0 < last.usage.ttft_s <= last.usage.e2e_s
        assert last.usage.tpot_s > 0


def test_long_prompts_match_colocated_and_kv_is_transferred(client, reference, worker_status):
    prompts = [p for length in (1501, 1777, 2048) for p in _random_prompts(1, length, 700, seed=length)]
    before = worker_status("decode").engine_metrics
    got = _disaggregated(client, prompts, max_tokens=24)
    after = worker_status("decode").engine_metrics
    assert got == reference.greedy(prompts, max_tokens=24, ignore_eos=True)
    transferred = after.get(TRANSFERRED, 0) - before.get(TRANSFERRED, 0)
    computed = after.get(COMPUTED, 0) - before.get(COMPUTED, 0)
    assert transferred == sum(len(p) for p in prompts), "decode did not receive the prompt KV by transfer"
    assert computed == 0, "decode recomputed prompt tokens instead of pulling them"


@pytest.mark.parametrize("length", [1, 128, 1000, 4000])
def test_prompt_lengths_match_colocated(client, reference, length):
    prompt = _random_prompts(1, length, 700, seed=length)[0]
    assert _disaggregated(client, [prompt], max_tokens=16) == reference.greedy([prompt], max_tokens=16, ignore_eos=True)


def test_sixteen_concurrent_requests_match_colocated(client, reference):
    rng = random.Random(16)
    prompts = [[rng.randrange(3, 700) for _ in range(rng.randint(5, 900))] for _ in range(16)]
    got = _disaggregated(client, prompts, max_tokens=32, workers=16)
    assert got == reference.greedy(prompts, max_tokens=32, ignore_eos=True)


def test_the_decode_front_end_knows_its_engines_kv_capacity(deployment):
    """``least_kv_load`` weighs requests on their way to a decode worker by its engine's KV
    capacity (router/pools.py), which the engine core tells each front end when it connects."""
    capacity = deployment.decode.members[0].engine.kv_capacity_tokens
    bytes_per_token = 4 * 2 * 4 * 32 * 4  # the built-in model: layers x (K, V) x KV heads x head size x float32
    assert capacity is not None and 2**29 < capacity * bytes_per_token <= 2**30  # the engines' 1 GiB of KV
