"""The encoder cache: where encode workers leave each image's encoder output for prefill engines.

An encode worker's engine (vLLM, encoder only: ``ec_role: ec_producer``) writes the output of
each image it encodes to a folder; a prefill engine (``ec_consumer``) that finds an image's
output there loads it instead of running the encoder, and runs the encoder itself when it does
not (vLLM's scheduler asks its connector per image). vLLM's ``ECExampleConnector`` is the
connector that runs on CPU: one file per image, at ``{folder}/{identifier}/encoder_cache.safetensors``,
the identifier being the image's digest (worker_runtime/images.py); duet's engines load it with
its writes made atomic (kv_transfer/ec_connector.py). vLLM's other connectors need a CUDA op
(``ECCPUConnector``) or RDMA (``ECMooncakeConnector``).

vLLM's connector never deletes a file, so the folder would grow with every distinct image.
:class:`EncoderCacheFolder` is the router's index of it: which images are there, how many bytes
they take, and the least recently used ones removed when the capacity is reached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from duet.config import DuetConfig

logger = logging.getLogger(__name__)

# Where several front doors share the folder, a file one of them used this recently is not
# removed by another: a prefill engine checks that an image's file exists when it schedules the
# prompt, and loads it within the same step.
SHARED_IN_USE_S = 60.0
# Where several front doors share the folder, the one that meets a new image first claims it
# (a marker file) and has it encoded; another that meets it meanwhile waits for its file. A
# claim older than this is taken to have died with its front door, and is taken over.
CLAIM_STALE_S = 30.0


def entry_file(folder: str, identifier: str) -> str:
    """Where an image's encoder output lies: vLLM's ``ECExampleConnector`` layout."""
    return os.path.join(folder, identifier, "encoder_cache.safetensors")


def ec_transfer_config(role: Literal["encode", "prefill"], folder: str, on_cpu: bool) -> dict[str, Any]:
    """vLLM's ``ec_transfer_config`` for an encode engine (writes outputs) or a prefill engine
    (reads them) over ``folder``."""
    from duet.kv_transfer.ec_connector import CONNECTOR_NAME, MODULE_PATH

    return {
        "ec_connector": CONNECTOR_NAME,
        "ec_connector_module_path": MODULE_PATH,
        "ec_role": "ec_producer" if role == "encode" else "ec_consumer",
        "ec_buffer_device": "cpu" if on_cpu else "cuda",
        "ec_connector_extra_config": {"shared_storage_path": folder},
    }


def engine_ec_config(role: str, config: DuetConfig, on_cpu: bool) -> dict[str, Any] | None:
    """The ``ec_transfer_config`` of a worker of ``role`` in a deployment configured by
    ``config``: the encode pool writes the encoder cache and the prefill pool reads it, where
    the model has an encode pool; None otherwise (decode engines encode what they compute)."""
    encode = config.encode
    if not encode.replicas or role not in ("encode", "prefill"):
        return None
    assert encode.cache_path is not None, "the deployment names the folder (with_encoder_cache_folder)"
    return ec_transfer_config(role, encode.cache_path, on_cpu)  # type: ignore[arg-type]


def with_encoder_cache_folder(config: DuetConfig, deployment_key: str) -> DuetConfig:
    """``config`` with its encoder cache's folder named, where it has an encode pool and names
    none: one folder per deployment and model under the system's temporary directory, the same
    for a control plane that takes the deployment over (``deployment_key`` is its id)."""
    encode = config.encode
    if not encode.replicas or encode.cache_path is not None:
        return config
    # The model's name and path: a model removed and added again from another checkpoint
    # under the same name must not read the old encoder's outputs.
    model_key = hashlib.sha256(f"{config.model.name}\0{config.model.path}".encode()).hexdigest()[:12]
    folder = os.path.join(default_root(deployment_key), model_key)
    return config.model_copy(update={"encode": encode.model_copy(update={"cache_path": folder})})


def default_root(deployment_key: str) -> str:
    """The folder under which a deployment's encoder caches live when the config names none."""
    return os.path.join(tempfile.gettempdir(), f"duet-encoder-cache-{deployment_key}")


