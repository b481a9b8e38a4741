"""Pairwise process groups: one two-rank group per (prefill worker, decode worker) pair.

No global ``init_process_group``: the decode worker hosts a TCPStore, each prefill worker that
wants to talk to it announces itself there, and both build a two-rank gloo (CPU) or NCCL (GPU)
backend on a PrefixStore private to that pair. Rank 0 sends, rank 1 receives. The hello
carries the sender's largest chunk, which must fit the receiver's landing buffers.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, Store, TCPStore


SENDER_RANK = 0
RECEIVER_RANK = 1
_COUNT_KEY = "duet/p2p/count"


def hello_key(index: int) -> str:
    return f"duet/p2p/hello/{index}"


def backend_name(device: torch.device) -> str:
    """NCCL for KV caches on CUDA devices, gloo for CPU ones: the same code drives both."""
    return "nccl" if device.type == "cuda" else "gloo"


def _make_backend(store: Store, rank: int, device: torch.device, timeout: timedelta):
    """A two-rank c10d backend on ``store`` (already prefixed for this pair)."""
    if backend_name(device) == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, opts)
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, 2, timeout)


class PeerLink:
    """One end of a pairwise group; ``send``/``recv`` block the calling thread only."""

    def __init__(self, backend, rank: int, device: torch.device, peer: str, index: int):
        self._backend = backend
        self._peer_rank = 1 - rank
        self.device = device
        self.peer = peer
        self.index = index
        self._closed = threading.Event()

    def send(self, message: torch.Tensor) -> None:
        """Send one message; returns once the buffer may be reused."""
        self.wait(self.post_send(message))

    def post_send(self, message: torch.Tensor):
        """Start sending one message; :meth:`wait` for the returned work before reusing it.
        Messages posted one after another arrive in that order."""
        return self._backend.send([message], self._peer_rank, 0)

    def post_recv(self, buffer: torch.Tensor):
        """Start receiving the next message into ``buffer`` (which may be longer than it);
        :meth:`wait` for the returned work before reading it."""
        return self._backend.recv([buffer], self._peer_rank, 0)

    def wait(self, work) -> None:
        work.wait()
        self._sync()

    def _sync(self) -> None:
        # NCCL's wait() only orders the current stream; the data must be complete here because
        # other threads read it (staging) or free it (send buffers) next.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Tear the group down; a peer blocked on this link gets an error, not a hang."""
        if self._closed.is_set():
            return
        self._closed.set()
        shutdown = getattr(self._backend, "shutdown", None) or getattr(self._backend, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # an already broken group has nothing left to shut down
        self._backend = None


def connect(
    host: str,
    port: int,
    me: str,
    device: torch.device,
    timeout: timedelta,
    link_timeout: timedelta,
    max_chunk_bytes: int,
) -> PeerLink:
    """Prefill side: announce ``me`` at the decode worker's store and join a pair group."""
    store = TCPStore(host, port, is_master=False, timeout=timeout)
    index = store.add(_COUNT_KEY, 1) - 1
    hello = {"peer": me, "backend": backend_name(device), "max_chunk_bytes": max_chunk_bytes}
    store.set(hello_key(index), json.dumps(hello))
    backend = _make_backend(PrefixStore(f"duet/p2p/pair/{index}/", store), SENDER_RANK, device, link_timeout)
    return PeerLink(backend, SENDER_RANK, device, f"{host}:{port}", index)


class Rendezvous:
    """Decode side: hosts the TCPStore and turns each announced peer into a :class:`PeerLink`."""

    def __init__(
        self,
        host: str,
        port: int,
        device: torch.device,
        timeout: timedelta,
        link_timeout: timedelta,
        max_chunk_bytes: int,
    ):
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        self._device = device
        self._max_chunk_bytes = max_chunk_bytes
        self._timeout = timeout
        self._link_timeout = link_timeout
        self._next = 0
        self._waited = 0.0

    def poll(self, wait_s: float) -> tuple[int, str] | None:
        """The next announced peer (index, name), or None after ``wait_s``; ValueError for a
        peer this worker cannot talk to (its handshake then times out on its side).

        A peer that took a ticket but never wrote its hello (it died in between) is skipped
        after the connect timeout, so it cannot block later peers.
        """
        key = hello_key(self._next)
        try:
            self._store.wait([key], timedelta(seconds=wait_s))
        except (RuntimeError, TimeoutError):  # torch raises DistStoreError, a RuntimeError
            if self._store.add(_COUNT_KEY, 0) > self._next:
                self._waited += wait_s
                if self._waited >= self._timeout.total_seconds():
                    self._next, self._waited = self._next + 1, 0.0
            return None
        hello = json.loads(self._store.get(key))
        index, self._next, self._waited = self._next, self._next + 1, 0.0
        self._store.delete_key(key)
        if hello["backend"] != backend_name(self._device):
            raise ValueError(f"peer {hello['peer']} uses {hello['backend']}, this worker {backend_name(self._device)}")
        if hello["max_chunk_bytes"] > self._max_chunk_bytes:
            raise ValueError(
                f"peer {hello['peer']} sends up to {hello['max_chunk_bytes']} KV bytes per message, this "
                f"worker receives up to {self._max_chunk_bytes}: set the same p2p_max_chunk_bytes on both"
            )
        return index, hello["peer"]

    def accept(self, index: int, peer: str) -> PeerLink:
        """Join the pair group of the ``index``-th announced peer (blocks until it joins too)."""
        backend = _make_backend(
            PrefixStore(f"duet/p2p/pair/{index}/", self._store), RECEIVER_RANK, self._device, self._link_timeout
        )
        return PeerLink(backend, RECEIVER_RANK, self._device, peer, index)
