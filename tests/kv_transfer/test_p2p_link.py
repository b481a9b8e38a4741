"""The p2p transport below vLLM: a real sender and listener over a real gloo pair group.

Both ends run in this process (the listener hosts its TCPStore, the sender joins it from its
own thread), which is what a pair of engines does across processes, minus the engines. The
engine-level tests (test_p2p_disagg.py, test_nccl_serving.py) show the same code inside vLLM.
"""

from __future__ import annotations

import time

import pytest
import torch

from duet.kv_transfer.p2p.buffers import BufferPool, size_class
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.receiver import Listener
from duet.kv_transfer.p2p.metadata import SaveSpec
from duet.kv_transfer.p2p.params import PeerAddress
from duet.kv_transfer.p2p.sender import PeerSender, layer_chunks
from duet.kv_transfer.p2p.staging import Landed, StagingArea
from duet.kv_transfer.p2p.stats import TransferStats
from duet.kv_transfer.p2p.wire import HEADER_BYTES, Header, Kind

CPU = torch.device("cpu")
BLOCK_SHAPE = (2, 16, 8)  # [K/V, tokens per block, values]: 1 KiB of float32 per block
BLOCK_TOKENS = BLOCK_SHAPE[1]
BLOCK_BYTES = 2 * 16 * 8 * 4


