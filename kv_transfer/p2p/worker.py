"""Worker-side half of the connector: streams layers out (prefill) and fills blocks (decode).

Prefill: ``save_kv_layer`` runs right after each attention layer wrote its KV; it copies the
step's new blocks of that layer into message buffers (``max_chunk_bytes`` of KV at most) and
queues them for the peer's sender thread, so the transfer of layer i overlaps the compute of
layers i+1.. and of later steps.
With ``layerwise`` off, ``wait_for_save`` of a request's last prefill step queues all of its
KV at once instead (the send-after-prefill baseline the benchmark compares against).

Decode: the listener lands chunks in staging as they arrive; a decode request's load is
registered in ``start_load_kv`` and finished in ``get_transfer_results`` once its staged KV is
complete (copied into its blocks), failed, cancelled or past the transfer timeout.

Moving out (live migration): ``start_load_kv``, which runs at every step, forward or not,
copies a moved request's KV, every layer, into message buffers for the target's sender, and
the step's ``get_transfer_results`` reports the request finished sending, so the engine frees
its blocks: once copied out they are no longer read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from duet.kv_transfer.p2p import kv_layout
from duet.kv_transfer.p2p.buffers import BufferPool
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.metadata import LoadSpec, P2pMetadata, SaveSpec
from duet.kv_transfer.p2p.receiver import Listener
from duet.kv_transfer.p2p.sender import PeerSender, layer_chunks
from duet.kv_transfer.p2p.staging import StagedKV, StagingArea
from duet.kv_transfer.p2p.stats import TransferStats


@dataclass
class _PendingLoad:
    spec: LoadSpec
    started: float
    deadline: float


class P2pWorker:
    """Per-worker state of the p2p connector."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, cfg: P2pConfig, is_producer: bool, is_consumer: bool, rank: int
    ):
        self._vllm_config = vllm_config
        self._engine_id = engine_id
        self._cfg = cfg
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._rank = rank
        self._block_size = vllm_config.cache_config.block_size
        self.stats = TransferStats()
        self._layer_index: dict[str, int] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._device = torch.device("cpu")
        self._senders: dict[tuple[str, int], PeerSender] = {}
        self._pool: BufferPool | None = None
        self._listener: Listener | None = None
        self._staging: StagingArea | None = None
        self._pending: dict[str, _PendingLoad] = {}
        self._cancelled: set[str] = set()
        self._moved_out: set[str] = set()  # requests whose KV was queued for their target this step

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Fix the layer order (both engines run the same model) and start the listener."""
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._kv_caches = dict(kv_caches)
        block_bytes = max(t[0].numel() * t.element_size() for t in kv_caches.values())
        if block_bytes > self._cfg.max_chunk_bytes:
            raise ValueError(
                f"p2p_max_chunk_bytes is {self._cfg.max_chunk_bytes}, smaller than one KV block "
                f"({block_bytes} bytes): raise it to at least that"
            )
        self._device = next(iter(kv_caches.values())).device
        self._pool = BufferPool(self._device, self._cfg.idle_buffer_bytes)
        if self._is_consumer:
            self._staging = StagingArea(self._cfg.staging_bytes, self._cfg.lease_s, self._pool)
            self._listener = Listener(
                self._cfg.host, self._cfg.port + self._rank, self._device, self._staging, self._pool, self._cfg,
                self.stats,
            )

    # -- prefill side ---------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: P2pMetadata) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._cfg.layerwise:
            return
        for spec in meta.saves:
            self._submit(spec, layer, kv_layer, spec.start)

    def wait_for_save(self, meta: P2pMetadata) -> None:
        """Runs after the step's forward: stamps the forward end of transfers it completed
        (before queueing anything, so a send-after-prefill transfer shows no overlap), and
        without layer-wise streaming queues those requests' whole KV, every layer."""
        now = time.monotonic()
        for spec in meta.saves:
            if not spec.last:
                continue
            self.stats.forward_ended(spec.tid, f"{spec.peer.host}:{spec.peer.port + self._rank}", now)
            if not self._cfg.layerwise:
                self._send_all_layers(spec)

    def _send_all_layers(self, spec: SaveSpec) -> None:
        for name, layer in self._layer_index.items():
            self._submit(spec, layer, self._kv_caches[name], 0)

    def _submit(self, spec: SaveSpec, layer: int, kv_layer: torch.Tensor, start: int) -> None:
        """Queue tokens [start, spec.end) of one layer for the peer's sender."""
        assert self._pool is not None
        sender = self._sender(spec.peer.host, spec.peer.port + self._rank)
        chunks = layer_chunks(
            spec, layer, len(self._layer_index), kv_layer, start, self._block_size, self._cfg.max_chunk_bytes, self._pool
        )
        for chunk in chunks:
            sender.submit(chunk)

    def _sender(self, host: str, port: int) -> PeerSender:
        key = (host, port)
        sender = self._senders.get(key)
        if sender is None:
            me = f"{self._engine_id}/rank{self._rank}"
            assert self._pool is not None
            sender = self._senders[key] = PeerSender(host, port, me, self._device, self._cfg, self.stats, self._pool)
        return sender

    # -- decode side ----------------------------------------------------------------------

    def start_load_kv(self, meta: P2pMetadata) -> None:
        for move in meta.moves:
            self._send_all_layers(move.save)
            self._moved_out.add(move.req_id)
        if self._staging is None:
            return
        now = time.monotonic()
        for spec in meta.loads:
            deadline = now + self._cfg.transfer_timeout_s
            self._pending[spec.req_id] = _PendingLoad(spec, now, deadline)
            self._staging.extend(spec.tid, deadline)
        for tid in meta.releases:
            self._staging.release(tid)
        self._cancelled.update(meta.cancels)

    def get_transfer_results(self, meta: P2pMetadata) -> KVConnectorTransferResults:
        results = self._collect_results()
        if meta.idle_step and self._pending and not results.finished_recving and not self._moved_out:
            # Nothing else to do this step: wait for the KV here rather than in a spinning loop.
            assert self._staging is not None
            self._staging.wait_for_news(self._cfg.idle_wait_s)
            results = self._collect_results()
        results.finished_sending, self._moved_out = self._moved_out, set()
        return results

    def _collect_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._staging is None:
            return results
        now = time.monotonic()
        for entry in self._staging.expire(now):
            self.stats.count("expired")
            self.stats.received(entry.tid, entry.nbytes, now - entry.created, "lease expired")
        for req_id, load in list(self._pending.items()):
            outcome = self._try_finish(req_id, load, now)
            if outcome is None:
                continue
            del self._pending[req_id]
            results.finished_recving.add(req_id)
            if outcome not in ("loaded", "cancelled"):
                results.failed_recving.add(req_id)
                self.stats.count("load_failures")
        return results

    def _try_finish(self, req_id: str, load: _PendingLoad, now: float) -> str | None:
        """'loaded', 'cancelled', a failure reason, or None while the transfer is in flight."""
        spec = load.spec
        assert self._staging is not None
        if req_id in self._cancelled:
            self._cancelled.discard(req_id)
            self._staging.release(spec.tid)
            return "cancelled"
        entry = self._staging.get(spec.tid)
        if entry is not None and entry.failure is not None:
            outcome = entry.failure
        elif entry is not None and entry.complete:
            with self._staging.reading(spec.tid) as staged:
                if staged is None:
                    outcome = "staged KV freed before loading"
                else:
                    outcome = self._copy_in(spec, staged)
        elif now >= load.deadline:
            outcome = "transfer timed out"
        else:
            return None
        self._staging.release(spec.tid)
        nbytes = entry.nbytes if entry is not None else 0
        self.stats.received(spec.tid, nbytes, now - load.started, outcome)
        if outcome == "loaded":
            self.stats.count("loaded_transfers")
        return outcome

    def _copy_in(self, spec: LoadSpec, staged: StagedKV) -> str:
        end = spec.start + spec.num_tokens
        forward_context = self._vllm_config.compilation_config.static_forward_context
        views = {i: forward_context[name].kv_cache for name, i in self._layer_index.items()}
        if (
            end > staged.total_tokens
            or staged.num_layers != len(views)
            or any(view.shape[1:] != staged.block_shape or view.dtype != staged.dtype for view in views.values())
        ):
            return "staged KV does not match the request"
        first, last = kv_layout.block_span(spec.start, end, self._block_size)
        if len(spec.block_ids) < last:
            return "too few blocks allocated"
        for i, view in views.items():
            staged.copy_layer_into(i, view, spec.block_ids, first, last)
        return "loaded"

    def shutdown(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
