"""Running batch jobs: each front door runs the jobs it holds the lease of, one at a time.

A job's lines are validated as one request each would be (the OpenAI front end's own
``prepare``), so a batch line is answered exactly as the same body sent to
``/v1/completions`` or ``/v1/chat/completions``; a line that is not a valid request fails alone,
with its error in the error file. The valid ones run in prefix-tree order (batch/prefix_order.py),
each waiting for the prefill of the request that computes the prefix it shares, through the
same serving path as online requests (admission, routing, disaggregation, retries).

A job has a lower priority than online traffic: it keeps at most ``max_inflight`` requests in
flight, one fewer for each online request this front door has in flight, so it fills the
capacity online requests leave and steps aside as they arrive. A request the deployment turns
away (over the admission limit, no ready worker) waits and runs again rather than failing.

Each finished request is appended to the job's results before the next is counted, and the
job's lease is renewed while it runs; a front door that dies leaves a lease that goes stale, and
whichever front door (or restarted control plane) takes it runs only what has no result yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from duet.batch.prefix_order import prefix_tree_order
from duet.batch.store import BatchStore, NotFound, process_name
from duet.router.auth import Caller, QuotaExceeded
from duet.router.http_server import OpenAIFrontEnd, PreparedRequest, _api_error
from duet.router.serving import Overloaded, Unavailable

logger = logging.getLogger(__name__)

# Runs of one job that may raise before it is failed (its lines' own errors never count).
_MAX_ATTEMPTS = 3

# What a line's url may name, and whether it is a chat request.
ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}


def jsonl_lines(text: str) -> list[str]:
    """A JSONL file's lines: split at newlines only (``str.splitlines`` also splits at U+2028
    and others, which a JSON string may hold raw)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _succeeded(result: dict[str, Any]) -> bool:
    """Whether a recorded result is a line's answer (not its error)."""
    return (result["output"]["response"] or {}).get("status_code") == 200


def _count(batch: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Set the job's counts from its recorded results (an earlier run's included)."""
    ok = sum(1 for result in results if _succeeded(result))
    batch["request_counts"].update(completed=ok, failed=len(results) - ok)


@dataclass
class _Line:
    """One line of a job's input: its number, custom id and, once validated, its request."""

    number: int
    custom_id: str
    prepared: PreparedRequest
    started: asyncio.Event = field(default_factory=asyncio.Event)  # its first token is out (or it ended)


