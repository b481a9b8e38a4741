"""The host KV pool across hosts: vLLM's p2p tier, made to wait instead of spin while idle.

A prefill engine whose host's pool lacks a prompt's prefix, where another host's holds it, fetches
it from an engine on that host (the router names it: ``remote_kv_source``, router/policies.py).
vLLM's ``P2PSecondaryTierManager`` does the fetching and the serving: it probes the source for
the prompt's blocks over ZMQ, the source finds them in its own tiers (its host tier, the host's
pool) and they cross over NIXL into the fetching engine's host tier. It is the tier after the
host's pool (kv_transfer/config.py), so a block found on the host is never fetched.

What duet changes is how an idle engine waits, and that it stops:

- The tier must see each peer's messages, and it reads them only when the engine steps, so
  vLLM's tier reports pending work always: an idle engine then steps without pause (73 of 500
  CPU ticks of its engine core's main thread over 5 idle seconds here). vLLM asks a tier for
  pending work only when the scheduler has no request of its own (``Scheduler.has_requests``),
  so :class:`HostPeerTier` waits there: at full speed while a transfer is in flight, otherwise
  up to :data:`IDLE_WAIT_S` for a peer's message on the tier's socket (it wakes at once when
  one comes), once per :data:`IDLE_WAIT_S` (vLLM asks up to three times per pass of its loop).
  A request arriving at an idle engine waits for the rest of that wait before its first step.
- vLLM's engine core leaves its loop on SIGTERM only once it has no work, which a tier that
  always has some never allows: the engine was killed after its process manager's 5 s grace.
  Once the engine has been told to stop, this tier reports no pending work.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import zmq
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

# How long an idle engine waits for a peer's message before its next (empty) step: the most a
# request arriving at an idle prefill engine waits before the engine looks at it.
IDLE_WAIT_S = 0.01


class HostPeerTier(P2PSecondaryTierManager):
    """vLLM's p2p tier, waiting for its peers' messages while it has nothing in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waited_at = 0.0
        self._stopping = False
        self._chain_stop_signals()

    def has_pending_work(self) -> bool:
        if self._stopping:
            return False  # let the engine core leave its loop
        if self._unbound_stores or any(session.has_pending_work for session in self._sessions.values()):
            return True
        now = time.monotonic()
        if now - self._waited_at >= IDLE_WAIT_S:
            self._waited_at = now
            self._wait_for_peer(IDLE_WAIT_S)
        return True  # the engine must step for the tier to read what came

    def _wait_for_peer(self, timeout_s: float) -> None:
        """Until a message reaches the tier's listening socket, or ``timeout_s``. The socket is
        read on this (the scheduler's) thread only, so polling it here is safe."""
        listener = getattr(self._control, "_router", None)
        if listener is None:  # vLLM's control transport changed: wait without waking early
            time.sleep(timeout_s)
            return
        poller = zmq.Poller()
        poller.register(listener, zmq.POLLIN)
        poller.poll(timeout_s * 1000)

    def _chain_stop_signals(self) -> None:
        """Note SIGTERM and SIGINT, then pass them to the engine core's own handlers (installed
        before the engine, and so this tier, is built)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread's handlers: nothing to chain here
        for signum in (signal.SIGTERM, signal.SIGINT):
            engine_handler = signal.getsignal(signum)

            def stop(received: int, frame: FrameType | None, engine_handler: Any = engine_handler) -> None:
                self._stopping = True
                if callable(engine_handler):
                    engine_handler(received, frame)
                elif engine_handler == signal.SIG_DFL:  # no handler of the engine's: end as it would have
                    signal.signal(received, signal.SIG_DFL)
                    os.kill(os.getpid(), received)

            signal.signal(signum, stop)
