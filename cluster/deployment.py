"""A running duet deployment: Ray, the worker pools, and the router's gRPC server.

``duet serve`` and the test suite both start duet through :class:`Deployment`, so the tests run
exactly what users run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import ray
import yaml
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from duet.cluster.autoscaler.live import LiveAutoscaler
from duet.cluster.autoscaler.metrics import AutoscalerMetrics
from duet.cluster.autoscaler.policy import load_policy
from duet.cluster.autoscaler.shared_budget import BudgetShare, Holder, share_of
from duet.config import ConfigError, DuetConfig, ServedModelConfig, one_model
from duet.cluster.cores import CoreAllocator
from duet.worker_runtime.engine import is_cpu_only, resolve_model_path
from duet.cluster.front_doors import ControlEndpoint, FrontDoorSet
from duet.cluster.actor_names import named_actors
from duet.cluster.model_serving import ModelServing
from duet.cluster.pool_manager import PoolManager, root_cause
from duet.cluster.ray_runtime import start_ray
from duet.encode_worker.worker import EncodeWorker
from duet.kv_transfer.encoder_cache import default_root, with_encoder_cache_folder
from duet.decode_worker.worker import ColocatedWorker, DecodeWorker, SimulatedColocatedWorker, SimulatedDecodeWorker
from duet.kv_transfer.ports import free_port, is_bindable
from duet.prefill_worker.worker import PrefillWorker, SimulatedPrefillWorker
from duet.router.metrics import start_metrics_server
from duet.cluster.health import HealthWatcher
from duet.router.pools import ScaleError, WorkerPool
from duet.router.admin import AdminServicer
from duet.router.assembly import request_service, router_host
from duet.router.auth import Gatekeeper
from duet.router.control_channel import start_control_server
from duet.router.front_ends import FrontEnds, check_exposure
from duet.router.lora_adapters import AdapterError, AdapterRegistry
from duet.router.served_models import ModelChangeError, ServedModels
from duet.router.serving import RequestService
from duet.router.status import ClusterView
from duet.yaml_config import field_errors, validate_mapping

logger = logging.getLogger(__name__)

# Each role's worker actor: one that hosts a vLLM engine core, or one that runs a SIMULATED engine.
_VLLM_WORKERS: dict[str, type] = {
    "prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker, "encode": EncodeWorker,
}
_SIMULATED_WORKERS: dict[str, type] = {
    "prefill": SimulatedPrefillWorker, "decode": SimulatedDecodeWorker, "colocated": SimulatedColocatedWorker,
}


class WorkerStartError(RuntimeError):
    """A worker's engine could not start; the message names the worker and the cause."""


class PortInUseError(OSError):
    """A port duet must listen on is taken; the message names it and the setting to change."""


def _port_in_use(what: str, host: str, port: int, flag: str) -> str:
    return (
        f"cannot listen on {host}:{port} for {what}: the address is in use (another duet server?); "
        f"choose another port with {flag} (0 picks a free one)"
    )


