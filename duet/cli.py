"""The ``duet`` command line: serve, generate, status (and the planning and deploy commands).

Every failure a user can cause ends with one line that says what to fix and exit status 2;
tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc

from duet.config import BUILTIN_MODEL, BUILTIN_TEXT_MODELS
from duet.logs import configure_logging
from duet.router.client import DEFAULT_TARGET, DuetClient, build_request
from duet.router.proto import duet_api_pb2 as pb

if TYPE_CHECKING:
    from duet.config import DuetConfig

USAGE_ERROR = 2


def _fail(message: str) -> int:
    print(f"duet: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _rpc_failure(error: grpc.RpcError, target: str) -> int:
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (error.details() or "").lower():
        return _fail(f"no duet server at {target} (start one with `duet serve`, or pass --target)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return _fail(f"{error.details()} (pass --api-key or set $DUET_API_KEY)")
    return _fail(f"{code.name}: {error.details()}")


def _client(args: argparse.Namespace) -> DuetClient:
    return DuetClient(
        args.target, api_key=args.api_key, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
    )


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_TARGET,
        help="the server's address, or several front doors' separated by commas: a stream that breaks resumes on the next",
    )
    parser.add_argument("--api-key", default=os.environ.get("DUET_API_KEY"), help="API key (default: $DUET_API_KEY)")
    parser.add_argument("--tls-ca", help="connect with TLS, trusting this CA's certificate (PEM)")
    parser.add_argument("--tls-cert", help="client certificate for mutual TLS (PEM)")
    parser.add_argument("--tls-key", help="client certificate's private key (PEM)")


# ---- serve -------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from duet.config import ConfigError, load_config, parse_config
    from duet.cluster.placement.plan import PlanError

    try:
        config = load_config(args.config)
        if args.plan:
            config = _with_plan(config, Path(args.plan))
        data = config.model_dump()
        if config.models and (args.model or args.autoscale is not None):
            return _fail("--model and --autoscale set the one model's; with models: in the config, set them there, per model")
        if args.model:
            model_dir = Path(args.model).expanduser().resolve()
            data["model"].update(path=str(model_dir), name=args.model_name or model_dir.name)
        if args.port is not None:
            data["server"]["port"] = args.port
        if args.metrics_port is not None:
            data["server"]["metrics_port"] = args.metrics_port
        if args.http_port is not None:
            data["server"]["http_port"] = None if args.http_port < 0 else args.http_port
        if args.host is not None:
            data["server"]["host"] = args.host
        if args.front_ends is not None:
            data["server"]["front_ends"] = args.front_ends
        if args.autoscale is not None:
            data["autoscale"] = args.autoscale
        if args.api_keys_file is not None:
            data["server"]["auth"]["api_keys_file"] = args.api_keys_file
        if args.allow_unauthenticated:
            data["server"]["allow_unauthenticated"] = True
        if args.tls_cert or args.tls_key:
            data["server"]["tls"] = {"cert_file": args.tls_cert, "key_file": args.tls_key, "client_ca_file": args.tls_client_ca}
        config = parse_config(data, source="command line")
    except (ConfigError, PlanError) as error:
        return _fail(str(error))
    # uvloop: the router relays every streamed token through its event loop, and uvloop's
    # loop costs a fraction of asyncio's per wake-up (vLLM's own server runs on it too).
    import uvloop

    from duet.cluster.process_reaper import run_reaped

    return run_reaped(lambda: uvloop.run(_run_deployment(config)))


def _with_plan(config: "DuetConfig", path: Path) -> "DuetConfig":
    """``config`` with the plan at ``path`` applied: one model's (``duet plan``) or several
    models' (``duet plan-models``, a file with ``plans:``)."""
    from duet.cluster.placement.multi_model import MultiPlan
    from duet.cluster.placement.plan import Plan, PlanError
    from duet.cluster.plan_deploy import apply_plan, apply_plans
    from duet.yaml_config import read_yaml, validate_mapping

    data = read_yaml(path, "plan", PlanError)  # read once: which kind it is, then the plan itself
    if isinstance(data, dict) and "plans" in data:
        return apply_plans(config, validate_mapping(MultiPlan, data, str(path), PlanError))
    return apply_plan(config, validate_mapping(Plan, data, str(path), PlanError))


