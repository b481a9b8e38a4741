"""Shared fixtures: one real duet deployment and one colocated reference engine per session.

Engines take 30-50 s to start on CPU, so every test that needs the serving path shares the same
deployment (local Ray, a prefill and a decode actor, each with a vLLM engine, NixlConnector
between them, the gRPC server on a free loopback port).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from duet.cluster.config import DuetConfig, load_config
from duet.router.client import DuetClient


class BackgroundLoop:
    """An asyncio loop in a thread, so sync tests can drive the async deployment."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def duet_config() -> DuetConfig:
    return load_config()


@pytest.fixture(scope="session")
def deployment(duet_config: DuetConfig) -> Iterator[Any]:
    from duet.cluster.deployment import Deployment, start_ray

    start_ray(duet_config)  # in the main thread, where Ray expects to be initialised
    loop = BackgroundLoop()
    running = loop.run(Deployment(duet_config).start(port=0), timeout=900)
    yield running
    loop.run(running.stop(), timeout=120)
    loop.close()
    import ray

    ray.shutdown()


@pytest.fixture(scope="session")
def client(deployment: Any) -> Iterator[DuetClient]:
    with DuetClient(f"127.0.0.1:{deployment.port}") as duet_client:
        yield duet_client


class ReferenceEngine:
    """A colocated vLLM engine with the deployment's engine settings: the exactness oracle."""

    def __init__(self, config: DuetConfig) -> None:
        from vllm import LLM

        from duet.cluster.engine import cpu_engine_environment, engine_kwargs, is_cpu_only

        if is_cpu_only():
            os.environ.update(cpu_engine_environment(kv_cache_gib=1, cpu_core=None))
        self.llm = LLM(**engine_kwargs(config.model, kv_cache_gib=1))

    def greedy(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="session")
def reference(duet_config: DuetConfig) -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine(duet_config)
    yield engine
    engine.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def tokenizer(deployment: Any) -> Any:
    from transformers import AutoTokenizer

    from duet.cluster.engine import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(deployment.config.model)))


def worker_status(deployment: Any, role: str) -> Any:
    """A worker's own report (engine state, in-flight requests, vLLM metrics), straight from Ray."""
    import ray

    pool = deployment.prefill if role == "prefill" else deployment.decode
    return ray.get(pool.members[0].actor.status.remote())
