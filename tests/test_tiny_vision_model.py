"""The built-in vision-language model: an Idefics3 that transformers loads whole, with the image
token count it is made for, and that vLLM reads as transformers does (issue 55's base; that it
is deterministic and cached is tested with the text model's, in test_tiny_model.py)."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Idefics3ForConditionalGeneration

from duet.worker_runtime import tiny_vision_model as vision
from duet.worker_runtime.tiny_vision_model import IMAGE_TOKEN, TOKENS_PER_IMAGE


def test_an_image_is_sixteen_tokens_and_changes_the_output():
    path = vision.ensure_tiny_vision_model()
    processor = AutoProcessor.from_pretrained(path)
    model, loading = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading  # every weight saved is loaded, none missing
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    logits = []
    for colour in ((200, 30, 40), (20, 180, 90)):
        inputs = processor(text=f"{IMAGE_TOKEN}\nwhat is this", images=Image.new("RGB", (80, 60), colour), return_tensors="pt")
        assert int((inputs["input_ids"] == image_id).sum()) == TOKENS_PER_IMAGE
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1]), "the vision tower's output reaches the language model"


def test_a_config_names_it_builtin_vl():
    from duet.config import ModelConfig
    from duet.worker_runtime.engine import resolve_model_path

    model = ModelConfig(name="duet-tiny-idefics3", path="builtin-vl")
    assert resolve_model_path(model) == vision.ensure_tiny_vision_model()


@pytest.fixture(scope="module")
def vision_engine():
    """A vLLM engine on the built-in vision model, with duet's engine settings."""
    from vllm import LLM

    from duet.config import ModelConfig
    from duet.worker_runtime.engine import cpu_engine_environment, engine_kwargs, is_cpu_only

    if is_cpu_only():
        os.environ.update(cpu_engine_environment(cpu_core=None, one_process_executor=False))
    llm = LLM(**engine_kwargs(ModelConfig(name="duet-tiny-idefics3", path="builtin-vl", max_model_len=1024), kv_cache_gib=0.25))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_vllm_reads_images_as_transformers_does(vision_engine):
    """vLLM on CPU serves the model with an image: the same prompt tokens as the Hugging Face
    processor makes, and the same greedy tokens as transformers; text alone works too."""
    from vllm import SamplingParams

    path = vision.ensure_tiny_vision_model()
    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = f"{IMAGE_TOKEN}\nwhat is this"
    for colour in ((200, 30, 40), (20, 180, 90)):
        image = Image.new("RGB", (80, 60), colour)
        (out,) = vision_engine.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], params, use_tqdm=False)
        inputs = processor(text=prompt, images=image, return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == expected[0, inputs["input_ids"].shape[1]:].tolist()
    (text_only,) = vision_engine.generate([{"prompt": "hello there"}], params, use_tqdm=False)
    assert len(text_only.outputs[0].token_ids) == 8