async def _run_deployment(config: "DuetConfig") -> int:
    from duet.config import ConfigError
    from duet.cluster.control_plane import RemoteControlPlane
    from duet.cluster.deployment import Deployment, WorkerStartError

    workers = " and ".join(
        (
            f"{served.colocated.replicas} colocated worker(s)"
            if served.mode == "colocated"
            else f"{served.prefill.replicas} prefill + {served.decode.replicas} decode worker(s)"
        )
        + f" for {served.model.name}"
        for served in config.served()
    )
    print(f"duet: starting {workers} (this takes about a minute on CPU)...", flush=True)
    # One front door: this process serves and controls. Several: each front door and the
    # control plane are processes of their own, none of which this one is.
    deployment = RemoteControlPlane(config) if config.server.front_doors_apart else Deployment(config)
    try:
        await deployment.start()
    except (WorkerStartError, ConfigError, OSError, TimeoutError) as error:
        await deployment.stop()
        return _fail(str(error))
    except Exception as error:  # the control plane actor's start failed: Ray wraps the cause
        await deployment.stop()
        cause = getattr(error, "cause", None) or error
        return _fail(f"{type(cause).__name__}: {cause}")
    serving = deployment.serving
    if isinstance(deployment, RemoteControlPlane):
        print(
            f"duet: {'took over the running' if deployment.took_over else 'started'} deployment {deployment.deployment_id}"
            + (" (its control plane outlives this process: `duet stop` ends it)" if config.ray.address != "local" else ""),
            flush=True,
        )
    if serving["exposure_warning"]:
        print(f"duet: WARNING: {serving['exposure_warning']}", file=sys.stderr, flush=True)
    metrics = serving["metrics_endpoint"]
    host = config.server.host
    scheme = "https" if config.server.tls else "http"
    print(
        f"duet: serving {', '.join(served.model.name for served in config.served())} on {host}:{serving['port']} (gRPC)"
        + (f", {scheme}://{host}:{serving['http_port']}/v1 (OpenAI)" if serving["http_port"] else "")
        + (f", metrics on http://{metrics}/metrics" if metrics else "")
        + (f", {config.server.front_ends} front doors" if config.server.front_ends > 1 else "")
        + (", TLS" if config.server.tls else "")
        + (", API keys required" if serving["keys_required"] else "")
        + " (Ctrl-C stops)",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    print("duet: stopping...", flush=True)
    await deployment.stop()
    return 0


# ---- stop --------------------------------------------------------------------------------


def _stop(args: argparse.Namespace) -> int:
    from duet.config import ConfigError, load_config
    from duet.cluster.control_plane import stop_running

    try:
        config = load_config(args.config)
        if config.ray.address == "local":
            return _fail("a deployment on a local Ray ends with its `duet serve` (Ctrl-C); "
                         "`duet stop` is for one on a Ray cluster: give --config with its ray.address")
        stopped = asyncio.run(stop_running(config, args.deployment))
    except ConfigError as error:
        return _fail(str(error))
    print(f"duet: stopped deployment {stopped}", flush=True)
    return 0


# ---- front-end ---------------------------------------------------------------------------


def _front_end(args: argparse.Namespace) -> int:
    from duet.cluster.front_doors import front_door_host_command

    command = front_door_host_command(args.cluster, args.node_ip_address)
    print(f"duet: joining {args.cluster} as a front-door host (Ctrl-C leaves)", flush=True)
    try:
        os.execv(command[0], command)  # `ray start --block`: its signals, its exit status
    except OSError as error:
        return _fail(f"cannot run {command[0]}: {error}")


# ---- generate ----------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    request = build_request(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or (),
        ignore_eos=args.ignore_eos,
        model=args.model,
    )
    with _client(args) as client:
        last = pb.GenerateResponse()
        try:
            for last in client.stream(request, timeout=args.timeout):
                sys.stdout.write(last.text)
                sys.stdout.flush()
        except grpc.RpcError as error:
            print(file=sys.stdout)
            return _rpc_failure(error, args.target)
        except KeyboardInterrupt:
            print("\nduet: cancelled", file=sys.stderr)
            return 130
    usage = last.usage
    print()
    print(
        f"[{pb.FinishReason.Name(last.finish_reason).removeprefix('FINISH_REASON_').lower()}: "
        f"{usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens, "
        f"TTFT {usage.ttft_s * 1000:.0f} ms, TPOT {usage.tpot_s * 1000:.1f} ms, "
        f"{usage.prefill_worker} -> {usage.decode_worker or '(prefill only)'}]",
        file=sys.stderr,
    )
    return 0


