"""Shared fixtures: one real duet deployment and one colocated reference engine per session.

Engines take 30-50 s to start on CPU, so every test that needs the serving path shares the same
deployment (local Ray, a prefill and a decode actor, each with a vLLM engine, NixlConnector
between them, the gRPC server on a free loopback port).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from duet.background_loop import BackgroundLoop
from duet.config import DuetConfig, load_config, parse_config
from duet.router.client import DuetClient


# Fixtures that start engines, Ray or other servers: a test that needs none of them is in the
# quick tier (`pytest -m quick`, the inner loop: seconds, not the suite's half hour).
_HEAVY_FIXTURES = frozenset(
    {"ray_session", "ray_cluster", "cluster", "reference", "vllm_server", "tiny_model", "vision_engine"}
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "quick: starts no engine, Ray or server (selected with -m quick)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not _HEAVY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def duet_config() -> Iterator[DuetConfig]:
    """The embedded default, with the metrics endpoint on a free port (several may run), batch
    jobs and the host KV pool kept in temporary folders (not the user's: a test then knows what
    the pool held before it), and vLLM's hermes tool-call parser."""
    data = load_config().model_dump()
    data["server"]["metrics_port"] = 0
    data["server"]["batches"]["directory"] = tempfile.mkdtemp(prefix="duet-test-batches-")
    kv_pool = tempfile.mkdtemp(prefix="duet-test-kv-pool-", dir="/dev/shm")
    data["kv_pool"].update(enabled=True, directory=kv_pool)  # off by default: the suite runs it
    # tool_choice "auto" needs a parser; hermes reads any tokenizer (tests/test_api_parity.py).
    data["api"]["tool_call_parser"] = "hermes"
    yield parse_config(data)
    shutil.rmtree(kv_pool, ignore_errors=True)  # host memory


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole run, shared by the deployment and the connector tests.

    Logical CPUs are generous because test engines coexist with the deployment's; the
    connector tests' actor module (tests/kv_transfer/engine_actor.py) must be importable in
    Ray's worker processes.
    """
    import ray

    from duet.cluster.ray_runtime import RAY_NAMESPACE

    actor_modules = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_transfer")
    pythonpath = os.pathsep.join(filter(None, [actor_modules, os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        namespace=RAY_NAMESPACE,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
    )
    yield
    ray.shutdown()


@contextmanager
def _running_deployment(config: DuetConfig) -> Iterator[Any]:
    """A started Deployment on a free port, stopped on exit (workers killed, server closed)."""
    from duet.cluster.deployment import Deployment

    loop = BackgroundLoop()
    running = loop.run(Deployment(config).start(port=0, http_port=0), timeout=900)
    running.background = loop  # tests that talk to the router's objects run on its loop
    try:
        yield running
    finally:
        loop.run(running.stop(), timeout=120)
        loop.close()


@pytest.fixture(scope="module")
def background_loop() -> Iterator[BackgroundLoop]:
    """An event loop in a thread for a module's async objects (stopped after the module)."""
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def running_deployment(ray_session: None) -> Callable[[DuetConfig], Any]:
    """For tests that need a deployment with another config: ``with running_deployment(cfg) as d``."""
    return _running_deployment


@pytest.fixture(scope="session")
def deployment(ray_session: None, duet_config: DuetConfig) -> Iterator[Any]:
    with _running_deployment(duet_config) as running:
        yield running


@pytest.fixture(scope="session")
def client(deployment: Any) -> Iterator[DuetClient]:
    with DuetClient(f"127.0.0.1:{deployment.port}") as duet_client:
        yield duet_client


class ReferenceEngine:
    """A colocated vLLM engine with the deployment's engine settings: the exactness oracle."""

    def __init__(self, config: DuetConfig) -> None:
        from vllm import LLM

        from duet.worker_runtime.engine import cpu_engine_environment, engine_kwargs, is_cpu_only

        if is_cpu_only():
            os.environ.update(cpu_engine_environment(cpu_core=None, one_process_executor=False))
        self.llm = LLM(**engine_kwargs(config.model, kv_cache_gib=1))

    def greedy(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        return [ids for ids, _ in self.greedy_completions(prompts, max_tokens, ignore_eos)]

    def greedy_completions(
        self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False
    ) -> list[tuple[list[int], str]]:
        """Token ids and text (vLLM's own detokenization) of each greedy completion."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(output.outputs[0].token_ids), output.outputs[0].text) for output in outputs]


@pytest.fixture(scope="session")
def reference(duet_config: DuetConfig) -> Iterator[ReferenceEngine]:
    engine = ReferenceEngine(duet_config)
    yield engine
    engine.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def tokenizer(deployment: Any) -> Any:
    from transformers import AutoTokenizer

    from duet.worker_runtime.engine import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(deployment.config.model)))


@pytest.fixture(scope="session")
def worker_status(deployment: Any) -> Callable[[str], Any]:
    """A worker's report (state, in-flight requests, vLLM metrics) from its engine's front end
    in the router."""

    def report(role: str) -> Any:
        pool = deployment.prefill if role == "prefill" else deployment.decode
        return deployment.background.run(pool.members[0].engine.status(), timeout=30)

    return report


@pytest.fixture(scope="session")
def wait_until_idle(worker_status: Callable[[str], Any]) -> Callable[..., Any]:
    """Wait until a role's worker holds no request (router side and engine side); its status."""
    import time

    def wait(role: str, timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            status = worker_status(role)
            if status.requests_inflight == 0 and status.engine_unfinished == 0:
                return status
            assert time.monotonic() < deadline, f"{role} still holds a request: {status}"
            time.sleep(0.1)

    return wait


def _stream_killing_worker(client: DuetClient, request: Any, member: Any) -> list[int]:
    """Stream ``request`` and kill ``member``'s actor the moment the first token arrives.

    The first token comes from prefill, so the kill lands while the KV hand-off to the decode
    worker is under way. Returns every token the client received.
    """
    import ray

    received: list[int] = []
    first_token = threading.Event()

    def consume() -> None:
        for message in client.generate(request, timeout=600):
            received.extend(message.token_ids)
            first_token.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert first_token.wait(120), "prefill never produced the first token"
    ray.kill(member.actor, no_restart=True)
    consumer.join(600)
    assert not consumer.is_alive(), "the stream did not finish after the worker died"
    return received


@pytest.fixture(scope="session")
def stream_killing_worker() -> Callable[[DuetClient, Any, Any], list[int]]:
    return _stream_killing_worker