class BatchRunner:
    """Claims unfinished jobs from ``store`` and runs them through ``front_end``."""

    def __init__(
        self, store: BatchStore, front_end: OpenAIFrontEnd, max_inflight: int, poll_s: float = 1.0,
        retry_s: float = 1.0, unavailable_timeout_s: float = 600.0,
    ) -> None:
        self.store = store
        self.front_end = front_end
        self.max_inflight = max_inflight
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.unavailable_timeout_s = unavailable_timeout_s
        self.owner = f"{process_name()}:{uuid.uuid4().hex[:8]}"
        self.inflight = 0  # the job's requests holding a place in its window (sequences)
        self.admitted = 0  # those of them sent to the deployment (the rest wait for their prefix's owner)
        self._room = asyncio.Condition()

    async def run(self) -> None:
        """Run jobs until cancelled: whichever unfinished job no live lease holds, oldest first."""
        while True:
            try:
                # Reading every job's state is file work: off the event loop that serves requests.
                for batch_id in await asyncio.to_thread(lambda: list(self.store.unfinished())):
                    if self.store.try_lease(batch_id, self.owner):
                        await self._run_leased(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # reading the store failed (a full disk, a vanished folder): try again
                logger.exception("batch runner error")
            await asyncio.sleep(self.poll_s)

    async def _run_leased(self, batch_id: str) -> None:
        job = asyncio.create_task(self.run_job(batch_id))
        renewing = asyncio.create_task(self._renew(batch_id, job))
        try:
            await job
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the runner is stopping; else the lease was lost and the job stopped
        except Exception as error:  # a bug or the disk: the job fails after a few attempts, not for ever
            logger.exception("batch %s: run failed", batch_id)
            self._attempt_failed(batch_id, error)
        finally:
            renewing.cancel()
            self.store.release_lease(batch_id, self.owner)

    async def _renew(self, batch_id: str, job: asyncio.Task[Any]) -> None:
        """Keep the lease fresh; a lease lost (this process stalled past it and another took
        the job) stops this copy of the job."""
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            if not self.store.renew_lease(batch_id, self.owner):
                logger.warning("batch %s: lease lost; another front door runs it", batch_id)
                job.cancel()
                return

    def _attempt_failed(self, batch_id: str, error: Exception) -> None:
        """Count a run of the job that raised; the third ends it as failed."""
        try:
            batch = self.store.batch(batch_id)
            batch["duet_attempts"] = batch.get("duet_attempts", 0) + 1
            if batch["duet_attempts"] >= _MAX_ATTEMPTS:
                self._fail(batch, "internal_error", f"the job failed {_MAX_ATTEMPTS} times, last: {type(error).__name__}: {error}")
            else:
                self.store.save_batch(batch)
        except Exception:
            logger.exception("batch %s: could not record the failure", batch_id)

    # -- one job ------------------------------------------------------------------------------
    async def run_job(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        now = int(time.time())
        if batch["status"] == "cancelling":
            return self._end(batch, "cancelled")
        if now >= batch["expires_at"]:
            return self._end(batch, "expired")
        caller = self._caller(batch)
        try:
            path = self.store.file(batch["input_file_id"]).content
            text = await asyncio.to_thread(path.read_text, encoding="utf-8", errors="replace")
        except (NotFound, FileNotFoundError):
            return self._fail(batch, "input_file_missing", f"input file {batch['input_file_id']} was deleted")
        if caller is None:
            return self._fail(batch, "invalid_api_key", f"API key {batch['duet_caller']!r} is no longer configured")
        recorded = await asyncio.to_thread(self.store.results, batch_id)
        done = {result["line"] for result in recorded}
        lines = [(number, raw) for number, raw in enumerate(jsonl_lines(text), 1) if raw.strip()]
        batch.update(status="in_progress", in_progress_at=batch.get("in_progress_at") or now)
        batch["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        _count(batch, recorded)
        self.store.save_batch(batch)
        valid: list[_Line] = []
        seen: set[str] = set()
        for number, raw in lines:
            await asyncio.sleep(0)  # validating is synchronous work: let online requests through between lines
            line = await self._validate(batch, number, raw, seen, skip=number in done)
            if line is not None and number not in done:
                valid.append(line)
        self.store.save_batch(batch)
        stopped = await self._run_lines(batch, valid, caller)
        batch = {**self.store.batch(batch_id), "request_counts": batch["request_counts"]}
        if stopped == "expired":
            return self._end(batch, "expired")
        if stopped == "cancelled" or batch["status"] == "cancelling":
            return self._end(batch, "cancelled")
        batch.update(status="finalizing", finalizing_at=int(time.time()))
        self.store.save_batch(batch)
        self._end(batch, "completed")

    def _caller(self, batch: dict[str, Any]) -> Caller | None:
        return self.front_end.service.gatekeeper.caller(batch["duet_caller"])

    async def _validate(self, batch: dict[str, Any], number: int, raw: str, seen: set[str], skip: bool) -> _Line | None:
        """The line's request, or None after recording (unless ``skip``: it has a result
        already) why it cannot run."""
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError as error:
            return self._refuse(batch, number, None, "invalid_json", f"line {number} is not valid JSON: {error}", skip)
        if not isinstance(entry, dict):
            return self._refuse(batch, number, None, "invalid_request", f"line {number} is not a JSON object", skip)
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return self._refuse(batch, number, None, "missing_custom_id", f"line {number} has no custom_id string", skip)
        if custom_id in seen:
            return self._refuse(batch, number, custom_id, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used by an earlier line", skip)
        seen.add(custom_id)
        if entry.get("method") != "POST":
            return self._refuse(batch, number, custom_id, "invalid_method", f"line {number}: method must be POST", skip)
        if entry.get("url") != batch["endpoint"]:
            return self._refuse(batch, number, custom_id, "mismatched_url", f"line {number}: url must be the batch's endpoint {batch['endpoint']}", skip)
        body = entry.get("body")
        if not isinstance(body, dict):
            return self._refuse(batch, number, custom_id, "invalid_request", f"line {number}: body must be a JSON object", skip)
        if body.get("stream"):
            return self._refuse(batch, number, custom_id, "invalid_request", f"line {number}: stream is not supported in a batch", skip)
        if skip:
            return None
        try:
            prepared = await self.front_end.prepare(body, ENDPOINTS[batch["endpoint"]], f"batch-{batch['id']}-{number}")
        except Exception as error:
            self._result(batch, number, custom_id, error=error)
            return None
        prepared.in_background()
        return _Line(number, custom_id, prepared)

    def _refuse(self, batch: dict[str, Any], number: int, custom_id: str | None, code: str, message: str, skip: bool) -> None:
        if not skip:
            self._write(batch, number, {
                "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                "error": {"code": code, "message": message, "line": number},
            })
        return None

    def _result(self, batch: dict[str, Any], number: int, custom_id: str, body: dict[str, Any] | None = None,
                error: Exception | None = None) -> None:
        """Record a request's answer (``body``), or the error its HTTP call would have got."""
        status = 200
        if error is not None:
            api_error = _api_error(error)
            status, body = api_error.status, api_error.body()
        self._write(batch, number, {
            "id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-{batch['id']}-{number}", "body": body},
            "error": None,
        })

    def _write(self, batch: dict[str, Any], number: int, output: dict[str, Any]) -> None:
        self.store.append_result(batch["id"], {"line": number, "output": output})
        ok = output["response"] is not None and output["response"]["status_code"] == 200
        batch["request_counts"]["completed" if ok else "failed"] += 1
        self.store.save_batch(batch)  # the counts a client polls

    async def _run_lines(self, batch: dict[str, Any], lines: list[_Line], caller: Caller) -> str | None:
        """Run ``lines`` in prefix-tree order within the window; "cancelled" or "expired" if the
        job stopped for that, else None. A line whose task raised (the store failing) fails the job's run."""
        block = self.front_end.service.limits.block_size
        schedule = prefix_tree_order([line.prepared.prompts[0].prompt_token_ids for line in lines], block)
        ordered = [lines[item.index] for item in schedule]
        tasks: list[asyncio.Task[None]] = []
        try:
            for item, line in zip(schedule, ordered):
                owner = ordered[item.owner] if item.owner is not None else None
                need = len(line.prepared.requests)
                stopped = await self._wait_for_room(need, batch)
                if stopped is not None:
                    return stopped
                self.inflight += need  # now, not when the task first runs: the next line sees it
                tasks.append(asyncio.create_task(self._run_line(batch, line, owner, caller)))
            while any(not task.done() for task in tasks):
                await asyncio.wait(tasks, timeout=1.0)
                stopped = self._stopped(batch)
                if stopped is not None:
                    return stopped
            for task in tasks:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.inflight = self.admitted = 0  # a task cancelled before it ran never gave its place back

    def _window(self) -> int:
        """How many requests the job may have in flight now: ``max_inflight`` less the online
        requests this front door has in flight."""
        online = self.front_end.service.cluster.inflight - self.admitted
        return self.max_inflight - max(0, online)

    def _stopped(self, batch: dict[str, Any]) -> str | None:
        """"cancelled" once a cancel was asked for, "expired" past the job's window, else None."""
        if self.store.cancel_asked(batch["id"]):
            return "cancelled"
        return "expired" if time.time() >= batch["expires_at"] else None

    async def _wait_for_room(self, need: int, batch: dict[str, Any]) -> str | None:
        """Wait until ``need`` more requests fit the window (one that asks for more than the
        window holds runs alone, once the job has nothing else in flight); "cancelled" or
        "expired" if the job stops meanwhile."""
        while (stopped := self._stopped(batch)) is None:
            window = self._window()
            if self.inflight + need <= window or (self.inflight == 0 and window > 0):
                return None
            async with self._room:
                try:  # online requests leave without telling the job: look again soon
                    await asyncio.wait_for(self._room.wait(), self.retry_s / 4)
                except TimeoutError:
                    pass
        return stopped

    async def _run_line(self, batch: dict[str, Any], line: _Line, owner: _Line | None, caller: Caller) -> None:
        """Serve one line (its place in the window taken by the caller) and record its result."""
        need = len(line.prepared.requests)
        try:
            if owner is not None:
                await owner.started.wait()
            self.admitted += need
            try:
                body = await self._serve(line, caller)
            finally:
                self.admitted -= need
            self._result(batch, line.number, line.custom_id, body=body)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._result(batch, line.number, line.custom_id, error=error)
        finally:
            line.started.set()
            self.inflight -= need
            async with self._room:
                self._room.notify_all()

    async def _serve(self, line: _Line, caller: Caller) -> dict[str, Any]:
        """The request's whole answer; turned away for load (admission, quota, no ready worker
        for up to ``unavailable_timeout_s``), it waits and runs again."""
        need = len(line.prepared.requests)
        service = line.prepared.service
        if need > service.max_inflight or (caller.max_concurrent_requests or need) < need:
            limit = min(service.max_inflight, caller.max_concurrent_requests or service.max_inflight)
            # Waiting would never help: refuse it as the online endpoint would, once.
            raise Overloaded(f"the line runs {need} sequences at once and at most {limit} may be in flight")
        give_up = time.monotonic() + self.unavailable_timeout_s
        while True:
            try:
                return await self.front_end.whole(line.prepared, caller, on_first_token=line.started.set)
            except (Overloaded, QuotaExceeded) as error:
                await asyncio.sleep(max(self.retry_s, getattr(error, "retry_after_s", 0.0) or 0.0))
            except Unavailable:
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(self.retry_s)

    # -- endings ------------------------------------------------------------------------------
    def _fail(self, batch: dict[str, Any], code: str, message: str) -> None:
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        self._end(batch, "failed")

    def _end(self, batch: dict[str, Any], status: str) -> None:
        """Put the job in its final state, with its output and error files made of the results
        so far (in the input's line order)."""
        self.store.sync_results(batch["id"])
        results = sorted(self.store.results(batch["id"]), key=lambda result: result["line"])
        if batch.get("request_counts", {}).get("total"):
            _count(batch, results)  # from the results themselves, whatever this run counted
        succeeded = [r["output"] for r in results if _succeeded(r)]
        failed = [r["output"] for r in results if not _succeeded(r)]
        if status in ("completed", "cancelled", "expired"):
            for key, outputs, purpose in (("output_file_id", succeeded, "batch_output"), ("error_file_id", failed, "batch_output")):
                if outputs and batch.get(key) is None:
                    content = "".join(json.dumps(output, separators=(",", ":")) + "\n" for output in outputs).encode()
                    name = "output" if key == "output_file_id" else "errors"
                    batch[key] = self.store.add_file(f"{batch['id']}_{name}.jsonl", purpose, content, batch["duet_caller"])["id"]
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        self.store.save_batch(batch)
        logger.info("batch %s %s: %s", batch["id"], status, batch.get("request_counts"))
