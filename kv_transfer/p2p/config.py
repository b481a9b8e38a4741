"""Settings of the p2p connector, read from ``kv_connector_extra_config``.

Every knob has a default so that only the decode side's listen address must be configured.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

EXTRA_KEY_PREFIX = "p2p_"


@dataclass(frozen=True)
class P2pConfig:
    """Transport settings; each field is read from ``kv_connector_extra_config["p2p_<name>"]``."""

    # Address the decode worker listens on (its TCPStore); TP rank r listens on port + r.
    host: str = "127.0.0.1"
    port: int = 18600
    # Decode side: longest wait from a decode request's load start to a complete staged KV.
    transfer_timeout_s: float = 30.0
    # Decode side: how long staged KV nobody has asked for stays before it is freed.
    lease_s: float = 60.0
    # Decode side: in an engine step that computes nothing while KV is still arriving, wait up
    # to this long for a transfer to land (returning at once when one does) instead of
    # returning empty: vLLM's engine loop otherwise spins a core, which on a CPU host is the
    # core the receiver needs.
    idle_wait_s: float = 0.002
    # Decode side: bound on staged (received, not yet consumed) KV bytes. A message kept in the
    # buffer it landed in holds at most twice its KV, so memory can reach twice this.
    staging_bytes: int = 1 << 30
    # Decode side: how long the receiver waits for staging space before dropping a transfer.
    staging_wait_s: float = 2.0
    # Prefill side: bound on KV bytes queued for sending to one decode worker.
    send_queue_bytes: int = 1 << 30
    # Both: most KV bytes in one message; the prefill side splits a layer's chunk above it by
    # whole blocks (so it must hold one block), the decode side keeps receives of
    # this size (plus the header) posted. A sender whose limit exceeds its receiver's is
    # refused at the handshake.
    max_chunk_bytes: int = 4 << 20
    # Messages in flight per link: sends posted ahead by the prefill side, receives posted
    # ahead by the decode side (each a buffer of max_chunk_bytes).
    send_depth: int = 4
    recv_depth: int = 4
    # Both: already-touched message and staging buffers kept for reuse (see buffers.py).
    idle_buffer_bytes: int = 256 << 20
    # Both: TCPStore connect and process-group rendezvous limit.
    connect_timeout_s: float = 5.0
    # Both: a link with no message for this long is dead (the sender sends keepalives).
    link_timeout_s: float = 20.0
    keepalive_s: float = 2.0
    # Prefill side: after a failed handshake, chunks for that peer are dropped for this long.
    reconnect_backoff_s: float = 1.0
    # Prefill side: stream each layer as soon as it is computed (True), or send the whole
    # prompt's KV only after its last prefill step (False; the baseline that shows what
    # streaming hides).
    layerwise: bool = True
    # Prefill side: send KV encoded (codec.py): "auto" where the link's measured rate makes it
    # pay (never to a peer on this host), "on" always, "off" never.
    codec: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> P2pConfig:
        """Build from vLLM's extra config, converting values to each field's type."""
        extra = extra or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = EXTRA_KEY_PREFIX + f.name
            if key in extra:
                values[f.name] = _convert(getattr(cls, f.name), extra[key])
        return cls(**values)

    def to_extra_config(self) -> dict[str, Any]:
        """The inverse of :meth:`from_extra_config`."""
        return {EXTRA_KEY_PREFIX + f.name: getattr(self, f.name) for f in fields(self)}


def _convert(default: Any, value: Any) -> Any:
    """``value`` as the type of ``default``; a string flag is parsed, since ``bool("false")`` is True."""
    if isinstance(default, bool) and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(value)
