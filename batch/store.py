"""Where batch jobs live: OpenAI's File and Batch objects, and each job's results, on disk.

A job outlives the process that runs it: its state, its results so far and its lease are files
in one directory (``server.batches.directory``; on a cluster, a path every front door's host
shares), so a front door or control plane that restarts, or another front door, picks the job
up where it stopped. Layout::

    files/<file-id>.json        the File object (OpenAI's fields)
    files/<file-id>.jsonl       its content
    batches/<batch-id>/batch.json   the Batch object; written only by the job's lease holder
                                    (and once by the front door that created it)
    batches/<batch-id>/results.jsonl  one line per finished request, appended as it finishes
    batches/<batch-id>/cancel       present once a cancel was asked for (any front door)
    batches/<batch-id>/lease        the running front door's name; its mtime is its heartbeat

Every JSON file is replaced atomically (written aside, then renamed); a results line that a
crash cut short is dropped when the job resumes, and its request runs again.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# A batch in one of these states is done with; the others are waiting for, or held by, a runner.
TERMINAL_STATES = frozenset({"failed", "completed", "expired", "cancelled"})


class NotFound(Exception):
    """No file or batch with this id (HTTP 404)."""


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (``file-...``, ``batch_...``), unguessable."""
    return f"{prefix}{secrets.token_hex(12)}"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    aside.write_text(json.dumps(value, separators=(",", ":")))
    os.replace(aside, path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(path.stem) from None
    assert isinstance(value, dict), path
    return value


@dataclass(frozen=True)
class StoredFile:
    """An uploaded (or produced) file: OpenAI's File object and where its bytes are."""

    info: dict[str, Any]
    content: Path


class BatchStore:
    """Files and batch jobs kept under ``directory`` (created on first use)."""

    def __init__(self, directory: str | os.PathLike[str], lease_s: float = 30.0) -> None:
        self.root = Path(os.path.expanduser(os.fspath(directory)))
        self.lease_s = lease_s
        self._files = self.root / "files"
        self._batches = self.root / "batches"
        for folder in (self._files, self._batches):
            folder.mkdir(parents=True, exist_ok=True)

    # -- files --------------------------------------------------------------------------------
    def add_file(self, filename: str, purpose: str, content: bytes, owner: str) -> dict[str, Any]:
        """Keep ``content`` as a new file of API key ``owner``; returns its File object (with
        ``duet_owner``, which the API does not show)."""
        file_id = new_id("file-")
        (self._files / f"{file_id}.jsonl").write_bytes(content)
        info = {
            "id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
            "status_details": None, "duet_owner": owner,
        }
        _write_json(self._files / f"{file_id}.json", info)
        return info

    def file(self, file_id: str) -> StoredFile:
        if not _safe_id(file_id, "file-"):
            raise NotFound(file_id)
        info = _read_json(self._files / f"{file_id}.json")
        return StoredFile(info, self._files / f"{file_id}.jsonl")

    def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file's File object, newest first (``purpose`` keeps one kind)."""
        found = []
        for path in self._files.glob("file-*.json"):
            try:
                info = _read_json(path)
            except NotFound:  # deleted meanwhile
                continue
            if purpose is None or info.get("purpose") == purpose:
                found.append(info)
        return sorted(found, key=lambda info: (info["created_at"], info["id"]), reverse=True)

    def delete_file(self, file_id: str) -> None:
        stored = self.file(file_id)
        (self._files / f"{file_id}.json").unlink(missing_ok=True)
        stored.content.unlink(missing_ok=True)

    # -- batches ------------------------------------------------------------------------------
    def _folder(self, batch_id: str) -> Path:
        if not _safe_id(batch_id, "batch_"):
            raise NotFound(batch_id)
        return self._batches / batch_id

    def add_batch(self, batch: dict[str, Any]) -> None:
        folder = self._batches / batch["id"]
        folder.mkdir()
        _write_json(folder / "batch.json", batch)

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The Batch object as stored, "cancelling" while a cancel waits for its runner."""
        folder = self._folder(batch_id)
        batch = _read_json(folder / "batch.json")
        if batch["status"] not in TERMINAL_STATES and (folder / "cancel").exists():
            batch = {**batch, "status": "cancelling", "cancelling_at": batch.get("cancelling_at") or _mtime(folder / "cancel")}
        return batch

    def save_batch(self, batch: dict[str, Any]) -> None:
        _write_json(self._folder(batch["id"]) / "batch.json", batch)

    def batches(self) -> list[dict[str, Any]]:
        """Every batch, newest first."""
        found = []
        for folder in self._batches.glob("batch_*"):
            try:
                found.append(self.batch(folder.name))
            except NotFound:
                continue
        return sorted(found, key=lambda batch: (batch["created_at"], batch["id"]), reverse=True)

    def ask_cancel(self, batch_id: str) -> None:
        (self._folder(batch_id) / "cancel").touch()

    def cancel_asked(self, batch_id: str) -> bool:
        return (self._folder(batch_id) / "cancel").exists()

    # -- results ------------------------------------------------------------------------------
    def results(self, batch_id: str) -> list[dict[str, Any]]:
        """The results written so far, one per input line (the first written: a front door
        that stalled past its lease may have finished a line its successor ran again); a last
        line a crash cut short is dropped from the file."""
        path = self._folder(batch_id) / "results.jsonl"
        if not path.exists():
            return []
        raw = path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            with path.open("r+b") as handle:
                handle.truncate(len(complete))
        by_line: dict[int, dict[str, Any]] = {}
        for text in complete.split(b"\n"):
            try:
                result = json.loads(text)
                by_line.setdefault(int(result["line"]), result)
            except (ValueError, KeyError, TypeError):  # blank, or damaged on disk: that line runs again
                continue
        return list(by_line.values())

    def append_result(self, batch_id: str, result: dict[str, Any]) -> None:
        """Record one finished line. Written through to the operating system (a front door that
        dies loses none), not synced to the disk one by one: a job's results are synced when
        it ends (:meth:`sync_results`), and a host that loses power runs the rest again."""
        with (self._folder(batch_id) / "results.jsonl").open("ab") as handle:
            handle.write(json.dumps(result, separators=(",", ":")).encode() + b"\n")

    def sync_results(self, batch_id: str) -> None:
        path = self._folder(batch_id) / "results.jsonl"
        if path.exists():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())

    # -- leases -------------------------------------------------------------------------------
    def try_lease(self, batch_id: str, owner: str) -> bool:
        """Take the job for ``owner`` (``HOST:PID:...``) unless a live lease holds it. A lease
        older than ``lease_s`` is taken over (its holder died or hung), and so is one whose
        holder was a process of this host that is gone (a restarted ``duet serve`` resumes
        its jobs at once)."""
        lease = self._folder(batch_id) / "lease"
        try:
            age = time.time() - lease.stat().st_mtime
            holder = lease.read_text()
        except FileNotFoundError:
            age, holder = None, ""
        if age is not None:
            if age < self.lease_s and not _gone_from_this_host(holder):
                return False
            # Of the front doors that found it stale, only one renames it away; one that was
            # a moment late may have renamed a fresh lease the first just made: it puts it back.
            aside = lease.with_name(f"lease.stale.{secrets.token_hex(4)}")
            try:
                os.rename(lease, aside)
            except FileNotFoundError:
                return False
            if aside.read_text() != holder:
                try:
                    os.link(aside, lease)
                except FileExistsError:
                    pass
                aside.unlink(missing_ok=True)
                return False
        try:
            descriptor = os.open(lease, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as handle:
            handle.write(owner)
        for stale in lease.parent.glob("lease.stale.*"):
            stale.unlink(missing_ok=True)
        return True

    def renew_lease(self, batch_id: str, owner: str) -> bool:
        """Refresh ``owner``'s lease; False if it is no longer ``owner``'s."""
        lease = self._folder(batch_id) / "lease"
        try:
            if lease.read_text() != owner:
                return False
            os.utime(lease)
        except FileNotFoundError:
            return False
        return True

    def release_lease(self, batch_id: str, owner: str) -> None:
        lease = self._folder(batch_id) / "lease"
        try:
            if lease.read_text() == owner:
                lease.unlink()
        except FileNotFoundError:
            pass

    def unfinished(self) -> Iterator[str]:
        """Ids of the batches not yet in a final state, oldest first."""
        for batch in reversed(self.batches()):
            if batch["status"] not in TERMINAL_STATES:
                yield batch["id"]


def process_name() -> str:
    """This process as a lease names it: ``HOST:PID:PID-NAMESPACE``. Two containers may share a
    host name (and the store), not a process-id namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}:{os.getpid()}:{namespace}"


def _gone_from_this_host(holder: str) -> bool:
    """Whether the lease holder ``HOST:PID:PID-NAMESPACE:...`` was a process of this host (and
    process-id namespace) that has exited."""
    host, pid, namespace, *_ = (holder.split(":") + ["", "", ""])[:4]
    here_host, _, here_namespace = process_name().split(":")
    if host != here_host or namespace != here_namespace or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _safe_id(value: str, prefix: str) -> bool:
    """Whether ``value`` is an id this store made (never a path)."""
    return value.startswith(prefix) and value[len(prefix):].isalnum() and len(value) < 80


def _mtime(path: Path) -> int | None:
    try:
        return int(path.stat().st_mtime)
    except FileNotFoundError:
        return None
