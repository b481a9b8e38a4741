"""The encoder cache's folder as the router keeps it (E+P+D, kv_transfer/encoder_cache.py): the
least recently used images removed past the capacity, never one a request holds or another
front door used a moment ago; and which engines write it and which read it. The encode pool on
real engines is tested in test_vision_language.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import pytest

from duet.config import ConfigError, load_config, parse_config
from duet.kv_transfer.encoder_cache import (
    CLAIM_STALE_S, SHARED_IN_USE_S, EncoderCacheFolder, engine_ec_config, entry_file, with_encoder_cache_folder,
)
from duet.worker_runtime.images import image_digest


def _write(folder: str, identifier: str, size: int) -> None:
    """An encoder output as vLLM's connector leaves it: {folder}/{identifier}/encoder_cache.safetensors."""
    os.makedirs(os.path.join(folder, identifier), exist_ok=True)
    with open(os.path.join(folder, identifier, "encoder_cache.safetensors"), "wb") as file:
        file.write(b"\0" * size)


def test_the_least_recently_used_images_go_past_the_capacity(tmp_path):
    cache = EncoderCacheFolder(str(tmp_path), capacity_bytes=300)
    for name in ("a", "b", "c"):
        _write(str(tmp_path), name, 100)
    cache.added(["a", "b", "c"])
    assert (len(cache), cache.bytes, cache.evictions) == (3, 300, 0)
    assert cache.holds("a")  # used again: now the most recent
    _write(str(tmp_path), "d", 100)
    cache.added(["d"])
    assert not cache.holds("b") and not os.path.exists(tmp_path / "b")
    assert all(cache.holds(name) for name in ("a", "c", "d")) and cache.evictions == 1
    assert not cache.holds("never-written")


def test_an_image_a_request_holds_is_kept(tmp_path):
    cache = EncoderCacheFolder(str(tmp_path), capacity_bytes=100)
    _write(str(tmp_path), "a", 100)
    cache.added(["a"])
    with cache.hold(["a"]):
        _write(str(tmp_path), "b", 100)
        cache.added(["b"])  # over the capacity: "a" is older, but being read, so "b" goes
        assert cache.holds("a") and not cache.holds("b")
    _write(str(tmp_path), "c", 100)
    cache.added(["c"])
    assert not cache.holds("a") and cache.holds("c")


def test_another_front_doors_recent_files_are_kept_and_found(tmp_path):
    """Front doors apart share the folder: each finds what the others wrote, and leaves alone
    what any of them used within in_use_s."""
    first = EncoderCacheFolder(str(tmp_path), capacity_bytes=100, in_use_s=60)
    second = EncoderCacheFolder(str(tmp_path), capacity_bytes=100, in_use_s=60)
    _write(str(tmp_path), "a", 100)
    first.added(["a"])
    assert second.holds("a")
    _write(str(tmp_path), "b", 100)
    first.added(["b"])
    assert first.holds("a"), "used a moment ago by the other front door"
    old = time.time() - 120
    os.utime(tmp_path / "a" / "encoder_cache.safetensors", (old, old))
    _write(str(tmp_path), "c", 100)
    first.added(["c"])
    assert not second.holds("a")


def test_a_new_index_finds_what_the_folder_holds_oldest_first(tmp_path):
    """A replacement front door, or a control plane that took the deployment over, indexes the
    folder as it finds it."""
    for age, name in ((300, "old"), (100, "newer")):
        _write(str(tmp_path), name, 50)
        stamp = time.time() - age
        os.utime(tmp_path / name / "encoder_cache.safetensors", (stamp, stamp))
    os.makedirs(tmp_path / "empty")  # a folder vLLM's connector made for an image it never wrote
    cache = EncoderCacheFolder(str(tmp_path), capacity_bytes=100)
    assert (len(cache), cache.bytes) == (2, 100)
    _write(str(tmp_path), "new", 50)
    cache.added(["new"])
    assert not os.path.exists(tmp_path / "old") and cache.holds("newer")


def test_encode_engines_write_the_cache_and_prefill_engines_read_it():
    config = with_encoder_cache_folder(load_config("configs/vision.yaml"), "key")
    assert config.encode.replicas == 1
    folder = config.encode.cache_path
    assert folder == with_encoder_cache_folder(load_config("configs/vision.yaml"), "key").encode.cache_path
    assert engine_ec_config("encode", config, on_cpu=True) == {
        "ec_connector": "DuetFolderECConnector", "ec_connector_module_path": "duet.kv_transfer.ec_connector",
        "ec_role": "ec_producer", "ec_buffer_device": "cpu", "ec_connector_extra_config": {"shared_storage_path": folder},
    }
    assert engine_ec_config("prefill", config, on_cpu=True)["ec_role"] == "ec_consumer"
    assert engine_ec_config("decode", config, on_cpu=True) is None  # it encodes what it computes itself
    without = parse_config({**load_config("configs/vision.yaml").model_dump(), "encode": {"replicas": 0}})
    assert with_encoder_cache_folder(without, "key") == without
    assert engine_ec_config("prefill", without, on_cpu=True) is None
    named = parse_config({**load_config("configs/vision.yaml").model_dump(), "encode": {"replicas": 1, "cache_path": "/shared/ec"}})
    assert with_encoder_cache_folder(named, "key").encode.cache_path == "/shared/ec"