# ---- status ------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            status = client.status()
        except grpc.RpcError as error:
            return _rpc_failure(error, args.target)
    if args.json:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(status, preserving_proto_field_name=True))  # the proto's names: front_ends, ...
        return 0
    _print_status(status)
    return 0


def _print_status(status: pb.ClusterStatus) -> None:
    from rich.console import Console
    from rich.table import Table

    adapters = f" + LoRA {', '.join(status.lora_adapters)}" if status.lora_adapters else ""
    several = len(status.served_models) > 1
    models = ", ".join(status.served_models) if several else status.model
    table = Table(title=f"duet · {models}{adapters} · KV transport {status.kv_transport}")
    for column in (
        "pool", "worker", "state", "core", "KV channel", "served", "in flight", "prompt tokens queued", "KV used",
        "prompt tokens transferred / computed", "KV transfers (MiB, GiB/s, failed)", "requests moved out / in (KV + replay)",
    ):
        table.add_column(column)
    workers = [worker for pool in status.pools for worker in pool.workers]
    lora = bool(status.lora_adapters) or any(worker.lora_adapter_reads for worker in workers)
    if lora:
        table.add_column("LoRA adapters read / activated")
    for pool in status.pools:
        for worker in pool.workers:
            lora_cell = [f"{worker.lora_adapter_reads} / {worker.lora_adapter_activations}"] if lora else []
            table.add_row(
                f"{pool.model} {pool.role}" if several else pool.role,
                worker.name,
                worker.state
                + (f", restarted {worker.restarts}x" if worker.restarts else "")
                + (f" ({worker.error})" if worker.error else ""),
                "-" if worker.cpu_core < 0 else str(worker.cpu_core),
                worker.kv_endpoint,
                str(worker.requests_served),
                str(worker.requests_inflight),
                str(worker.outstanding_prompt_tokens),
                f"{worker.kv_cache_usage:.1%}",
                f"{worker.prompt_tokens_transferred} / {worker.prompt_tokens_computed}",
                _transfer_cell(worker),
                _migrations_cell(worker),
                *lora_cell,
            )
    if status.metrics_endpoint:
        table.caption = f"Prometheus: http://{status.metrics_endpoint}/metrics"
    # Piped output (scripts, CI logs) gets full rows instead of an 80-column squeeze.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for line in status.routing:
        console.print(f"routing: {line}")
    console.print(
        f"requests: {status.requests_served} served, {status.requests_inflight} in flight, "
        f"{status.requests_failed} failed"
    )
    if len(status.models) > 1 or status.lora_adapters:  # by model name: the model's and each adapter's
        for model in status.models:
            console.print(
                f"  {model.model}: {model.requests_served} served, {model.requests_inflight} in flight, "
                f"{model.requests_failed} failed"
            )
    for cache in status.encoder_caches:
        console.print(
            f"images{f' ({cache.model})' if several else ''}: {cache.images_encoded} encoded by the encode pool, "
            f"{cache.cache_hits} encoder-cache hits, {cache.fallbacks} left to prefill; encoder cache "
            f"{cache.images_held} images, {cache.bytes_held / 2**20:.1f} of {cache.capacity_bytes / 2**20:.0f} MiB, "
            f"{cache.evictions} evicted"
        )
    for kv_pool in status.kv_pools:
        console.print(
            f"KV pool on {kv_pool.host}: {kv_pool.blocks} blocks ({kv_pool.bytes / 2**20:.1f} of "
            f"{kv_pool.capacity_bytes / 2**20:.0f} MiB), {kv_pool.hits} hits / {kv_pool.misses} misses"
            f"{f' ({kv_pool.fetched} fetched from other hosts)' if kv_pool.fetched else ''}, {kv_pool.evictions} evicted"
        )
    if status.deployment_id:
        console.print(f"deployment: {status.deployment_id}")
    if len(status.front_ends) > 1:
        console.print(f"control plane: pid {status.control_plane_pid or '- (unreachable)'}")
        for door in status.front_ends:
            console.print(
                f"front door {door.index}: {door.state}, pid {door.pid or '-'} on {door.host or '-'}"
                + (f", replaced {door.restarts}x" if door.restarts else "")
                + f"; {door.requests_served} served, {door.requests_inflight} in flight, {door.requests_failed} failed"
                + (f" ({door.error})" if door.error else "")
            )


