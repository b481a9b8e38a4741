"""Prefill: run the prompt on an engine that is a KV producer and sample the first token.

With the nixl transport the engine keeps the prompt's KV blocks until a decode worker pulls them
(or the lease expires); with nccl it streams each layer to the chosen decode worker while
prefill runs. The result is the first token and the transfer parameters, nothing more: the
decode side does everything after.

:func:`run_prefill` is the one implementation. For vLLM workers the router runs it against the
engine's front end in its own process (router/engine_front_end.py); :class:`PrefillWorker` is
the Ray actor that hosts the engine core. :class:`SimulatedPrefillWorker` hosts a SIMULATED
engine, which lives in the actor, and runs it there.
"""

from __future__ import annotations

from typing import Any, Callable

from duet.config import KVTransferConfig
from duet.worker_runtime.engine_host import EngineCoreHost
from duet.worker_runtime.simulated_host import SimulatedHost
from duet.worker_runtime.images import opened_prompt
from duet.worker_runtime.worker_api import EngineAborted, PrefillResult, SamplingSpec, logprobs_of
from duet.kv_transfer.config import pool_source_params, prefill_request_params

# Builds the engine's request parameters: (sampling, kv_transfer_params, delta outputs) -> params.
ParamsFactory = Callable[[SamplingSpec, "dict[str, Any] | None", bool], Any]


async def run_prefill(
    engine: Any,
    make_params: ParamsFactory,
    transfer: KVTransferConfig,
    worker: str,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: SamplingSpec,
    decode_endpoint: str | None = None,
    pool_source: str | None = None,
) -> PrefillResult:
    """Prefill ``prompt_token_ids`` on ``engine`` (anything with ``AsyncLLM.generate``).

    ``decode_endpoint`` names the decode worker for push transports, which stream the KV to it
    while prefill runs. ``pool_source`` ("host:port") names an engine on another host whose
    pool holds the prompt's prefix: the engine's p2p tier fetches what its own host's pool lacks.
    """
    # Asking for remote decode only matters if a decode step will follow.
    wants_decode = sampling.max_tokens > 1
    transfer_params = prefill_request_params(transfer, decode_endpoint) if wants_decode else None
    if pool_source is not None:
        transfer_params = {**(transfer_params or {}), **pool_source_params(pool_source, request_id)}
    params = make_params(sampling.for_prefill(), transfer_params, False)
    final: Any = None
    async for output in engine.generate(
        await opened_prompt(prompt_token_ids, sampling.images), params, request_id, lora_request=sampling.lora_request(),
        priority=sampling.priority,
    ):
        final = output
    completion = final.outputs[0]
    if completion.finish_reason == "abort":  # its worker was found dead, or it was cancelled
        raise EngineAborted(f"request {request_id} was aborted in the engine")
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
        worker=worker,
        first_logprobs=logprobs_of(completion.logprobs),
        prompt_logprobs=logprobs_of(final.prompt_logprobs),
        stop_reason=None if handing_over else completion.stop_reason,
        cached_tokens=final.num_cached_tokens or 0,
    )


class PrefillWorker(EngineCoreHost):
    """Hosts a prefill pool's vLLM engine core (a KV producer)."""

    role = "prefill"


class SimulatedPrefillWorker(SimulatedHost):
    role = "prefill"

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        decode_endpoint: str | None = None,
    ) -> PrefillResult:
        """Prefill inside the actor (see :func:`run_prefill`)."""
        with self._tracked(request_id):
            return await run_prefill(
                self.engine, self._params, self.config.kv_transfer, self.name,
                request_id, prompt_token_ids, sampling, decode_endpoint,
            )
