"""The built-in model is deterministic, cached, and loads in transformers as in vLLM."""

from __future__ import annotations

import hashlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from duet.worker_runtime import tiny_model


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_creation_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "a"))
    first = tiny_model.ensure_tiny_model()
    modified = first.stat().st_mtime_ns
    assert tiny_model.ensure_tiny_model() == first and first.stat().st_mtime_ns == modified
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "b"))
    second = tiny_model.ensure_tiny_model()
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
