"""The host KV pool across hosts: vLLM's p2p tier, made to wait instead of spin while idle.

A prefill engine whose host's pool lacks a prompt's prefix, where another host's holds it, fetches
it from an engine on that host (the router names it: ``remote_kv_source``, router/policies.py).
vLLM's ``P2PSecondaryTierManager`` does the fetching and the serving: it probes the source for
the prompt's blocks over ZMQ, the source finds them in its own tiers (its host tier, the host's
pool) and they cross over NIXL into the fetching engine's host tier. It is the tier after the
host's pool (kv_transfer/config.py), so a block found on the host is never fetched.

What duet changes is how an idle engine waits. The tier must see each peer's messages, and it
reads them only when the engine steps, so vLLM's tier reports pending work always: an idle
engine then steps without pause. Here that took about 90% of a core for the engine core and as
much for its worker, per engine, with no request in sight. vLLM asks a tier for pending work
only when the scheduler has no request of its own (``Scheduler.has_requests``), so
:class:`HostPeerTier` waits there: at full speed while a transfer is in flight, otherwise up to
:data:`IDLE_WAIT_S` for a peer's message on the tier's socket (it wakes at once when one comes).
A request arriving meanwhile waits for the rest of that wait before its first step.
"""

from __future__ import annotations

import time

import zmq
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

# How long an idle engine waits for a peer's message before its next (empty) step: the most a
# request arriving at an idle prefill engine waits before the engine looks at it.
IDLE_WAIT_S = 0.01


class HostPeerTier(P2PSecondaryTierManager):
    """vLLM's p2p tier, waiting for its peers' messages while it has nothing in flight."""

    def has_pending_work(self) -> bool:
        if self._unbound_stores or any(session.has_pending_work for session in self._sessions.values()):
            return True
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
