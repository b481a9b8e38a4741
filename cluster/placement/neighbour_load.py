"""A second vLLM engine that keeps one core busy, for ``duet profile``'s co-run measurement.

On a CPU host the engines of a deployment run side by side, one per core, and slow each other
through the caches and memory bandwidth they share even though neither takes the other's core.
``duet profile`` measures that by timing its own engine with this one running next to it:

    python -m duet.cluster.placement.neighbour_load MODEL_DIR CORE KV_CACHE_GIB

It prints ``ready`` once its engine has started, then serves batches of prompts with short
outputs (prefill and decode both, as a deployment's other engine does) until it is killed.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from duet.worker_runtime.engine import apply_environment, cpu_engine_environment

BATCH = 16
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 64


def main(model_dir: str, core: int, kv_cache_gib: float) -> None:
    os.sched_setaffinity(0, {core})
    apply_environment(cpu_engine_environment(core, one_process_executor=False))
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False, seed=1,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    print("ready", flush=True)
    while True:
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, PROMPT_TOKENS).tolist()} for _ in range(BATCH)]
        llm.generate(prompts, params, use_tqdm=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
