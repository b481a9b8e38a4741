"""``P2pConnector``: duet's vLLM KV connector over torch.distributed point-to-point ops.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER); this class only routes each hook to :class:`P2pScheduler` or :class:`P2pWorker`.
Load it with ``kv_connector="P2pConnector"`` and
``kv_connector_module_path="duet.kv_transfer.p2p.connector"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.metadata import P2pMetadata
from duet.kv_transfer.p2p.prom import P2pPromMetrics
from duet.kv_transfer.p2p.scheduler import P2pScheduler
from duet.kv_transfer.p2p.stats import P2pKVConnectorStats
from duet.kv_transfer.p2p.worker import P2pWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class P2pConnector(KVConnectorBase_V1):
    """Layer-wise streaming prefill -> decode KV connector on NCCL (GPU) or gloo (CPU)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        assert ktc.engine_id is not None
        cfg = P2pConfig.from_extra_config(ktc.kv_connector_extra_config)
        self._scheduler: P2pScheduler | None = None
        self._worker: P2pWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = P2pScheduler(
                ktc.engine_id, vllm_config.cache_config.block_size, ktc.is_kv_producer, ktc.is_kv_consumer
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = P2pWorker(
                vllm_config, ktc.engine_id, cfg, ktc.is_kv_producer, ktc.is_kv_consumer, get_tensor_model_parallel_rank()
            )

    @property
    def transfer_stats(self) -> dict[str, Any] | None:
        """Plain-dict snapshot of this worker's transfer stats (None on the scheduler side)."""
        return None if self._worker is None else self._worker.stats.snapshot()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer must run between graph pieces

    # -- scheduler side -------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(set(connector_output.finished_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is scheduled (asynchronous loading)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, kv_layer, self._meta())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results(self._meta())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        records, failures = self._worker.stats.drain_interval()
        if not records and not failures:
            return None
        return P2pKVConnectorStats(data={"records": records, "failures": failures})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return P2pKVConnectorStats(data=data) if data is not None else P2pKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> P2pPromMetrics:
        return P2pPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _meta(self) -> P2pMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pMetadata)
        return meta
