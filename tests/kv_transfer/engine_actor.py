"""A vLLM ``AsyncLLM`` inside a Ray actor, for tests that need engines in separate processes.

The actor also records what vLLM's stats path delivers (prompt tokens by source and the
connector's per-interval stats), which is how the tests prove the decode side loaded the KV
instead of recomputing it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core and worker in the actor: 2 fewer processes
    "RAY_AUTH_MODE": "disabled",
}


def _collector_factory(sink: dict[str, Any]):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Collector(StatLoggerBase):
        """Accumulates prompt-token sources and connector stats into ``sink``."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                pts = iteration_stats.prompt_token_stats
                for key in ("computed", "local_cache_hit", "external_kv_transfer", "total"):
                    sink["prompt_tokens"][key] += getattr(pts, key)
            if scheduler_stats is not None and scheduler_stats.kv_connector_stats:
                data = scheduler_stats.kv_connector_stats
                sink["connector"]["records"].extend(data.get("records", []))
                sink["connector"]["failures"].extend(data.get("failures", []))

        def log_engine_initialized(self):
            pass

    return Collector


@ray.remote(num_cpus=0)
class EngineActor:
    """One engine; ``generate`` takes token ids and returns tokens plus kv_transfer_params."""

    def __init__(self, model: str, kv_transfer_config: dict[str, Any] | None, max_model_len: int = 4096):
        os.environ.update(ENGINE_ENV)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._sink: dict[str, Any] = {
            "prompt_tokens": {"computed": 0, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 0},
            "connector": {"records": [], "failures": []},
        }
        args = AsyncEngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            kv_transfer_config=kv_transfer_config,
            disable_log_stats=False,
        )
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[_collector_factory(self._sink)])
        self._next_id = 0

    async def generate(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        logprobs: int | None = None,
    ) -> dict[str, Any]:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra, logprobs=logprobs
        )
        self._next_id += 1
        final = None
        async for out in self._llm.generate({"prompt_token_ids": prompt_token_ids}, params, f"req-{self._next_id}"):
            final = out
        assert final is not None
        return {
            "token_ids": list(final.outputs[0].token_ids),
            "finish_reason": final.outputs[0].finish_reason,
            "kv_transfer_params": final.kv_transfer_params,
            "logprobs": [
                {tok: lp.logprob for tok, lp in step.items()} for step in (final.outputs[0].logprobs or [])
            ],
        }

    async def generate_many(self, batch: list[tuple[list[int], int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
        """All requests at once, so they are in flight together."""
        return await asyncio.gather(*(self.generate(*item) for item in batch))

    async def stats(self) -> dict[str, Any]:
        """What vLLM's stats path delivered so far (waits one logging tick to flush)."""
        await asyncio.sleep(0.2)
        await self._llm.do_log_stats()
        return self._sink

    def reset_stats(self) -> None:
        for key in self._sink["prompt_tokens"]:
            self._sink["prompt_tokens"][key] = 0
        self._sink["connector"] = {"records": [], "failures": []}

    def shutdown(self) -> None:
        self._llm.shutdown()
