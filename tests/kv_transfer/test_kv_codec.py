"""KV encoded for slow links (codec.py), when it is chosen (codec_policy.py), and encoded
messages across a real gloo link (the engines' side is in test_p2p_disagg.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duet.kv_transfer.p2p import codec
from duet.kv_transfer.p2p.codec_policy import PROBE_EVERY, CodecPolicy, LinkRate, is_local_address
from duet.kv_transfer.p2p.config import P2pConfig
from duet.kv_transfer.p2p.metadata import SaveSpec
from duet.kv_transfer.p2p.params import PeerAddress
from duet.kv_transfer.p2p.sender import Chunk, layer_chunks

import test_p2p_link
from test_p2p_link import BLOCK_BYTES, BLOCK_TOKENS, random_kv, staged_layer

pair = test_p2p_link.pair  # the fixture: one listener and one sender on loopback


@pytest.fixture(scope="module")
def model_kv(tiny_model) -> torch.Tensor:
    """The built-in model's real KV for a 1,000-token prompt, as ``[values, head_dim]`` rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[3 + (i * 104729) % 697 for i in range(1000)]])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return torch.cat([t.flatten() for layer in cache.layers for t in (layer.keys, layer.values)])


def test_the_models_kv_is_four_times_smaller_within_one_percent(model_kv):
    head_dim = 32
    frame = codec.encode(model_kv, head_dim)
    decoded = torch.empty_like(model_kv)
    codec.decode(torch.frombuffer(bytearray(frame), dtype=torch.uint8), head_dim, decoded)
    ratio = model_kv.numel() * 4 / len(frame)
    error = codec.relative_rmse(model_kv, decoded)
    print(f"\nbuilt-in model KV: {ratio:.2f}x smaller, relative RMSE {error:.3%}")
    assert ratio > 3.8 and error < 0.01


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_kv_halves_and_comes_back_in_its_dtype(dtype):
    kv = torch.randn(64, 2, 16, 32).to(dtype)
    frame = codec.encode(kv, 32)
    out = torch.empty_like(kv)
    codec.decode(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 32, out)
    assert len(frame) < kv.numel() * 2 / 1.8 and codec.relative_rmse(kv, out) < 0.01


def test_extreme_values_stay_finite():
    kv = torch.tensor([[0.0] * 31 + [1e-30], [1e6] * 16 + [-1e6] * 16, [float(i) for i in range(32)]])
    out = torch.empty_like(kv)
    codec.decode(torch.frombuffer(bytearray(codec.encode(kv, 32)), dtype=torch.uint8), 32, out)
    half_step = kv.abs().amax(dim=1, keepdim=True) / 127 / 2  # each value within half its group's step
    assert torch.isfinite(out).all() and ((out - kv).abs() <= half_step * 1.01 + 1e-4).all()


def test_a_damaged_frame_is_refused():
    out = torch.empty(4, 32)
    frame = bytearray(codec.encode(torch.randn(4, 32), 32))
    with pytest.raises(ValueError):
        codec.decode(torch.frombuffer(frame[:-7], dtype=torch.uint8), 32, out)
    other = codec.encode(torch.randn(8, 32), 32)
    with pytest.raises(ValueError, match="announced"):
        codec.decode(torch.frombuffer(bytearray(other), dtype=torch.uint8), 32, out)


def test_groups_are_a_heads_values_or_nothing():
    assert codec.group_size((16, 4, 32), torch.float32) == 32
    assert codec.group_size((16, 4, 32), torch.uint8) is None  # fp8/uint8 caches go raw
    assert codec.group_size((16, 4, 4), torch.float32) is None
    assert codec.group_size((2, 2, 4096), torch.float16) is None


def test_link_rate_is_read_once_the_socket_buffer_is_full():
    rate = LinkRate(buffer_bytes=4 << 20, sample_bytes=4 << 20)
    rate.busy()
    t = 0.0
    for _ in range(2):  # the buffer fills at memory speed
        t += 0.001
        rate.completed(2 << 20, t)
    for _ in range(8):  # then each 2 MiB waits for the wire: 12.5 MB/s (100 Mbit/s)
        t += (2 << 20) / 12.5e6
        rate.completed(2 << 20, t)
    rate.idle()
    assert rate.bytes_per_s == pytest.approx(12.5e6, rel=0.01)
    rate.busy()  # a burst that fits the buffer says nothing about the link
    rate.completed(3 << 20, t + 0.001)
    rate.idle()
    assert rate.bytes_per_s == pytest.approx(12.5e6, rel=0.01)


