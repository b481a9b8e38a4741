"""The built-in tiny vision-language model: an Idefics3 (SmolVLM's architecture: a SigLIP tower
and the tiny Llama) made locally.

Like the built-in text model (tiny_model.py), it is made on first use, deterministically, with
random weights, and cached; it is a real Hugging Face checkpoint that vLLM (on CPU: its vision
tower runs on torch SDPA) and transformers both load. Idefics3 because vLLM's modules for LLaVA,
Qwen2-VL and Gemma 3 import torchvision, which this machine cannot have (PyPI's builds are CUDA
builds and break transformers; see ../shared/ENVIRONMENT.md), while Idefics3's image processor
has a PIL form.

The shape: the built-in text model's Llama as the language model, with Idefics3's tokens added
to its tokenizer; a 2-layer SigLIP tower on 112x112 images in 14-pixel patches (64 patches),
pixel-shuffled by 2, so every image is 16 tokens; images are not split into tiles.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from duet.worker_runtime import tiny_model

VISION_MODEL_NAME = "duet-tiny-idefics3"
IMAGE_TOKEN = "<image>"
_SPECIAL_TOKENS = (IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
IMAGE_SIZE = 112
PATCH_SIZE = 14
SCALE_FACTOR = 2
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
_RECIPE_VERSION = 1
_VISION_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
}


def tiny_vision_model_dir() -> Path:
    """The cache path of the current recipe (the recipe is part of the name)."""
    recipe = json.dumps(
        {"v": _RECIPE_VERSION, "text": tiny_model.BUILTIN_SHAPES["builtin"][1], "vision": _VISION_CONFIG}, sort_keys=True
    )
    return tiny_model.cache_dir() / f"{VISION_MODEL_NAME}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def ensure_tiny_vision_model() -> Path:
    """The built-in vision-language model's directory, made on first use (atomically, as the
    text model's: concurrent callers never see a half-written one)."""
    target = tiny_vision_model_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write(out: Path) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    text = tiny_model.BUILTIN_SHAPES["builtin"][1]
    tiny_model.write_tokenizer(out, text, extra_special_tokens=_SPECIAL_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = Idefics3Config(
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **text,
        ),
        vision_config=Idefics3VisionConfig(**_VISION_CONFIG),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
    )
    torch.manual_seed(tiny_model.SEED)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # well-separated greedy picks, as the text model's
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": IMAGE_SIZE},
            max_image_size={"longest_edge": IMAGE_SIZE},
        ),
        tokenizer=tokenizer,
        image_seq_len=TOKENS_PER_IMAGE,
        chat_template=tiny_model.CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
