"""The one serving path both front ends (gRPC and OpenAI HTTP) call.

A front end turns its wire request into a :class:`ValidatedRequest` and its credentials into a
:class:`Caller`; everything after that is shared: the caller's quota, the deployment's admission
limit (backpressure instead of an unbounded queue), the request lifecycle across the pools, and
the accounting behind ``duet status`` and the metrics. Each front end maps the exceptions below
to its own status codes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from duet.router.auth import Caller, Gatekeeper, QuotaExceeded, Unauthenticated
from duet.router.lifecycle import RequestCrashesEngines, RequestFailed, RequestLifecycle, StreamEvent
from duet.router.rebalancer import Rebalancer
from duet.router.load_meter import LoadMeter
from duet.router.pools import NoWorkerAvailable
from duet.router.status import ClusterView
from duet.router.validation import ModelLimits, Tokenizer, ValidatedRequest

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """The deployment is at its admission limit (RESOURCE_EXHAUSTED / 429)."""

    retry_after_s = 1.0


class Unavailable(Exception):
    """The request could not be served: no ready worker, or every attempt failed (UNAVAILABLE / 503)."""


@dataclass
class RequestService:
    lifecycle: RequestLifecycle
    limits: ModelLimits
    tokenizer: Tokenizer
    cluster: ClusterView
    gatekeeper: Gatekeeper
    max_inflight: int
    # What the autoscaler reads: arrivals, first tokens and completions as they happen.
    load: LoadMeter = field(default_factory=LoadMeter)
    # Moves requests off an overfull decode worker while the front door serves (router.rebalance_kv_gap).
    rebalancer: Rebalancer | None = None

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header (or gRPC metadata) value names; raises
        Unauthenticated (counted) without a valid key."""
        try:
            return self.gatekeeper.authenticate_header(authorization)
        except Unauthenticated:
            self.cluster.reject("unauthenticated")
            raise

    def is_ready(self) -> bool:
        """Whether every pool has a ready worker, so a request would be served now."""
        return all(any(m.state == "ready" for m in pool.members) for pool in self.cluster.pools)

    async def generate(self, request: ValidatedRequest, caller: Caller) -> AsyncIterator[StreamEvent]:
        """Serve ``request`` for ``caller``, streaming its events.

        Raises QuotaExceeded or Overloaded before any worker is touched, Unavailable when it
        cannot be served, RequestCrashesEngines when it must not be retried; a consumer that stops early (client gone) aborts it on the workers.
        """
        try:
            caller.acquire()
        except QuotaExceeded:
            self.cluster.reject("quota")
            raise
        try:
            if self.cluster.inflight >= self.max_inflight:
                self.cluster.reject("overloaded")
                raise Overloaded(f"{self.cluster.inflight} requests in flight (limit {self.max_inflight}); retry later")
            self.cluster.admit()
            handle = self.load.arrived(len(request.prompt_token_ids))
            outcome, usage, first = "failed", None, True
            try:
                # aclosing: a consumer that stops early aborts the request on its workers now,
                # not whenever the garbage collector finalizes the generator.
                async with aclosing(self.lifecycle.run(request)) as events:
                    async for event in events:
                        if first and event.token_ids:
                            self.load.first_token(handle)
                            first = False
                        usage = event.usage or usage
                        yield event
                outcome = "served"
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            except (RequestFailed, NoWorkerAvailable) as error:
                logger.warning("request %s failed: %s", request.request_id, error)
                raise Unavailable(f"request {request.request_id} failed: {error}") from error
            except RequestCrashesEngines as error:
                logger.error("request %s failed, not retried: %s", request.request_id, error)
                raise
            finally:
                self.cluster.finish(outcome, usage)
                self.load.left(handle, usage if outcome == "served" else None)
        finally:
            caller.release()