@pytest.mark.parametrize(
    "mode,host,rate,encodes",
    [
        ("auto", "10.255.0.7", None, False),  # nothing measured yet
        ("auto", "10.255.0.7", 12.5e6, True),  # 100 Mbit/s
        ("auto", "10.255.0.7", 1.25e9, False),  # 10 Gbit/s
        ("auto", "127.0.0.1", 12.5e6, False),  # within this host
        ("on", "127.0.0.1", None, True),
        ("off", "10.255.0.7", 12.5e6, False),
    ],
)
def test_the_policy_encodes_only_where_the_link_is_slow(mode, host, rate, encodes):
    policy = CodecPolicy(mode, host)
    policy.link.bytes_per_s = rate
    assert policy.encode_transfer(4) is encodes


def test_while_encoding_a_transfer_now_and_then_goes_raw_to_measure_the_link():
    policy = CodecPolicy("auto", "10.255.0.7")
    policy.link.bytes_per_s = 12.5e6
    choices = [policy.encode_transfer(4) for _ in range(2 * PROBE_EVERY)]
    assert choices.count(False) == 2 and choices[PROBE_EVERY - 1] is False


def test_a_slow_coder_is_not_worth_it():
    policy = CodecPolicy("auto", "10.255.0.7")
    policy.link.bytes_per_s = 12.5e6
    for _ in range(4):  # 4 MiB/s: slower than the wire
        policy.encoded(4, raw_bytes=4 << 20, wire_bytes=1 << 20, seconds=1.0)
    assert not policy.encode_transfer(4)


def test_the_codecs_speed_is_measured_so_a_half_gigabit_link_is_worth_it():
    """The codec's speed is measured when a sender starts (about 1 GB/s on one core here), so
    a 0.5 Gbit/s link is worth encoding for and a 10 Gbit/s one is not."""
    policy = CodecPolicy("auto", "10.255.0.7")
    policy.link.bytes_per_s = 62.5e6
    assert policy.encode_transfer(4)
    policy.link.bytes_per_s = 1.25e9
    assert not policy.encode_transfer(4)


def test_local_addresses():
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.1") and not is_local_address("no-such-host.invalid")


def test_encoded_chunks_cross_the_link_and_land_close(pair, free_port):
    p = pair(P2pConfig(port=free_port(), max_chunk_bytes=4 * BLOCK_BYTES, codec="on"))
    kv = random_kv(3, 500, seed=9)
    p.send_layerwise("t", kv, 500, 128)
    entry = p.wait_staged("t")
    assert entry.failure is None
    for layer in range(len(kv)):
        assert codec.relative_rmse(kv[layer], staged_layer(entry, layer)) < 0.01
    sent = p.send_stats.snapshot()
    assert sent["encoded_transfers"] == 1 and 3 * sent["sent_wire_bytes"] < sent["sent_bytes"]


def test_a_damaged_encoded_message_fails_its_transfer_not_the_link(pair):
    p = pair()
    peer = PeerAddress("127.0.0.1", p.cfg.port, "decode-test")
    kv = random_kv(1, BLOCK_TOKENS, seed=1)
    spec = SaveSpec("bad", peer, [0], 0, BLOCK_TOKENS, BLOCK_TOKENS)
    (chunk,) = layer_chunks(spec, 0, 1, kv[0], 0, BLOCK_TOKENS, p.cfg.max_chunk_bytes, p.send_pool)
    header = dataclasses.replace(chunk.header, encoded_bytes=64)  # 64 bytes that are no zstd frame
    header.write_into(chunk.message)
    p.sender.submit(Chunk(header, chunk.message[: header.message_bytes], None, True, codec="off"))
    assert "does not decode" in (p.wait_staged("bad").failure or "")
    p.send_layerwise("good", kv, BLOCK_TOKENS, BLOCK_TOKENS)  # the link still carries the next
    assert torch.equal(staged_layer(p.wait_staged("good"), 0), kv[0])
