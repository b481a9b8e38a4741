"""Encode: run a request's images through a vision-language model's encoder, and nothing else.

An encode worker's vLLM engine is encoder-only (``ec_role: ec_producer``): it keeps no KV cache,
computes no token, and leaves each image's encoder output in the encoder cache
(kv_transfer/encoder_cache.py), from which the prefill engine of the request loads it (E+P+D:
docs/concepts/images.md). Its prompt is one image placeholder per image: vLLM keys an image's
encoder output by the image alone (its identifier), reusing it across prompts in its own encoder
cache, and the text would only cost input processing.

:func:`run_encode` is the one implementation; the router runs it against the engine's front end
in its own process (router/engine_front_end.py), as it runs prefill. :class:`EncodeWorker` is the
Ray actor that hosts the engine core.
"""

from __future__ import annotations

from typing import Any

from duet.worker_runtime.engine_host import EngineCoreHost
from duet.worker_runtime.images import opened_prompt
from duet.worker_runtime.worker_api import EngineAborted


async def run_encode(engine: Any, request_id: str, placeholder_ids: list[int], images: tuple[bytes, ...]) -> None:
    """Encode ``images`` on ``engine`` (anything with ``AsyncLLM.generate``); returns once
    their outputs are in the encoder cache."""
    from vllm import SamplingParams

    prompt = await opened_prompt(placeholder_ids * len(images), images)
    final: Any = None
    async for output in engine.generate(prompt, SamplingParams(max_tokens=1), request_id):
        final = output
    if final is None or (final.outputs and final.outputs[0].finish_reason == "abort"):
        raise EngineAborted(f"request {request_id} was aborted in the engine")


class EncodeWorker(EngineCoreHost):
    """Hosts an encode pool's vLLM engine core (encoder only)."""

    role = "encode"
