"""The host KV pool: prefix KV blocks kept beyond the engines, shared by every engine on a host.

Built on vLLM's KV offloading framework rather than a store of duet's own (issue 54 weighed it
against Mooncake Store and LMCache: it is already in the engine duet runs, and on CPU it needs
only the block copy below). vLLM's ``OffloadingConnector`` with its tiering spec keeps, per
engine, a small primary tier in host memory (LRU) through which blocks pass, and secondary tiers
behind it. duet's secondary tier is vLLM's file-system tier pointed at a directory on
``/dev/shm``: host memory that every engine on the host reads and that outlives any one of them.
Its files are named by model, KV layout and block hash (a sha256 chain with a fixed seed, equal
across processes), so a prefix one engine computed is a hit for every other engine of the same
model on the host: a prefill worker scaled in or restarted is warm from its first request.

duet adds three things to vLLM's classes:
- :class:`HostCopyWorker`: the copies between a CPU engine's KV cache and the primary tier.
  vLLM's own copies with CUDA streams and refuses other platforms; on a CPU engine the KV cache
  is host memory already, so two torch index operations per KV tensor do it, synchronously. On
  a GPU, vLLM's own worker runs.
- :class:`HostPoolTier`: the file-system tier with the host's capacity (the oldest blocks
  evicted past it, :mod:`duet.kv_transfer.pool_capacity`), block files that carry a checksum
  checked on every load (:mod:`duet.kv_transfer.pool_blocks`: a corrupt block is deleted and
  computed, never served), a synchronous lookup (a file's existence on ``/dev/shm`` takes
  microseconds; vLLM's asynchronous one costs every request a scheduler step), and the pool's
  size, evictions and corrupt blocks as metrics beside vLLM's hits and queries.
- :class:`HostTieringSpec`: vLLM's tiering spec with that worker.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from duet.kv_transfer import pool_blocks, pool_capacity
from duet.kv_transfer.metrics import POOL_BLOCKS, POOL_BYTES, POOL_CAPACITY, POOL_CORRUPT, POOL_EVICTIONS

# An engine sweeps the host's pool after writing this share of its capacity.
_SWEEP_SHARE = 0.05


def forget_engine_buffer(engine_id: str) -> None:
    """Remove the name of an engine's host tier (vLLM's ``/dev/shm/vllm_offload_<engine id>.mmap``,
    ``kv_pool.engine_buffer_mib``) once the engine is ready: its scheduler and worker have both
    mapped it by then, and the kernel frees the memory when the last of them exits, however it
    exits. Left named, every engine stopped by a signal (as duet stops them) left it behind."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/vllm_offload_{engine_id}.mmap")


class HostCopyWorker(OffloadingWorker):
    """Copies whole KV blocks between a CPU engine's KV cache and the primary tier's region.

    One engine block per offloaded chunk and one KV cache group (every model duet serves); each
    copy is done when submitted, so a transfer never fails after it is accepted (vLLM's connector
    asserts that a finished transfer succeeded)."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError("the host KV pool supports models with one KV cache group")
        self._region = region
        self._engine = [cache.tensor.view(torch.int8).view(-1, cache.page_size_bytes) for cache in kv_caches.tensors]
        self._pool = [region.create_next_worker_view(cache.page_size_bytes) for cache in kv_caches.tensors]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, self._engine, src_spec, self._pool, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, self._pool, src_spec, self._engine, dst_spec)

    def _copy(
        self, job_id: int, sources: list[torch.Tensor], source: LoadStoreSpec,
        targets: list[torch.Tensor], target: LoadStoreSpec,
    ) -> bool:
        assert isinstance(source, BlockIDsLoadStoreSpec) and isinstance(target, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        rows_from = torch.from_numpy(np.asarray(source.block_ids, dtype=np.int64))
        rows_to = torch.from_numpy(np.asarray(target.block_ids, dtype=np.int64))
        size = 0
        for from_tensor, to_tensor in zip(sources, targets):
            to_tensor.index_copy_(0, rows_to, from_tensor.index_select(0, rows_from))
            size += len(rows_from) * from_tensor.shape[1]
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Every copy is done when submitted."""

    def shutdown(self) -> None:
        self._engine, self._pool = [], []  # the region refuses to close while views of it live
        self._region.cleanup()


class HostTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec (primary tier in host memory, secondary tiers such as the shared
    file-system one), with :class:`HostCopyWorker` where the engine's KV cache is host memory
    (a CPU engine); on a GPU, vLLM's own worker and its CUDA copies."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self._host_copy_worker(kv_caches)
        return self._worker

    def _host_copy_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        region = SharedOffloadRegion(
            engine_id=self._engine_id,  # the file the scheduler side maps too
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
            # No barrier: the engine core's scheduler maps the same /dev/shm file (its tiers read
            # and write the region), and may do so after this worker; a barrier would unlink it
            # first, and the scheduler would map a region of its own (tests/test_elastic_pools.py
            # caught the garbage KV that followed). The file is removed at shutdown.
        )
        try:
            return HostCopyWorker(kv_caches, region)
        except Exception:
            region.cleanup()
            raise


