"""Decode: generate a request's tokens on an engine that is a KV consumer.

Given the prompt and the prefill worker's transfer parameters, the engine pulls the prompt's KV
instead of recomputing it, then decodes. The engine re-derives the first token from the pulled
KV (vLLM recomputes the last prompt position to get its logits); the router has already sent that
token to the client, so the stream skips it and carries only what follows. Without transfer
parameters the engine computes the prompt itself: colocated serving (``mode: colocated``), where
every token is streamed, the first included, or the fallback when a KV hand-off failed.

:func:`decode_updates` is the one implementation. For vLLM workers the router runs it against
the engine's front end in its own process, so tokens go from the engine core straight to the
client's stream (router/engine_front_end.py). :class:`DecodeWorker` is the Ray actor that hosts
the engine core. :class:`SimulatedDecodeWorker` hosts a SIMULATED engine, which lives in the
actor; it runs decode there and sends the tokens to the router in per-step batches
(worker_runtime/worker_channel.py).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

from duet.worker_runtime.engine_host import EngineCoreHost
from duet.worker_runtime.simulated_host import SimulatedHost
from duet.worker_runtime.images import opened_prompt
from duet.worker_runtime.worker_api import DecodeChunk, SamplingSpec, logprobs_of
from duet.worker_runtime.worker_channel import Message
from duet.prefill_worker.worker import ParamsFactory

logger = logging.getLogger(__name__)


async def decode_updates(
    engine: Any,
    make_params: ParamsFactory,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec,
    kv_transfer_params: dict[str, Any] | None,
    first_token_id: int | None = None,
    first_text: str = "",
) -> AsyncIterator[DecodeChunk]:
    """The request's new tokens, text, logprobs and finish as ``engine`` produces them.

    ``first_token_id`` is the token prefill already sent (with its logprobs), which is
    skipped; None streams every token (a request computed here, or moved here from another
    decode worker, whose first output is new). ``first_text`` is that token's text. Delta
    outputs: vLLM hands over only what is new, merging steps a slow reader missed.

    The engine re-derives the skipped token under the request's own sampling, so from then on
    its state is what a single engine's would be: penalties count that token as output, a
    grammar has consumed it, a seeded generator has drawn it. Prompt logprobs come from the
    engine that computed the prompt: asked of this one only when no KV is handed to it.
    """
    if kv_transfer_params is not None or first_token_id is not None:
        sampling = sampling.for_decode()
    params = make_params(sampling, kv_transfer_params, True)
    skip_first = first_token_id is not None
    prompt_logprobs_due = sampling.prompt_logprobs is not None
    async for output in engine.generate(
        await opened_prompt(prompt_token_ids, sampling.images), params, request_id, lora_request=sampling.lora_request(),
        priority=sampling.priority,
    ):
        completion = output.outputs[0]
        token_ids, text = list(completion.token_ids), completion.text
        logprobs = logprobs_of(completion.logprobs)
        if skip_first and token_ids:
            skip_first = False
            if token_ids[0] != first_token_id:
                # Only possible with sampling and float noise between the two engines.
                logger.warning("request %s: decode re-derived a different first token", request_id)
            token_ids = token_ids[1:]
            logprobs = logprobs[1:] if logprobs is not None else None
            text = text[len(first_text):] if text.startswith(first_text) else text
        prompt_logprobs = None
        if prompt_logprobs_due and output.prompt_logprobs is not None:
            prompt_logprobs, prompt_logprobs_due = logprobs_of(output.prompt_logprobs), False
        finish = completion.finish_reason if output.finished else None
        if token_ids or text or finish is not None:
            yield DecodeChunk(
                token_ids, text, finish, logprobs, prompt_logprobs, completion.stop_reason if finish is not None else None
            )


class DecodeWorker(EngineCoreHost):
    """Hosts a decode pool's vLLM engine core (a KV consumer)."""

    role = "decode"


class ColocatedWorker(EngineCoreHost):
    """Hosts a colocated deployment's vLLM engine core: no KV transfer, every request whole."""

    role = "colocated"


class SimulatedDecodeWorker(SimulatedHost):
    role = "decode"

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None = None,
        first_text: str = "",
        *,
        reply: Callable[[Message], None],
    ) -> None:
        """Generate, each step's tokens put with ``reply`` (the channel the request came
        over); returns when finished."""
        with self._tracked(request_id):
            async for chunk in decode_updates(
                self.engine, self._params, request_id, prompt_token_ids, sampling,
                kv_transfer_params, first_token_id, first_text,
            ):
                reply([request_id, "tokens", chunk.token_ids, chunk.text, chunk.finish_reason])


class SimulatedColocatedWorker(SimulatedDecodeWorker):
    """A SIMULATED worker of a colocated deployment: every request computed whole."""

    role = "colocated"
