"""The built-in tiny vision-language model: an Idefics3 (SmolVLM's architecture: a SigLIP tower
and the tiny Llama) made locally.

Like the built-in text model (tiny_model.py), it is made on first use, deterministically, with
random weights, and cached; it is a real Hugging Face checkpoint that vLLM (on CPU: its vision
tower runs on torch SDPA) and transformers both load. Idefics3 because vLLM's modules for LLaVA,
Qwen2-VL and Gemma 3 import torchvision, which this machine cannot have (PyPI's builds are CUDA
builds and break transformers; see ../shared/ENVIRONMENT.md), while Idefics3's image processor
has a PIL form.

The shape: the built-in text model's Llama as the language model, with Idefics3's tokens added
to its tokenizer; a SigLIP tower on square images in 14-pixel patches, pixel-shuffled so that
every image is 16 tokens (:data:`VISION_SHAPES`); images are not split into tiles.
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
# Each built-in vision model's shape: its image size, its SigLIP tower and its pixel shuffle.
# builtin-vl: a 2-layer tower on 112x112 images (64 patches, shuffled by 2). builtin-vl-large: a
# 6-layer tower four times as wide on 224x224 images (256 patches, shuffled by 4), whose encoder
# costs tens of milliseconds an image on one core, as a real model's costs more than its
# prompt's share of prefill (`duet bench images`). Both make 16 tokens an image.
PATCH_SIZE = 14
VISION_SHAPES: dict[str, dict] = {
    "builtin-vl": {"image_size": 112, "scale_factor": 2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    "builtin-vl-large": {
        "image_size": 224, "scale_factor": 4, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 6,
    },
}
TOKENS_PER_IMAGE = 16
_RECIPE_VERSION = 1


def _vision_config(shape: str) -> dict:
    """The SigLIP tower's config of ``shape``."""
    spec = VISION_SHAPES[shape]
    return {
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": 4,
        "image_size": spec["image_size"],
        "patch_size": PATCH_SIZE,
    }


def tiny_vision_model_dir(shape: str = "builtin-vl") -> Path:
    """The cache path of the current recipe of ``shape`` (the recipe is part of the name)."""
    recipe = json.dumps(
        {"v": _RECIPE_VERSION, "text": tiny_model.BUILTIN_SHAPES["builtin"][1], "vision": _vision_config(shape)}, sort_keys=True
    )
    return tiny_model.cache_dir() / f"{vision_model_name(shape)}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def vision_model_name(shape: str = "builtin-vl") -> str:
    """The name of built-in vision model ``shape`` (its checkpoint folder's, less the recipe's hash)."""
    return VISION_MODEL_NAME if shape == "builtin-vl" else f"{VISION_MODEL_NAME}-{shape.removeprefix('builtin-vl-')}"


def ensure_tiny_vision_model(shape: str = "builtin-vl") -> Path:
    """The built-in vision-language model's directory, made on first use (atomically, as the
    text model's: concurrent callers never see a half-written one)."""
    target = tiny_vision_model_dir(shape)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write(staging, shape)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write(out: Path, shape: str) -> None:
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
        vision_config=Idefics3VisionConfig(**_vision_config(shape)),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=VISION_SHAPES[shape]["scale_factor"],
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
            size={"longest_edge": VISION_SHAPES[shape]["image_size"]},
            max_image_size={"longest_edge": VISION_SHAPES[shape]["image_size"]},
        ),
        tokenizer=tokenizer,
        image_seq_len=TOKENS_PER_IMAGE,
        chat_template=tiny_model.CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
