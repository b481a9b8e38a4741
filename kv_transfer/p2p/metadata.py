"""What the scheduler-side connector tells the worker-side one each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from duet.kv_transfer.p2p.params import PeerAddress


@dataclass
class SaveSpec:
    """Prefill side: send tokens [start, end) of every layer to ``peer`` in this step."""

    tid: str
    peer: PeerAddress
    block_ids: list[int]
    start: int
    end: int
    total_tokens: int
    codec: str | None = None  # "on"/"off": the request's own choice of encoding; None: the sender's

    @property
    def last(self) -> bool:
        return self.end >= self.total_tokens


@dataclass
class MoveSpec:
    """A running request's whole KV, sent once outside any forward (live migration): its blocks
    are held until the worker has copied them out, then ``req_id`` is reported finished sending."""

    req_id: str
    save: SaveSpec


@dataclass
class LoadSpec:
    """Decode side: fill tokens [start, start + num_tokens) of ``req_id``'s blocks from staging."""

    req_id: str
    tid: str
    block_ids: list[int]
    start: int
    num_tokens: int


@dataclass
class P2pMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    moves: list[MoveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Decode side: staged transfers nobody will load (request aborted or fully cached locally).
    releases: list[str] = field(default_factory=list)
    # Decode side: requests aborted while their load is pending; report them done at once.
    cancels: list[str] = field(default_factory=list)
    # Nothing is computed this step: the engine only polls its connector.
    idle_step: bool = False
