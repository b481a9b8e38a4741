"""The prefill worker: a Ray actor whose vLLM engine is a KV producer.

It runs the prompt and samples the first token. With the nixl transport it keeps the prompt's
KV blocks until a decode worker pulls them (or the lease expires); with nccl it streams each
layer to the chosen decode worker while prefill runs. It returns the first token and the
transfer parameters, nothing more: the decode side does everything after.
"""

from __future__ import annotations

from typing import Any

from duet.cluster.engine_host import EngineHost
from duet.cluster.worker_api import PrefillResult, SamplingSpec
from duet.kv_transfer.config import prefill_request_params


class PrefillWorker(EngineHost):
    role = "prefill"

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        decode_endpoint: str | None = None,
    ) -> PrefillResult:
        """Prefill ``prompt_token_ids``; its KV is kept for (nixl) or sent to (nccl) decode.

        ``decode_endpoint`` names the decode worker for push transports, which stream the KV
        to it while prefill runs.
        """
        # Asking for remote decode only matters if a decode step will follow.
        wants_decode = sampling.max_tokens > 1
        transfer = prefill_request_params(self.config.kv_transfer, decode_endpoint) if wants_decode else None
        params = self._params(sampling.for_prefill(), transfer)
        final: Any = None
        with self._tracked(request_id):
            async for output in self.engine.generate(
                {"prompt_token_ids": prompt_token_ids}, params, request_id
            ):
                final = output
        completion = final.outputs[0]
        # Hitting the one-token limit means "hand over to decode" unless one token was all we
        # wanted; any other reason (EOS, stop) ends the request here.
        handing_over = wants_decode and completion.finish_reason == "length"
        finish = None if handing_over else completion.finish_reason
        return PrefillResult(
            first_token_id=completion.token_ids[0],
            first_text=completion.text,
            num_prompt_tokens=len(prompt_token_ids),
            kv_transfer_params=final.kv_transfer_params if handing_over else None,
            finish_reason=finish,
            worker=self.name,
        )
