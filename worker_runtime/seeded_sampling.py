"""Seeded sampling on CPU engines: a prompt prefilled in several steps must not kill the engine.

vLLM gives each request with a seed a generator of its own. A step that computes only part of a
prompt (a prompt longer than the step's token budget, or one sharing a step with others) still
samples a token for it, and throws that token away; vLLM then rewinds the request's generator,
so that its seeded tokens do not depend on how its prompt was split, with
``generator.set_offset(generator.get_offset() - 4)`` (``_bookkeeping_sync`` in vLLM 0.32.0's
``gpu_model_runner.py``, which the CPU model runner inherits). That relies on CUDA's Philox
generator: a CPU generator has no offset, ``get_offset`` raises ``CPU Generator does not use
offset``, and the engine core dies with every request on it. The request that killed it, retried,
kills the next engine the same way. The same bug is reported against another vLLM backend whose
generators live on the CPU (vllm-rbln pull request 1025, which skips the rewind).

duet gives every sampled request a seed (router/validation.py), so that a stream resumed on
another worker continues as it would have; so on a CPU engine every sampled request with a long
prompt, or arriving under load, killed its engine (measured: 125 of 150 requests of a load at
8 req/s failed, the prefill engine died seven times in two minutes).

Skipping the rewind would keep the engine alive but make a seeded request's tokens depend on how
its prompt was split. Here the discarded token is drawn from a throwaway copy of the request's
generator instead, and the request's own generator is left untouched: exactly the state the CUDA
rewind restores. GPU generators keep vLLM's own rewind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class _ThrowawayGenerator(torch.Generator):
    """A CPU generator's copy that a discarded token is drawn from; vLLM's rewind of it (the
    offset calls) has nothing to undo, since the request's own generator never moved."""

    @classmethod
    def copy_of(cls, generator: torch.Generator) -> "_ThrowawayGenerator":
        copy = cls()
        copy.set_state(generator.get_state())
        return copy

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> "_ThrowawayGenerator":
        return self


def discarded_cpu_generators(model_runner: Any) -> list[int]:
    """The batch rows of this step whose sampled token will be discarded (their prompt is not
    done) and whose generator is a CPU one."""
    batch = model_runner.input_batch
    rows = np.nonzero(model_runner.discard_request_mask.np[: batch.num_reqs])[0]
    return [int(row) for row in rows if int(row) in batch.generators and batch.generators[int(row)].device.type == "cpu"]


def install() -> None:
    """Make every vLLM model runner of this process draw discarded tokens of seeded requests
    from throwaway copies of CPU generators. Called by duet's vLLM plugin in each duet engine
    process (kv_transfer/vllm_plugin.py)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample_tokens = getattr(GPUModelRunner.sample_tokens, "_duet_original", GPUModelRunner.sample_tokens)

    def sample_tokens_keeping_generators(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows = discarded_cpu_generators(self) if self.execute_model_state is not None else []
        if not rows:
            return sample_tokens(self, *args, **kwargs)
        generators = self.input_batch.generators  # the step's sampling metadata holds this dict
        own = {row: generators[row] for row in rows}
        generators.update({row: _ThrowawayGenerator.copy_of(generator) for row, generator in own.items()})
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            generators.update(own)

    sample_tokens_keeping_generators._duet_original = sample_tokens  # type: ignore[attr-defined]
    GPUModelRunner.sample_tokens = sample_tokens_keeping_generators  # type: ignore[method-assign]
