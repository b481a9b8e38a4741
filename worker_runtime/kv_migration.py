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
exactly where the stream stands whatever it had received.
"""

from __future__ import annotations

from typing import Any

# The utility's name on vLLM's EngineCoreProc (router/engine_front_end.py calls it).
MIGRATE_OUT_METHOD = "duet_migrate_out"


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


def install() -> None:
    """Add :func:`migrate_out` to vLLM's engine core as a utility call; idempotent."""
    from vllm.v1.engine.core import EngineCoreProc

    setattr(EngineCoreProc, MIGRATE_OUT_METHOD, migrate_out)