class HostPoolTier(FileSystemTierManager):
    """vLLM's file-system tier on the host's pool directory, kept within ``capacity_bytes``.

    Each engine counts what it stores; once that reaches :data:`_SWEEP_SHARE` of the capacity
    since its last sweep, it sweeps the directory in a thread of its own (the scheduler never
    waits for one). The pool's size it reports is its last sweep's plus what it stored since."""

    def __init__(self, *, capacity_bytes: int, **file_system_tier: Any) -> None:
        super().__init__(**file_system_tier)
        self._root = file_system_tier["root_dir"]
        self._capacity_bytes = capacity_bytes
        self._sweep_after_bytes = max(self.block_size_bytes, int(_SWEEP_SHARE * capacity_bytes))
        self._store_jobs: set[int] = set()
        self._sweeper: threading.Thread | None = None
        self._last_sweep: pool_capacity.Sweep | None = None
        self._stored_since_sweep = 0
        self._evictions_unreported = 0
        self._corrupt_unreported = 0
        self._host = (socket.gethostname(),)
        self._reported: tuple[pool_capacity.Sweep, int] | None = None  # the size last reported
        self._lock = threading.Lock()
        self._start_sweep()  # what the host's pool holds already

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        host = ("host",)
        return {
            POOL_BYTES: OffloadingGaugeMetadata(
                "Bytes of KV blocks in the host's KV pool: its last sweep's count and what this engine stored since.", host
            ),
            POOL_BLOCKS: OffloadingGaugeMetadata("KV blocks in the host's KV pool, counted the same way.", host),
            POOL_CAPACITY: OffloadingGaugeMetadata("The most the host's KV pool holds (kv_pool.capacity_gib).", host),
            POOL_EVICTIONS: OffloadingCounterMetadata(
                "KV blocks this engine's sweeps evicted from the host's KV pool (least recently used first).", host
            ),
            POOL_CORRUPT: OffloadingCounterMetadata(
                "KV blocks this engine found corrupt in the host's KV pool (their checksum failed): deleted and computed.", host
            ),
        }

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if os.path.exists(self.file_mapper.get_file_name(key)) else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        pool_capacity.touch([self.file_mapper.get_file_name(key) for key in keys])

    def submit_store(self, job_metadata: TransferJob) -> None:
        """vLLM's store, with duet's block files (:mod:`duet.kv_transfer.pool_blocks`: each
        block with its checksum) in place of vLLM's unchecked ones."""
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        self._store_jobs.add(job_id)
        if self.events is not None:
            self._store_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        paths, offsets = self._files(keys, job_metadata)
        task = functools.partial(pool_blocks.store_blocks, paths, self._primary_kv_view, offsets, self._block_size)
        self._pool.enqueue_store(job_id, 1, [task])

    def submit_load(self, job_metadata: TransferJob) -> None:
        """vLLM's load, each block checked: one that is missing or corrupt fails the load from
        it on, and vLLM's tier then recomputes those blocks (a corrupt one is deleted, so the
        next lookup misses it)."""
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        paths, offsets = self._files(keys, job_metadata)

        def load() -> None:
            try:
                pool_blocks.load_blocks(paths, self._primary_kv_view, offsets, self._block_size)
            except pool_blocks.BlockLoadError as error:
                self._load_progress[job_id] = error.num_succeeded  # read by vLLM's get_finished_jobs
                with self._lock:
                    self._corrupt_unreported += error.corrupt
                raise

        self._pool.enqueue_load(job_id, 1, [load])

    def _files(self, keys: list[OffloadKey], job_metadata: TransferJob) -> tuple[list[str], list[int]]:
        """The job's block files, and where each block sits in the primary tier's region."""
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        return paths, [int(chunk) * self._block_size for chunk in job_metadata.chunk_ids]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = list(super().get_finished_jobs())
        stored = 0
        for job in finished:
            if job.job_id in self._store_jobs:
                self._store_jobs.discard(job.job_id)
                stored += (job.transfer_bytes or 0) if job.success else 0
        with self._lock:
            self._stored_since_sweep += stored
            due = self._stored_since_sweep >= self._sweep_after_bytes
        if due:
            self._start_sweep()
        return finished

    def _start_sweep(self) -> None:
        if self._sweeper is not None and self._sweeper.is_alive():
            return
        self._sweeper = threading.Thread(target=self._sweep, name="duet-kv-pool-sweep", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        swept = pool_capacity.sweep(self._root, self._capacity_bytes)
        if swept is not None:
            with self._lock:
                self._last_sweep, self._stored_since_sweep = swept, 0
                self._evictions_unreported += swept.blocks_evicted

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The pool's size when it changed (vLLM asks every engine step), and new evictions."""
        with self._lock:
            swept, stored, evicted, corrupt = (
                self._last_sweep, self._stored_since_sweep, self._evictions_unreported, self._corrupt_unreported
            )
            self._evictions_unreported = self._corrupt_unreported = 0
            if swept is None or ((swept, stored) == self._reported and not corrupt):
                return None
            self._reported = (swept, stored)
        stats = OffloadingConnectorStats()
        stats.set_gauge(POOL_BYTES, swept.bytes_held + stored, self._host)
        stats.set_gauge(POOL_BLOCKS, swept.blocks_held + stored // self.block_size_bytes, self._host)
        stats.set_gauge(POOL_CAPACITY, self._capacity_bytes, self._host)
        stats.increase_counter(POOL_EVICTIONS, evicted, self._host)
        stats.increase_counter(POOL_CORRUPT, corrupt, self._host)
        return stats

    def shutdown(self) -> None:
        super().shutdown()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