class EncoderCacheFolder:
    """One front door's index of the encoder cache's folder, kept within a capacity by
    removing the least recently used images.

    Images held (:meth:`hold`) by a request whose prompt is being computed are never removed.
    Several front doors share the folder, each with an index and a share of the capacity; then
    a file any of them used in the last ``in_use_s`` seconds is not removed either."""

    def __init__(self, folder: str, capacity_bytes: int, in_use_s: float = 0.0) -> None:
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.in_use_s = in_use_s
        self._sizes: OrderedDict[str, int] = OrderedDict()  # identifier -> bytes, least recently used first
        self._held: dict[str, int] = {}
        self._touched: dict[str, float] = {}  # identifier -> when this index last stamped its file
        self.evictions = 0
        os.makedirs(folder, exist_ok=True)
        self._index_existing()

    def _index_existing(self) -> None:
        """Index what the folder holds already (a front door that replaced another, a control
        plane that took the deployment over), oldest first."""
        found = []
        for entry in os.scandir(self.folder):
            try:
                stat = os.stat(entry_file(self.folder, entry.name))
            except OSError:
                continue
            found.append((stat.st_mtime, entry.name, stat.st_size))
        for _, identifier, size in sorted(found):
            self._sizes[identifier] = size

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __len__(self) -> int:
        return len(self._sizes)

    def holds(self, identifier: str) -> bool:
        """Whether the image's encoder output is in the folder (another front door's too); the
        image counts as just used."""
        path = entry_file(self.folder, identifier)
        try:
            if self.in_use_s:  # used now: no other front door removes it for a while
                os.utime(path)
            stat = os.stat(path)
        except OSError:
            self._sizes.pop(identifier, None)  # removed by another front door
            self._touched.pop(identifier, None)
            return False
        if self.in_use_s:
            self._touched[identifier] = stat.st_mtime
        self._sizes[identifier] = stat.st_size
        self._sizes.move_to_end(identifier)
        return True

    def added(self, identifiers: Iterable[str]) -> list[str]:
        """The encode pool was asked for these images' outputs: index those it wrote, then
        remove the least recently used images past the capacity. Returns those written."""
        written = [identifier for identifier in identifiers if self.holds(identifier)]
        self._evict()
        return written

    @contextmanager
    def hold(self, identifiers: list[str]) -> Iterator[None]:
        """Keep these images while a request's prompt is computed from them."""
        for identifier in identifiers:
            self._held[identifier] = self._held.get(identifier, 0) + 1
        try:
            yield
        finally:
            for identifier in identifiers:
                self._held[identifier] -= 1
                if not self._held[identifier]:
                    del self._held[identifier]

    def claim(self, identifier: str) -> bool:
        """Whether this front door is to have the image encoded: True unless another front door
        sharing the folder claimed it first, less than :data:`CLAIM_STALE_S` ago. A front door
        alone in the folder needs no claim (its own requests wait on one another in memory).
        A folder that refuses the claim (full, read-only, gone) costs a duplicate encode at
        worst, never the request: True."""
        if not self.in_use_s:
            return True
        path = self._claim_file(identifier)
        try:
            for _ in range(2):
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    return True
                except FileExistsError:
                    try:
                        if time.time() - os.stat(path).st_mtime < CLAIM_STALE_S:
                            return False
                        os.unlink(path)  # its front door died mid-encode: take it over
                    except FileNotFoundError:
                        pass  # released meanwhile: claim it again
        except OSError as error:
            logger.warning("encoder cache: cannot claim %s in %s (%s); encoding it here", identifier, self.folder, error)
        return True

    def claimed_elsewhere(self, identifier: str) -> bool:
        """Whether another front door's claim on the image still stands (its encode under way)."""
        try:
            return time.time() - os.stat(self._claim_file(identifier)).st_mtime < CLAIM_STALE_S
        except OSError:  # released, or the folder cannot be read: its prefill encodes it
            return False

    def release(self, identifiers: Iterable[str]) -> None:
        """This front door's encode of these images is over, written or not."""
        if not self.in_use_s:
            return
        for identifier in identifiers:
            try:
                os.unlink(self._claim_file(identifier))
            except OSError:  # gone already (taken over as stale, or never made)
                pass

    def _claim_file(self, identifier: str) -> str:
        # A dot name: never an entry (entry_file), so indexing and vLLM's connector pass it by.
        return os.path.join(self.folder, f".{identifier}.encoding")

    def _evict(self) -> None:
        total = self.bytes
        recent = time.time() - self.in_use_s
        for identifier in list(self._sizes):
            if total <= self.capacity_bytes:
                return
            if identifier in self._held or (self.in_use_s and self._used_elsewhere_since(identifier, recent)):
                continue
            total -= self._sizes.pop(identifier)
            self._touched.pop(identifier, None)
            shutil.rmtree(os.path.join(self.folder, identifier), ignore_errors=True)
            self.evictions += 1
        if total > self.capacity_bytes:
            logger.warning(
                "encoder cache over its capacity (%d of %d bytes): every image in it is being read, or was used by "
                "another front door in the last %.0f s", total, self.capacity_bytes, self.in_use_s,
            )

    def _used_elsewhere_since(self, identifier: str, since: float) -> bool:
        """Whether another front door used the image's file since ``since`` (its stamp is newer
        than this index's own)."""
        try:
            stamped = os.stat(entry_file(self.folder, identifier)).st_mtime
        except OSError:
            return False
        return stamped > since and stamped > self._touched.get(identifier, 0.0)
