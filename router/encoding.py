"""The encode step of E+P+D: a request's images encoded by the encode pool before its prompt is
computed, once per distinct image across the deployment.

Before a prefill worker computes a prompt with images, the router looks each image up in the
encoder cache (kv_transfer/encoder_cache.py) by its digest. The images not there go to an
encode worker, in one request, and the prefill waits for it; an image another request is
encoding already is waited for, not encoded again: in this front door's memory, and across front
doors apart by a claim in the cache's folder (:meth:`EncoderCacheFolder.claim`). The prefill
engine then loads every image's output from the cache instead of running the encoder. Text-only
requests skip the step.

Nothing here can fail a request: if the encode pool has no worker ready, or the worker dies or
refuses, the prefill engine finds no output for those images and runs the encoder itself, as in
EP+D (the dead worker is taken out of rotation and replaced as in every pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from duet.kv_transfer.encoder_cache import EncoderCacheFolder
from duet.router.metrics import RouterMetrics
from duet.router.pools import NoWorkerAvailable, WorkerPool
from duet.router.worker_engines import EngineLost, EngineRejected
from duet.worker_runtime.images import image_digest

if TYPE_CHECKING:  # the load meter reads the lifecycle's usage type, and the lifecycle this step
    from duet.router.load_meter import LoadMeter

logger = logging.getLogger(__name__)

# How often a request waiting for another front door's encode of an image looks for its file.
ELSEWHERE_POLL_S = 0.02


class EncodeStep:
    """Has the encode pool encode a request's images into the encoder cache."""

    def __init__(self, pool: WorkerPool, cache: EncoderCacheFolder, metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.cache = cache
        # Images by outcome, for status and metrics: "encoded" by the encode pool, "cache_hit"
        # (in the cache, or being encoded for another request), "fallback" (left to the prefill
        # engine because no encode worker could take them).
        self.counts: Counter[str] = Counter()
        self.metrics = metrics
        self.encode_seconds = 0.0  # waited on the encode pool, summed over requests
        # The serving path's load meter, told each encode's wait and fallbacks (the autoscaler
        # sizes the encode pool by them: cluster/autoscaler/encode_pool.py).
        self.load: LoadMeter | None = None
        self._encoding: dict[str, asyncio.Future[bool]] = {}  # digest -> whether any output was written

    @asynccontextmanager
    async def encoded(self, request_id: str, images: tuple[bytes, ...]) -> AsyncIterator[None]:
        """The request's images encoded into the cache (where an encode worker could) and kept
        there while the body runs: the prefill that loads them."""
        digests = await asyncio.to_thread(lambda: [image_digest(data) for data in images])  # up to 80 MiB to hash
        with self.cache.hold(digests):
            await self._encode_missing(request_id, dict(zip(digests, images)))
            yield

    async def _encode_missing(self, request_id: str, images: dict[str, bytes]) -> None:
        waits, elsewhere, missing, found = [], [], {}, 0
        for digest, data in images.items():
            if digest in self._encoding:
                waits.append((digest, self._encoding[digest]))
            elif self.cache.holds(digest):
                found += 1
            elif not self.cache.claim(digest):
                elsewhere.append(digest)
            else:
                missing[digest] = data
        self._count("cache_hit", found)
        if missing:
            await self._encode_now(request_id, missing)
        for digest, wait in waits:  # another request is encoding it: a hit once it is written
            written = await asyncio.shield(wait)
            self._count("cache_hit" if written and self.cache.holds(digest) else "fallback", 1)
        for digest in elsewhere:
            self._count("cache_hit" if await self._written_elsewhere(digest) else "fallback", 1)

    async def _written_elsewhere(self, digest: str) -> bool:
        """Wait while another front door's encode of the image is under way; whether its output
        is in the cache then (if not, this request's prefill encodes it)."""
        while not self.cache.holds(digest):
            if not self.cache.claimed_elsewhere(digest):
                return self.cache.holds(digest)  # written just before its claim was released, or never
            await asyncio.sleep(ELSEWHERE_POLL_S)
        return True

    async def _encode_now(self, request_id: str, missing: dict[str, bytes]) -> None:
        """Encode ``missing`` for this request, the requests that want the same images waiting
        on it; count what reached the cache."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        for digest in missing:
            self._encoding[digest] = done
        started = time.perf_counter()
        try:
            await self._encode(request_id, tuple(missing.values()))
        finally:
            # Whatever became of it (cancelled too), index what the encode worker wrote, and
            # let the requests waiting on it go on.
            present = self.cache.added(missing)
            self.cache.release(missing)
            done.set_result(bool(present))
            for digest in missing:
                del self._encoding[digest]
            waited = time.perf_counter() - started
            self.encode_seconds += waited
        # What is not in the cache now its prefill encodes: the encode worker failed, or it held
        # the image's output in memory from an earlier request (its file since removed to make
        # room) and answered without writing it again (vLLM's connector saves what it computes).
        self._count("encoded", len(present))
        self._count("fallback", len(missing) - len(present))
        if self.load is not None:
            self.load.encoded(waited, len(missing) - len(present))

    async def _encode(self, request_id: str, images: tuple[bytes, ...]) -> None:
        """Encode ``images`` on an encode worker; nothing (the prefill engine encodes them) if
        none is ready or it failed."""
        try:
            worker = self.pool.pick()
        except NoWorkerAvailable:
            return
        engine = worker.engine
        if engine is None:  # removed since it was picked
            return
        worker.inflight += 1
        try:
            await engine.encode(f"{request_id}-encode", images)
        except (EngineLost, EngineRejected) as error:
            if isinstance(error, EngineLost):
                self.pool.mark_failed(worker, error, engine)
            logger.warning("request %s: encode worker %s failed (%s); its prefill encodes its images", request_id, worker.name, error)
        finally:
            worker.inflight -= 1

    def _count(self, outcome: str, images: int) -> None:
        if not images:
            return
        self.counts[outcome] += images
        if self.metrics is not None:
            self.metrics.images.labels(outcome, self.pool.model).inc(images)
