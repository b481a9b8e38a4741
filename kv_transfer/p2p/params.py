"""The ``kv_transfer_params`` contract between router, prefill engine and decode engine.

Prefill request in:   ``{"do_remote_decode": True, "p2p_peer": {"host", "port", "engine_id"}}``
Prefill output out:   ``{"do_remote_prefill": True, "p2p_transfer_id", "p2p_num_tokens", ...}``
Decode request in:    the prefill output's params, unchanged.

A prefill request may also carry ``"p2p_codec": "on" | "off"``, which overrides the sender's
choice of sending its KV encoded (codec_policy.py) for that request alone: how tests and
benchmarks compare both forms on the same engines.

A running decode request moving to another decode worker (live migration) is finished by its
engine with ``{"do_remote_decode": True, "p2p_peer": target, "p2p_move": True}``; the connector
sends the KV of every computed token to ``target`` and answers with params of the same form as
a prefill's output, which the target's request carries as a decode request's would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duet.kv_transfer.p2p.config import P2pConfig

CONNECTOR_CLASS = "P2pConnector"
CONNECTOR_MODULE = "duet.kv_transfer.p2p.connector"


@dataclass(frozen=True)
class PeerAddress:
    """Where a decode worker's p2p listener runs (TP rank 0's port; rank r adds r)."""

    host: str
    port: int
    engine_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "engine_id": self.engine_id}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerAddress:
        return cls(str(d["host"]), int(d["port"]), str(d.get("engine_id", "")))


def kv_transfer_config(
    role: str,
    cfg: P2pConfig | None = None,
    engine_id: str | None = None,
    kv_load_failure_policy: str = "fail",
) -> dict[str, Any]:
    """The vLLM ``kv_transfer_config`` dict that enables this connector for ``role``."""
    out: dict[str, Any] = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": (cfg or P2pConfig()).to_extra_config(),
    }
    if engine_id is not None:
        out["engine_id"] = engine_id
    return out


def prefill_request_params(peer: PeerAddress, codec: str | None = None) -> dict[str, Any]:
    """kv_transfer_params for a prefill request whose KV goes to the decode worker ``peer``
    (``codec``: "on" or "off" to override the sender's choice of encoding it)."""
    out: dict[str, Any] = {"do_remote_decode": True, "p2p_peer": peer.to_dict()}
    if codec is not None:
        out["p2p_codec"] = codec
    return out


def codec_override(params: dict[str, Any] | None) -> str | None:
    """A prefill request's own choice of encoding its KV ("on"/"off"), if it makes one."""
    value = (params or {}).get("p2p_codec")
    return value if value in ("on", "off") else None


def move_out_params(peer: PeerAddress) -> dict[str, Any]:
    """kv_transfer_params that finish a running decode request whose KV moves to ``peer``."""
    return {**prefill_request_params(peer), "p2p_move": True}


def wants_move(params: dict[str, Any] | None) -> bool:
    """True for a decode request finished to move, with its KV, to another decode worker."""
    return bool(wants_send(params) and params and params.get("p2p_move"))


def wants_send(params: dict[str, Any] | None) -> bool:
    """True for a prefill request that must stream its KV to a decode worker."""
    return bool(params and params.get("do_remote_decode") and params.get("p2p_peer"))


def wants_load(params: dict[str, Any] | None) -> bool:
    """True for a decode request whose prompt KV is (being) staged by the p2p receiver."""
    return bool(params and params.get("do_remote_prefill") and params.get("p2p_transfer_id"))


def transfer_id(engine_id: str, request_id: str) -> str:
    """Staging key: unique across prefill engines because it carries the engine id."""
    return f"{engine_id}/{request_id}"
