"""What a front door spends per request, beside what its API's framework alone spends.

``duet bench front-door`` starts a deployment of SIMULATED workers (no model is computed; the
workers' CPU is not counted) with two front doors, and beside it two bare servers that speak
the same APIs and do nothing else: a ``grpc.aio`` server whose ``Generate`` answers every
request with one message holding all its tokens, and an aiohttp server whose
``/v1/completions`` answers with one server-sent event, its usage and ``[DONE]``. The bare
servers are the floor: what any Python front door on these frameworks pays for a call before
it does any work, on the same machine at the same moment. One client process per run (duet's
own open-loop replayers, gRPC or HTTP) sends the same requests at the same rate to each system
in turn, round after round (this machine's speed changes within minutes), and each system's
server processes' CPU is read from the kernel around the run.

Reported per system, API and output length: CPU per served request and per streamed token, and
the ratio of duet's front doors to the bare server of their API in the same round; and each
round, every system's CPU while idle (what of a request's share is a fixed cost per second). A request's
CPU in duet's front door covers the API, validation, admission, routing, both workers'
channels and streaming every merged output message (one per ``output_interval_ms`` of decode,
so longer outputs send more messages; the floor sends one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from duet.benchmarks.arguments import positive_list, write_results
from duet.benchmarks.router_overhead import _CLIENT as _GRPC_CLIENT
from duet.benchmarks.router_overhead import _config

RESULTS = Path(__file__).resolve().parent / "results" / "front_door_cost.json"

# The HTTP client: duet's OpenAI replayer in its own process, records as JSON on stdout.
_HTTP_CLIENT = (
    "import asyncio, json, sys\n"
    "from duet.benchmarks.openai_replay import replay_openai\n"
    "from duet.cluster.placement.trace import synthetic\n"
    "url, n, rate, lengths, seed, model = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]\n"
    "trace = synthetic(n, rate, lengths=lengths, seed=seed + 1)\n"
    "records = asyncio.run(replay_openai(url, model, trace, seed=seed, timeout_s=120))\n"
    "print(json.dumps([r.to_dict() for r in records]))\n"
)

# The bare servers: the same APIs, one answer per request, no work. ``sys.argv[1]`` picks the
# API; the bound port is printed, then the server runs until its parent kills it.
_FLOOR_SERVER = '''
import asyncio, json, sys
import uvloop

async def grpc_floor():
    import grpc
    from duet.router.proto import duet_api_pb2 as pb, duet_api_pb2_grpc as pb_grpc

    class Floor(pb_grpc.DuetServicer):
        async def Generate(self, request, context):
            response = pb.GenerateResponse(request_id=request.request_id, token_ids=[5] * request.max_tokens)
            response.finish_reason = pb.FINISH_REASON_LENGTH
            response.usage.completion_tokens = request.max_tokens
            yield response

    server = grpc.aio.server()
    pb_grpc.add_DuetServicer_to_server(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

async def http_floor():
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        n = int(body["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "floor", "object": "text_completion", "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n + len(body["prompt"])}}
        await response.write(("data: " + json.dumps(chunk) + "\\n\\ndata: [DONE]\\n\\n").encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

uvloop.run(grpc_floor() if sys.argv[1] == "grpc" else http_floor())
'''


class FloorServer:
    """A bare server of one API in a process of its own (see ``_FLOOR_SERVER``)."""

    def __init__(self, api: str) -> None:
        self.api = api
        self._process = subprocess.Popen([sys.executable, "-c", _FLOOR_SERVER, api], stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            self._process.kill()
            raise RuntimeError(f"the bare {api} server did not start")
        self.port = int(line)
        self.processes = [psutil.Process(self._process.pid)]

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()


async def _replay(api: str, port: int, model: str, rate: float, requests: int, lengths: str, seed: int) -> list[dict[str, Any]]:
    """One client process's run against ``port``; its records."""
    if api == "grpc":
        arguments = [_GRPC_CLIENT, f"127.0.0.1:{port}", str(requests), str(rate), lengths, str(seed), "4"]
    else:
        arguments = [_HTTP_CLIENT, f"http://127.0.0.1:{port}", str(requests), str(rate), lengths, str(seed), model]
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", *arguments, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await client.communicate()
    if client.returncode != 0:
        raise RuntimeError(f"the {api} client failed:\n{err.decode()[-3000:]}")
    return json.loads(out)


def _cpu_s(processes: list[psutil.Process]) -> float:
    return sum(sum(process.cpu_times()[:2]) for process in processes)


async def _idle_cpu_share(systems: dict[str, list[psutil.Process]], seconds: float = 5.0) -> dict[str, float]:
    """Each system's CPU with no request in flight, as a share of one core: the part of a
    request's CPU that is a fixed cost per second (timers, health and membership polls, the
    Ray core worker's threads in duet's front doors)."""
    start = {name: _cpu_s(processes) for name, processes in systems.items()}
    await asyncio.sleep(seconds)
    return {name: round((_cpu_s(processes) - start[name]) / seconds, 4) for name, processes in systems.items()}