@pytest.mark.parametrize(
    "data, says",
    [
        ({"mode": "colocated", "encode": {"replicas": 1}}, "colocated"),
        ({"encode": {"replicas": 1}}, "takes no images"),  # the built-in text model
        ({"model": {"name": "vl", "path": "builtin-vl"}, "encode": {"replicas": 1, "engine": "simulated"}}, "SIMULATED"),
        ({"model": {"name": "vl", "path": "builtin-vl"}, "encode": {"replicas": 1, "tensor_parallel": 2}}, "one device"),
        ({"model": {"name": "vl", "path": "builtin-vl"}, "encode": {"replicas": 1}, "ray": {"address": "auto"}}, "every node mounts"),
        (
            {"model": {"name": "vl", "path": "builtin-vl"}, "encode": {"replicas": 1, "nodes": [1]}, "prefill": {"nodes": [0]}},
            "every node mounts",
        ),
    ],
)
def test_an_encode_pool_where_it_cannot_serve_is_refused(data, says):
    with pytest.raises(ConfigError, match="encode.replicas|encode.engine|encode.tensor_parallel|encode.cache_path") as raised:
        parse_config(data)
    assert says in str(raised.value)


def test_a_plan_on_one_node_keeps_the_default_cache_folder():
    """`duet serve --plan` names each worker's node; all on node 0 is one host's folder."""
    config = parse_config({"model": {"name": "vl", "path": "builtin-vl"}, "encode": {"replicas": 1, "nodes": [0]}, "prefill": {"nodes": [0]}})
    assert config.encode.cache_path is None


def _connector(folder: str, producer: bool) -> object:
    """duet's connector over ``folder`` with only what its file handling reads (the rest of it
    is vLLM's, exercised by the engines in test_vision_language.py)."""
    from duet.kv_transfer.ec_connector import DuetFolderECConnector

    connector = object.__new__(DuetFolderECConnector)
    connector._storage_path, connector._is_producer, connector._is_consumer = folder, producer, not producer
    return connector


def test_an_encoder_output_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A writer that dies mid-write leaves no file a reader would take for an output, and asking
    about an image creates nothing."""
    import safetensors.torch
    import torch

    writer, reader = _connector(str(tmp_path), True), _connector(str(tmp_path), False)
    assert not reader.has_cache_item("abc") and not os.listdir(tmp_path)
    output = {"abc": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    real_save = safetensors.torch.save_file

    def dies_mid_write(tensors: dict, path: str) -> None:
        with open(path, "wb") as file:
            file.write(b"half a file")
        raise OSError("killed")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_mid_write)
    with pytest.raises(OSError):
        writer.save_caches(output, "abc")
    assert not reader.has_cache_item("abc") and os.listdir(tmp_path / "abc") == []
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    writer.save_caches(output, "abc")
    assert reader.has_cache_item("abc")
    loaded = safetensors.torch.load_file(str(tmp_path / "abc" / "encoder_cache.safetensors"))["ec_cache"]
    assert torch.equal(loaded, output["abc"])


def test_front_doors_sharing_the_folder_claim_a_new_image_once(tmp_path):
    first, second = (EncoderCacheFolder(str(tmp_path), 1 << 20, in_use_s=SHARED_IN_USE_S) for _ in range(2))
    assert first.claim("img") and not second.claim("img") and second.claimed_elsewhere("img")
    first.release(["img"])
    assert not second.claimed_elsewhere("img") and second.claim("img")
    # A claim whose front door died mid-encode is taken over once stale.
    claim = tmp_path / ".img.encoding"
    os.utime(claim, (time.time() - CLAIM_STALE_S - 1,) * 2)
    assert first.claim("img") and not second.claim("img")
    # The claim is no entry: a new index of the folder does not take it for an image.
    assert len(EncoderCacheFolder(str(tmp_path), 1 << 20)) == 0
    # A front door alone in its folder claims nothing on disk.
    alone = EncoderCacheFolder(str(tmp_path / "alone"), 1 << 20)
    assert alone.claim("img") and alone.claim("img") and not os.listdir(tmp_path / "alone")


class _EncodeWorkerEngine:
    """Stands in for an encode worker's engine (the thing under test is the front doors' step):
    writes each image's output file, as the encode engine's connector does, after a delay."""

    def __init__(self, folder: str) -> None:
        self.folder, self.calls = folder, 0

    async def encode(self, request_id: str, images: tuple[bytes, ...]) -> None:
        self.calls += 1
        await asyncio.sleep(0.2)
        for data in images:
            path = entry_file(self.folder, image_digest(data))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                out.write(b"x" * 64)


def test_two_front_doors_meeting_a_new_image_at_once_encode_it_once(tmp_path):
    from duet.router.encoding import EncodeStep
    from duet.router.pools import PoolMember, WorkerPool

    engine = _EncodeWorkerEngine(str(tmp_path))
    doors = []
    for _ in range(2):
        pool = WorkerPool("encode")
        pool.members.append(PoolMember("encode-0", actor=None, engine=engine))
        doors.append(EncodeStep(pool, EncoderCacheFolder(str(tmp_path), 1 << 20, in_use_s=SHARED_IN_USE_S)))

    async def request(step: EncodeStep, request_id: str) -> None:
        async with step.encoded(request_id, (b"the same picture",)):
            pass

    async def both() -> None:
        await asyncio.gather(request(doors[0], "a"), request(doors[1], "b"))

    asyncio.run(both())
    assert engine.calls == 1
    assert sorted(sum((step.counts for step in doors), Counter()).items()) == [("cache_hit", 1), ("encoded", 1)]
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".encoding")]
