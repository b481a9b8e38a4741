"""Engine arguments shared by every vLLM engine duet starts.

Prefill, decode and the colocated reference engine must agree on everything that shapes the KV
cache and the numerics (model, dtype, max length, block size, seed); building all of them here is
what makes "disaggregated equals colocated, token for token" a property of the code, not of care.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from duet.config import BUILTIN_TEXT_MODELS, BUILTIN_VISION_MODELS, ModelConfig
from duet.worker_runtime.gloo_device import ENV_SHARED_GLOO_DEVICE

_GIB = 1 << 30


def resolve_model_path(model: ModelConfig) -> Path:
    """The model directory on this machine, creating a built-in model on first use."""
    if model.path in BUILTIN_TEXT_MODELS:
        from duet.worker_runtime.tiny_model import ensure_tiny_model

        return ensure_tiny_model(shape=model.path)
    if model.path in BUILTIN_VISION_MODELS:
        from duet.worker_runtime.tiny_vision_model import ensure_tiny_vision_model

        return ensure_tiny_vision_model(model.path)
    return Path(model.path).expanduser().resolve()


def engine_kwargs(
    model: ModelConfig,
    *,
    kv_cache_gib: float,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    kv_transfer_config: dict[str, Any] | None = None,
    ec_transfer_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.AsyncEngineArgs`` / ``vllm.LLM``."""
    kwargs: dict[str, Any] = {
        "model": str(resolve_model_path(model)),
        "served_model_name": model.name,
        "dtype": model.dtype,
        "enforce_eager": model.enforce_eager,
        "seed": model.seed,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "tensor_parallel_size": tensor_parallel,
        "pipeline_parallel_size": pipeline_parallel,
        "kv_cache_memory_bytes": int(kv_cache_gib * _GIB),
        "disable_log_stats": False,  # the workers read vLLM's metrics for status and tests
        # Requests carry a priority (SamplingSpec.priority): a batch job's wait behind online
        # requests in every engine's queue, and are preempted first when KV runs out. Requests
        # of one priority are served in arrival order, as vLLM's default policy serves them.
        "scheduling_policy": "priority",
    }
    if model.max_model_len is not None:
        kwargs["max_model_len"] = model.max_model_len
    if model.lora is not None:
        # Every engine of every role can apply every adapter: prefill and decode must agree on
        # it for disaggregated output to equal colocated (and for prefix-cache keys to match).
        kwargs.update(
            enable_lora=True,
            max_loras=model.lora.max_loras,
            max_lora_rank=model.lora.max_lora_rank,
            max_cpu_loras=model.lora.max_cpu_loras,
        )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    if ec_transfer_config is not None:  # an encode or prefill engine of E+P+D (kv_transfer/encoder_cache.py)
        kwargs["ec_transfer_config"] = ec_transfer_config
    return kwargs


def cpu_engine_environment(cpu_core: int | None, one_process_executor: bool = True) -> dict[str, str]:
    """Environment for a vLLM CPU engine: the model in the engine core's process and,
    optionally, one core.

    The KV cache's size is the engine argument ``kv_cache_memory_bytes`` (:func:`engine_kwargs`;
    without an explicit size the CPU worker demands 92% of NUMA node 0's memory free at start-up
    and refuses to start beside another engine). Not ``VLLM_CPU_KVCACHE_SPACE``: vLLM's CPU
    platform lets that legacy variable, whole GiB only, override the argument, which made
    0.25 GiB a whole GiB and 1.5 GiB two.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's CPU platform on its one-process executor
    for single-rank engines: the model runs inside the engine core's process instead of a
    separate worker process. That worker reads its shared-memory queue by spinning
    (``sched_yield``) for a second after every message, which on a CPU host burns the very
    cores the engines and the serving path share (docs/benchmarks/serving.md). ``AsyncLLM`` still
    runs its engine core in a process of its own, so the actor's event loop never waits on a
    forward pass. Multi-rank engines need vLLM's multiprocess executor and keep it. An offline
    ``vllm.LLM`` must not get it (``one_process_executor=False``): there the variable would run the
    whole engine inside the calling process. ``DUET_SHARED_GLOO_DEVICE`` has vLLM's
    single-rank gloo groups share one device, whose loop thread wakes 100 times a second
    (worker_runtime/gloo_device.py).
    """
    env = {}
    if one_process_executor:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    env[ENV_SHARED_GLOO_DEVICE] = "1"
    return env


def is_cpu_only() -> bool:
    """True where vLLM runs on the CPU platform (the ``+cpu`` torch build, no GPU)."""
    import torch

    return "+cpu" in torch.__version__ or not torch.cuda.is_available()


def apply_environment(env: dict[str, str]) -> None:
    """Set ``env`` in this process before an engine spawns its own processes (they inherit it)."""
    os.environ.update(env)
