"""Both front ends of one deployment, started and stopped together over its served models.

The gRPC API and the OpenAI HTTP API share the host, the TLS settings and the callers' keys and
quotas (held by the service's Gatekeeper). A deployment can open more than one pair, for
example a TLS pair beside a loopback one, all serving the same pools.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

from duet.batch.http_api import start_batch_jobs
from duet.config import ConfigError, ServerConfig
from duet.router.admin import AdminServicer
from duet.router.auth import Gatekeeper
from duet.router.http_server import OpenAIFrontEnd, start_http_server
from duet.router.server import DuetServicer, report_readiness, start_server
from duet.router.served_models import ServedModels
from duet.router.serving import RequestService
from duet.router.tls import http_ssl_context

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def check_exposure(server: ServerConfig, gatekeeper: Gatekeeper) -> str | None:
    """Refuse to serve a non-loopback address without authentication (API keys or client
    certificates) unless explicitly allowed.

    Returns a warning to print when it is allowed; raises ConfigError when it is not.
    """
    client_certificates = server.tls is not None and server.tls.client_ca_file is not None
    if is_loopback(server.host) or gatekeeper.enabled or client_certificates:
        return None
    if not server.allow_unauthenticated:
        raise ConfigError(
            f"server.host {server.host} is reachable from other machines and no API keys are configured: "
            "set server.auth.api_keys_file or $DUET_API_KEYS, or require client certificates "
            "(server.tls.client_ca_file; docs/guides/security.md), or pass "
            "--allow-unauthenticated to serve anyone who can connect"
        )
    return (
        f"serving {server.host} WITHOUT authentication (--allow-unauthenticated): anyone who can "
        "reach it can use this deployment"
    )


@dataclass
class FrontEnds:
    grpc_server: Any
    grpc_port: int
    http_runner: Any
    http_port: int | None
    # Keeping grpc.health.v1 in step with the pools.
    tasks: list[asyncio.Task[None]]
    # Each served model's decode-pool rebalancing (router.rebalance_kv_gap), by its service.
    rebalancing: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    @classmethod
    async def start(
        cls,
        served: ServedModels | RequestService,
        server: ServerConfig,
        grpc_port: int,
        http_port: int | None,
        admin: AdminServicer | None = None,
    ) -> "FrontEnds":
        """Start gRPC on ``grpc_port`` and HTTP on ``http_port`` (None: no HTTP; 0: any port)
        over ``served`` (one model's service, or several models'); with ``admin`` the gRPC
        server also serves the Admin service. With several front doors (``server.front_ends``)
        every one listens on the same ports."""
        models = served if isinstance(served, ServedModels) else ServedModels([served])
        reuse_port = server.front_ends > 1 and server.front_end_placement == "local"
        grpc_server, bound_grpc, health_service = await start_server(
            DuetServicer(models), server.host, grpc_port, server.tls, admin, reuse_port
        )
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(report_readiness(health_service, models.is_ready))]
        http_runner, bound_http = None, None
        if http_port is not None:
            front_end = OpenAIFrontEnd(models, server.http_max_body_bytes)
            batch_api, batch_runner = start_batch_jobs(front_end, server.batches, bound_grpc)
            front_end.more_routes.append(batch_api.add_routes)
            tasks.append(batch_runner)
            ssl_context = http_ssl_context(server.tls) if server.tls else None
            try:
                http_runner, bound_http = await start_http_server(
                    front_end, server.host, http_port, ssl_context, reuse_port
                )
            except OSError:
                for task in tasks:
                    task.cancel()
                await grpc_server.stop(grace=None)
                raise
        front_ends = cls(grpc_server, bound_grpc, http_runner, bound_http, tasks)
        for service in models.services:
            front_ends.start_rebalancing(service)
        return front_ends

    def start_rebalancing(self, service: RequestService) -> None:
        """Rebalance ``service``'s decode pool while serving, if its router asks for it."""
        if service.rebalancer is not None:
            self.rebalancing[id(service)] = asyncio.get_running_loop().create_task(service.rebalancer.run())

    def stop_rebalancing(self, service: RequestService) -> None:
        """Stop rebalancing ``service``'s decode pool (its model is no longer served)."""
        task = self.rebalancing.pop(id(service), None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        for task in [*self.tasks, *self.rebalancing.values()]:
            task.cancel()
        await self.grpc_server.stop(grace=2)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
