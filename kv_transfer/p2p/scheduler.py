"""Scheduler-side half of the connector: decides what each step saves and loads.

Prefill (producer): a request whose kv_transfer_params name a decode peer gets a save spec for
the tokens each step computes (from token 0 on its first step, so locally cached prefix blocks
are sent too). Its blocks are freed as usual when it finishes: the worker already copied the
KV into send buffers during the forward.

Decode (consumer): a request carrying a transfer id reports its prompt as external tokens
loaded asynchronously; once blocks are allocated the worker fills them from staging.

Moving (live migration, any role): a running request finished with move params keeps its
blocks; the next step's metadata asks the worker to send the KV of every computed token to the
target, and the blocks are freed once the worker has copied them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import SchedulerOutput

from duet.kv_transfer.p2p import params as p2p_params
from duet.kv_transfer.p2p.metadata import LoadSpec, MoveSpec, P2pMetadata, SaveSpec
from duet.kv_transfer.p2p.params import PeerAddress

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request


@dataclass
class _Send:
    request: Request
    peer: PeerAddress
    tid: str
    codec: str | None = None  # the request's own choice of encoding, if any
    sent_upto: int = 0


class P2pScheduler:
    """Per-engine scheduler state of the p2p connector."""

    def __init__(self, engine_id: str, block_size: int, is_producer: bool, is_consumer: bool):
        self._engine_id = engine_id
        self._block_size = block_size
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._sends: dict[str, _Send] = {}
        self._loads: list[LoadSpec] = []
        self._loading: set[str] = set()  # decode requests whose load the worker runs
        self._releases: list[str] = []
        self._cancels: list[str] = []
        self._moves: list[MoveSpec] = []
        self._kv_cache_manager: KVCacheManager | None = None

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self._is_producer and p2p_params.wants_send(params):
            assert params is not None
            self._sends[request.request_id] = _Send(
                request,
                PeerAddress.from_dict(params["p2p_peer"]),
                p2p_params.transfer_id(self._engine_id, request.request_id),
                p2p_params.codec_override(params),
            )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self._is_consumer and p2p_params.wants_load(params)):
            return 0, False
        assert params is not None
        remote = min(int(params["p2p_num_tokens"]), request.num_prompt_tokens)
        count = remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self._is_consumer and p2p_params.wants_load(params)):
            return
        assert params is not None
        tid = params["p2p_transfer_id"]
        if num_external_tokens > 0:
            remote = min(int(params["p2p_num_tokens"]), request.num_prompt_tokens)
            self._loads.append(
                LoadSpec(request.request_id, tid, list(blocks.get_block_ids()[0]), remote - num_external_tokens, num_external_tokens)
            )
            self._loading.add(request.request_id)
        else:
            self._releases.append(tid)  # the local prefix cache covered it all
        # One load per request: a preempted and rescheduled request recomputes locally.
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pMetadata:
        meta = P2pMetadata(
            loads=self._loads,
            releases=self._releases,
            cancels=self._cancels,
            moves=self._moves,
            idle_step=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._loads, self._releases, self._cancels, self._moves = [], [], [], []
        if self._sends:
            meta.saves = self._build_saves(scheduler_output)
        return meta

    def _build_saves(self, scheduler_output: SchedulerOutput) -> list[SaveSpec]:
        assert self._kv_cache_manager is not None
        saves = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            send = self._sends.get(req_id)
            if send is None:
                continue
            request = send.request
            computed = request.num_computed_tokens  # before this step (updated after this call)
            end = min(computed + num_scheduled, request.num_prompt_tokens)
            start = min(send.sent_upto, computed)
            if start >= end:
                continue
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
            saves.append(SaveSpec(send.tid, send.peer, block_ids, start, end, request.num_prompt_tokens, send.codec))
            send.sent_upto = end
        return saves

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def update_connector_output(self, finished_recving: set[str]) -> None:
        self._loading -= finished_recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Clean up; for a prefill request return the params its decode request needs, and
        for a request moving out, also keep its blocks (True) until its KV is sent."""
        req_id = request.request_id
        params = request.kv_transfer_params
        if p2p_params.wants_move(params):
            assert params is not None
            return True, self._move(request, PeerAddress.from_dict(params["p2p_peer"]), block_ids)
        send = self._sends.pop(req_id, None)
        if req_id in self._loading:
            self._cancels.append(req_id)  # aborted while waiting: the worker reports it done
        elif self._is_consumer and p2p_params.wants_load(params):
            assert params is not None
            self._releases.append(params["p2p_transfer_id"])  # aborted before allocation
            params["do_remote_prefill"] = False
        if send is None or send.sent_upto < request.num_prompt_tokens:
            return False, None
        return False, self._load_params(send.tid, request.num_prompt_tokens, send.peer)

    def _move(self, request: Request, peer: PeerAddress, block_ids: list[int]) -> dict[str, Any]:
        """Queue the send of ``request``'s computed tokens (all but its last, sampled one) to
        ``peer``; the params the target's request carries to load them."""
        tid = p2p_params.transfer_id(self._engine_id, request.request_id)
        tokens = request.num_computed_tokens
        self._moves.append(MoveSpec(request.request_id, SaveSpec(tid, peer, list(block_ids), 0, tokens, tokens)))
        return self._load_params(tid, tokens, peer)

    def _load_params(self, tid: str, num_tokens: int, peer: PeerAddress) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "p2p_transfer_id": tid,
            "p2p_num_tokens": num_tokens,
            "p2p_peer": peer.to_dict(),
            "p2p_source_engine_id": self._engine_id,
        }
