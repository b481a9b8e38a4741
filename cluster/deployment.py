"""A running duet deployment: Ray, the worker pools, and the router's gRPC server.

``duet serve`` and the test suite both start duet through :class:`Deployment`, so the tests run
exactly what users run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from duet.cluster.config import DuetConfig
from duet.cluster.engine import resolve_model_path
from duet.decode_worker.worker import ColocatedWorker, DecodeWorker
from duet.kv_transfer.ports import is_bindable
from duet.prefill_worker.worker import PrefillWorker
from duet.kv_transfer.config import TRANSPORTS
from duet.router.lifecycle import RequestLifecycle, RetryPolicy
from duet.router.metrics import start_metrics_server
from duet.router.pools import PoolMember, WorkerPool
from duet.router.auth import Gatekeeper
from duet.router.front_ends import FrontEnds, check_exposure
from duet.router.serving import RequestService
from duet.router.status import ClusterView
from duet.router.token_stream import TokenReceiver
from duet.router.validation import ModelLimits

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "duet"


class WorkerStartError(RuntimeError):
    """A worker's engine could not start; the message names the worker and the cause."""


class PortInUseError(OSError):
    """A port duet must listen on is taken; the message names it and the setting to change."""


def _port_in_use(what: str, host: str, port: int, flag: str) -> str:
    return (
        f"cannot listen on {host}:{port} for {what}: the address is in use (another duet server?); "
        f"choose another port with {flag} (0 picks a free one)"
    )


def start_ray(config: DuetConfig) -> None:
    """Join or start Ray as configured (a no-op if this process is already connected)."""
    if ray.is_initialized():
        return
    common = {"namespace": RAY_NAMESPACE, "log_to_driver": config.ray.worker_logs_to_driver}
    if config.ray.address == "local":
        # Ray starts worker processes at nice 15, and vLLM's engine processes inherit it from
        # the actor that spawns them: under load the router and Ray's own daemons (nice 0) then
        # preempt the engines' forward passes, which is TPOT and TTFT. Engines and serving path
        # share the cores as equals, as in a plain vLLM server.
        ray.init(
            num_cpus=config.ray.num_cpus,
            include_dashboard=False,
            _system_config={"worker_niceness": 0},
            **common,
        )
    else:
        ray.init(address=config.ray.address, **common)


