"""The ``duet.v1.Admin`` gRPC service: scale pools, drain workers, list them with their states,
load and unload LoRA adapters, add and remove models.

It only translates: the pools are changed by the deployment's pool managers
(cluster/pool_manager.py), reached through :class:`PoolOperator`. When API keys are configured
only keys marked ``admin: true`` may call it (PERMISSION_DENIED otherwise).
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Protocol

import grpc

from duet.router.lora_adapters import AdapterError
from duet.router.pools import ScaleError
from duet.router.proto import duet_api_pb2 as pb
from duet.router.proto import duet_api_pb2_grpc as pb_grpc
from duet.router.server import authenticated_caller, refuse_malformed
from duet.router.served_models import ModelChangeError
from duet.router.serving import RequestService


class PoolOperator(Protocol):
    """What the Admin service needs from a deployment."""

    def scale(self, role: str, replicas: int, model: str = "") -> list[str]: ...

    def drain(self, worker: str, timeout_s: float | None) -> str: ...

    async def load_adapter(self, name: str, path: str, model: str = "") -> str: ...

    async def unload_adapter(self, name: str) -> str: ...

    async def add_model(self, model_config: str) -> list[str]: ...

    async def remove_model(self, name: str, timeout_s: float | None) -> list[str]: ...


class AdminServicer:
    def __init__(self, service: RequestService, operator: PoolOperator, trusted: bool = False) -> None:
        """``trusted``: served on the control plane's private socket, whose only callers are
        the deployment's front doors, which authorized the caller already (:class:`ForwardingAdmin`)."""
        self.service = service
        self.operator = operator
        self.trusted = trusted

    async def _authorize(self, request: object, context: grpc.aio.ServicerContext) -> None:
        """The caller must hold an admin key; then a request that did not parse is refused."""
        if not self.trusted:
            caller = await authenticated_caller(self.service, context)
            if not caller.admin:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"API key {caller.name!r} is not an admin key")
        await refuse_malformed(request, context)

    async def ScalePool(self, request: pb.ScalePoolRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await self._change(context, lambda: self.operator.scale(request.role, request.replicas, request.model))

    async def DrainWorker(self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        if not request.worker:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker: required (a name from ListWorkers)")
        timeout = request.timeout_s if request.HasField("timeout_s") else None
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be a finite number >= 0, got {timeout}")
        return await self._change(context, lambda: [self.operator.drain(request.worker, timeout)])

    async def ListWorkers(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        await self._authorize(request, context)
        return await self.service.cluster.status()

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _adapter_change(context, self.operator.load_adapter(request.lora_name, request.lora_path, request.model))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _adapter_change(context, self.operator.unload_adapter(request.lora_name))

    async def AddModel(self, request: pb.AddModelRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _model_change(context, self.operator.add_model(request.model_config))

    async def RemoveModel(self, request: pb.RemoveModelRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        timeout = request.timeout_s if request.HasField("timeout_s") else None
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be a finite number >= 0, got {timeout}")
        return await _model_change(context, self.operator.remove_model(request.model, timeout))

    @staticmethod
    async def _change(context: grpc.aio.ServicerContext, change: Callable[[], list[str]]) -> pb.AdminReply:
        try:
            return pb.AdminReply(changes=change())
        except ScaleError as error:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if error.out_of_resources else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(error))
            raise  # unreachable: abort raises


class ForwardingAdmin(AdminServicer):
    """The Admin service of a front door in a process of its own: it authorizes the
    caller as every front door does, then carries the call to the control plane over its
    private channel (the pools are changed there). Errors come back with the control plane's
    status code and message. ``control`` gives the channel's current stub: a control plane
    started again may be reached at another address (router/front_door.py, ``control_at``)."""

    def __init__(self, service: RequestService, control: Callable[[], "pb_grpc.AdminStub"]) -> None:
        super().__init__(service, operator=None)  # type: ignore[arg-type]
        self.control = control

    async def ScalePool(self, request: pb.ScalePoolRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().ScalePool(request))

    async def DrainWorker(self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().DrainWorker(request))

    async def ListWorkers(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        await self._authorize(request, context)
        return await _forward(context, self.control().ListWorkers(request))

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().LoadLoraAdapter(request))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().UnloadLoraAdapter(request))

    async def AddModel(self, request: pb.AddModelRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().AddModel(request))

    async def RemoveModel(self, request: pb.RemoveModelRequest, context: grpc.aio.ServicerContext) -> pb.AdminReply:
        await self._authorize(request, context)
        return await _forward(context, self.control().RemoveModel(request))


async def _adapter_change(context: grpc.aio.ServicerContext, change: Awaitable[str]) -> pb.AdminReply:
    try:
        return pb.AdminReply(changes=[await change])
    except AdapterError as error:
        await context.abort(_ADAPTER_ERROR_CODES[error.kind], str(error))
        raise  # unreachable: abort raises


async def _model_change(context: grpc.aio.ServicerContext, change: Awaitable[list[str]]) -> pb.AdminReply:
    try:
        return pb.AdminReply(changes=await change)
    except ModelChangeError as error:
        await context.abort(_MODEL_ERROR_CODES[error.kind], str(error))
        raise  # unreachable: abort raises


_MODEL_ERROR_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
_ADAPTER_ERROR_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "off": grpc.StatusCode.FAILED_PRECONDITION,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


async def _forward(context: grpc.aio.ServicerContext, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            await context.abort(code, f"the control plane cannot be reached: {error.details()}")
        await context.abort(code, error.details() or str(code))
        raise  # unreachable: abort raises
