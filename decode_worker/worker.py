"""The decode worker: a Ray actor whose vLLM engine is a KV consumer.

Given the prompt and the prefill worker's transfer parameters, its engine pulls the prompt's KV
instead of recomputing it, then decodes. The engine re-derives the first token from the pulled
KV (vLLM recomputes the last prompt position to get its logits); the router has already sent that
token to the client, so the stream skips it and yields only what follows.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from duet.cluster.engine_host import EngineHost
from duet.cluster.worker_api import DecodeChunk, SamplingSpec

logger = logging.getLogger(__name__)


class DecodeWorker(EngineHost):
    role = "decode"

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None,
        first_token_id: int,
        first_text: str,
    ) -> AsyncIterator[DecodeChunk]:
        """Stream the tokens after the first, as chunks of new token ids and text.

        Without ``kv_transfer_params`` the engine computes the prompt itself (the fallback when a
        KV hand-off failed or timed out).
        """
        params = sampling.to_vllm(kv_transfer_params=kv_transfer_params, cumulative=True)
        sent_tokens, sent_text = 1, first_text
        with self._tracked(request_id):
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt_token_ids}, params, request_id
            ):
                completion = output.outputs[0]
                if sent_tokens == 1 and completion.token_ids and completion.token_ids[0] != first_token_id:
                    # Only possible with sampling and float noise between the two engines.
                    logger.warning("request %s: decode re-derived a different first token", request_id)
                new_ids = list(completion.token_ids[sent_tokens:])
                text = completion.text
                delta = text[len(sent_text):]
                finish = completion.finish_reason if output.finished else None
                if not new_ids and not delta and finish is None:
                    continue
                sent_tokens += len(new_ids)
                sent_text = text
                yield DecodeChunk(token_ids=new_ids, text=delta, finish_reason=finish)
