"""duet's gRPC server: the ``duet.v1.Duet`` service, health checking and reflection.

Callers present their API key as ``authorization: Bearer KEY`` metadata (UNAUTHENTICATED
without a valid one, when keys are configured). Requests are validated before they reach a
worker (INVALID_ARGUMENT naming the field), then served by the shared :class:`RequestService`:
a key over its quota or a deployment at ``server.max_inflight_requests`` gets
RESOURCE_EXHAUSTED with a ``retry-after`` (seconds) trailing-metadata hint, backpressure the
client can retry on rather than an unbounded queue. A malformed message,
including a string field that is not UTF-8, is answered with INVALID_ARGUMENT too, instead of the
INTERNAL error grpc would give for a message it cannot parse.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duet.config import TlsConfig
from duet.router.auth import Caller, ModelNotAllowed, QuotaExceeded, Unauthenticated
from duet.router.lifecycle import RequestCrashesEngines, StreamEvent
from duet.router.proto import duet_api_pb2 as pb
from duet.router.served_models import ServedModels
from duet.router.serving import Overloaded, RequestService, Unavailable, sequences
from duet.router.tls import grpc_server_credentials
from duet.router.validation import InvalidRequest
from duet.worker_runtime.worker_api import PositionLogprobs
from duet.router.wire import describe_decode_error

if TYPE_CHECKING:
    from duet.router.admin import AdminServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Duet"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name
# A grpc.health.v1 service name that is SERVING as long as the server runs, whatever the pools'
# state: a liveness probe on it restarts a hung process, never one whose workers are restarting
# (readiness, on the default service "", follows the pools; see report_readiness).
LIVENESS_SERVICE = "liveness"

_FINISH = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request that could not be parsed, so the handler can explain why."""

    problem: str


def _parser(message_type: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    """A request deserializer that never raises: bytes that are not a ``message_type`` become a
    MalformedRequest, which the method refuses with INVALID_ARGUMENT (gRPC's own deserializer
    would end the call with UNKNOWN or INTERNAL before duet's code runs)."""

    def parse(data: bytes) -> Message | MalformedRequest:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return MalformedRequest(describe_decode_error(message_type.DESCRIPTOR, data))

    return parse


async def refuse_malformed(request: object, context: grpc.aio.ServicerContext) -> None:
    """Abort INVALID_ARGUMENT, naming what could not be parsed, if ``request`` did not parse.
    Called after authentication, so an unauthenticated caller learns nothing more."""
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)


def add_parsing_handlers(server: grpc.aio.Server, service_name: str, servicer: object) -> None:
    """Serve every method of a duet.v1 service on ``server``, its requests parsed by
    :func:`_parser`, in place of the generated ``add_*Servicer_to_server``.

    Registered (grpc core matches the method itself) as well as generic: a call to a registered
    method skips the Python lookup through every generic handler of the server."""
    service = pb.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[-1]]
    handlers = {}
    for method in service.methods:
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)


async def authenticated_caller(service: RequestService, context: grpc.aio.ServicerContext) -> Caller:
    """The caller named by a call's ``authorization`` metadata; aborts UNAUTHENTICATED otherwise.

    Every duet gRPC service (Duet, Admin) authenticates through this one path."""
    metadata = dict(context.invocation_metadata() or ())
    try:
        return service.authenticate(metadata.get("authorization"))
    except Unauthenticated as error:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        raise  # unreachable: abort raises


class DuetServicer:
    """The gRPC front end: credentials from the ``authorization`` metadata, the rest through
    the shared :class:`RequestService`."""

    def __init__(self, served: ServedModels) -> None:
        self.models = served
        # Keys, admission, accounting and status are shared by every model: the default's.
        self.service = served.default

    async def Generate(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        caller = await authenticated_caller(self.service, context)
        if isinstance(request, MalformedRequest):
            self.service.cluster.reject("invalid")
            await refuse_malformed(request, context)
        try:
            service = self.models.for_model(request.model)
            validated = await service.validate(request)
            await service.check_constraints([validated])
        except InvalidRequest as error:
            self.service.cluster.reject("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Unavailable as error:  # no worker to check its images with (RequestService.image_check)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        try:
            async for index, event in service.generate_sequences(sequences(validated), caller):
                yield _response(validated.request_id, index, event)
        except (QuotaExceeded, Overloaded) as error:
            # The retry hint travels as trailing metadata, in whole seconds (at least 1).
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                str(error),
                trailing_metadata=(("retry-after", str(max(1, math.ceil(error.retry_after_s)))),),
            )
        except ModelNotAllowed as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except Unavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except RequestCrashesEngines as error:  # INTERNAL: a status clients do not retry
            await context.abort(grpc.StatusCode.INTERNAL, f"request {validated.request_id} failed: {error}")
        except Exception as error:
            logger.exception("request %s failed", validated.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {validated.request_id} failed: {error}")

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        await authenticated_caller(self.service, context)
        await refuse_malformed(request, context)
        return await self.service.cluster.status()


def _response(request_id: str, index: int, event: StreamEvent) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, index=index, token_ids=event.token_ids, text=event.text)
    if event.finish_reason is not None:
        response.finish_reason = _FINISH[event.finish_reason]
    if event.usage is not None:
        response.usage.CopyFrom(pb.Usage(**vars(event.usage)))
    if event.logprobs is not None:
        response.logprobs.extend(_positions(event.logprobs))
    if event.prompt_logprobs is not None:
        response.prompt_logprobs.extend(_positions(event.prompt_logprobs))
    return response


def _positions(positions: list[PositionLogprobs | None]) -> list[pb.PositionLogprobs]:
    return [
        pb.PositionLogprobs(entries=[
            pb.TokenLogprob(token_id=token_id, logprob=entry.logprob, rank=entry.rank or 0, text=entry.decoded_token or "")
            for token_id, entry in (position or {}).items()
        ])
        for position in positions
    ]


async def start_server(
    servicer: DuetServicer,
    host: str,
    port: int,
    tls: TlsConfig | None = None,
    admin: "AdminServicer | None" = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start serving; returns the server, the bound port (``port=0`` picks a free one) and the
    health service (see :func:`report_readiness`).

    Health checking and reflection need no API key (probes and tooling); with ``tls`` every
    service is served over TLS only. ``reuse_port`` shares the port with the deployment's other
    front doors (SO_REUSEPORT: the kernel spreads new connections among them); without it a
    second server on a taken port fails instead of sharing it silently.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(reuse_port))])
    add_parsing_handlers(server, SERVICE_NAME, servicer)
    services = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    if admin is not None:
        add_parsing_handlers(server, ADMIN_SERVICE_NAME, admin)
        services.append(ADMIN_SERVICE_NAME)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(services, server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, grpc_server_credentials(tls)) if tls else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (is another duet server running?)")
    await server.start()
    return server, bound, health_servicer


async def report_readiness(health_servicer: health.aio.HealthServicer, is_ready: Callable[[], bool]) -> None:
    """Keep the health service's status in step with ``is_ready`` (runs until cancelled).

    SERVING while every pool has a ready worker, NOT_SERVING otherwise, checked every second,
    like HTTP ``/health``: a load balancer or a Kubernetes readiness probe then takes a
    deployment without workers out of rotation.
    """
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if is_ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, status)
        await asyncio.sleep(1.0)