@dataclass
class Deployment:
    config: DuetConfig
    prefill: WorkerPool = field(default_factory=lambda: WorkerPool("prefill"))
    # In a colocated deployment this pool holds the workers that run whole requests, and the
    # prefill pool stays empty.
    decode: WorkerPool = field(default_factory=lambda: WorkerPool("decode"))
    front_ends: FrontEnds | None = None
    port: int = 0  # the gRPC API's
    http_port: int | None = None  # the OpenAI HTTP API's (None: disabled)
    cluster: ClusterView | None = None
    service: RequestService | None = None
    tokens: TokenReceiver | None = None
    # A warning to show the operator (serving a public address without authentication).
    exposure_warning: str | None = None
    _metrics_server: Any = None

    async def start(self, port: int | None = None, http_port: int | None = -1) -> "Deployment":
        """Start workers and both front ends; ``port`` and ``http_port`` override the config
        (0 picks a free port; the default -1 keeps the config's HTTP port).

        Listening ports and API keys are checked before any worker starts, so a port in use or
        a bad keys file fails in a second with its name, not after a minute of engine start-up.
        """
        server_config = self.config.server
        bind_port = server_config.port if port is None else port
        bind_http = server_config.http_port if http_port == -1 else http_port
        for what, wanted, flag in (("gRPC", bind_port, "--port"), ("HTTP", bind_http, "--http-port")):
            if wanted and not is_bindable(server_config.host, wanted):
                raise PortInUseError(_port_in_use(what, server_config.host, wanted, flag))
        gatekeeper = Gatekeeper.from_config(server_config.auth)
        self.exposure_warning = check_exposure(server_config, gatekeeper)
        colocated = self.config.mode == "colocated"
        if colocated:
            self.decode.role = "colocated"
        pools = [self.decode] if colocated else [self.prefill, self.decode]
        transport = "none (colocated)" if colocated else self.config.kv_transfer.transport
        self.cluster = ClusterView(self.config.model.name, transport, pools)
        if server_config.metrics_port is not None:
            try:
                self.cluster.metrics, metrics_port, self._metrics_server = start_metrics_server(
                    server_config.host, server_config.metrics_port, self.cluster.pools
                )
            except OSError:
                raise PortInUseError(
                    _port_in_use("metrics", server_config.host, server_config.metrics_port, "--metrics-port")
                ) from None
            self.cluster.metrics_endpoint = f"{server_config.host}:{metrics_port}"
        start_ray(self.config)
        resolve_model_path(self.config.model)  # create the built-in model once, not per worker
        self.tokens = TokenReceiver(_token_host(self.config))
        self.tokens.start()
        if colocated:
            self._create_workers(ColocatedWorker, self.decode, self.config.colocated)
        else:
            self._create_workers(PrefillWorker, self.prefill, self.config.prefill)
            self._create_workers(DecodeWorker, self.decode, self.config.decode)
        await self._wait_ready()
        first_worker = (self.prefill.members + self.decode.members)[0]
        limits = ModelLimits(self.config.model.name, *await first_worker.actor.model_limits.remote())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(self.config.model)))
        transfer = self.config.kv_transfer
        lifecycle = RequestLifecycle(
            None if colocated else self.prefill,
            self.decode,
            self.tokens,
            RetryPolicy(worker_wait_s=server_config.worker_start_timeout_s, transfer_timeout_s=transfer.handoff_timeout_s),
            prefill_pushes_kv=TRANSPORTS[transfer.transport].pushes_to_decode,
        )
        self.service = RequestService(
            lifecycle, limits, tokenizer, self.cluster, gatekeeper, server_config.max_inflight_requests
        )
        self.front_ends = await FrontEnds.start(self.service, server_config, bind_port, bind_http, _chat_template(self.config))
        self.port, self.http_port = self.front_ends.grpc_port, self.front_ends.http_port
        return self

    def _create_workers(self, worker_class: type, pool: WorkerPool, pool_config: Any) -> None:
        actor_class = ray.remote(worker_class)
        node_ids = _plan_node_ids(pool.role, pool_config.nodes)
        # Only workers that stream tokens (decode, colocated) get the router's token socket;
        # prefill workers return their one token through the Ray call and open no socket.
        assert self.tokens is not None
        token_address = self.tokens.address if issubclass(worker_class, DecodeWorker) else ""

        def create(index: int) -> Any:
            options: dict[str, Any] = {}
            if node_ids is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_ids[index], soft=False)
            return actor_class.options(
                num_cpus=pool_config.num_cpus, num_gpus=pool_config.num_gpus, max_concurrency=1000, **options
            ).remote(f"{pool.role}-{index}", self.config, index, token_address)

        async def restart(member: PoolMember) -> None:
            """Replace a dead worker with a fresh actor and engine on the same replica slot."""
            ray.kill(member.actor, no_restart=True)
            index = pool.members.index(member)
            replacement = create(index)
            status = await asyncio.wait_for(replacement.start.remote(), self.config.server.worker_start_timeout_s)
            member.actor, member.kv_endpoint = replacement, status.kv_endpoint

        pool.restart = restart
        for index in range(pool_config.replicas):
            pool.members.append(PoolMember(name=f"{pool.role}-{index}", actor=create(index)))

    async def _wait_ready(self) -> None:
        members = self.prefill.members + self.decode.members
        timeout = self.config.server.worker_start_timeout_s
        results = await asyncio.wait_for(
            asyncio.gather(*(m.actor.start.remote() for m in members), return_exceptions=True), timeout
        )
        failures = [f"{m.name}: {_root_cause(r)}" for m, r in zip(members, results) if isinstance(r, BaseException)]
        if failures:
            raise WorkerStartError("workers failed to start:\n  " + "\n  ".join(failures))
        for member, status in zip(members, results):
            member.kv_endpoint = status.kv_endpoint

    async def stop(self) -> None:
        if self.front_ends is not None:
            await self.front_ends.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        for member in self.prefill.members + self.decode.members:
            try:
                await member.actor.shutdown.remote()
            except Exception:  # already dead: nothing to shut down
                pass
            ray.kill(member.actor)
        if self.tokens is not None:
            self.tokens.close()


def _chat_template(config: DuetConfig) -> str | None:
    """The configured chat template's text (None: the tokenizer's own)."""
    path = config.model.chat_template
    return Path(path).expanduser().read_text() if path else None


def _token_host(config: DuetConfig) -> str:
    """The address workers push tokens to: loopback on a private local Ray, else this node's."""
    if config.ray.address == "local":
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _plan_node_ids(role: str, nodes: list[int] | None) -> list[str] | None:
    """Ray node ids for a plan's node indices (alive nodes sorted by address, as documented)."""
    if nodes is None:
        return None
    alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    missing = sorted({index for index in nodes if index >= len(alive)})
    if missing:
        raise WorkerStartError(
            f"the {role} pool is placed on node(s) {missing}, but the Ray cluster has {len(alive)} node(s)"
        )
    return [alive[index]["NodeID"] for index in nodes]


def _root_cause(error: BaseException) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
