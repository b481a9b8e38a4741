"""Transfer totals read from a worker's vLLM metrics, the same way for every transport.

NixlConnector records ``vllm:nixl_*`` metrics (on the decode side, which reads the KV); duet's
p2p connector records ``vllm:p2p_*`` (both sides, labelled by direction). Both are Prometheus
histograms of per-transfer duration and bytes plus a failure counter, so one summary serves
``duet status`` and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

# transport prefix -> (duration histogram, bytes histogram, failure counters)
_SOURCES = {
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred", ("vllm:nixl_num_failed_transfers_total",)),
    "p2p": ("vllm:p2p_xfer_time_seconds", "vllm:p2p_bytes_transferred", ("vllm:p2p_num_failed_transfers_total",)),
}
NIXL_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


@dataclass(frozen=True)
class TransferTotals:
    transfers: int = 0
    bytes: float = 0.0
    seconds: float = 0.0
    failures: int = 0

    @property
    def gib_per_s(self) -> float:
        """Mean bandwidth over the transfers' own durations."""
        return self.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


def metric_total(metrics: dict[str, float], name: str) -> float:
    """Sum a sample over all its label sets (keys look like ``name`` or ``name{a=b}``)."""
    return sum(value for key, value in metrics.items() if key == name or key.startswith(name + "{"))


def transfer_totals(metrics: dict[str, float]) -> TransferTotals:
    """Totals since the worker started, from its flattened vLLM metrics."""
    transfers = nbytes = seconds = failures = 0.0
    for duration, size, failure_counters in _SOURCES.values():
        transfers += metric_total(metrics, f"{duration}_count")
        seconds += metric_total(metrics, f"{duration}_sum")
        nbytes += metric_total(metrics, f"{size}_sum")
        failures += sum(metric_total(metrics, counter) for counter in failure_counters)
    return TransferTotals(int(transfers), nbytes, seconds, int(failures))


# The host KV pool (kv_transfer/kv_pool.py records these inside the engine): duet's gauges and
# counter, labelled by host, and vLLM's chunk lookups of the pool's tier, the first secondary
# tier (a chunk is one KV block there). Named here, where the router reads them without
# importing vLLM's offloading code.
POOL_TIER_TYPE = "HostPoolTier"
POOL_PEER_TIER_TYPE = "HostPeerTier"  # after it: fetches from other hosts' pools
POOL_BYTES = "duet:kv_pool_bytes"
POOL_BLOCKS = "duet:kv_pool_blocks"
POOL_CAPACITY = "duet:kv_pool_capacity_bytes"
POOL_EVICTIONS = "duet:kv_pool_evictions"
POOL_CORRUPT = "duet:kv_pool_corrupt_blocks"
_POOL_TIER = f"{{tier=1:{POOL_TIER_TYPE}}}"
_PEER_TIER = f"{{tier=2:{POOL_PEER_TIER_TYPE}}}"


@dataclass(frozen=True)
class PoolTotals:
    """One engine's view of its host's KV pool, since the engine started."""

    host: str
    blocks: int
    bytes: float
    capacity_bytes: float
    hits: int  # block lookups that found the block in the pool (after the engine's own cache missed)
    misses: int
    evictions: int  # blocks this engine's sweeps evicted
    fetched: int = 0  # blocks it fetched from other hosts' pools (its p2p tier's hits)


def pool_totals(metrics: dict[str, float]) -> PoolTotals | None:
    """The pool's figures from an engine's flattened metrics; None for an engine without one
    (or before its first report)."""
    prefix = POOL_CAPACITY + "{host="
    host = next((key[len(prefix):-1] for key in metrics if key.startswith(prefix)), None)
    if host is None:
        return None
    label = f"{{host={host}}}"
    queries = metrics.get("vllm:kv_offload_tiering_chunk_queries_total" + _POOL_TIER, 0.0)
    hits = metrics.get("vllm:kv_offload_tiering_chunk_hits_total" + _POOL_TIER, 0.0)
    return PoolTotals(
        host=host,
        blocks=int(metrics.get(POOL_BLOCKS + label, 0)),
        bytes=metrics.get(POOL_BYTES + label, 0.0),
        capacity_bytes=metrics[POOL_CAPACITY + label],
        hits=int(hits),
        misses=int(queries - hits),
        evictions=int(metrics.get(POOL_EVICTIONS + "_total" + label, 0)),  # a counter's sample
        fetched=int(metrics.get("vllm:kv_offload_tiering_chunk_hits_total" + _PEER_TIER, 0.0)),
    )
