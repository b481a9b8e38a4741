"""A worker found dead ends every request on its engine front end at once, including one that
vLLM was still registering when the worker died.

Such a request (its inputs are processed in a thread, where no abort reaches it) used to be sent
to the dead engine core and wait for an answer that never came: a decode worker killed during
a KV hand-off kept its request for the whole 30 s hand-off timeout (a CI flake of
tests/kv_transfer/test_nccl_serving.py::test_decode_killed_during_handoff_resumes).

A real vLLM front end and engine core (the built-in tiny model), started in this process as
``duet bench front-end`` starts one; the worker's death is reported by the router's own call,
:meth:`EngineFrontEnd.lost`, as the health watcher makes it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from duet.config import KVTransferConfig, ModelConfig
from duet.worker_runtime.engine import cpu_engine_environment, engine_kwargs, is_cpu_only
from duet.worker_runtime.worker_api import SamplingSpec
from duet.router.engine_front_end import EngineFrontEnd, new_front_end
from duet.router.worker_engines import EngineLost

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
# Far longer than the test: a request that finishes on its own proves nothing.
LONG = SamplingSpec(max_tokens=400, ignore_eos=True)
ANSWER_WITHIN_S = 10.0


async def _next_chunk(stream: Any) -> Any:
    return await asyncio.wait_for(anext(stream), ANSWER_WITHIN_S)


async def _death_during_registration() -> tuple[BaseException, BaseException]:
    """Start one request, then another, and report the worker dead while vLLM processes the
    second one's inputs. Returns what each request raised."""
    from prometheus_client import CollectorRegistry
    from vllm.engine.arg_utils import AsyncEngineArgs

    vllm_config = AsyncEngineArgs(**engine_kwargs(ModelConfig(), kv_cache_gib=1)).create_engine_config()
    registry = CollectorRegistry()
    front_end = EngineFrontEnd("decode-0", None, new_front_end(vllm_config, registry), registry, KVTransferConfig())
    try:
        running = front_end.decode("running", PROMPT, LONG, None, None, "")
        await _next_chunk(running)

        processing = front_end.engine.input_processor.process_inputs_async

        async def worker_dies_meanwhile(*args: Any, **kwargs: Any) -> Any:
            front_end.lost(RuntimeError("the actor died"))
            return await processing(*args, **kwargs)

        front_end.engine.input_processor.process_inputs_async = worker_dies_meanwhile
        registering = front_end.decode("registering", PROMPT, LONG, None, None, "")
        errors = []
        for stream in (registering, running):
            with pytest.raises(EngineLost) as raised:
                while True:
                    await _next_chunk(stream)
            errors.append(raised.value)
        return errors[0], errors[1]
    finally:
        front_end.close()


def test_requests_end_as_lost_when_the_worker_dies_even_while_being_registered(monkeypatch):
    if is_cpu_only():
        for name, value in cpu_engine_environment(cpu_core=None).items():
            monkeypatch.setenv(name, value)  # as in a worker; restored after the test
    registering, running = asyncio.run(_death_during_registration())
    assert "decode-0 is gone" in str(registering)
    assert "the actor died" in str(running)
