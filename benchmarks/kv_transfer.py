"""``duet bench transfer``: KV-transfer bandwidth against its ceilings, and the TTFT it adds.

For prompts of 1k, 8k and 32k tokens, in one run:

- **Ceilings** for the same byte count: a raw NIXL agent-to-agent READ between two processes
  (DRAM, the progress thread off, as duet configures NIXL), a raw gloo send/recv between two
  processes (what the nccl transport runs on a CPU), and a single-threaded memcpy. Each
  transport's ratio is to its raw transport measured beside it (just before and just after that
  size's requests, with its deployment up), since on a shared machine a ceiling taken minutes
  earlier can be off by half; the ceilings taken at the start of the run are kept too.
- **The nccl transport's link alone**: duet's own sender and listener moving the same KV between
  two bare processes, to tell what the protocol costs from what sharing the machine with a
  deployment costs.
- **Achieved bandwidth** of each transport from its own per-transfer metrics, read from the
  workers of a real deployment: NIXL's ``vllm:nixl_xfer_time_seconds`` (post to completion, on the
  decode side) and the p2p connector's ``vllm:p2p_recv_wire_seconds`` (decode side: the time the
  link carried each message, from its send, or the previous message's arrival if later, to its
  arrival), each as a ratio to its raw transport and to memcpy.
- **What disaggregation adds to TTFT.** duet streams the first token from the prefill worker,
  so the client's TTFT hides the hand-off; the cost shows in the time to the *second* token,
  the first one the decode side produces. ``added = TT2T(disaggregated) - TT2T(colocated)``,
  medians over prompts of the same length, where a colocated engine's TT2T is its prefill plus
  one decode step: the prefill timed on the same prefill worker alone (a twin prompt of the
  same length, one token, no transfer, right after each disaggregated request so both see the
  same machine load) and the step taken from the disaggregated stream's later tokens. Its
  robust part is the hand-off, ``TT2T - TTFT - step`` (prefill-end to decode-ready, free of the
  prefill-time noise both TTFTs carry). Measured
  for nixl (pull after prefill), nccl with layer-wise streaming, and nccl sending after
  prefill (``kv_transfer.layerwise: false``).
- **Hidden fraction** of the layer-wise nccl transfer: ``1 - exposed / wire``, where ``exposed``
  is the time from the end of the prefill forward to the last chunk sent (what streaming did not
  hide) and ``wire`` the link's time carrying the transfer.

Results go to JSON (default ``benchmarks/results/kv_transfer.json``) and a table to stdout.
Engines run one deployment at a time (at most two engines alive), since a 2-core machine is
shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from duet.kv_transfer.metrics import metric_total
from duet.kv_transfer.ports import free_port

EXIT_BAD_INPUT = 2
SIZES = {"1k": 1024, "8k": 8192, "32k": 32768}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kv_transfer.json"
QUICK_OUT = DEFAULT_OUT.with_name("kv_transfer_quick.json")  # a smoke run never replaces the real one
# Context of the long-context tiny model: 32k prompt tokens plus room for the generated ones.
LONG_CONTEXT = 34816
BUILTIN_CONTEXT = 4096
BLOCK_TOKENS = 128  # vLLM's KV block size on CPU: transports move whole blocks
MAX_TOKENS = 4  # the second token is the decode side's first; later ones flush its stats
MEASURED_TOKENS = 32768  # prompt tokens per size and variant at most (see reps_for)
PROMPT_TOKEN_RANGE = (3, 700)  # above the tiny model's special tokens
GOAL_RATIO = 0.70
GOAL_HIDDEN = 0.50
_GIB = 2**30


# ---- sizes and bytes ---------------------------------------------------------------------


def parse_sizes(text: str) -> dict[str, int]:
    """``1k,8k,32k`` (or plain token counts) into ``{label: tokens}``; ValueError on bad input."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        digits = item.removesuffix("k")
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(f"--sizes {text!r}: {item!r} is not a token count like 8k or 8192")
        tokens = int(digits) * (1024 if item.endswith("k") else 1)
        if tokens + MAX_TOKENS > LONG_CONTEXT:
            raise ValueError(f"--sizes {text!r}: {item!r} exceeds the {LONG_CONTEXT}-token context")
        sizes[item] = tokens
    if not sizes:
        raise ValueError("--sizes is empty")
    return sizes


