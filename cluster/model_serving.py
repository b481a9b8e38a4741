"""One served model inside a deployment: its pools, their managers, its LoRA adapters, its
serving path and its autoscaler.

A deployment serves one model or several (``models:`` in the config); each gets one of these,
so each model's pools start, scale, drain and autoscale on their own, while the deployment
owns what they share: Ray, the front doors, the cluster view, health watching and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from duet.cluster.autoscaler.live import LiveAutoscaler
from duet.cluster.front_doors import FrontDoorSet
from duet.cluster.pool_manager import PoolManager
from duet.config import DuetConfig
from duet.router.lora_adapters import AdapterError, AdapterRegistry
from duet.router.pools import ScaleError, WorkerPool
from duet.router.serving import RequestService

logger = logging.getLogger(__name__)


@dataclass
class ModelServing:
    # This model's view of the deployment's config (DuetConfig.served): its own model, mode,
    # pools and autoscaling policy with the deployment's shared sections.
    config: DuetConfig
    # Whether it is the default model (the one a request that names none gets): its workers
    # are named as in a one-model deployment (:attr:`worker_prefix`).
    default: bool = False
    prefill: WorkerPool = field(default_factory=lambda: WorkerPool("prefill"))
    # Colocated, this pool holds the workers that run whole requests and prefill stays empty.
    decode: WorkerPool = field(default_factory=lambda: WorkerPool("decode"))
    # E+P+D: image encoders of their own, whose outputs the prefill engines load (empty unless
    # the config's encode.replicas is above 0 at start).
    encode: WorkerPool = field(default_factory=lambda: WorkerPool("encode"))
    managers: dict[str, PoolManager] = field(default_factory=dict)
    service: RequestService | None = None
    autoscaler: LiveAutoscaler | None = None
    # The front doors in processes of their own, if any, told of its adapters.
    front_doors: FrontDoorSet | None = None
    # The LoRA adapters served on this model: changed one at a time, under the lock.
    adapters: AdapterRegistry | None = None
    _adapters_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        if self.colocated:
            self.decode.role = "colocated"
        for pool in (self.prefill, self.decode, self.encode):
            pool.model = self.name
        self.adapters = AdapterRegistry(self.config.model)  # each new engine loads them before serving

    @property
    def name(self) -> str:
        return self.config.model.name

    @property
    def worker_prefix(self) -> str:
        """What its workers' names start with ("" for the default model: "prefill-0"; "NAME/"
        for the others: "NAME/prefill-0"), so that every worker of the deployment has a name of
        its own."""
        return "" if self.default else f"{self.name}/"

    def serves_adapter(self, name: str) -> bool:
        """Whether LoRA adapter ``name`` is served on this model."""
        return self.adapters is not None and self.adapters.serves(name)

    @property
    def colocated(self) -> bool:
        return self.config.mode == "colocated"

    @property
    def encodes(self) -> bool:
        """Whether it has an encode pool (E+P+D): configured with encode workers at start."""
        return not self.colocated and self.config.encode.replicas > 0

    @property
    def pools(self) -> list[WorkerPool]:
        """The pools that serve it: the colocated one, or prefill and decode (and encode)."""
        if self.colocated:
            return [self.decode]
        return [self.prefill, self.decode, self.encode] if self.encodes else [self.prefill, self.decode]

    def units_held(self) -> int:
        """Units (GPUs, or cores on CPU) its workers hold or are starting to hold; a draining
        worker holds its units until it is gone."""
        return sum(
            sum(member.state != "failed" for member in manager.pool.members)
            * manager.pool_config.tensor_parallel * manager.pool_config.pipeline_parallel
            for manager in self.managers.values()
        )

    def manager(self, role: str) -> PoolManager:
        """The manager of pool ``role``; ScaleError naming the roles this model has."""
        if role not in self.managers:
            raise ScaleError(f"role: {self.name} has no {role!r} pool (it has: {', '.join(self.managers)})")
        return self.managers[role]

    def scale(self, role: str, replicas: int) -> list[str]:
        """Grow or shrink this model's pool ``role`` to ``replicas`` workers."""
        return self.manager(role).scale_to(replicas)

    async def load_adapter(self, name: str, path: str) -> str:
        """Serve the LoRA adapter at ``path`` as model ``name`` (the Admin service's
        LoadLoraAdapter): checked, preloaded on every running engine of this model (a worker
        started later loads it before it joins rotation: pool_manager.py), then served by every
        front door."""
        # Shielded: a caller that gives up (a timeout, a closed connection) must not leave the
        # engines, the list and the front doors half changed.
        return await asyncio.shield(self._load_adapter(name, path))

    async def _load_adapter(self, name: str, path: str) -> str:
        assert self.adapters is not None
        async with self._adapters_lock:
            adapter = self.adapters.new_adapter(name, path)  # its id is never issued again
            members = [member for pool in (self.prefill, self.decode) for member in pool.members if member.engine is not None]
            timeout = self.config.server.worker_start_timeout_s
            results = await asyncio.gather(
                *(asyncio.wait_for(member.engine.add_lora(adapter), timeout) for member in members), return_exceptions=True
            )
            for member, result in zip(members, results):
                if isinstance(result, BaseException) and member.state == "ready":
                    problem = "did not answer" if isinstance(result, TimeoutError) else f"could not load it: {result}"
                    raise AdapterError("invalid", f"lora_path: {member.name} {problem}")
            self.adapters.add(adapter)
            await self.publish_adapters()
        logger.info("serving LoRA adapter %s from %s", name, adapter.path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_adapter(self, name: str) -> str:
        """Stop serving LoRA adapter ``name`` (the Admin service's UnloadLoraAdapter). Requests
        in flight carry it and finish; the engines drop it from their caches as others are used."""
        return await asyncio.shield(self._unload_adapter(name))

    async def _unload_adapter(self, name: str) -> str:
        assert self.adapters is not None
        async with self._adapters_lock:
            self.adapters.remove(name)
            await self.publish_adapters()
        logger.info("stopped serving LoRA adapter %s", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def publish_adapters(self) -> None:
        """Every front door serves exactly this model's adapter list from now on."""
        assert self.adapters is not None and self.service is not None
        self.service.set_adapters(self.adapters.adapters)
        if self.front_doors is not None:
            await self.front_doors.set_adapters(self.name, self.adapters.adapters)

    async def stop(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        await asyncio.gather(*(manager.stop() for manager in self.managers.values()))
