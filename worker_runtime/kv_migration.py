"""Moving a running request out of its engine core with its KV (live migration).

A decode engine that must give up a request (its worker drains, or is scaled away) used to stop
it and let another worker recompute the whole context. Now the context's KV moves instead:
:func:`migrate_out`, a utility call the router makes on the engine core's own thread between two
steps, finishes the request as the connector finishes a prefill whose KV goes to a decode engine
(status ``FINISHED_LENGTH_CAPPED``, with the transport's ``kv_transfer_params``:
kv_transfer/config.py ``move_out_params``). With ``nixl`` the connector keeps the request's
blocks for the lease (``kv_transfer.kv_lease_s``) and answers with the parameters a pull needs;
the source frees the blocks when the target has read them. With ``nccl`` (push) the router names
the target first, and duet's connector sends it the KV at the next step, then frees the blocks
(kv_transfer/p2p/scheduler.py). Either way the router hands the answer to the target worker as it
hands a prefill's to a decode worker. No scheduler is changed: this is the path every prefill's
KV already takes, entered from a running request instead of a finished prefill.

The request's tokens so far travel with the answer: the engine core's own list is what the KV
covers (every token but the last, which was sampled and not yet computed), so the router knows
exactly where the stream stands whatever it had received. The target's prompt is the context
with every token, the last included; the answer's parameters say how many of its tokens the KV
covers (``KV_TOKENS_PARAM``), so the target loads those and computes only the last, whose step
samples the next new token. (A prefill's hand-off loads every prompt token and recomputes the
last to re-derive a token the client has: for a move, a whole step of the target's spent on a
token the stream already carries. Measured, docs/benchmarks/migration.md.)
"""

from __future__ import annotations

from typing import Any

# The utilities' names on vLLM's EngineCoreProc (router/engine_front_end.py calls them).
MIGRATE_OUT_METHOD = "duet_migrate_out"
KV_PEER_METHOD = "duet_kv_peer"
CONNECT_KV_PEER_METHOD = "duet_connect_kv_peer"
# In a moved request's ``kv_transfer_params``: how many of the target's prompt tokens the KV
# covers. duet's push connector carries its own count (``p2p_num_tokens``); NixlConnector's pull
# is capped to this one (:func:`_cap_nixl_pull`).
KV_TOKENS_PARAM = "duet_kv_tokens"


def migrate_out(core: Any, request_id: str, kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Finish ``request_id`` (the engine core's id) handing its KV on as ``kv_transfer_params``
    say (default: kept for a pull); returns ``{"kv_transfer_params", "token_ids"}``, or None
    when it cannot move now: unknown, finished, not running (waiting, or its own KV still
    arriving), or without an output yet.

    Runs between engine steps (utility calls do), so no step of the request is in flight.
    ``kv_transfer_params`` is None when no connector keeps the blocks (then they are freed and
    only the tokens are left to resume from)."""
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    request = scheduler.requests.get(request_id)
    if request is None or request.status != RequestStatus.RUNNING or not request.output_token_ids:
        return None
    if getattr(request, "num_output_placeholders", 0):  # asynchronous scheduling: a step in flight
        return None
    # What a prefill finishing for a remote decode carries: the connector keeps (or sends) the blocks.
    request.kv_transfer_params = kv_transfer_params or {"do_remote_decode": True}
    _track_for_pull(scheduler, request_id)
    # Counted among the engine's requests until the pull (or the lease) ends it: a drain must
    # not remove the worker while the target still reads its KV (engine_clients.py).
    request.duet_moving_out = True
    scheduler.running.remove(request)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    kv_transfer_params, _ = scheduler._free_request(request)
    if kv_transfer_params is not None:
        kv_transfer_params[KV_TOKENS_PARAM] = request.num_computed_tokens
    return {"kv_transfer_params": kv_transfer_params, "token_ids": list(request.output_token_ids)}


def _track_for_pull(scheduler: Any, request_id: str) -> None:
    """Make the connector's worker side follow ``request_id`` as a prefill it will be read from.

    NixlConnector's worker frees a finished request's blocks, when the reader's notification
    comes or its lease runs out, only for requests it saw scheduled with ``do_remote_decode``
    (the scheduler side's ``_reqs_in_batch``, filled when a prefill's blocks are allocated). A
    request moving out got that flag long after its blocks were allocated, so without this its
    blocks, and its entry in the engine, would stay until the worker is removed: a rebalanced
    worker would leak them, and a drain would wait out ``router.drain_timeout_s``. The next
    step's connector metadata carries it with the lease (``reqs_to_send``), as for a prefill."""
    connector = getattr(getattr(scheduler, "connector", None), "connector_scheduler", None)
    in_batch = getattr(connector, "_reqs_in_batch", None)
    if in_batch is not None:
        in_batch.add(request_id)


def kv_peer(core: Any) -> dict[str, Any] | None:
    """Where another engine's NIXL agent reaches this one's (its side channel, as a pull's
    ``kv_transfer_params`` name it), and the engines it has handshaken with (``connected``);
    None without NixlConnector."""
    connector = getattr(getattr(core.scheduler, "connector", None), "connector_scheduler", None)
    if connector is None or not hasattr(connector, "side_channel_port"):
        return None
    connected = core.model_executor.collective_rpc(_connected_engines)
    return {
        "engine_id": connector.engine_id,
        "host": connector.side_channel_host,
        "port": connector.side_channel_port,
        "tp_size": connector.transfer_tp_size,
        "connected": sorted(set().union(*connected)),
    }


def connect_kv_peer(core: Any, peer: dict[str, Any]) -> None:
    """Start NIXL's handshake with ``peer`` (:func:`kv_peer` of another engine) now, in the
    connector's background thread, instead of at the first pull from it.

    Decode engines read each other's KV only when a request moves, so the first move between
    two of them found no handshake done: its requests waited for it, and for the engine step
    that then posts their reads (a handshake took 15-45 ms here, a step 25-40 ms; with RDMA,
    registering the peer's memory takes longer). Handshaking when a decode worker joins takes
    that off the first move. Returns at once: the engine's steps do not wait for it."""
    core.model_executor.collective_rpc(_start_handshake, args=(peer,))


def _connected_engines(worker: Any) -> list[str]:
    """In each of the engine's workers: the remote engines its NIXL agent has handshaken with."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector_worker = get_kv_transfer_group().connector_worker
    with connector_worker._handshake_lock:  # the background handshakes add to it
        return list(connector_worker._remote_agents)


def _start_handshake(worker: Any, peer: dict[str, Any]) -> None:
    """In each of the engine's workers: NixlConnector's own entry for a handshake, idempotent
    (a peer already known, or being handshaken with, is left as it is)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector_worker = get_kv_transfer_group().connector_worker
    connector_worker._ensure_handshake(peer["engine_id"], peer["host"], peer["port"], peer["tp_size"])


def _cap_nixl_pull() -> None:
    """Make NixlConnector's decode side load no more of a moved request's prompt than its
    source holds KV for (``KV_TOKENS_PARAM``); idempotent.

    For a remote prefill it loads every prompt token, and vLLM then recomputes the last one to
    get its logits. A moved request's prompt ends with the token the source sampled but never
    computed: loading only what precedes it, the target computes that token, as the source's
    next step would have, and its first output is the stream's next token. The source's blocks
    cover exactly those tokens, so the read lines up block for block."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    original = getattr(NixlPullConnectorScheduler.get_num_new_matched_tokens, "_duet_original", NixlPullConnectorScheduler.get_num_new_matched_tokens)

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        count, load_async = original(self, request, num_computed_tokens)
        held = (request.kv_transfer_params or {}).get(KV_TOKENS_PARAM)
        if held is None or count <= 0:
            return count, load_async
        count = min(count, held - num_computed_tokens)
        return (count, load_async) if count > 0 else (0, False)  # the local prefix cache covers it

    get_num_new_matched_tokens._duet_original = original  # type: ignore[attr-defined]
    NixlPullConnectorScheduler.get_num_new_matched_tokens = get_num_new_matched_tokens  # type: ignore[method-assign]


def install() -> None:
    """Add :func:`migrate_out`, :func:`kv_peer` and :func:`connect_kv_peer` to vLLM's engine
    core as utility calls, and cap NixlConnector's pull of a moved request; idempotent."""
    from vllm.v1.engine.core import EngineCoreProc

    setattr(EngineCoreProc, MIGRATE_OUT_METHOD, migrate_out)
    setattr(EngineCoreProc, KV_PEER_METHOD, kv_peer)
    setattr(EngineCoreProc, CONNECT_KV_PEER_METHOD, connect_kv_peer)
    _cap_nixl_pull()
