"""duet's gRPC server: the ``duet.v1.Duet`` service, health checking and reflection.

Requests are validated before they reach a worker (INVALID_ARGUMENT naming the field), admitted
up to ``server.max_inflight_requests`` (beyond it RESOURCE_EXHAUSTED: backpressure the client can
retry on, not an unbounded queue), then run by :class:`RequestLifecycle`. A malformed message,
including a string field that is not UTF-8, is answered with INVALID_ARGUMENT too, instead of the
INTERNAL error grpc would give for a message it cannot parse.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duet.router.lifecycle import RequestFailed, RequestLifecycle, StreamEvent
from duet.router.pools import NoWorkerAvailable
from duet.router.proto import duet_api_pb2 as pb
from duet.router.status import ClusterView
from duet.router.validation import InvalidRequest, ModelLimits, Tokenizer, validate
from duet.router.wire import describe_decode_error

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Duet"].full_name

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


def _parse_generate_request(data: bytes) -> pb.GenerateRequest | MalformedRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError:
        return MalformedRequest(describe_decode_error(pb.GenerateRequest.DESCRIPTOR, data))


class DuetServicer:
    def __init__(
        self,
        lifecycle: RequestLifecycle,
        limits: ModelLimits,
        tokenizer: Tokenizer,
        cluster: ClusterView,
        max_inflight: int,
    ) -> None:
        self.lifecycle = lifecycle
        self.limits = limits
        self.tokenizer = tokenizer
        self.cluster = cluster
        self.max_inflight = max_inflight

    async def Generate(
        self, request: pb.GenerateRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, MalformedRequest):
            self.cluster.reject("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
        try:
            validated = validate(request, self.limits, self.tokenizer)
        except InvalidRequest as error:
            self.cluster.reject("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if self.cluster.inflight >= self.max_inflight:
            self.cluster.reject("overloaded")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.cluster.inflight} requests in flight (limit {self.max_inflight}); retry later",
            )
        self.cluster.admit()
        outcome, usage = "failed", None
        try:
            async for event in self.lifecycle.run(validated):
                usage = event.usage or usage
                yield _response(validated.request_id, event)
            outcome = "served"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except (RequestFailed, NoWorkerAvailable) as error:
            logger.warning("request %s failed: %s", validated.request_id, error)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {validated.request_id} failed: {error}")
        except Exception as error:
            logger.exception("request %s failed", validated.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {validated.request_id} failed: {error}")
        finally:
            self.cluster.finish(outcome, usage)

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        return await self.cluster.status()


def _response(request_id: str, event: StreamEvent) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id, token_ids=event.token_ids, text=event.text)
    if event.finish_reason is not None:
        response.finish_reason = _FINISH[event.finish_reason]
    if event.usage is not None:
        response.usage.CopyFrom(pb.Usage(**vars(event.usage)))
    return response


def _generic_handler(servicer: DuetServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with our own request parser for Generate."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.ClusterStatus.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


async def start_server(servicer: DuetServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (``port=0`` picks a free one)."""
    # No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_generic_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (is another duet server running?)")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound

