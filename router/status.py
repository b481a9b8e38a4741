"""The router's view of the cluster: request counters and each worker's reported state."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from duet.worker_runtime.worker_api import WorkerStatus
from duet.kv_transfer.metrics import PoolTotals, pool_totals, transfer_totals
from duet.router.encoding import EncodeStep
from duet.router.lifecycle import Move, Usage
from duet.router.metrics import RouterMetrics
from duet.router.pools import PoolMember, WorkerPool
from duet.router.proto import duet_api_pb2 as pb

# A worker that does not answer within this is shown as unreachable rather than stalling status.
_STATUS_TIMEOUT_S = 5.0

_TRANSFERRED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
_COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
_KV_USAGE = "vllm:kv_cache_usage_perc"
# Per-model counts that front doors report and status sums.
ModelCounts = TypeVar("ModelCounts", pb.ModelRequests, pb.EncoderCache)


class ClusterView:
    def __init__(self, model: str, transport: str, pools: list[WorkerPool]) -> None:
        self.model = model  # the default model's name (a request that names none gets it)
        self.served_models = [model]  # every model served, the default first
        # The model names of each served model's LoRA adapters.
        self.adapters_by_model: dict[str, tuple[str, ...]] = {}
        self.transport = transport
        self.pools = pools
        self.inflight = 0
        self.outcomes: Counter[str] = Counter()
        # Admitted requests by the model name they asked for: (model, outcome) and in flight.
        self.model_outcomes: Counter[tuple[str, str]] = Counter()
        self.model_inflight: Counter[str] = Counter()
        self.metrics: RouterMetrics | None = None
        self.metrics_endpoint = ""
        # Routing facts beyond each pool's policy (conditional disaggregation's threshold).
        self.routing_notes: list[str] = []
        # The deployment's front doors as status shows them, when each is a process of its own
        # (cluster/front_doors.py); None: this process is the one front door.
        self.front_doors: Callable[[], Awaitable[list[pb.FrontEnd]]] | None = None
        self.index = 0  # this process's client index in every engine core
        self.forwards_status = False  # a front door apart, whose status is the control plane's
        self.host = socket.gethostname()  # what status shows as this front door's host
        self.deployment_id = ""  # the deployment's id, when its control plane is restartable
        # This front door's requests that moved between decode workers, by (worker, direction
        # "out" or "in", method "kv" or "replay").
        self.migrations: Counter[tuple[str, str, str]] = Counter()
        # The encode step of each model with an encode pool (E+P+D), by model name.
        self.encoders: dict[str, EncodeStep] = {}

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """Every served model's LoRA adapters' names, model by model."""
        return tuple(name for model in self.served_models for name in self.adapters_by_model.get(model, ()))

    def admit(self, model: str) -> None:
        """Count a request admitted for ``model`` (the model name it asked for)."""
        self.inflight += 1
        self.model_inflight[model] += 1
        if self.metrics:
            self.metrics.inflight.labels(model).inc()

    def reject(self, reason: str, model: str = "") -> None:
        """Count a request turned away before admission ("invalid", "overloaded", ...);
        ``model`` is empty when it was refused before its model name was read."""
        self.outcomes[reason] += 1
        if self.metrics:
            self.metrics.requests.labels(reason, model).inc()

    def finish(self, outcome: str, usage: Usage | None, model: str) -> None:
        """Count a request that left the router (served, failed or cancelled)."""
        self.inflight -= 1
        self.outcomes[outcome] += 1
        self.model_inflight[model] -= 1
        self.model_outcomes[model, outcome] += 1
        if self.metrics:
            self.metrics.inflight.labels(model).dec()
            self.metrics.requests.labels(outcome, model).inc()
            if usage is not None:
                where = "decode_worker" if usage.prefill_worker == usage.decode_worker else "prefill_pool"
                self.metrics.prefills.labels(where, model).inc()
                self.metrics.ttft.labels(model).observe(usage.ttft_s)
                self.metrics.e2e.labels(model).observe(usage.e2e_s)
                if usage.completion_tokens > 1:
                    self.metrics.tpot.labels(model).observe(usage.tpot_s)

    def moved(self, move: Move) -> None:
        """Count a request that continued on another decode worker (the lifecycle's ``on_move``)."""
        self.migrations[move.source, "out", move.method] += 1
        self.migrations[move.target, "in", move.method] += 1
        if self.metrics:
            self.metrics.migrations.labels(move.source, "out", move.method).inc()
            self.metrics.migrations.labels(move.target, "in", move.method).inc()
            self.metrics.migration_stall.labels(move.method).observe(move.stall_s)
            for phase, seconds in move.phases.items():
                self.metrics.migration_phase.labels(move.method, phase).observe(seconds)

    async def status(self) -> pb.ClusterStatus:
        """The cluster as ``duet status`` shows it; request and migration counts are every
        front door's."""
        pools_and_kv_pools = await asyncio.gather(*(self._pool_status(pool) for pool in self.pools))
        pools = [pool for pool, _ in pools_and_kv_pools]
        kv_pools = [totals for _, counted in pools_and_kv_pools for totals in counted]
        front_ends = await self.front_doors() if self.front_doors is not None else [self.front_door(self.index)]
        _add_migrations(pools, front_ends)
        return pb.ClusterStatus(
            model=self.model,
            served_models=self.served_models,
            lora_adapters=self.lora_adapters,
            pools=pools,
            requests_served=sum(front_end.requests_served for front_end in front_ends),
            requests_inflight=sum(front_end.requests_inflight for front_end in front_ends),
            requests_failed=sum(front_end.requests_failed for front_end in front_ends),
            kv_transport=self.transport,
            metrics_endpoint=self.metrics_endpoint,
            routing=[self._routing_line(pool) for pool in self.pools] + self.routing_notes,
            front_ends=front_ends,
            models=_sum_by_model([counts for door in front_ends for counts in door.models]),
            # Each front door indexes the images it used of the shared folder: an image two of
            # them used is held in both counts.
            encoder_caches=_sum_by_model([counts for door in front_ends for counts in door.encoder_caches]),
            kv_pools=_kv_pools(kv_pools),
            control_plane_pid=os.getpid() if not self.forwards_status else 0,
            deployment_id=self.deployment_id,
        )

    def front_door(self, index: int) -> pb.FrontEnd:
        """This process as a front door: its requests, by what became of them."""
        return pb.FrontEnd(
            index=index,
            pid=os.getpid(),
            host=self.host,
            state="ready",
            requests_served=self.outcomes["served"],
            requests_inflight=self.inflight,
            requests_failed=self.outcomes["failed"],
            migrations=[
                pb.WorkerMigrations(
                    worker=worker,
                    **{f"{direction}_{method}": self.migrations[worker, direction, method]
                       for direction in ("out", "in") for method in ("kv", "replay")},
                )
                for worker in sorted({worker for worker, _, _ in self.migrations})
            ],
            models=[
                pb.ModelRequests(
                    model=model,
                    requests_served=self.model_outcomes[model, "served"],
                    requests_inflight=self.model_inflight[model],
                    requests_failed=self.model_outcomes[model, "failed"],
                )
                for model in sorted(self.model_inflight)
            ],
            encoder_caches=[_encoder_cache(model, self.encoders[model]) for model in sorted(self.encoders)],
        )

    def _routing_line(self, pool: WorkerPool) -> str:
        """``pool``'s routing policy, named by its model when several are served."""
        model = f"{pool.model} " if len(self.served_models) > 1 else ""
        return f"{model}{pool.role}: {pool.policy.describe()}"

    async def _pool_status(self, pool: WorkerPool) -> tuple[pb.Pool, list[PoolTotals]]:
        """The pool's workers, and what each reports of its host's KV pool."""
        reports = await asyncio.gather(*(_worker_status(pool.role, member) for member in pool.members))
        states = [state for state, _ in reports]
        return pb.Pool(role=pool.role, workers=states, model=pool.model or self.model), [t for _, t in reports if t]


def _sum_by_model(counted: list[ModelCounts]) -> list[ModelCounts]:
    """Front doors' counts of one message type (``ModelRequests``, ``EncoderCache``) summed
    field by field per model, in the models' order."""
    total: dict[str, ModelCounts] = {}
    for counts in counted:
        model = total.setdefault(counts.model, type(counts)(model=counts.model))
        for field in counts.DESCRIPTOR.fields:
            if field.name != "model":
                setattr(model, field.name, getattr(model, field.name) + getattr(counts, field.name))
    return [total[model] for model in sorted(total)]


def _encoder_cache(model: str, step: EncodeStep) -> pb.EncoderCache:
    cache, counts = step.cache, step.counts
    return pb.EncoderCache(
        model=model, images_encoded=counts["encoded"], cache_hits=counts["cache_hit"], fallbacks=counts["fallback"],
        images_held=len(cache), bytes_held=cache.bytes, capacity_bytes=cache.capacity_bytes, evictions=cache.evictions,
        encode_seconds=step.encode_seconds,
    )


def _kv_pools(reports: list[PoolTotals]) -> list[pb.KVPool]:
    """Each host's KV pool from its engines' reports: their lookups and evictions summed, its
    size the largest any of them last saw."""
    by_host: dict[str, pb.KVPool] = {}
    for report in reports:
        pool = by_host.setdefault(report.host, pb.KVPool(host=report.host, capacity_bytes=report.capacity_bytes))
        pool.hits += report.hits
        pool.misses += report.misses
        pool.evictions += report.evictions
        pool.fetched += report.fetched
        if report.bytes >= pool.bytes:
            pool.bytes, pool.blocks = report.bytes, report.blocks
    return [by_host[host] for host in sorted(by_host)]


def _add_migrations(pools: list[pb.Pool], front_ends: list[pb.FrontEnd]) -> None:
    """Sum every front door's migration counts into its workers' states."""
    for pool in pools:
        for worker in pool.workers:
            for counted in (moves for door in front_ends for moves in door.migrations if moves.worker == worker.name):
                worker.migrations_out_kv += counted.out_kv
                worker.migrations_out_replay += counted.out_replay
                worker.migrations_in_kv += counted.in_kv
                worker.migrations_in_replay += counted.in_replay


async def _worker_status(role: str, member: PoolMember) -> tuple[pb.WorkerState, PoolTotals | None]:
    """A worker's state, and what its engine reports of its host's KV pool (None: no pool)."""
    router_side = {
        "name": member.name,
        "role": role,
        "state": member.state,
        "restarts": member.restarts,
        "outstanding_prompt_tokens": member.outstanding_tokens,
        "cpu_core": -1 if member.cpu_core is None else member.cpu_core,
    }
    if member.state not in ("ready", "draining"):  # starting, dead or being replaced
        return pb.WorkerState(error=member.error, **router_side), None
    try:
        status: WorkerStatus = await asyncio.wait_for(member.engine.status(), _STATUS_TIMEOUT_S)
    except Exception as error:
        return pb.WorkerState(error=f"unreachable: {type(error).__name__}: {error}", **router_side), None
    if "SIMULATED" in status.state:  # say so wherever a simulated engine serves
        router_side["state"] = f"{member.state} (SIMULATED engine)"
    metrics = status.engine_metrics
    transfers = transfer_totals(metrics)
    kv_pool = pool_totals(metrics)
    state = pb.WorkerState(
        **router_side,
        kv_endpoint=member.kv_endpoint,
        requests_served=status.requests_served,
        requests_inflight=status.requests_inflight,
        kv_cache_usage=metrics.get(_KV_USAGE, 0.0),
        prompt_tokens_transferred=int(metrics.get(_TRANSFERRED, 0)),
        prompt_tokens_computed=int(metrics.get(_COMPUTED, 0)),
        error=status.error,
        kv_transfers=transfers.transfers,
        kv_transfer_bytes=transfers.bytes,
        kv_transfer_seconds=transfers.seconds,
        kv_transfer_failures=transfers.failures,
        lora_adapter_reads=status.adapter_loads.get("read", 0),
        lora_adapter_activations=status.adapter_loads.get("activated", 0),
    )
    if kv_pool is not None:
        state.kv_pool_host, state.kv_pool_hits, state.kv_pool_misses = kv_pool.host, kv_pool.hits, kv_pool.misses
    return state, kv_pool
