"""OpenAI's Files and Batch APIs: ``/v1/files`` and ``/v1/batches``, as OpenAI's SDKs call them.

A job's input is a JSONL file uploaded with purpose ``batch``: one ``{"custom_id", "method":
"POST", "url", "body"}`` per line, every url the batch's ``endpoint`` (``/v1/completions`` or
``/v1/chat/completions``). Its output and error files are Files too, made when it ends, each
line ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` in the
input's order. With API keys, a key sees and uses only its own files and batches, and its jobs
run as it (its model scopes and quotas apply). Errors take OpenAI's shape (router/http_server.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from duet.batch.runner import ENDPOINTS, BatchRunner, jsonl_lines
from duet.batch.store import TERMINAL_STATES, BatchStore, NotFound, new_id
from duet.config import BatchesConfig
from duet.router.auth import Caller
from duet.router.http_server import ApiError, OpenAIFrontEnd, _json_body
from duet.router.validation import InvalidRequest

_PURPOSES = ("batch", "batch_output", "user_data")
_WINDOW_S = {"24h": 24 * 3600}


def _public(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored File or Batch object as the API shows it (without whose it is)."""
    return {key: value for key, value in stored.items() if not key.startswith("duet_")}


@dataclass
class BatchApi:
    front_end: OpenAIFrontEnd
    store: BatchStore
    config: BatchesConfig

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{file_id}", self.get_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_delete("/v1/files/{file_id}", self.delete_file)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self.get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_batch)

    def _caller(self, http: web.Request) -> Caller:
        return self.front_end.service.authenticate(http.headers.get("Authorization"))

    # -- files --------------------------------------------------------------------------------
    async def upload(self, http: web.Request) -> web.Response:
        """``POST /v1/files``: a multipart form with ``purpose`` and ``file``."""
        caller = self._caller(http)
        if not http.content_type.startswith("multipart/"):
            raise InvalidRequest("file", "upload the file as multipart/form-data with fields 'purpose' and 'file'")
        reader = await http.multipart()
        purpose, filename, content = None, "upload.jsonl", b""
        while (part := await reader.next()) is not None:
            if part.name == "purpose":
                purpose = (await part.read_chunk(64)).decode(errors="replace").strip()  # type: ignore[union-attr]
            elif part.name == "file":
                filename = part.filename or filename  # type: ignore[union-attr]
                content = await self._read_limited(part)
        if purpose not in _PURPOSES:
            raise InvalidRequest("purpose", f"must be one of {', '.join(_PURPOSES)}")
        if not content:
            raise InvalidRequest("file", "is missing or empty")
        if purpose == "batch":
            self._check_batch_input(content)
        info = await asyncio.to_thread(self.store.add_file, filename, purpose, content, caller.name)
        return web.json_response(_public(info))

    async def _read_limited(self, part: Any) -> bytes:
        chunks, size = [], 0
        while chunk := await part.read_chunk(1 << 20):
            size += len(chunk)
            if size > self.config.max_file_bytes:
                raise ApiError(413, f"the file exceeds {self.config.max_file_bytes} bytes (server.batches.max_file_bytes)",
                               "invalid_request_error", param="file", code="file_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_batch_input(self, content: bytes) -> None:
        """A batch input file must be UTF-8 JSONL within the request limit (each line's own
        problems fail that line only, when the job runs)."""
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequest("file", f"is not valid UTF-8 (byte {error.start})") from None
        count = sum(1 for line in jsonl_lines(text) if line.strip())
        if count > self.config.max_requests:
            raise InvalidRequest("file", f"has {count} requests; a batch takes at most {self.config.max_requests} (server.batches.max_requests)")

    def _own_file(self, http: web.Request, caller: Caller) -> dict[str, Any]:
        file_id = http.match_info["file_id"]
        try:
            info = self.store.file(file_id).info
        except NotFound:
            info = None
        if info is None or info.get("duet_owner") != caller.name:
            raise ApiError(404, f"No such File object: {file_id}", "invalid_request_error", param="id", code="not_found")
        return info

    async def list_files(self, http: web.Request) -> web.Response:
        caller = self._caller(http)
        files = [_public(info) for info in self.store.files(http.query.get("purpose")) if info.get("duet_owner") == caller.name]
        return web.json_response({"object": "list", "data": files, "has_more": False})

    async def get_file(self, http: web.Request) -> web.Response:
        return web.json_response(_public(self._own_file(http, self._caller(http))))

    async def file_content(self, http: web.Request) -> web.StreamResponse:
        info = self._own_file(http, self._caller(http))
        return web.FileResponse(self.store.file(info["id"]).content, headers={"Content-Type": "application/octet-stream"})

    async def delete_file(self, http: web.Request) -> web.Response:
        info = self._own_file(http, self._caller(http))
        self.store.delete_file(info["id"])
        return web.json_response({"id": info["id"], "object": "file", "deleted": True})

    # -- batches ------------------------------------------------------------------------------
    async def create_batch(self, http: web.Request) -> web.Response:
        """``POST /v1/batches``: a job over an uploaded ``batch`` file; it starts ``validating``
        and is run by whichever front door takes its lease first."""
        caller = self._caller(http)
        body = await _json_body(http, self.front_end.max_body_bytes)
        if not isinstance(body, dict):
            raise InvalidRequest("body", "must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise InvalidRequest("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
        if window not in _WINDOW_S:
            raise InvalidRequest("completion_window", "must be '24h'")
        metadata = body.get("metadata")
        _check_metadata(metadata)
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise InvalidRequest("input_file_id", "must be the id of a file uploaded with purpose 'batch'")
        try:
            info = self.store.file(file_id).info
        except NotFound:
            info = None
        if info is None or info.get("duet_owner") != caller.name:
            raise ApiError(404, f"No such File object: {file_id}", "invalid_request_error", param="input_file_id", code="not_found")
        if info["purpose"] != "batch":
            raise InvalidRequest("input_file_id", f"file {file_id} has purpose {info['purpose']!r}; a batch's input needs 'batch'")
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": file_id, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + _WINDOW_S[window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
            "duet_caller": caller.name,
        }
        self.store.add_batch(batch)
        return web.json_response(_public(batch))

    def _own_batch(self, http: web.Request, caller: Caller) -> dict[str, Any]:
        batch_id = http.match_info["batch_id"]
        try:
            batch = self.store.batch(batch_id)
        except NotFound:
            batch = None
        if batch is None or batch.get("duet_caller") != caller.name:
            raise ApiError(404, f"No such Batch object: {batch_id}", "invalid_request_error", param="batch_id", code="not_found")
        return batch

    async def get_batch(self, http: web.Request) -> web.Response:
        return web.json_response(_public(self._own_batch(http, self._caller(http))))

    async def cancel_batch(self, http: web.Request) -> web.Response:
        batch = self._own_batch(http, self._caller(http))
        if batch["status"] in TERMINAL_STATES:
            raise ApiError(409, f"Cannot cancel a batch with status {batch['status']}", "invalid_request_error", code="conflict")
        self.store.ask_cancel(batch["id"])
        return web.json_response(_public(self.store.batch(batch["id"])))

    async def list_batches(self, http: web.Request) -> web.Response:
        """Newest first; ``after`` a batch id and ``limit`` (1-100, 20) page through them."""
        caller = self._caller(http)
        try:
            limit = int(http.query.get("limit", "20"))
        except ValueError:
            raise InvalidRequest("limit", "must be an integer from 1 to 100") from None
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit", "must be an integer from 1 to 100")
        batches = [batch for batch in self.store.batches() if batch.get("duet_caller") == caller.name]
        after = http.query.get("after")
        if after is not None:
            ids = [batch["id"] for batch in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = [_public(batch) for batch in batches[:limit]]
        return web.json_response({
            "object": "list", "data": page, "has_more": len(batches) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })


def _check_metadata(metadata: object) -> None:
    """OpenAI's metadata rule: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise InvalidRequest("metadata", "must be an object of at most 16 key-value pairs")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequest("metadata", "keys must be strings of at most 64 characters, values strings of at most 512")


def batch_store_path(config: BatchesConfig, grpc_port: int) -> str:
    """The deployment's own folder under ``config.directory``: the deployment is known by its
    gRPC port on the host (every front door shares it; a deployment started again on the
    same port finds its jobs and resumes them)."""
    return re.sub(r"/+$", "", config.directory) + f"/grpc-{grpc_port}"


def start_batch_jobs(front_end: OpenAIFrontEnd, config: BatchesConfig, grpc_port: int) -> tuple[BatchApi, asyncio.Task[None]]:
    """The Files and Batch APIs on ``front_end``, and its runner of batch jobs (a task)."""
    store = BatchStore(batch_store_path(config, grpc_port), config.lease_s)
    runner = BatchRunner(store, front_end, config.max_inflight)
    return BatchApi(front_end, store, config), asyncio.get_running_loop().create_task(runner.run())