@dataclass
class Deployment:
    config: DuetConfig
    # Names this deployment's actors (detached, so no process owns them) when its control plane
    # runs apart (cluster/control_plane.py); a control plane started again under the same id
    # takes over the workers and front doors that run. None: actors owned by this process.
    deployment_id: str | None = None
    adopted: bool = False  # whether start() took over a running deployment
    # Each served model's pools, managers, adapters and serving path; the default model first
    # (the one a request that names none gets). One model unless the config lists ``models``.
    models: list[ModelServing] = field(default_factory=list)
    front_ends: FrontEnds | None = None
    port: int = 0  # the gRPC API's
    http_port: int | None = None  # the OpenAI HTTP API's (None: disabled)
    cluster: ClusterView | None = None
    # A warning to show the operator (serving a public address without authentication).
    exposure_warning: str | None = None
    health: HealthWatcher | None = None
    # The front doors, each a process of its own, when there are several (server.front_ends >
    # 1; with one, this process serves), and the private socket (in a directory of its own) on
    # which they reach this control plane.
    front_doors: FrontDoorSet | None = None
    _control_dir: str | None = None
    _control_server: Any = None
    _metrics_server: Any = None
    _metrics_registry: CollectorRegistry | None = None  # the /metrics endpoint's, when it is on
    # What models added while serving share with the others (add_model), and the front door's
    # list of every model's serving path.
    _served: ServedModels | None = None
    _gatekeeper: Gatekeeper | None = None
    _cores: CoreAllocator | None = None
    _models_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _autoscaler_metrics: AutoscalerMetrics | None = None  # one set of families, a label per model

    def __post_init__(self) -> None:
        # Where each model's encoder cache lives when its config names no folder (E+P+D): the
        # same for a control plane that takes the deployment over.
        self._cache_key = self.deployment_id or f"{os.getpid()}-{secrets.token_hex(4)}"
        self.models = [
            ModelServing(with_encoder_cache_folder(served, self._cache_key), default=index == 0)
            for index, served in enumerate(self.config.served())
        ]

    # The default model's parts, by the names a one-model deployment has always had.
    @property
    def default(self) -> ModelServing:
        return self.models[0]

    @property
    def prefill(self) -> WorkerPool:
        return self.default.prefill

    @property
    def decode(self) -> WorkerPool:
        return self.default.decode

    @property
    def service(self) -> RequestService | None:
        return self.default.service

    @property
    def managers(self) -> dict[str, PoolManager]:
        return self.default.managers

    @property
    def autoscaler(self) -> LiveAutoscaler | None:
        return self.default.autoscaler

    @property
    def adapters(self) -> AdapterRegistry | None:
        return self.default.adapters

    async def start(self, port: int | None = None, http_port: int | None = -1) -> "Deployment":
        """Start workers and both front ends; ``port`` and ``http_port`` override the config
        (0 picks a free port; the default -1 keeps the config's HTTP port).

        Listening ports and API keys are checked before any worker starts, so a port in use or
        a bad keys file fails in a second with its name, not after a minute of engine start-up.
        """
        server_config = self.config.server
        bind_port = server_config.port if port is None else port
        bind_http = server_config.http_port if http_port == -1 else http_port
        start_ray(self.config)
        self.adopted = self.deployment_id is not None and bool(named_actors(self.deployment_id))
        for what, wanted, flag in (("gRPC", bind_port, "--port"), ("HTTP", bind_http, "--http-port")):
            if wanted and not self.adopted and not is_bindable(server_config.host, wanted):
                raise PortInUseError(_port_in_use(what, server_config.host, wanted, flag))
        gatekeeper = self._gatekeeper = Gatekeeper.from_config(server_config.auth)
        self.exposure_warning = check_exposure(server_config, gatekeeper)
        pools = [pool for served in self.models for pool in served.pools]
        disaggregated = [served for served in self.models if not served.colocated]
        transport = self.config.kv_transfer.transport if disaggregated else "none (colocated)"
        self.cluster = ClusterView(self.default.name, transport, pools)
        self.cluster.served_models = []
        for served in self.models:
            self._list_served(served.config)
        self.cluster.deployment_id = self.deployment_id or ""
        if server_config.front_doors_apart:
            self.front_doors = FrontDoorSet(
                self.config, router_host(self.config), self._control_endpoint(), self.cluster.pools,
                actor_prefix=self.deployment_id, models=[served.config for served in self.models],
            )
            if self.adopted and await self.front_doors.find():
                self._adopt_added_models(self.front_doors.models)
            for served in self.models:
                served.front_doors = self.front_doors
            self.cluster.front_doors = self.front_doors.status
        if server_config.metrics_port is not None:
            try:
                self._metrics_registry, self.cluster.metrics, metrics_port, self._metrics_server = start_metrics_server(
                    server_config.host, server_config.metrics_port, self.cluster.pools,
                    self.front_doors.metrics_texts if self.front_doors is not None else None,
                )
            except OSError:
                raise PortInUseError(
                    _port_in_use("metrics", server_config.host, server_config.metrics_port, "--metrics-port")
                ) from None
            self.cluster.metrics_endpoint = f"{server_config.host}:{metrics_port}"
        for served in self.models:
            resolve_model_path(served.config.model)  # create a built-in model once, not per worker
        if self.front_doors is not None and not self.adopted:
            self.front_doors.create()  # they come up (a few seconds) while the engines do
        self._cores = CoreAllocator() if is_cpu_only() else None
        for served in self.models:
            self._add_managers(served)
        if self.adopted:
            await asyncio.gather(*(manager.adopt() for served in self.models for manager in served.managers.values()))
        else:
            for served in self.models:
                for manager in served.managers.values():
                    manager.create(manager.pool_config.replicas)
            await self._wait_ready()
        self.health = HealthWatcher(
            pools,
            self.config.router.health_interval_s,
            self.config.router.health_timeout_s,
            self.config.router.health_failures,
            self.config.router.health_starved_limit_s,
        )
        if self.front_doors is not None:  # they route by load they cannot measure themselves
            self.health.on_loads = lambda loads: self.front_doors.tell("report_loads", loads)
        self.health.start()
        limits = {served.name: await self._start_service(served) for served in self.models}
        self._served = ServedModels([served.service for served in self.models])
        if self.front_doors is None:
            self.front_ends = await FrontEnds.start(
                self._served, server_config, bind_port, bind_http, AdminServicer(self.service, self),
            )
            self.port, self.http_port = self.front_ends.grpc_port, self.front_ends.http_port
        else:
            self._control_server = await start_control_server(
                self.front_doors.control.address, AdminServicer(self.service, self, trusted=True), self.front_doors.control.token
            )
            if self.adopted:
                self.port, self.http_port = await self.front_doors.adopt(limits)
                for served in self.models:  # the adapters loaded by the control plane before, if any
                    if served.name in self.front_doors.adapters:
                        served.adapters.adopt(self.front_doors.adapters[served.name])
                    await served.publish_adapters()  # every front door on the same lists again
            else:
                self.front_doors.adapters = {served.name: served.adapters.adapters for served in self.models}
                self.port, self.http_port = await self.front_doors.start(bind_port, bind_http, limits)
        for served in self.models:
            if served.config.autoscale is not None:
                self._start_autoscaler(served)
        # The router holds vLLM, torch and the tokenizers: millions of long-lived objects that
        # every full garbage collection walks again, while decoding the engines' outputs
        # allocates fast enough to trigger collections all the time (a native profile under
        # load had a sixth of the router's samples in the collector). Exempt what exists now,
        # as vLLM's own API server does.
        gc.collect()
        gc.freeze()
        return self

    def _add_managers(self, served: ModelServing) -> None:
        roles = {"colocated": served.config.colocated} if served.colocated else {
            "prefill": served.config.prefill, "decode": served.config.decode,
        }
        if served.encodes:
            roles["encode"] = served.config.encode
        served.managers = {
            role: self._manager(served, role, served.decode if role == "colocated" else getattr(served, role), pool_config)
            for role, pool_config in roles.items()
        }

    async def _start_service(self, served: ModelServing) -> tuple[int, int, int]:
        """``served``'s serving path over its ready pools, sharing the cluster view and the
        callers' keys; returns its engine's limits (the front doors apart serve each model with them)."""
        assert self.cluster is not None and self._gatekeeper is not None
        first_worker = (served.prefill.members + served.decode.members)[0]
        engine_limits = await first_worker.engine.model_limits()
        served.service = request_service(
            served.config, None if served.colocated else served.prefill, served.decode, engine_limits, self.cluster, self._gatekeeper,
            served.encode if served.encodes else None,
        )
        served.service.adapter_admin = self  # loads and unloads across every model's names
        several = len(self.models) > 1
        notes = _conditional_disaggregation_notes(served.config)
        self.cluster.routing_notes.extend(f"{served.name}: {note}" if several else note for note in notes)
        return engine_limits

    def _control_endpoint(self) -> ControlEndpoint:
        """Where front doors reach this control plane: a private Unix socket on its host, or
        TCP with a token for front doors on hosts of their own (router/control_channel.py)."""
        if self.config.server.front_end_placement == "nodes":
            host = router_host(self.config)
            return ControlEndpoint(f"{host}:{free_port(host)}", secrets.token_hex(16))
        self._control_dir = _control_dir(self.deployment_id)
        return ControlEndpoint("unix:" + os.path.join(self._control_dir, "control.sock"))

    @property
    def serving(self) -> dict[str, Any]:
        """What ``duet serve`` says once ready: ports, metrics, security."""
        return {
            "port": self.port,
            "http_port": self.http_port,
            "metrics_endpoint": self.cluster.metrics_endpoint if self.cluster else "",
            "exposure_warning": self.exposure_warning,
            "keys_required": bool(self.service and self.service.gatekeeper.enabled),
            "adopted": self.adopted,
        }

    def _start_autoscaler(self, served: ModelServing) -> None:
        assert self.cluster is not None and served.service is not None and served.config.autoscale is not None
        policy_name = served.config.autoscale
        policy = load_policy(policy_name)
        if self._metrics_registry is not None and self._autoscaler_metrics is None:
            self._autoscaler_metrics = AutoscalerMetrics(self._metrics_registry)
        metrics = self._autoscaler_metrics.for_model(served.name, policy.slo_profile()) if self._autoscaler_metrics else None
        pools = {"prefill": served.prefill, "decode": served.decode}
        if served.encodes:
            pools["encode"] = served.encode
        load = self.front_doors.load_of(served.name) if self.front_doors is not None else served.service.load
        served.autoscaler = LiveAutoscaler(policy, pools, load, served, metrics, budget_left=self._budget_left(served))
        served.autoscaler.start()
        slo = policy.slo_profile()
        self.cluster.routing_notes.append(
            (f"{served.name}: " if len(self.models) > 1 else "")
            + f"autoscaling: policy {policy_name} (SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s at {slo.attainment:.0%}; "
            f"prefill {policy.prefill.min}-{policy.prefill.max}, decode {policy.decode.min}-{policy.decode.max}"
            + (f", encode {policy.encode.min}-{policy.encode.max}" if served.encodes else "")
            + " workers)"
        )

    def _budget_left(self, served: ModelServing) -> Callable[[], BudgetShare] | None:
        """What ``served``'s autoscaler may hold of the deployment's autoscale_budget: the
        budget less what every other model holds now, arbitrated by SLO shortfall
        (cluster/autoscaler/shared_budget.py; None without a shared budget)."""
        budget = self.config.autoscale_budget
        if budget is None:
            return None

        def holder(model: ModelServing) -> Holder:
            scaler = model.autoscaler.autoscaler if model.autoscaler is not None else None
            if scaler is None:
                return Holder(model.name, model.units_held())
            return Holder(model.name, model.units_held(), scaler.asked, scaler.shortfall)

        return lambda: share_of(budget, holder(served), [holder(other) for other in self.models if other is not served])

    def _manager(self, served: ModelServing, role: str, pool: WorkerPool, pool_config: Any) -> PoolManager:
        workers = _SIMULATED_WORKERS if pool_config.engine == "simulated" else _VLLM_WORKERS
        return PoolManager(
            pool, workers[role], pool_config, served.config, router_host(self.config), self._cores,
            plan_nodes=_plan_node_ids(pool.role, pool_config.nodes), front_doors=self.front_doors,
            actor_prefix=self.deployment_id, served_adapters=lambda: served.adapters.adapters if served.adapters else (),
            worker_prefix=served.worker_prefix,
        )

    def served_model(self, name: str) -> ModelServing:
        """The served model ``name`` ("": the default); ScaleError naming the models served."""
        if not name:
            return self.default
        for served in self.models:
            if served.name == name:
                return served
        raise ScaleError(f"model: this deployment serves no model {name!r} (it serves: {', '.join(m.name for m in self.models)})")

    def scale(self, role: str, replicas: int, model: str = "") -> list[str]:
        """Grow or shrink pool ``role`` of ``model`` (default: the default model) to
        ``replicas`` workers (the Admin service's ScalePool)."""
        return self.served_model(model).scale(role, replicas)

    def drain(self, worker: str, timeout_s: float | None = None) -> str:
        """Remove ``worker`` after its requests finish (the Admin service's DrainWorker)."""
        managers = [manager for served in self.models for manager in served.managers.values()]
        for manager in managers:
            if manager.pool.find(worker) is not None:
                return manager.drain(worker, timeout_s)
        known = ", ".join(m.name for manager in managers for m in manager.pool.members)
        raise ScaleError(f"worker: no worker named {worker!r} (workers: {known})")

    async def load_adapter(self, name: str, path: str, model: str = "") -> str:
        """Serve the LoRA adapter at ``path`` as model ``name`` on the served model ``model``
        ("": the default; the Admin service's LoadLoraAdapter; see ModelServing.load_adapter).
        Its name must be free among every model's, as vLLM's server requires among its own."""
        try:
            target = self.served_model(model)
        except ScaleError as error:
            raise AdapterError("not_found", str(error)) from None
        for served in self.models:
            if served is target:
                continue  # its own names: its registry checks them
            if name == served.name:
                raise AdapterError("invalid", f"The lora adapter '{name}' conflicts with a served base model.")
            if served.serves_adapter(name):
                raise AdapterError("invalid", f"The lora adapter '{name}' has already been loaded.")
        return await target.load_adapter(name, path)

    async def unload_adapter(self, name: str) -> str:
        """Stop serving LoRA adapter ``name`` (the Admin service's UnloadLoraAdapter), on
        whichever model serves it."""
        for served in self.models:
            if served.serves_adapter(name):
                return await served.unload_adapter(name)
        return await self.default.unload_adapter(name)  # refuses it, naming what is served

    def manager(self, role: str) -> PoolManager:
        """The manager of the default model's pool ``role``; ScaleError naming the roles it has."""
        return self.default.manager(role)

    async def add_model(self, model_config: str) -> list[str]:
        """Serve another model (the Admin service's AddModel): ``model_config`` is one entry of
        the config's ``models:`` in YAML or JSON. Its workers start beside the others' (which
        are not touched); once all are ready, every front door serves its name. Raises
        ModelChangeError: "invalid" for a config that cannot be served, "unavailable" if its
        workers cannot start (they are removed)."""
        return await asyncio.shield(self._add_model(model_config))

    async def _add_model(self, model_config: str) -> list[str]:
        assert self.cluster is not None and self._served is not None
        async with self._models_lock:
            try:
                config = self._model_config(model_config)
            except ConfigError as error:
                raise ModelChangeError("invalid", str(error)) from None
            served = self._serve_another(config)
            try:
                if self.front_doors is not None:  # their pools for its workers, before those start
                    await self.front_doors.set_models([model.config for model in self.models])
                await asyncio.to_thread(resolve_model_path, served.config.model)  # a built-in model is made once
                self._add_managers(served)
                for manager in served.managers.values():
                    manager.create(manager.pool_config.replicas)
                await self._wait_ready(served)
                model_limits = await self._start_service(served)
                if self.front_doors is not None:
                    await self.front_doors.serve_model(served.name, model_limits, served.adapters.adapters)
            except Exception as error:  # whatever failed, nothing of the model is left
                await self._forget(served)
                problem = str(error) or f"{type(error).__name__} (its workers did not start in time?)"
                raise ModelChangeError("unavailable", f"{served.name} not added: {problem}") from None
            except BaseException:
                await self._forget(served)
                raise
            assert served.service is not None
            if self.front_ends is not None:
                self.front_ends.start_rebalancing(served.service)
            self._served.services.append(served.service)
            self._list_served(served.config)
            if served.config.autoscale is not None:
                self._start_autoscaler(served)
        workers = [member.name for pool in served.pools for member in pool.members]
        logger.info("serving model %s (%s)", served.name, ", ".join(workers))
        return [f"{served.name}: serving ({', '.join(workers)})"]

    def _serve_another(self, config: DuetConfig) -> ModelServing:
        """A served model for ``config`` (one model's view of the deployment's), beside the
        others: its pools are in status, health watching and metrics from now on."""
        assert self.cluster is not None
        served = ModelServing(with_encoder_cache_folder(config, self._cache_key), front_doors=self.front_doors)
        self.models.append(served)
        self.cluster.pools.extend(served.pools)
        return served

    def _adopt_added_models(self, models: list[DuetConfig]) -> None:
        """The models added while the deployment ran, as its front doors serve them (a control
        plane started again knows only its config's): taken over with the others."""
        assert self.cluster is not None
        known = {served.name for served in self.models}
        for config in models:
            if config.model.name not in known:
                self._serve_another(config)
                self._list_served(config)

    def _list_served(self, config: DuetConfig) -> None:
        """Status lists model ``config`` and its configured adapters as served from now on."""
        assert self.cluster is not None
        self.cluster.served_models.append(config.model.name)
        self.cluster.adapters_by_model[config.model.name] = config.model.adapter_names()

    def _model_config(self, model_config: str) -> DuetConfig:
        """The added model's view of the deployment's config; ConfigError saying what is wrong."""
        try:
            entry = yaml.safe_load(model_config)
        except yaml.YAMLError as error:
            raise ConfigError(f"model_config: not YAML or JSON ({error})") from None
        served = validate_mapping(ServedModelConfig, entry, "model_config", ConfigError)
        taken = self._served.names() if self._served is not None else []
        clashes = [name for name in (served.model.name, *served.model.adapter_names()) if name in taken]
        if clashes:
            raise ConfigError(f"model_config: {', '.join(clashes)} already served; give the model and its adapters names of their own")
        try:
            return one_model(self.config, served)
        except ValidationError as error:
            raise ConfigError("model_config: " + "; ".join(field_errors(error))) from None

    async def remove_model(self, name: str, timeout_s: float | None = None) -> list[str]:
        """Stop serving model ``name`` (the Admin service's RemoveModel): its names are refused
        from now on, its requests in flight get up to ``timeout_s`` (router.drain_timeout_s) to
        finish, then its workers are removed. ModelChangeError ("invalid") for the default
        model or one not served."""
        return await asyncio.shield(self._remove_model(name, timeout_s))

    async def _remove_model(self, name: str, timeout_s: float | None) -> list[str]:
        assert self.cluster is not None and self._served is not None
        async with self._models_lock:
            try:
                served = self.served_model(name)
            except ScaleError as error:
                raise ModelChangeError("invalid", str(error)) from None
            if served is self.default:
                raise ModelChangeError("invalid", f"model: {self.default.name} is the default model (requests that name none get it); it stays")
            assert served.service is not None
            self._served.services.remove(served.service)  # new requests for it are refused from here,
            served.service.retired = True  # and those that chose it a moment before
            self.cluster.served_models.remove(served.name)
            names = self.cluster.adapters_by_model.pop(served.name, ()) + (served.name,)
            if self.front_doors is not None:
                await self.front_doors.retire_model(served.name)
            timeout = served.config.router.drain_timeout_s if timeout_s is None else timeout_s
            deadline = asyncio.get_running_loop().time() + timeout
            while (cut := await self._inflight(names)) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            workers = [member.name for pool in served.pools for member in pool.members]
            await self._forget(served)
        logger.info("stopped serving model %s (%d requests cut off)", name, cut)
        return [f"{name}: removed ({', '.join(workers)})" + (f"; {cut} requests in flight were cut off" if cut else "")]

    async def _inflight(self, names: tuple[str, ...]) -> int:
        """Requests in flight for these model names, at every front door."""
        assert self.cluster is not None
        here = sum(self.cluster.model_inflight[name] for name in names)
        return here + (await self.front_doors.inflight(list(names)) if self.front_doors is not None else 0)

    async def _forget(self, served: ModelServing) -> None:
        """Remove ``served``'s workers and every trace of its pools."""
        assert self.cluster is not None and self.health is not None
        if self.front_ends is not None and served.service is not None:
            self.front_ends.stop_rebalancing(served.service)
        for pool in served.pools:
            self.cluster.pools.remove(pool)
            for member in pool.members:
                self.health.forget_misses(member.name)
        notes = self.cluster.routing_notes
        notes[:] = [note for note in notes if not note.startswith(f"{served.name}: ")]
        self.models.remove(served)
        self.cluster.encoders.pop(served.name, None)
        if self.front_doors is not None:  # every front door forgets it too
            await self.front_doors.set_models([model.config for model in self.models])
        await served.stop()
        cache = served.config.encode.cache_path
        if served.encodes and cache is not None and cache.startswith(default_root(self._cache_key)):
            shutil.rmtree(cache, ignore_errors=True)  # a model added again under its name encodes anew

    async def _wait_ready(self, only: ModelServing | None = None) -> None:
        """Start every worker created (of ``only``'s pools, if given); WorkerStartError naming each that failed."""
        models = [only] if only is not None else self.models
        pairs = [(manager, member) for served in models for manager in served.managers.values() for member in manager.pool.members]
        members = [member for _, member in pairs]
        timeout = self.config.server.worker_start_timeout_s
        starts = [manager.start(member) for manager, member in pairs]
        try:
            results = await asyncio.wait_for(asyncio.gather(*starts, return_exceptions=True), timeout)
        except TimeoutError:  # most often a worker Ray has no room for: it waits, and says nothing
            free = ray.available_resources()
            waiting = ", ".join(member.name for member in members if member.state != "ready")
            raise WorkerStartError(
                f"workers not ready within server.worker_start_timeout_s ({timeout:g} s): {waiting}. A worker waits "
                f"until the Ray cluster has its pool's num_cpus, num_gpus and resources free; it has "
                f"{free.get('CPU', 0.0):g} CPU and {free.get('GPU', 0.0):g} GPU free now"
            ) from None
        failures = [f"{m.name}: {root_cause(r)}" for m, r in zip(members, results) if isinstance(r, BaseException)]
        if failures:
            raise WorkerStartError("workers failed to start:\n  " + "\n  ".join(failures))

    async def stop(self) -> None:
        if self.front_doors is not None:
            await self.front_doors.stop()
        if self._control_server is not None:
            await self._control_server.stop(grace=None)
        if self._control_dir is not None:
            shutil.rmtree(self._control_dir, ignore_errors=True)
        if self.front_ends is not None:
            await self.front_ends.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.health is not None:
            self.health.stop()
        await asyncio.gather(*(served.stop() for served in self.models))
        shutil.rmtree(default_root(self._cache_key), ignore_errors=True)  # the encoder caches duet named, if any


def _control_dir(deployment_id: str | None) -> str:
    """The directory of the control plane's private socket (this user's only): one per
    deployment id, so a restarted control plane listens where the front doors reach it."""
    if deployment_id is None:
        return tempfile.mkdtemp(prefix="duet-control-")
    path = os.path.join(tempfile.gettempdir(), f"duet-control-{deployment_id}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, "control.sock"))  # the dead control plane's
    return path


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


def _conditional_disaggregation_notes(config: DuetConfig) -> list[str]:
    """What ``duet status`` says about which prompts the decode workers prefill themselves."""
    if config.mode == "colocated":
        return []
    router, notes = config.router, []
    if router.local_prefill_max_tokens:
        notes.append(
            f"conditional disaggregation: prompts under {router.local_prefill_max_tokens} tokens "
            "are prefilled on the decode worker"
        )
    if router.local_prefill_queue_tokens:
        notes.append(
            f"conditional disaggregation: while every prefill worker has over {router.local_prefill_queue_tokens} "
            "prompt tokens queued, a decode worker with a shorter queue prefills the prompt itself"
            + (
                f" while its streams stay within {router.local_prefill_tpot_s * 1000:g} ms per token"
                if router.local_prefill_tpot_s is not None else ""
            )
        )
    return notes