@dataclass(frozen=True)
class KVGeometry:
    """How big a prompt's KV is, from the model's config (fp32, as duet serves the tiny model)."""

    layers: int
    bytes_per_token_per_layer: int  # K and V together

    @classmethod
    def of(cls, model_dir: Path) -> KVGeometry:
        cfg = json.loads((model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], 2 * cfg["num_key_value_heads"] * head_dim * 4)

    def prompt_bytes(self, tokens: int) -> int:
        """Bytes a transport moves for a prompt: its whole blocks, every layer."""
        return -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS * self.layers * self.bytes_per_token_per_layer


def gib_per_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / _GIB if seconds > 0 else 0.0


# ---- ceilings: raw transports and memcpy ---------------------------------------------------


# Ceilings are the best of their repetitions: other work on a shared machine only ever slows a
# copy down, so the fastest run is the closest to what the hardware allows.


def memcpy_seconds(nbytes: int, reps: int) -> float:
    """Best time of one thread copying ``nbytes`` (the transports copy with one thread too)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)  # fault the pages in before timing
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)


def _two_processes(first: Callable[..., None], second: Callable[..., None], *args: Any) -> float:
    """Run ``first`` and ``second`` in two fresh processes joined by a pair of queues; returns
    what ``second`` reports. Spawned, so neither inherits this process's threads or Ray."""
    ctx = mp.get_context("spawn")
    to_second, to_first, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=first, args=(to_second, to_first, *args), daemon=True),
        ctx.Process(target=second, args=(to_first, to_second, *args, result), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        return result.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _gloo_group(rank: int, port: int) -> Any:
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = timedelta(seconds=60)
    store = TCPStore("127.0.0.1", port, is_master=rank == 1, wait_for_workers=False, timeout=timeout)
    return ProcessGroupGloo(store, rank, 2, timeout)


def _gloo_sender(outbox: Any, inbox: Any, nbytes: int, reps: int, port: int) -> None:
    import torch

    group = _gloo_group(0, port)
    buf = torch.ones(nbytes // 4)
    for _ in range(reps + 1):
        group.send([buf], 1, 0).wait()


def _gloo_receiver(outbox: Any, inbox: Any, nbytes: int, reps: int, port: int, result: Any) -> None:
    import torch

    group = _gloo_group(1, port)
    buf = torch.empty(nbytes // 4)
    times = []
    for _ in range(reps + 1):  # the first one also sets the connection up: not counted
        start = time.perf_counter()
        group.recv([buf], 0, 0).wait()
        times.append(time.perf_counter() - start)
    result.put(min(times[1:]) if bool(buf[-1] == 1.0) else float("nan"))


def raw_gloo_seconds(nbytes: int, reps: int) -> float:
    """Best time of a plain gloo send/recv of ``nbytes`` between two processes (loopback)."""
    return _two_processes(_gloo_sender, _gloo_receiver, nbytes, reps, free_port("127.0.0.1"))


def _nixl_agent(name: str, nbytes: int, descriptors: int, fill: float) -> tuple[Any, Any, Any]:
    """An agent with ``nbytes`` of registered DRAM, and that memory as equal descriptors."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False))
    buf = torch.full((nbytes // 4,), fill)
    agent.register_memory(buf)
    base, size = buf.data_ptr(), nbytes // descriptors
    descs = [(base + i * size, size, 0) for i in range(descriptors)]
    return agent, buf, agent.get_xfer_descs(descs, "DRAM")


def _nixl_target(outbox: Any, inbox: Any, nbytes: int, reps: int, descriptors: int) -> None:
    """Holds the source memory (the prefill engine's role) and progresses until told to stop."""
    agent, _buf, descs = _nixl_agent("duet-bench-target", nbytes, descriptors, 1.0)
    outbox.put((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
    while inbox.empty():
        agent.get_new_notifs()  # without a progress thread, the target advances UCX here
        time.sleep(0.001)


def _nixl_initiator(outbox: Any, inbox: Any, nbytes: int, reps: int, descriptors: int, result: Any) -> None:
    """Reads the target's memory (the decode engine's role); reports the best post-to-done."""
    agent, buf, local = _nixl_agent("duet-bench-initiator", nbytes, descriptors, 0.0)
    metadata, serialized = inbox.get(timeout=60)
    peer = agent.add_remote_agent(metadata)
    remote = agent.deserialize_descs(serialized)
    times = []
    for _ in range(reps + 1):  # the first one also sets the connection up: not counted
        handle = agent.initialize_xfer("READ", local, remote, peer)
        start = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            times[-1] = float("nan")
    outbox.put("done")
    result.put(min(times[1:]) if bool(buf[-1] == 1.0) else float("nan"))


def raw_nixl_seconds(nbytes: int, reps: int, descriptors: int) -> float:
    """Best time of a NIXL READ of ``nbytes`` in ``descriptors`` pieces between two agents in
    two processes. vLLM merges a layer's consecutive blocks into one descriptor, so a prompt's
    KV is one descriptor per layer (``vllm:nixl_num_descriptors`` confirms it per run)."""
    return _two_processes(_nixl_target, _nixl_initiator, nbytes, reps, descriptors)


def _link_receiver(outbox: Any, inbox: Any, geometry: KVGeometry, tokens: int, reps: int, port: int, result: Any) -> None:
    """The decode side of the p2p link alone: a listener staging transfers, released as they
    complete; reports the best transfer's wire time (what the deployment's metric sums)."""
    import torch

    from duet.kv_transfer.p2p.buffers import BufferPool
    from duet.kv_transfer.p2p.config import P2pConfig
    from duet.kv_transfer.p2p.receiver import Listener
    from duet.kv_transfer.p2p.staging import StagingArea
    from duet.kv_transfer.p2p.stats import TransferStats

    cpu, cfg, stats = torch.device("cpu"), P2pConfig(port=port), TransferStats()
    pool = BufferPool(cpu, cfg.idle_buffer_bytes)
    staging = StagingArea(cfg.staging_bytes, cfg.lease_s, pool)
    listener = Listener("127.0.0.1", port, cpu, staging, pool, cfg, stats)
    outbox.put("listening")
    try:
        for rep in range(reps + 1):
            deadline = time.monotonic() + 60
            while (entry := staging.get(f"link-{rep}")) is None or not (entry.complete or entry.failure):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer {rep} did not land")
                time.sleep(0.001)
            staging.release(f"link-{rep}")
        snapshot = stats.snapshot()
        wires = [r["wire_s"] for r in snapshot["records"] if r["side"] == "landed"]
        complete = len(wires) == reps + 1 and snapshot["received_bytes"] == (reps + 1) * geometry.prompt_bytes(tokens)
        result.put(min(wires[1:]) if complete else float("nan"))  # the first one also connects
    finally:
        listener.close()


def _link_sender(outbox: Any, inbox: Any, geometry: KVGeometry, tokens: int, reps: int, port: int) -> None:
    """The prefill side of the p2p link alone: sends a prompt's KV, every layer at once in the
    deployment's messages (the send-after-prefill pattern), from a paged cache like vLLM's."""
    import torch

    from duet.kv_transfer.p2p.buffers import BufferPool
    from duet.kv_transfer.p2p.config import P2pConfig
    from duet.kv_transfer.p2p.metadata import SaveSpec
    from duet.kv_transfer.p2p.params import PeerAddress
    from duet.kv_transfer.p2p.sender import PeerSender, layer_chunks
    from duet.kv_transfer.p2p.stats import TransferStats

    cpu, cfg = torch.device("cpu"), P2pConfig(port=port)
    pool = BufferPool(cpu, cfg.idle_buffer_bytes)
    blocks = -(-tokens // BLOCK_TOKENS)
    block_shape = (1, BLOCK_TOKENS, geometry.bytes_per_token_per_layer // 4)  # [.., tokens, ..] like vLLM's
    cache = [torch.randn(blocks, *block_shape) for _ in range(geometry.layers)]
    inbox.get(timeout=60)  # the listener is up
    sender = PeerSender("127.0.0.1", port, "bench-link", cpu, cfg, TransferStats(), pool)
    try:
        for rep in range(reps + 1):
            spec = SaveSpec(f"link-{rep}", PeerAddress("127.0.0.1", port), list(range(blocks)), 0, tokens, tokens)
            with torch.inference_mode():  # as in vLLM's forward pass
                for layer in range(geometry.layers):
                    for chunk in layer_chunks(
                        spec, layer, geometry.layers, cache[layer], 0, BLOCK_TOKENS, cfg.max_chunk_bytes, pool
                    ):
                        sender.submit(chunk)
            time.sleep(0.2)  # one transfer at a time, as the deployment's requests come
    finally:
        sender.close()


def p2p_link_seconds(geometry: KVGeometry, tokens: int, reps: int) -> float:
    """Best wire time of the nccl transport's own link (duet's sender and listener, gloo)
    moving a prompt's KV between two bare processes: the transport without the deployment."""
    return _two_processes(_link_sender, _link_receiver, geometry, tokens, reps, free_port("127.0.0.1"))


@dataclass(frozen=True)
class Ceilings:
    """Bandwidth (GiB/s) of the raw transports and of memcpy for one byte count."""

    nbytes: int
    memcpy: float
    gloo: float
    nixl: float
    p2p_link: float  # not a ceiling: the nccl transport's link between two bare processes


def raw_transport_seconds(raw: str, geometry: KVGeometry, tokens: int, reps: int) -> float:
    """Best time of the raw transport ``raw`` (``gloo`` or ``nixl``) moving a prompt's KV."""
    nbytes = geometry.prompt_bytes(tokens)
    if raw == "nixl":
        return raw_nixl_seconds(nbytes, reps, geometry.layers)
    return raw_gloo_seconds(nbytes, reps)


def measure_ceilings(geometry: KVGeometry, tokens: int, reps: int) -> Ceilings:
    nbytes = geometry.prompt_bytes(tokens)
    return Ceilings(
        nbytes,
        memcpy=gib_per_s(nbytes, memcpy_seconds(nbytes, reps)),
        gloo=gib_per_s(nbytes, raw_transport_seconds("gloo", geometry, tokens, reps)),
        nixl=gib_per_s(nbytes, raw_transport_seconds("nixl", geometry, tokens, reps)),
        p2p_link=gib_per_s(nbytes, p2p_link_seconds(geometry, tokens, reps)),
    )


# ---- the serving path: variants, requests, metrics ---------------------------------------


@dataclass(frozen=True)
class Variant:
    """One way of moving the KV, as a deployment config sets it."""

    name: str
    transport: str
    layerwise: bool = True
    raw: str = "gloo"  # which ceiling is this transport's own


VARIANTS = (
    Variant("nixl", "nixl", raw="nixl"),
    Variant("nccl layer-wise", "nccl", layerwise=True),
    Variant("nccl after prefill", "nccl", layerwise=False),
)


@dataclass(frozen=True)
class Timing:
    """One disaggregated request: seconds from sending it to each of its tokens."""

    token_s: tuple[float, ...]

    @property
    def first_s(self) -> float:
        return self.token_s[0]

    @property
    def second_s(self) -> float:
        return self.token_s[1]

    @property
    def step_s(self) -> float:
        """One decode step: the mean gap between the tokens after the second (whole over the
        gaps, so tokens an engine sends together, ``output_interval_ms``, still average out:
        the last token is sent as soon as it exists)."""
        return (self.token_s[-1] - self.token_s[1]) / (len(self.token_s) - 2)


@dataclass
class TransferMetrics:
    """Sums over a size's measured requests of the transport's per-transfer metrics."""

    transfers: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0  # the transport's own transfer time (NIXL: post to done; p2p: wire)
    exposed_s: float = 0.0  # p2p: forward end to last chunk sent
    descriptors: float = 0.0  # NIXL: descriptors per transfer, summed

    @property
    def gib_per_s(self) -> float:
        return gib_per_s(self.bytes, self.seconds)


def _prompts(tokens: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(tokens)] for _ in range(count)]


def transfer_delta(transport: str, before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> TransferMetrics:
    """The transport's metrics accumulated between two reads of both workers' metrics."""

    def delta(role: str, name: str) -> float:
        return metric_total(after[role], name) - metric_total(before[role], name)

    if transport == "nixl":  # the decode side reads, and records the transfers
        return TransferMetrics(
            transfers=delta("decode", "vllm:nixl_xfer_time_seconds_count"),
            bytes=delta("decode", "vllm:nixl_bytes_transferred_sum"),
            seconds=delta("decode", "vllm:nixl_xfer_time_seconds_sum"),
            descriptors=delta("decode", "vllm:nixl_num_descriptors_sum"),
        )
    return TransferMetrics(  # counted once both sides have recorded the transfer
        transfers=min(
            delta("prefill", "vllm:p2p_send_exposed_seconds_count"),
            delta("decode", "vllm:p2p_recv_wire_seconds_count"),
        ),
        bytes=delta("prefill", "vllm:p2p_bytes_transferred_sum{direction=send}"),
        seconds=delta("decode", "vllm:p2p_recv_wire_seconds_sum"),
        exposed_s=delta("prefill", "vllm:p2p_send_exposed_seconds_sum"),
    )


async def _timed_request(stub: Any, prompt: list[int]) -> Timing:
    """Send one greedy request and note when the first and the second token arrive."""
    from duet.router.client import build_request

    request = build_request(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    stamps: list[float] = []
    async for message in stub.Generate(request, timeout=600):
        stamps.extend([time.perf_counter() - start] * len(message.token_ids))
    if len(stamps) != MAX_TOKENS:
        raise RuntimeError(f"got {len(stamps)} of {MAX_TOKENS} tokens")
    return Timing(tuple(stamps))


async def _prefill_alone_s(deployment: Any, prompt: list[int], request_id: str) -> float:
    """A colocated engine's time to first token: the prefill worker's engine running the
    prompt for one token, no transfer (timed in the router's process: no gRPC)."""
    from duet.worker_runtime.worker_api import SamplingSpec

    start = time.perf_counter()
    await deployment.prefill.members[0].engine.prefill(request_id, prompt, SamplingSpec(max_tokens=1), None)
    return time.perf_counter() - start


async def _worker_metrics(deployment: Any) -> dict[str, dict[str, float]]:
    prefill, decode = deployment.prefill.members[0].engine, deployment.decode.members[0].engine
    statuses = await asyncio.gather(prefill.status(), decode.status())
    return {"prefill": statuses[0].engine_metrics, "decode": statuses[1].engine_metrics}


_EMPTY: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}


async def _settled_metrics(deployment: Any, stub: Any, transport: str, expected: int) -> dict[str, dict[str, float]]:
    """Metrics once the transfers of ``expected`` requests are recorded.

    vLLM hands connector stats over on engine steps only, and a p2p sender may finish after the
    prefill engine's last step; a one-token request (prefill only, no transfer) is such a step.
    """
    from duet.router.client import build_request

    flush = build_request(prompt_token_ids=[PROMPT_TOKEN_RANGE[0]] * 4, max_tokens=1)
    deadline = time.monotonic() + 30
    while True:
        metrics = await _worker_metrics(deployment)
        recorded = transfer_delta(transport, _EMPTY, metrics).transfers
        if recorded >= expected or time.monotonic() > deadline:
            return metrics
        async for _ in stub.Generate(flush, timeout=60):
            pass
        await asyncio.sleep(0.2)


@dataclass
class SizeRun:
    """One variant's measurements for one prompt size."""

    timings: list[Timing] = field(default_factory=list)
    colocated_ttft_s: list[float] = field(default_factory=list)
    transfer: TransferMetrics = field(default_factory=TransferMetrics)
    raw_s: list[float] = field(default_factory=list)  # the raw transport, same bytes, beside it


# A prompt for the disaggregated request and another of the same length for the colocated one
# (a shared prompt would let one engine's prefix cache serve the other request).
PromptPair = tuple[list[int], list[int]]


def prompt_pairs(tokens: int, count: int) -> list[PromptPair]:
    pairs = _prompts(tokens, 2 * count, seed=tokens)
    return list(zip(pairs[:count], pairs[count:]))


def reps_for(tokens: int, reps: int) -> int:
    """Requests per size: ``reps``, fewer for long prompts (a 32k prefill takes tens of seconds)."""
    return max(1, min(reps, MEASURED_TOKENS // tokens))


def _deployment_config(model_dir: Path | None, variant: Variant) -> Any:
    from duet.config import load_config, parse_config

    data = load_config().model_dump()
    if model_dir is not None:
        data["model"]["path"] = str(model_dir)
    data["kv_transfer"]["transport"] = variant.transport
    data["kv_transfer"]["layerwise"] = variant.layerwise
    data["server"]["metrics_port"] = None
    # The time to the second token is the decode side's first step after the transfer: every
    # token goes to the client as its step ends, not merged (PoolConfig.output_interval_ms).
    for pool in ("prefill", "decode"):
        data[pool]["output_interval_ms"] = 0
    return parse_config(data, source=f"bench variant {variant.name}")


@asynccontextmanager
async def _serving(config: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A started deployment on a free port and a gRPC stub to it; stopped on exit."""
    import grpc

    from duet.cluster.deployment import Deployment
    from duet.router.proto import duet_api_pb2_grpc as pb_grpc

    deployment = await Deployment(config).start(port=0, http_port=None)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
            yield deployment, pb_grpc.DuetStub(channel)
    finally:
        await deployment.stop()


async def measure_sizes(
    deployment: Any,
    stub: Any,
    transport: str,
    prompts: dict[str, list[PromptPair]],
    raw_seconds: Callable[[str], float],
) -> dict[str, SizeRun]:
    """Serve every size's prompts one at a time, each disaggregated request followed by its
    colocated twin (so both see the same machine load); each size also gets the transfer
    metrics its requests added (read from the workers before and after), and its raw
    transport's time for the same bytes (``raw_seconds(label)``), measured just before and just
    after its requests with the deployment up and idle: the ceiling under the same conditions."""
    runs: dict[str, SizeRun] = {}
    done = transfer_delta(transport, _EMPTY, await _worker_metrics(deployment)).transfers
    for label, pairs in prompts.items():
        before = await _settled_metrics(deployment, stub, transport, done)
        run = runs[label] = SizeRun()
        run.raw_s.append(await asyncio.to_thread(raw_seconds, label))
        for index, (prompt, twin) in enumerate(pairs):
            run.timings.append(await _timed_request(stub, prompt))
            run.colocated_ttft_s.append(await _prefill_alone_s(deployment, twin, f"bench-colocated-{label}-{index}"))
        done += len(pairs)
        after = await _settled_metrics(deployment, stub, transport, done)
        run.transfer = transfer_delta(transport, before, after)
        run.raw_s.append(await asyncio.to_thread(raw_seconds, label))
    return runs


def raw_seconds_for(variant: Variant, sizes: dict[str, int], geometry: KVGeometry, reps: int) -> Callable[[str], float]:
    """The best time of ``variant``'s raw transport moving a size's KV bytes, by size label."""
    return lambda label: raw_transport_seconds(variant.raw, geometry, sizes[label], reps)


async def run_variant(
    variant: Variant,
    model_dir: Path | None,
    prompts: dict[str, list[PromptPair]],
    warmup: list[int],
    raw_seconds: Callable[[str], float],
) -> dict[str, SizeRun]:
    """Measure ``variant`` on a fresh deployment, after one unmeasured request (handshakes)."""
    async with _serving(_deployment_config(model_dir, variant)) as (deployment, stub):
        await _timed_request(stub, warmup)
        await _settled_metrics(deployment, stub, variant.transport, 1)
        return await measure_sizes(deployment, stub, variant.transport, prompts, raw_seconds)


# ---- results -----------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratio(value: float, ceiling: float) -> float:
    return value / ceiling if ceiling > 0 else float("nan")


def variant_result(run: SizeRun, ceilings: Ceilings, variant: Variant) -> dict[str, Any]:
    """One cell of the result: latencies against colocated, bandwidth against the ceilings."""
    tt2t = _median([t.second_s for t in run.timings])
    ttft = _median([t.first_s for t in run.timings])
    step = _median([t.step_s for t in run.timings])
    base_ttft = _median(run.colocated_ttft_s)
    base_tt2t = base_ttft + step
    transfer = run.transfer
    raw = gib_per_s(ceilings.nbytes, min(run.raw_s)) if run.raw_s else float("nan")
    out: dict[str, Any] = {
        "requests": len(run.timings),
        "ttft_s": ttft,
        "tt2t_s": tt2t,
        "colocated_ttft_s": base_ttft,
        "decode_step_s": step,
        "colocated_tt2t_s": base_tt2t,
        "added_tt2t_s": tt2t - base_tt2t,
        "added_ttft_s": ttft - base_ttft,
        # First token to second beyond one decode step: the hand-off alone, free of the
        # prefill-time noise that the two TTFTs carry (a 32k prefill swings by seconds).
        "added_handoff_s": tt2t - ttft - step,
        "transfers": transfer.transfers,
        "bytes_per_transfer": transfer.bytes / transfer.transfers if transfer.transfers else 0.0,
        "transfer_s_per_transfer": transfer.seconds / transfer.transfers if transfer.transfers else 0.0,
        "gib_per_s": transfer.gib_per_s,
        "raw_transport": variant.raw,
        "raw_gib_per_s": raw,  # measured beside this variant, just before and after its requests
        "raw_up_front_gib_per_s": getattr(ceilings, variant.raw),  # at the start of the run
        "ratio_to_raw": _ratio(transfer.gib_per_s, raw),
        "ratio_to_memcpy": _ratio(transfer.gib_per_s, ceilings.memcpy),
    }
    if variant.transport == "nixl" and transfer.transfers:
        out["descriptors_per_transfer"] = transfer.descriptors / transfer.transfers
    if variant.transport == "nccl" and transfer.seconds > 0:
        out["exposed_s_per_transfer"] = transfer.exposed_s / transfer.transfers
        out["hidden_fraction"] = min(1.0, max(0.0, 1.0 - transfer.exposed_s / transfer.seconds))
    return out


def goals(sizes: dict[str, Any]) -> dict[str, Any]:
    """The issue's two goals, checked on what was measured (None where not measured)."""
    ratios = {
        f"{label} {name}": cell["ratio_to_raw"]
        for label, size in sizes.items()
        for name, cell in size["variants"].items()
    }
    hidden_8k = sizes.get("8k", {}).get("variants", {}).get("nccl layer-wise", {}).get("hidden_fraction")
    return {
        "ratio_to_raw_goal": GOAL_RATIO,
        "ratio_to_raw_met": {key: value >= GOAL_RATIO for key, value in ratios.items()},
        "hidden_8k_goal": GOAL_HIDDEN,
        "hidden_8k": hidden_8k,
        "hidden_8k_met": None if hidden_8k is None else hidden_8k >= GOAL_HIDDEN,
    }


def format_table(sizes: dict[str, Any]) -> str:
    """A markdown table: one row per size and variant, ratios and added latency side by side."""
    head = (
        "| prompt | transport | GiB/s | raw GiB/s | memcpy GiB/s | / raw | / memcpy "
        "| hand-off added ms | TTFT Δ ms | hidden |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for label, size in sizes.items():
        ceilings = size["ceilings_gib_per_s"]
        for name, cell in size["variants"].items():
            hidden = cell.get("hidden_fraction")
            rows.append(
                f"| {label} | {name} | {cell['gib_per_s']:.2f} | {cell['raw_gib_per_s']:.2f} "
                f"({cell['raw_transport']}) | {ceilings['memcpy']:.2f} | {cell['ratio_to_raw']:.0%} "
                f"| {cell['ratio_to_memcpy']:.0%} | {cell['added_handoff_s'] * 1e3:.1f} "
                f"| {cell['added_ttft_s'] * 1e3:+.1f} | {'-' if hidden is None else f'{hidden:.0%}'} |"
            )
    return "\n".join(rows)


# ---- the run -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    sizes: dict[str, int]
    reps: int  # measured requests per size and variant
    ceiling_reps: int
    out: Path


def _model_dir(sizes: dict[str, int]) -> Path | None:
    """The long-context tiny model when a prompt needs it, else the built-in one (None)."""
    if max(sizes.values()) + MAX_TOKENS <= BUILTIN_CONTEXT:
        return None
    from duet.worker_runtime.tiny_model import ensure_tiny_model

    return ensure_tiny_model(context=LONG_CONTEXT)


async def _serving_runs(plan: Plan, model_dir: Path | None, geometry: KVGeometry) -> dict[str, dict[str, SizeRun]]:
    """Each variant on its own deployment, one after the other (two engines alive at a time)."""
    prompts = {label: prompt_pairs(tokens, reps_for(tokens, plan.reps)) for label, tokens in plan.sizes.items()}
    warmup = _prompts(512, 1, seed=1)[0]
    variants = {}
    for variant in VARIANTS:
        print(f"bench transfer: serving {variant.name} ...", file=sys.stderr, flush=True)
        raw = raw_seconds_for(variant, plan.sizes, geometry, plan.ceiling_reps)
        variants[variant.name] = await run_variant(variant, model_dir, prompts, warmup, raw)
    return variants


def run(plan: Plan) -> dict[str, Any]:
    """Measure everything in one run and return the JSON-ready result."""
    from duet.worker_runtime.engine import resolve_model_path
    from duet.config import ModelConfig

    load_before = os.getloadavg()
    model_dir = _model_dir(plan.sizes)
    geometry = KVGeometry.of(model_dir or resolve_model_path(ModelConfig()))
    ceilings = {}
    for label, tokens in plan.sizes.items():
        print(f"bench transfer: ceilings for {label} ...", file=sys.stderr, flush=True)
        ceilings[label] = measure_ceilings(geometry, tokens, plan.ceiling_reps)
    variants = asyncio.run(_serving_runs(plan, model_dir, geometry))
    sizes = {
        label: {
            "tokens": tokens,
            "kv_bytes": ceilings[label].nbytes,
            "ceilings_gib_per_s": {k: v for k, v in asdict(ceilings[label]).items() if k != "nbytes"},
            "variants": {
                v.name: variant_result(variants[v.name][label], ceilings[label], v)
                for v in VARIANTS
            },
        }
        for label, tokens in plan.sizes.items()
    }
    return {
        "benchmark": "duet bench transfer",
        "machine": {"cpus": os.cpu_count(), "gpu": None, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "reps": plan.reps,
        "ceiling_reps": plan.ceiling_reps,
        "sizes": sizes,
        "goals": goals(sizes),
    }


# ---- command line ------------------------------------------------------------------------


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None, help="prompt sizes, e.g. 1k,8k,32k (default; --quick: 1k)")
    parser.add_argument("--out", type=Path, help=f"JSON result path (default {DEFAULT_OUT.name}; --quick: {QUICK_OUT.name})")
    parser.add_argument("--reps", type=int, default=None, help="measured requests per size and transport (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1k only, one request each")
    parser.set_defaults(handler=_bench_transfer)


def register_command(benches: argparse._SubParsersAction) -> None:
    """Add ``bench transfer`` to duet's CLI."""
    _add_arguments(benches.add_parser("transfer", help="KV-transfer bandwidth vs ceilings, and TTFT it adds"))


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The run the arguments ask for; ValueError on bad input."""
    sizes = parse_sizes(args.sizes if args.sizes is not None else ("1k" if args.quick else "1k,8k,32k"))
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if reps < 1:
        raise ValueError(f"--reps {reps}: must be at least 1")
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    if out.is_dir():
        raise ValueError(f"--out {out}: is a directory")
    return Plan(sizes, reps, ceiling_reps=3 if args.quick else 9, out=out)


def _bench_transfer(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as error:
        print(f"duet bench transfer: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = run(plan)
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    plan.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result["sizes"]))
    print(f"\nload average {result['machine']['loadavg_before'][0]:.2f} -> {result['machine']['loadavg_after'][0]:.2f}; "
          f"wrote {plan.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duet.benchmarks.kv_transfer", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
