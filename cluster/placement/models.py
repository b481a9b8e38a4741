"""Model architectures the planner knows: sizes that set KV bytes per token, weights, FLOPs.

A plan needs these even with a measured latency profile: the KV transfer time depends on the KV
bytes per token, and the memory left for KV depends on the weights. Unknown names are rejected
with the closest known ones, so a typo does not silently plan for another model.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


class UnknownModelError(ValueError):
    """A model name the planner has no architecture for."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


_KNOWN = (
    ModelSpec("facebook/opt-13b", 12.85e9, 40, 5120, 40, 128),
    ModelSpec("facebook/opt-66b", 65.7e9, 64, 9216, 72, 128),
    ModelSpec("facebook/opt-175b", 175e9, 96, 12288, 96, 128),
    ModelSpec("meta-llama/Llama-2-7b-hf", 6.74e9, 32, 4096, 32, 128),
    ModelSpec("meta-llama/Llama-2-13b-hf", 13.0e9, 40, 5120, 40, 128),
    ModelSpec("meta-llama/Llama-2-70b-hf", 69.0e9, 80, 8192, 8, 128),
    ModelSpec("meta-llama/Llama-3.1-8B", 8.03e9, 32, 4096, 8, 128),
    # duet's built-in tiny model (worker_runtime/tiny_model.py), served in float32 on CPU.
    ModelSpec("duet-tiny-llama", 4.46e6, 4, 256, 4, 32, dtype_bytes=4),
    # duet's built-in vision-language models (worker_runtime/tiny_vision_model.py): the same
    # Llama behind a SigLIP tower, whose cost the profile's encoder fit holds.
    ModelSpec("duet-tiny-idefics3", 4.46e6, 4, 256, 4, 32, dtype_bytes=4),
    ModelSpec("duet-tiny-idefics3-large", 4.46e6, 4, 256, 4, 32, dtype_bytes=4),
)
MODELS: dict[str, ModelSpec] = {m.name.lower(): m for m in _KNOWN}


def get_model(name: str) -> ModelSpec:
    """Look a model up by full name or by the part after the organisation (``opt-13b``)."""
    key = name.lower()
    if key in MODELS:
        return MODELS[key]
    by_short = {k.split("/")[-1]: m for k, m in MODELS.items()}
    if key.split("/")[-1] in by_short:
        return by_short[key.split("/")[-1]]
    close = difflib.get_close_matches(key, list(MODELS) + list(by_short), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise UnknownModelError(
        f"unknown model {name!r}: the planner has no architecture for it.{hint} "
        f"Known models: {', '.join(m.name for m in _KNOWN)}."
    )
