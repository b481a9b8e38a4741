"""``duet batch FILE``: run an OpenAI batch input file on a running duet and fetch its results.

It does what a client of OpenAI's Batch API does, over duet's HTTP API: uploads FILE
(``/v1/files``, purpose ``batch``), creates the job (``/v1/batches``), follows its counts, and
writes the output and error files beside FILE. Ctrl-C cancels the job; ``--no-wait`` only
starts it (its id is printed; ``duet batch --status ID`` and ``--results ID`` find it later).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

USAGE_ERROR = 2
_DONE = ("completed", "failed", "expired", "cancelled")


class BatchCliError(Exception):
    """A failure the user can fix, said in one line."""


def register_command(commands: Any) -> None:
    batch = commands.add_parser(
        "batch",
        help="run a batch input file (OpenAI's JSONL) on a running duet and write its results",
        description="Upload FILE (one {custom_id, method, url, body} request per line), run it as a batch job "
        "in prefix-tree order at a lower priority than online requests, and write FILE's results beside it "
        "(NAME.output.jsonl, NAME.errors.jsonl). Ctrl-C cancels the job.",
    )
    batch.add_argument("file", nargs="?", help="the batch input file (JSONL)")
    batch.add_argument("--url", default="http://127.0.0.1:8000", help="the deployment's HTTP API (default: %(default)s)")
    batch.add_argument("--api-key", default=os.environ.get("DUET_API_KEY"), help="API key (default: $DUET_API_KEY)")
    batch.add_argument("--endpoint", help="the batch's endpoint (default: the first line's url)")
    batch.add_argument("--output", help="where to write the results (default: FILE's name with .output.jsonl)")
    batch.add_argument("--no-wait", action="store_true", help="start the job, print its id and return")
    batch.add_argument("--status", metavar="BATCH_ID", help="print a job's state and counts")
    batch.add_argument("--results", metavar="BATCH_ID", help="wait for a job and write its results to --output")
    batch.set_defaults(handler=_batch)


def _batch(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except BatchCliError as error:
        print(f"duet: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130


async def _run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(args.url.rstrip("/"), headers=headers) as http:
        api = _Api(http, args.url)
        if args.status:
            print(_summary(await api.call("GET", f"/v1/batches/{args.status}")))
            return 0
        if args.results:
            if not args.output:
                raise BatchCliError("--results needs --output FILE")
            return await _follow(api, args.results, Path(args.output))
        if not args.file:
            raise BatchCliError("name the batch input file (or pass --status / --results BATCH_ID)")
        path = Path(args.file)
        if not path.is_file():
            raise BatchCliError(f"{path}: no such file")
        endpoint = args.endpoint or _first_url(path)
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", path.read_bytes(), filename=path.name, content_type="application/jsonl")
        uploaded = await api.call("POST", "/v1/files", data=form)
        job = await api.call("POST", "/v1/batches", json={
            "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h",
        })
        count = sum(1 for line in path.read_bytes().splitlines() if line.strip())
        print(f"batch {job['id']}: {count} requests to {endpoint}", file=sys.stderr)
        if args.no_wait:
            print(job["id"])
            return 0
        output = Path(args.output) if args.output else path.with_name(path.name.removesuffix(".jsonl") + ".output.jsonl")
        try:
            return await _follow(api, job["id"], output)
        except (KeyboardInterrupt, asyncio.CancelledError):
            await api.call("POST", f"/v1/batches/{job['id']}/cancel")
            print(f"\nduet: batch {job['id']} cancelled", file=sys.stderr)
            return 130


class _Api:
    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            async with self.http.request(method, path, **kwargs) as response:
                if path.endswith("/content"):
                    body: Any = await response.read()
                else:
                    body = await response.json(content_type=None)
                if response.status >= 400:
                    error = body.get("error", {}) if isinstance(body, dict) else {}
                    raise BatchCliError(f"{method} {path}: {response.status} {error.get('message', body)}")
                return body
        except aiohttp.ClientConnectionError:
            raise BatchCliError(f"no duet HTTP API at {self.url} (start one with `duet serve`, or pass --url)") from None


def _first_url(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    url = json.loads(line).get("url")
                except (json.JSONDecodeError, AttributeError):
                    raise BatchCliError(f"{path}: the first line is not a JSON object (or pass --endpoint)") from None
                if not isinstance(url, str):
                    raise BatchCliError(f"{path}: the first line has no url (or pass --endpoint)")
                return url
    raise BatchCliError(f"{path} is empty")


def _summary(job: dict[str, Any]) -> str:
    counts = job["request_counts"]
    return f"{job['id']}: {job['status']}, {counts['completed']} completed, {counts['failed']} failed of {counts['total']}"


async def _follow(api: _Api, batch_id: str, output: Path) -> int:
    """Wait for the job, printing its progress, then write its output (and errors) files."""
    last = ""
    while True:
        job = await api.call("GET", f"/v1/batches/{batch_id}")
        line = _summary(job)
        if line != last:
            print(line, file=sys.stderr)
            last = line
        if job["status"] in _DONE:
            break
        await asyncio.sleep(1.0)
    if job["status"] == "failed":
        errors = (job.get("errors") or {}).get("data") or [{}]
        raise BatchCliError(f"batch {batch_id} failed: {errors[0].get('message', 'no reason given')}")
    errors = output.with_name(output.stem.removesuffix(".output") + ".errors.jsonl")
    for key, target in (("output_file_id", output), ("error_file_id", errors)):
        if job.get(key):
            target.write_bytes(await api.call("GET", f"/v1/files/{job[key]}/content"))
            print(f"wrote {target}", file=sys.stderr)
    return 0 if job["status"] == "completed" else 1
