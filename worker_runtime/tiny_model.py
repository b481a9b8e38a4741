"""The built-in tiny models: Llama-architecture models and a byte-level BPE tokenizer made locally.

duet must start on a fresh machine with no model hub, so its default model is created here,
deterministically (fixed corpus, fixed seed), and cached under ``~/.cache/duet`` (or
``$DUET_CACHE_DIR``). Its weights are random: the text it prints is not meaningful, but it is a
real Hugging Face checkpoint that vLLM and transformers both load, which is what the serving path
and the exactness tests need (greedy float32 output is a deterministic function of the weights).

A second built-in model of another shape (``builtin-wide``: wider, shallower, a KV head per
attention head, so its KV blocks are laid out differently) lets one deployment serve two models
on a laptop (configs/multi-model.yaml).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_NAME = "duet-tiny-llama"
WIDE_MODEL_NAME = "duet-tiny-llama-wide"
# Bumped whenever the recipe below changes, so that a stale cache is never served.
_RECIPE_VERSION = 2
SEED = 1234

_LLAMA_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_WIDE_LLAMA_CONFIG = {
    **_LLAMA_CONFIG,
    "hidden_size": 384,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
}
# Each built-in model by its config path (model.path), with its served name and shape.
BUILTIN_SHAPES = {"builtin": (TINY_MODEL_NAME, _LLAMA_CONFIG), "builtin-wide": (WIDE_MODEL_NAME, _WIDE_LLAMA_CONFIG)}
_TARGET_VOCAB_SIZE = 4096
# A plain role-tagged chat format, so /v1/chat/completions works on the built-in model.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The built-in tokenizer is trained on sentences of these words, so each is one token of it
# after a space; benchmarks write prompts of them (benchmarks/image_trace.py).
CORPUS_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out other into time only some could them these may than first any new very my "
    "made after most over did down also way many then before must through where much should "
    "well people work about water long little world great under years between state never "
    "house light place again because number small large point city country school order "
    "system program question during government early around something family night "
    "prefill decode cache token request router worker cluster engine model transfer memory "
    "batch latency throughput serving prompt layer block stream scheduler replica placement"
).split()


def cache_dir() -> Path:
    """Where created models live; ``DUET_CACHE_DIR`` overrides the default."""
    return Path(os.environ.get("DUET_CACHE_DIR", Path.home() / ".cache" / "duet"))


def _llama_config(context: int | None, shape: str) -> dict:
    config = BUILTIN_SHAPES[shape][1]
    if context is None:
        return config
    return {**config, "max_position_embeddings": context}


def tiny_model_dir(context: int | None = None, shape: str = "builtin") -> Path:
    """The cache path of the current recipe (the recipe is part of the name)."""
    recipe = json.dumps(
        {"v": _RECIPE_VERSION, "seed": SEED, "cfg": _llama_config(context, shape), "vocab": _TARGET_VOCAB_SIZE},
        sort_keys=True,
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    return cache_dir() / f"{BUILTIN_SHAPES[shape][0]}-{digest}"


def ensure_tiny_model(context: int | None = None, shape: str = "builtin") -> Path:
    """Return the directory of the built-in model ``shape`` (a key of BUILTIN_SHAPES), creating
    it on first use.

    ``context`` overrides the maximum sequence length (4,096) for a long-context variant with
    otherwise identical weights, used by the KV-transfer benchmark's 32k-token prompts.
    Creation writes to a temporary sibling directory and renames it into place, so concurrent
    callers (several Ray actors starting at once) never see a half-written model.
    """
    target = tiny_model_dir(context, shape)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_tokenizer(staging, _llama_config(context, shape))
        _write_model(staging, _llama_config(context, shape))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _training_corpus() -> list[str]:
    """A fixed pseudo-English corpus: seeded word sequences, identical on every machine."""
    rng = random.Random(SEED)
    lines = []
    for _ in range(20000):
        words = [rng.choice(CORPUS_WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ","])
        lines.append(sentence)
    return lines


def write_tokenizer(out: Path, llama_config: dict, extra_special_tokens: tuple[str, ...] = ()) -> None:
    """The built-in byte-level BPE tokenizer, trained on the fixed corpus, into ``out``
    (``extra_special_tokens``: e.g. the vision model's ``<image>``, one id each)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>", *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=llama_config["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def _write_model(out: Path, llama_config: dict) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        **llama_config,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Larger-than-default logits make greedy picks well separated, so exactness tests compare
    # decisions, not float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