class Pair:
    """One listener (decode side) and one sender (prefill side) on loopback."""

    def __init__(self, port: int, sender_cfg: P2pConfig, receiver_cfg: P2pConfig):
        self.pool = BufferPool(CPU, 1 << 26)
        self.staging = StagingArea(receiver_cfg.staging_bytes, receiver_cfg.lease_s, self.pool)
        self.recv_stats, self.send_stats = TransferStats(), TransferStats()
        self.listener = Listener("127.0.0.1", port, CPU, self.staging, self.pool, receiver_cfg, self.recv_stats)
        self.send_pool = BufferPool(CPU, 1 << 26)
        self.sender = PeerSender("127.0.0.1", port, "prefill-test", CPU, sender_cfg, self.send_stats, self.send_pool)
        self.cfg = sender_cfg

    def send_layerwise(self, tid: str, kv: list[torch.Tensor], total_tokens: int, step_tokens: int) -> None:
        """Queue ``kv`` (per layer ``[blocks, *BLOCK_SHAPE]``) the way the prefill worker does:
        per step and layer, with the worker's own chunking (whole blocks, split at the limit)."""
        peer = PeerAddress("127.0.0.1", self.cfg.port, "decode-test")
        block_ids = list(range(kv[0].shape[0]))
        for start in range(0, total_tokens, step_tokens):
            spec = SaveSpec(tid, peer, block_ids, start, min(start + step_tokens, total_tokens), total_tokens)
            for layer, layer_kv in enumerate(kv):
                for chunk in layer_chunks(
                    spec, layer, len(kv), layer_kv, spec.start, BLOCK_TOKENS, self.cfg.max_chunk_bytes, self.send_pool
                ):
                    self.sender.submit(chunk)

    def wait_staged(self, tid: str, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self.staging.get(tid)
            if entry is not None and (entry.complete or entry.failure):
                return entry
            time.sleep(0.005)
        raise AssertionError(f"{tid} was not staged within {timeout_s} s")

    def close(self) -> None:
        self.sender.close()
        self.listener.close()


@pytest.fixture
def pair(free_port):
    made: list[Pair] = []

    def make(sender_cfg: P2pConfig | None = None, receiver_cfg: P2pConfig | None = None) -> Pair:
        sender_cfg = sender_cfg or P2pConfig(port=free_port(), max_chunk_bytes=4 * BLOCK_BYTES)
        made.append(Pair(sender_cfg.port, sender_cfg, receiver_cfg or sender_cfg))
        return made[-1]

    yield make
    for p in made:
        p.close()


def staged_layer(entry, layer: int) -> torch.Tensor:
    """A staged layer as one ``[blocks, *block_shape]`` tensor, put together by the same copy the
    decode engine makes into its cache (here a cache whose block i is the request's block i)."""
    out = torch.zeros((entry.num_blocks, *entry.block_shape), dtype=entry.dtype)
    entry.copy_layer_into(layer, out, list(range(entry.num_blocks)), 0, entry.num_blocks)
    return out


def random_kv(layers: int, tokens: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-tokens // BLOCK_TOKENS)
    return [torch.randn((blocks, *BLOCK_SHAPE), generator=gen) for _ in range(layers)]


@pytest.mark.parametrize("tokens,step", [(1, 1), (100, 100), (1000, 256), (1000, 1000)])
def test_split_messages_land_byte_exact(pair, tokens, step):
    """Steps cut mid-block and layers split into 4-block messages (the prefill worker's
    chunking) reassemble exactly."""
    p = pair()
    kv = random_kv(3, tokens, seed=tokens + step)
    p.send_layerwise("t", kv, tokens, step)
    entry = p.wait_staged("t")
    assert entry.failure is None
    for layer in range(len(kv)):
        assert torch.equal(staged_layer(entry, layer), kv[layer])
    landing_bytes = HEADER_BYTES + p.cfg.max_chunk_bytes
    for piece in (piece for layer in entry.pieces for piece in layer):
        payload = piece.blocks.numel() * piece.blocks.element_size()
        kept = piece.blocks.storage_offset() * piece.blocks.element_size() == HEADER_BYTES  # still behind its header
        assert kept == (2 * payload >= landing_bytes), "big messages stay where they landed, small ones are copied"
    kv_bytes = sum(t.numel() * 4 for t in kv)
    assert p.recv_stats.snapshot()["received_bytes"] == kv_bytes
    (landed,) = [r for r in p.recv_stats.snapshot()["records"] if r["side"] == "landed"]
    assert landed["bytes"] == kv_bytes and 0 < landed["wire_s"] < 10


def test_many_transfers_in_flight_reuse_buffers(pair):
    p = pair()
    kvs = {f"t{i}": random_kv(2, 300 + 37 * i, seed=i) for i in range(12)}
    for tid, kv in kvs.items():
        p.send_layerwise(tid, kv, kv[0].shape[0] * BLOCK_TOKENS, 128)
    for tid, kv in kvs.items():
        entry = p.wait_staged(tid)
        assert all(torch.equal(staged_layer(entry, layer), kv[layer]) for layer in range(len(kv)))
        p.staging.release(tid)
    assert p.staging.used_bytes == 0
    assert p.pool.idle_bytes > 0, "released staging memory goes back to the pool for reuse"


def test_sender_with_bigger_chunks_is_refused_and_receiver_survives(pair, free_port):
    port = free_port()
    small = P2pConfig(port=port, max_chunk_bytes=2 * BLOCK_BYTES, connect_timeout_s=1.0, link_timeout_s=2.0)
    big = P2pConfig(port=port, max_chunk_bytes=8 * BLOCK_BYTES, connect_timeout_s=1.0, link_timeout_s=2.0)
    p = pair(sender_cfg=big, receiver_cfg=small)
    p.send_layerwise("t", random_kv(1, 64, seed=1), 64, 64)
    deadline = time.monotonic() + 15
    while p.send_stats.snapshot()["send_failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.send_stats.snapshot()["send_failures"] == 1
    assert p.recv_stats.snapshot()["handshake_failures"] >= 1
    assert p.staging.get("t") is None, "nothing of the refused sender was staged"
    # The listener still serves a well-configured peer.
    ok = P2pConfig(port=port, max_chunk_bytes=2 * BLOCK_BYTES)
    good = PeerSender("127.0.0.1", port, "prefill-ok", CPU, ok, TransferStats(), BufferPool(CPU, 1 << 20))
    try:
        p.sender, p.cfg, p.send_pool = good, ok, good._pool
        kv = random_kv(1, 64, seed=2)
        p.send_layerwise("ok", kv, 64, 64)
        assert torch.equal(staged_layer(p.wait_staged("ok"), 0), kv[0])
    finally:
        good.close()


def test_pinned_staging_is_not_recycled_until_unpinned():
    pool = BufferPool(CPU, 1 << 24)
    staging = StagingArea(1 << 24, 60.0, pool)
    header = Header(Kind.KV, tid="t", layer=0, num_layers=1, start_block=0, num_blocks=2, tokens_end=32,
                    total_tokens=32, block_shape=BLOCK_SHAPE, dtype=torch.float32)
    entry = staging.open(header, link=0, wait_s=0.0)
    buffer = pool.acquire(header.payload_bytes)
    blocks = buffer.view(torch.float32).view(header.payload_shape())
    assert staging.land(entry, header, blocks, buffer) is Landed.COMPLETE
    with staging.reading("t") as staged:
        assert staged is entry
        staging.release("t")  # e.g. the request was aborted while its KV is being copied in
        assert pool.idle_bytes == 0, "a buffer still being read must not be handed out again"
    assert pool.idle_bytes == size_class(header.payload_bytes)


def test_size_classes_waste_at_most_a_quarter():
    for n in (1, 70_000, 1 << 20, (4 << 20) + 384, 100_000_007):
        c = size_class(n)
        assert c >= n and c <= max(n, 64 << 10) * 1.25


def test_buffers_handed_out_under_inference_mode_are_reused():
    """The prefill side gathers into message buffers inside vLLM's forward pass, where
    ``torch.inference_mode`` leaves views without ``_base``: the pool must still take the whole
    buffer back in its own size class, or every message faults in fresh memory."""
    pool = BufferPool(CPU, 1 << 24)
    nbytes = (1 << 20) + 384
    with torch.inference_mode():
        first = pool.acquire(nbytes)
        address = first.data_ptr()
        pool.release(first)
        assert pool.idle_bytes == size_class(nbytes)
        again = pool.acquire(nbytes)
    assert again.data_ptr() == address and again.numel() == nbytes
    assert pool.idle_bytes == 0
