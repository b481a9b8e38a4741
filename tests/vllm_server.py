"""vLLM's own OpenAI server, started for a test on a duet deployment's model: the specification
duet's API answers are compared with (tests/test_api_parity.py, tests/test_lora.py)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from duet.config import ModelConfig
from duet.kv_transfer.ports import free_port
from duet.worker_runtime.engine import resolve_model_path


@contextmanager
def running_vllm_server(model: ModelConfig, *extra_args: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """vLLM's OpenAI server on ``model`` with duet's engine settings (plus ``extra_args`` and
    environment ``env``); its port."""
    port = free_port("127.0.0.1")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(resolve_model_path(model)), "--served-model-name", model.name,
        "--dtype", model.dtype, "--seed", str(model.seed), "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]
    if model.max_model_len is not None:
        command += ["--max-model-len", str(model.max_model_len)]
    environment = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "", **(env or {}),
    }
    server = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while http_get(port, "/health") != 200:
            assert server.poll() is None, f"vLLM's server exited: {server.stderr.read().decode()[-3000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "vLLM's server did not become healthy in 300 s"
            time.sleep(1)
        yield port
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(30)


def http_get(port: int, path: str) -> int:
    """The status of GET ``path`` (0 when nothing answers)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", path)
        return connection.getresponse().status
    except OSError:
        return 0


def http_post(port: int, path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON; the status and the reply (JSON, or text where it is not)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        raw = reply.read().decode()
        try:
            return reply.status, json.loads(raw)
        except ValueError:
            return reply.status, raw
    finally:
        connection.close()