def _transfer_cell(worker: pb.WorkerState) -> str:
    if not worker.kv_transfers and not worker.kv_transfer_failures:
        return "-"
    rate = worker.kv_transfer_bytes / worker.kv_transfer_seconds / 2**30 if worker.kv_transfer_seconds else 0.0
    return (
        f"{worker.kv_transfers} ({worker.kv_transfer_bytes / 2**20:.1f} MiB, {rate:.2f} GiB/s, "
        f"{worker.kv_transfer_failures} failed)"
    )


def _migrations_cell(worker: pb.WorkerState) -> str:
    counts = (worker.migrations_out_kv, worker.migrations_out_replay, worker.migrations_in_kv, worker.migrations_in_replay)
    if not any(counts):
        return "-"
    return "{}+{} / {}+{}".format(*counts)


# ---- scale and drain ---------------------------------------------------------------------


def _parse_targets(items: list[str]) -> dict[str, int] | str:
    """``["prefill=3", "decode=2"]`` as a mapping, or the problem as a message."""
    targets: dict[str, int] = {}
    for item in items:
        role, _, count = item.partition("=")
        if not role or not count.lstrip("-").isdigit():
            return f"{item!r}: expected ROLE=COUNT, e.g. prefill=2"
        targets[role] = int(count)
    return targets


def _scale(args: argparse.Namespace) -> int:
    targets = _parse_targets(args.targets)
    if isinstance(targets, str):
        return _fail(targets)
    with _client(args) as client:
        try:
            for role, replicas in targets.items():
                for change in client.scale(role, replicas, model=args.model):
                    print(change)
            if args.wait:
                return _wait_settled(client, args.wait_timeout)
        except grpc.RpcError as error:
            return _rpc_failure(error, args.target)
    return 0


