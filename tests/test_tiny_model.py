"""The built-in models are deterministic and cached; the text model loads in transformers as in
vLLM (the vision model's own tests: test_vision_language.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from duet.worker_runtime import tiny_model, tiny_vision_model


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("ensure", [tiny_model.ensure_tiny_model, tiny_vision_model.ensure_tiny_vision_model])
def test_creation_is_deterministic_and_cached(tmp_path, monkeypatch, ensure):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "a"))
    first = ensure()
    modified = first.stat().st_mtime_ns
    assert ensure() == first and first.stat().st_mtime_ns == modified
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "b"))
    second = ensure()
    assert _digest(first) == _digest(second)


def test_tokenizer_round_trips_text():
    path = tiny_model.ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "The router sends the prompt to a prefill worker, ünïcödé ✓."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_transformers_greedy_equals_vllm_colocated(reference):
    path = tiny_model.ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = list(range(20, 60))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert out[0, len(prompt):].tolist() == reference.greedy([prompt], max_tokens=16, ignore_eos=True)[0]