async def measure(
    system: str, api: str, port: int, processes: list[psutil.Process], model: str,
    rate: float, duration_s: float, lengths: str, seed: int,
) -> dict[str, Any]:
    """One run: ``processes``' CPU around a replay at ``rate`` over ``api``."""
    start = _cpu_s(processes)
    records = await _replay(api, port, model, rate, int(rate * duration_s), lengths, seed)
    cpu_s = _cpu_s(processes) - start
    served = [r for r in records if not r["error"]]
    tokens = sum(r["completion_tokens"] for r in served)
    return {
        "system": system,
        "api": api,
        "lengths": lengths,
        "offered_rate": rate,
        "requests": len(records),
        "failed": len(records) - len(served),
        "errors": sorted({r["error"][:120] for r in records if r["error"]})[:3],
        # NaN when nothing was served: a run that only failed measured nothing.
        "cpu_ms_per_request": cpu_s / len(served) * 1000 if served else math.nan,
        "cpu_us_per_token": cpu_s / tokens * 1e6 if tokens else math.nan,
    }


async def run_benchmark(
    workers: int, apis: list[str], lengths: list[str], rates: list[float], duration_s: float, rounds: int
) -> list[dict[str, Any]]:
    """Every (API, length) measured on duet's front doors and on the bare server of its API,
    round after round, the order alternating."""
    from duet.cluster.deployment import Deployment

    deployment = await Deployment(_config(workers, front_ends=2)).start(port=0, http_port=0)
    floors = {api: FloorServer(api) for api in apis}
    results: list[dict[str, Any]] = []
    try:
        doors = [psutil.Process(door.pid) for door in (await deployment.cluster.status()).front_ends]
        model = deployment.config.model.name
        duet_ports = {"grpc": deployment.port, "http": deployment.http_port}
        for round_index in range(rounds):
            idle = await _idle_cpu_share({"duet": doors, **{f"floor {api}": floors[api].processes for api in apis}})
            results.append({"round": round_index, "idle_cpu_share": idle})
            print(f"round {round_index}, idle CPU (share of a core): {idle}", flush=True)
            for api in apis:
                for length, rate in zip(lengths, rates):
                    systems = [("duet", duet_ports[api], doors), ("floor", floors[api].port, floors[api].processes)]
                    if round_index % 2:
                        systems.reverse()
                    pair = []
                    for system, port, processes in systems:
                        result = await measure(
                            system, api, port, processes, model, rate, duration_s, length, seed=len(results)
                        )
                        result["round"] = round_index
                        results.append(result)
                        pair.append(result)
                        print(_line(result), flush=True)
                    duet, floor = sorted(pair, key=lambda r: r["system"])
                    print(f"  round {round_index}, {api} {length}: duet / floor CPU per request "
                          f"{duet['cpu_ms_per_request'] / floor['cpu_ms_per_request']:.2f}x", flush=True)
    finally:
        for floor_server in floors.values():
            floor_server.stop()
        await deployment.stop()
    return results


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['system']:5s} {result['api']:4s} {result['lengths']:>14s} at {result['offered_rate']:g} req/s: "
        f"{result['cpu_ms_per_request']:.2f} ms CPU per request, {result['cpu_us_per_token']:.0f} us per token "
        f"({result['requests'] - result['failed']} served, {result['failed']} failed {result['errors']})"
    )


def _command(args: argparse.Namespace) -> int:
    if len(args.lengths) != len(args.rates):
        print("duet bench front-door: give one --rates entry per --lengths entry", file=sys.stderr)
        return 2
    results = asyncio.run(run_benchmark(args.workers, args.apis, args.lengths, args.rates, args.duration, args.rounds))
    return write_results(results, args.out, RESULTS)


def _apis(text: str) -> list[str]:
    apis = text.split(",")
    if not set(apis) <= {"grpc", "http"}:
        raise argparse.ArgumentTypeError(f"comma-separated grpc and http (got {text!r})")
    return apis


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "front-door", help="a front door's CPU per request against its API framework's bare floor (SIMULATED workers)"
    )
    parser.add_argument("--workers", type=int, default=4, help="simulated workers, half prefill, half decode")
    parser.add_argument("--apis", type=_apis, default="grpc,http", help="comma-separated: grpc, http")
    parser.add_argument(
        "--lengths", type=lambda text: text.split(","), default="fixed:64:1,fixed:64:16,fixed:64:256",
        help="synthetic request lengths, one run each (see `duet simulate`)",
    )
    parser.add_argument("--rates", type=positive_list(float), default="40,40,8", help="offered req/s, one per --lengths")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help=f"results file (default {RESULTS.relative_to(RESULTS.parents[2])})")
    parser.set_defaults(handler=_command)
