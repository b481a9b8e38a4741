"""The decode worker: a Ray actor whose vLLM engine is a KV consumer.

Given the prompt and the prefill worker's transfer parameters, its engine pulls the prompt's KV
instead of recomputing it, then decodes. The engine re-derives the first token from the pulled
KV (vLLM recomputes the last prompt position to get its logits); the router has already sent that
token to the client, so the stream skips it and carries only what follows.

Tokens do not travel back as the return value of the call: :meth:`DecodeWorker.decode` drops
each step's new tokens into the worker's outbox, and the router reads every request's tokens
from the worker's one token stream (see :mod:`duet.cluster.token_outbox`). The call itself
returns when the request is done; the router awaits it only to learn of failures.

The same worker serves colocated deployments (``mode: colocated``): there it computes the prompt
itself and streams every token, the first included.
"""

from __future__ import annotations

import logging
from typing import Any

from duet.cluster.engine_host import EngineHost
from duet.cluster.worker_api import SamplingSpec

logger = logging.getLogger(__name__)


class DecodeWorker(EngineHost):
    role = "decode"

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int | None = None,
        first_text: str = "",
    ) -> None:
        """Generate the request's tokens into the token stream; returns when it finished.

        ``first_token_id`` is the token prefill already sent, which the stream skips; None
        streams every token (colocated serving). Without ``kv_transfer_params`` the engine
        computes the prompt itself (colocated, or the fallback when a KV hand-off failed).
        """
        params = self._params(sampling, kv_transfer_params, delta=True)
        skip_first = first_token_id is not None
        put = self.outbox.put
        with self._tracked(request_id):
            async for output in self.engine.generate({"prompt_token_ids": prompt_token_ids}, params, request_id):
                completion = output.outputs[0]
                token_ids, text = completion.token_ids, completion.text
                if skip_first and token_ids:
                    skip_first = False
                    if token_ids[0] != first_token_id:
                        # Only possible with sampling and float noise between the two engines.
                        logger.warning("request %s: decode re-derived a different first token", request_id)
                    token_ids = token_ids[1:]
                    text = text[len(first_text):] if text.startswith(first_text) else text
                finish = completion.finish_reason if output.finished else None
                if token_ids or text or finish is not None:
                    put((request_id, list(token_ids), text, finish))


class ColocatedWorker(DecodeWorker):
    """A worker of a colocated deployment: no KV transfer, every request computed whole."""

    role = "colocated"