def _wait_settled(client: DuetClient, timeout_s: float) -> int:
    """Wait until no worker is starting or draining; show the pools."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        status = client.list_workers()
        moving = [w.name for pool in status.pools for w in pool.workers if w.state in ("starting", "draining", "restarting")]
        if not moving:
            _print_status(status)
            return 0
        if time.monotonic() > deadline:
            return _fail(f"still settling after {timeout_s:.0f} s: {', '.join(moving)}")
        time.sleep(1.0)


def _drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            for change in client.drain(args.worker, args.timeout):
                print(change)
        except grpc.RpcError as error:
            return _rpc_failure(error, args.target)
    return 0


def _lora_make(args: argparse.Namespace) -> int:
    from duet.worker_runtime.tiny_lora import make_tiny_lora

    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        print(f"duet: {out} exists and is not a directory; name a directory for the adapter", file=sys.stderr)
        return 2
    make_tiny_lora(out, seed=args.seed, rank=args.rank, base_model=args.base)
    print(f"duet: wrote a rank-{args.rank} LoRA adapter for the built-in model {args.base} to {out}")
    return 0


def _lora_load(args: argparse.Namespace) -> int:
    return _lora_change(args, lambda client: client.load_lora_adapter(args.name, args.path, model=args.model))


def _lora_unload(args: argparse.Namespace) -> int:
    return _lora_change(args, lambda client: client.unload_lora_adapter(args.name))


def _lora_change(args: argparse.Namespace, change: Callable[[DuetClient], str]) -> int:
    return _admin_change(args, lambda client: [change(client)])


def _model_add(args: argparse.Namespace) -> int:
    try:
        model_config = Path(args.file).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        return _fail(f"cannot read {args.file}: {getattr(error, 'strerror', None) or error}")
    return _admin_change(args, lambda client: client.add_model(model_config, timeout=args.wait_timeout))


def _model_remove(args: argparse.Namespace) -> int:
    return _admin_change(args, lambda client: client.remove_model(args.name, args.timeout))


def _admin_change(args: argparse.Namespace, change: Callable[[DuetClient], list[str]]) -> int:
    """Make an Admin change and print what changed, a line each."""
    with _client(args) as client:
        try:
            for line in change(client):
                print(line)
        except grpc.RpcError as error:
            return _rpc_failure(error, args.target)
    return 0


# ---- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="start duet (local Ray, workers, gRPC server)")
    serve.add_argument("--config", help="deployment YAML (default: configs/local.yaml)")
    serve.add_argument("--plan", help="deploy this placement plan (from `duet plan`) as is")
    serve.add_argument(
        "--autoscale", metavar="POLICY",
        help="size the pools to an SLO while serving: a policy under configs/autoscale or a YAML path",
    )
    serve.add_argument("--model", help="serve this local Hugging Face model directory instead")
    serve.add_argument("--model-name", help="name clients use for --model (default: its directory name)")
    serve.add_argument("--port", type=int, help="gRPC port (default: from the config, 50051; 0 picks one)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default: from the config, 9400; 0 picks one)")
    serve.add_argument("--http-port", type=int, help="OpenAI HTTP API port (default: from the config, 8000; 0 picks one; -1 disables)")
    serve.add_argument("--host", help="address both APIs listen on (default: from the config, 127.0.0.1)")
    serve.add_argument(
        "--front-ends", type=int, metavar="N",
        help="front doors serving both APIs on the same ports, each a process of its own (default: from the config, 1)",
    )
    serve.add_argument("--api-keys-file", help="YAML file of API keys and their quotas (docs/guides/security.md)")
    serve.add_argument(
        "--allow-unauthenticated", action="store_true", help="serve a non-loopback --host without API keys"
    )
    serve.add_argument("--tls-cert", help="serve both APIs over TLS with this certificate (PEM)")
    serve.add_argument("--tls-key", help="the certificate's private key (PEM)")
    serve.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    serve.set_defaults(handler=_serve)

    front_end = commands.add_parser(
        "front-end",
        help="make this host a front-door host of a running duet (server.front_end_placement: nodes)",
        description="Join the Ray cluster at ADDRESS as a front-door host: the control plane starts a "
        "front door here (or keeps this host as a standby) and it serves both APIs on this host's "
        "server.port and server.http_port. Ctrl-C leaves the cluster.",
    )
    front_end.add_argument("--cluster", required=True, metavar="ADDRESS", help="the Ray cluster's head, HOST:PORT (port 6379 by default)")
    front_end.add_argument("--node-ip-address", help="this host's address as the cluster reaches it (default: Ray's guess)")
    front_end.set_defaults(handler=_front_end)

    generate = commands.add_parser("generate", help="stream a completion from a running duet")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--model", default="", help="the served model's name or one of its LoRA adapters' (default: the model)")
    generate.add_argument("--timeout", type=float, default=300.0)
    _add_client_arguments(generate)
    generate.set_defaults(handler=_generate)

    stop = commands.add_parser(
        "stop", help="stop a deployment on a Ray cluster that no `duet serve` watches (its control plane outlived it)",
    )
    stop.add_argument("--config", help="the deployment's YAML: its ray.address, and its ports to find it by")
    stop.add_argument("--deployment", metavar="ID", help="the deployment's id, as `duet status` shows it")
    stop.set_defaults(handler=_stop)

    status = commands.add_parser("status", help="show the pools, each worker's state and requests served")
    _add_client_arguments(status)
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.set_defaults(handler=_status)

    scale = commands.add_parser("scale", help="grow or shrink pools while serving: duet scale prefill=2 decode=2")
    scale.add_argument("targets", nargs="+", metavar="ROLE=COUNT")
    scale.add_argument("--model", default="", help="the served model whose pools to scale (default: the deployment's default model)")
    scale.add_argument("--wait", action="store_true", help="wait until new workers are ready and removed ones gone")
    scale.add_argument("--wait-timeout", type=float, default=900.0)
    _add_client_arguments(scale)
    scale.set_defaults(handler=_scale)

    drain = commands.add_parser("drain", help="remove a worker once its requests finish")
    drain.add_argument("worker", help="a worker name from `duet status` (e.g. decode-1)")
    drain.add_argument("--timeout", type=float, help="seconds to wait for its requests (default: router.drain_timeout_s)")
    _add_client_arguments(drain)
    drain.set_defaults(handler=_drain)

    lora = commands.add_parser("lora", help="LoRA adapters: make one for a built-in model, load and unload them while serving")
    lora_commands = lora.add_subparsers(dest="lora", required=True, metavar="ACTION")
    make = lora_commands.add_parser(
        "make", help="write a random-weight LoRA adapter for a built-in model (to try, test or benchmark adapters)",
        description="Write a PEFT LoRA adapter for a built-in model (--base) into DIR, with random weights drawn "
        "from --seed: the same seed gives the same adapter, different seeds adapters that generate differently. "
        "Serve it by listing it under model.lora.adapters in the config.",
    )
    make.add_argument("out", metavar="DIR", help="directory to write (created if missing)")
    make.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    make.add_argument("--rank", type=int, default=8, choices=(1, 8, 16, 32, 64), help="the adapter's rank (default 8)")
    make.add_argument(
        "--base", default=BUILTIN_MODEL, choices=BUILTIN_TEXT_MODELS,
        help="the built-in text model it adapts, as model.path names it (default: builtin)",
    )
    make.set_defaults(handler=_lora_make)
    load = lora_commands.add_parser(
        "load", help="serve a LoRA adapter on a running duet, under a model name of its own",
        description="Preload the PEFT LoRA adapter in PATH on every engine of a running duet, then serve it "
        "as model NAME from every front door (the deployment needs model.lora in its config; PATH is read on the "
        "workers' hosts). With API keys, an admin key.",
    )
    load.add_argument("name", help="the model name requests will send")
    load.add_argument("path", help="the adapter's directory, as the workers' hosts see it")
    load.add_argument("--model", default="", help="the served model it adapts (default: the first in the config)")
    _add_client_arguments(load)
    load.set_defaults(handler=_lora_load)
    unload = lora_commands.add_parser("unload", help="stop serving a LoRA adapter (requests in flight finish with it)")
    unload.add_argument("name", help="the adapter's model name")
    _add_client_arguments(unload)
    unload.set_defaults(handler=_lora_unload)

    model = commands.add_parser("model", help="add a model to a running duet, or remove one")
    model_commands = model.add_subparsers(dest="model_action", required=True, metavar="ACTION")
    add = model_commands.add_parser(
        "add", help="serve another model from a running duet (returns once it serves)",
        description="Start the pools of the model FILE describes (one entry of a config's models: list, in YAML: "
        "model, mode, prefill, decode, colocated, autoscale) beside the running models, which are not touched; "
        "once its workers are ready, every API serves its name. With API keys, an admin key.",
    )
    add.add_argument("file", metavar="FILE", help="the model's config (YAML or JSON)")
    add.add_argument("--wait-timeout", type=float, default=900.0, help="seconds to wait for its workers (default 900)")
    _add_client_arguments(add)
    add.set_defaults(handler=_model_add)
    remove = model_commands.add_parser(
        "remove", help="stop serving a model: its names are refused at once, its requests finish, its workers go",
    )
    remove.add_argument("name", help="the model's name (not the default model's)")
    remove.add_argument("--timeout", type=float, help="seconds to wait for its requests (default: router.drain_timeout_s)")
    _add_client_arguments(remove)
    remove.set_defaults(handler=_model_remove)

    from duet.benchmarks.chaos import register_command as register_bench_chaos
    from duet.benchmarks.encoder_cache import register_command as register_bench_images
    from duet.benchmarks.image_load import register_command as register_bench_image_load
    from duet.benchmarks.front_door_cost import register_command as register_bench_front_door
    from duet.benchmarks.front_end_cost import register_command as register_bench_front_end
    from duet.benchmarks.fuzz import register_command as register_bench_fuzz
    from duet.benchmarks.kv_transfer import register_command as register_bench_transfer
    from duet.benchmarks.kv_pool import register_command as register_bench_kv_pool
    from duet.benchmarks.kv_pool_cost import register_command as register_bench_kv_pool_cost
    from duet.benchmarks.kv_pool_hosts import register_command as register_bench_kv_pool_hosts
    from duet.benchmarks.local_prefill import register_command as register_bench_local_prefill
    from duet.benchmarks.batch_jobs import register_command as register_bench_batch
    from duet.benchmarks.lora_affinity import register_command as register_bench_lora_affinity
    from duet.benchmarks.migration import register_command as register_bench_migrate
    from duet.benchmarks.multi_model import register_command as register_bench_multi_model
    from duet.benchmarks.multinode import register_command as register_bench_multinode
    from duet.benchmarks.prefix_affinity import register_command as register_bench_affinity
    from duet.benchmarks.rebalance import register_command as register_bench_rebalance
    from duet.benchmarks.router_overhead import register_command as register_bench_router
    from duet.benchmarks.autoscale_replay import register_command as register_bench_autoscale
    from duet.benchmarks.serve_bench import register_command as register_bench_serve
    from duet.benchmarks.soak import register_command as register_bench_soak
    from duet.benchmarks.vllm_client import register_command as register_bench_vllm_client
    from duet.batch.cli import register_command as register_batch
    from duet.cluster.placement.commands import register_commands as register_planning
    from duet.deploy.commands import register_commands as register_deploy

    register_batch(commands)  # batch
    register_planning(commands)  # plan, plan-models, simulate, profile
    register_deploy(commands)  # deploy render
    bench = commands.add_parser("bench", help="benchmarks against a real deployment")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    register_bench_transfer(benches)  # bench transfer
    register_bench_serve(benches)  # bench serve
    register_bench_vllm_client(benches)  # bench vllm-client
    register_bench_affinity(benches)  # bench affinity
    register_bench_batch(benches)  # bench batch
    register_bench_kv_pool(benches)  # bench kv-pool
    register_bench_kv_pool_cost(benches)  # bench kv-pool-cost
    register_bench_kv_pool_hosts(benches)  # bench kv-pool-hosts
    register_bench_lora_affinity(benches)  # bench lora-affinity
    register_bench_multi_model(benches)  # bench multi-model
    register_bench_images(benches)  # bench images
    register_bench_image_load(benches)  # bench image-load
    register_bench_local_prefill(benches)  # bench local-prefill
    register_bench_router(benches)  # bench router
    register_bench_autoscale(benches)  # bench autoscale
    register_bench_multinode(benches)  # bench multinode
    register_bench_front_end(benches)  # bench front-end
    register_bench_front_door(benches)  # bench front-door
    register_bench_chaos(benches)  # bench chaos
    register_bench_soak(benches)  # bench soak
    register_bench_fuzz(benches)  # bench fuzz
    register_bench_migrate(benches)  # bench migrate
    register_bench_rebalance(benches)  # bench rebalance
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        # A benchmark may start a whole deployment in this process (a local Ray and its daemons):
        # run reaped, as `duet serve` is, so that none of Ray's agents outlives it.
        from duet.cluster.process_reaper import run_reaped

        return run_reaped(lambda: args.handler(args))
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
