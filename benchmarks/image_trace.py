"""The image trace of ``duet bench serve --images MIX``: a text trace's requests as OpenAI chat
requests that carry images, for a vision-language model.

Each request of the trace keeps its arrival time, its output length (``max_tokens``, greedy,
``ignore_eos``, streamed with usage) and its prompt length, which becomes text: random words
of the tokenizer's built-in corpus cut to that many tokens of the model's tokenizer (the chat
template's few tokens and the images' tokens come on top). The images come from a mix:

- ``vqa``: 0, 1 or 2 images a request with probabilities 0.3, 0.5 and 0.2; each new image
  224x224, 448x336 or 640x480 pixels (equally likely, random pixels, sent as a PNG data: URL;
  the model's processor resizes it: builtin-vl-large to 224 pixels a side, 16 tokens an image);
  and each image sent is, with probability 0.5, one an earlier request of the same replay sent
  (drawn uniformly among them, never twice in one request), so that encoder caches can hit, duet's
  and vLLM's server's own alike.

Every replay (the warm-up, each rate, each round) draws from its own seed, with pictures of its
own, so that no replay re-sends another's images; the same seed gives every system the same
requests. The text comes first in each message and differs between requests, so an image sent
again saves its encoder pass, not the prompt's prefill.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from duet.benchmarks.encoder_cache import image_part, pictures, png
from duet.benchmarks.openai_replay import greedy_stream
from duet.cluster.placement.trace import IMAGE_MIXES as PLANNED_MIXES
from duet.cluster.placement.trace import Trace
from duet.worker_runtime.tiny_model import CORPUS_WORDS


# The model an image trace runs on unless --config names another: the built-in vision model whose
# encoder costs tens of milliseconds an image on one core, as a real model's costs more than its
# prompt's share of prefill.
IMAGE_MODEL = "builtin-vl-large"


@dataclass(frozen=True)
class ImageMix:
    """How many images each request carries, how large they are, and how often one repeats."""

    description: str
    count_weights: tuple[float, ...]  # the chance of 0, 1, 2, ... images in a request
    sizes: tuple[tuple[int, int], ...]  # (width, height) a new image is drawn from
    repeat_share: float  # the chance that an image sent is one an earlier request sent


def _count_weights(name: str) -> tuple[float, ...]:
    """The chance of 0, 1, 2, ... images in a request of ``duet plan``'s mix ``name``, so that a
    plan and the benchmark that checks it draw the same counts."""
    shares = dict(PLANNED_MIXES[name])
    return tuple(shares.get(count, 0.0) for count in range(max(shares) + 1))


IMAGE_MIXES = {
    "vqa": ImageMix(
        "0/1/2 images a request (p 0.3/0.5/0.2, as duet plan --images vqa), 224x224, 448x336 or 640x480 pixels, "
        "half of the images sent re-sent from an earlier request of the same replay",
        count_weights=_count_weights("vqa"),
        sizes=((224, 224), (448, 336), (640, 480)),
        repeat_share=0.5,
    ),
}


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


def image_plan(mix: ImageMix, requests: int, seed: int) -> list[list[int]]:
    """Per request, the pictures it sends, numbered in order of their first send: a number
    below every number an earlier request sent is an image sent again."""
    rng = random.Random(f"image-plan-{seed}")
    plan: list[list[int]] = []
    sent = 0  # pictures sent so far, numbered 0..sent-1
    for _ in range(requests):
        earlier, chosen = sent, []
        for _ in range(rng.choices(range(len(mix.count_weights)), mix.count_weights)[0]):
            again = [picture for picture in range(earlier) if picture not in chosen]
            if again and rng.random() < mix.repeat_share:
                chosen.append(rng.choice(again))
            else:
                chosen.append(sent)
                sent += 1
        plan.append(chosen)
    return plan


def plan_counts(plan: list[list[int]]) -> dict[str, int]:
    """What a replay of ``plan`` sends: requests with images, images sent, distinct images."""
    return {
        "requests": len(plan),
        "requests_with_images": sum(1 for request in plan if request),
        "images_sent": sum(len(request) for request in plan),
        "distinct_images": len({picture for request in plan for picture in request}),
    }


def prompt_texts(lengths: Sequence[int], seed: int, tokenizer: Tokenizer) -> list[str]:
    """Per prompt length, random words cut to that many tokens of ``tokenizer``: each word is
    at least one token, so the cut never falls short."""
    rng = random.Random(f"chat-text-{seed}")
    texts = []
    for length in lengths:
        words = " ".join(rng.choice(CORPUS_WORDS) for _ in range(length))
        texts.append(tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:length]))
    return texts


def chat_bodies(model: str, trace: Trace, seed: int, mix: ImageMix, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The replay of ``trace`` with ``seed``: one streamed chat request per row, its text then
    its images (:func:`image_plan`), each picture a PNG file of this seed's own."""
    plan = image_plan(mix, len(trace), seed)
    drawn = pictures(plan_counts(plan)["distinct_images"], seed, mix.sizes)
    files = [png(picture, f"serve-{seed}-{index}") for index, picture in enumerate(drawn)]
    texts = prompt_texts([int(n) for n in trace.input_len], seed, tokenizer)
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *(image_part(files[i]) for i in images)]}],
            **greedy_stream(int(n_out)),
        }
        for text, images, n_out in zip(texts, plan, trace.output_len)
    ]


@cache
def model_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of the model in ``model_dir`` (Hugging Face's), loaded once a run."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
