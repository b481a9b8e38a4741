"""The private channel between the front doors and the control plane (Admin calls, status).

A front door authorizes its caller itself, then carries Admin calls and status requests to the
control plane (router/admin.py), whose server trusts what arrives. On one host that server
listens on a Unix socket only its own user can reach. Front doors on hosts of their own
(``server.front_end_placement: nodes``) reach it over TCP, so there every call carries a
token that only the deployment's own actors are given (over Ray, which authenticates its
nodes), and a call without it is refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
from typing import Any

import grpc

from duet.router.proto import duet_api_pb2_grpc as pb_grpc
from duet.router.server import ADMIN_SERVICE_NAME, add_parsing_handlers

# The metadata key that carries the control plane's token.
TOKEN_KEY = "duet-control-token"


class _RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        given = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(str(given).encode(), self._token):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the control plane's private API needs its token")

        return grpc.unary_unary_rpc_method_handler(refuse)


class _AddToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), (TOKEN_KEY, self._token)]
        return await continuation(details._replace(metadata=metadata), request)


async def start_control_server(address: str, admin: Any, token: str | None) -> Any:
    """The control plane's private gRPC server at ``address`` (``unix:PATH``, or ``HOST:PORT``
    with a ``token``)."""
    server = grpc.aio.server(interceptors=[_RequireToken(token)] if token else None)
    add_parsing_handlers(server, ADMIN_SERVICE_NAME, admin)
    server.add_insecure_port(address)
    await server.start()
    return server


def control_stub(address: str, token: str | None) -> tuple[grpc.aio.Channel, pb_grpc.AdminStub]:
    """A front door's channel to the control plane, adding the token to every call."""
    channel = grpc.aio.insecure_channel(address, interceptors=[_AddToken(token)] if token else None)
    return channel, pb_grpc.AdminStub(channel)
