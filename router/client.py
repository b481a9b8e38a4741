"""Python client for duet's gRPC API (used by the CLI and the tests)."""

from __future__ import annotations

from typing import Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.router.proto import duet_api_pb2 as pb
from duet.router.proto import duet_api_pb2_grpc as pb_grpc
from duet.router.tls import grpc_channel_credentials

DEFAULT_TARGET = "127.0.0.1:50051"


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Iterable[int] | None = None,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    model: str = "",
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; exactly one of prompt / prompt_token_ids."""
    request = pb.GenerateRequest(
        model=model,
        max_tokens=max_tokens,
        request_id=request_id,
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        stop=pb.StopConditions(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos),
    )
    if prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    elif prompt is not None:
        request.prompt = prompt
    return request


class DuetClient:
    """A blocking client; one channel, safe to share across threads.

    ``api_key`` is sent as ``authorization: Bearer KEY`` metadata on every call. With
    ``tls_ca`` (the CA that signed the server's certificate) the channel uses TLS; add
    ``tls_cert`` and ``tls_key`` for a server that requires client certificates.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self.target = target
        # A connection of its own: gRPC otherwise shares one among every channel of a process
        # to the same target, and with several front doors behind one port (the kernel picks
        # one per connection) every client of a process would reach the same front door.
        options = [("grpc.use_local_subchannel_pool", 1)]
        if tls_ca or tls_cert:
            self._channel = grpc.secure_channel(target, grpc_channel_credentials(tls_ca, tls_cert, tls_key), options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = pb_grpc.DuetStub(self._channel)
        self._admin = pb_grpc.AdminStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream responses; cancel by calling ``.cancel()`` on the returned iterator."""
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def generate_ids(self, request: pb.GenerateRequest, timeout: float | None = None) -> tuple[list[int], pb.GenerateResponse]:
        """Run a request to completion: all token ids and the final message (finish, usage)."""
        ids: list[int] = []
        last = pb.GenerateResponse()
        for last in self.generate(request, timeout=timeout):
            ids.extend(last.token_ids)
        return ids, last

    def status(self, timeout: float = 10.0) -> pb.ClusterStatus:
        return self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self._metadata)

    def scale(self, role: str, replicas: int, timeout: float = 30.0) -> list[str]:
        """Admin: grow or shrink pool ``role`` to ``replicas`` workers; what changed, a line each."""
        reply = self._admin.ScalePool(pb.ScalePoolRequest(role=role, replicas=replicas), timeout=timeout, metadata=self._metadata)
        return list(reply.changes)

    def drain(self, worker: str, timeout_s: float | None = None, timeout: float = 30.0) -> list[str]:
        """Admin: remove ``worker`` once its requests finish (or after ``timeout_s``)."""
        request = pb.DrainWorkerRequest(worker=worker, timeout_s=timeout_s)
        return list(self._admin.DrainWorker(request, timeout=timeout, metadata=self._metadata).changes)

    def list_workers(self, timeout: float = 10.0) -> pb.ClusterStatus:
        return self._admin.ListWorkers(pb.GetStatusRequest(), timeout=timeout, metadata=self._metadata)

    def is_serving(self, timeout: float = 2.0) -> bool:
        """Whether the standard gRPC health service reports duet as SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service="duet.v1.Duet"), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "DuetClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
