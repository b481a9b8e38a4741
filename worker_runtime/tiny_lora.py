"""Random-weight LoRA adapters for the built-in models (``duet lora make``).

LoRA serving needs adapters to serve, and a fresh machine has no model hub: like the built-in
model itself, an adapter is made here, deterministically from its seed, in the PEFT format that
vLLM loads (``adapter_config.json`` and ``adapter_model.safetensors``). Its weights are random,
so an adapter changes what the model generates (each one differently) without meaning anything:
enough for tests, benchmarks and trying the feature.
"""

from __future__ import annotations

import json
from pathlib import Path

from duet.worker_runtime.tiny_model import ensure_tiny_model

# The attention projections every Llama-family adapter targets (PEFT's usual choice).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# Large enough that a greedy pick changes within a few tokens, small enough to stay numerically tame.
_WEIGHT_STD = 0.05


def make_tiny_lora(out: Path, seed: int = 0, rank: int = 8, base_model: str = "builtin") -> Path:
    """Write a LoRA adapter of ``rank`` for the built-in model ``base_model`` (``builtin`` or
    ``builtin-wide``) into ``out`` and return it.

    Both LoRA matrices are random (PEFT starts B at zero, which would make the adapter a no-op).
    The same seed and rank always give the same adapter.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    base = ensure_tiny_model(shape=base_model)
    config = AutoConfig.from_pretrained(base)
    hidden = config.hidden_size
    kv_width = config.num_key_value_heads * (hidden // config.num_attention_heads)
    widths = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width), "o_proj": (hidden, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGET_MODULES:
            fan_in, fan_out = widths[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * _WEIGHT_STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * _WEIGHT_STD
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
