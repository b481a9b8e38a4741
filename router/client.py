"""Python client for duet's gRPC API (used by the CLI and the tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

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
    resume_after: Iterable[int] = (),
    n: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    include_stop_str_in_output: bool = False,
    images: Iterable[bytes] = (),
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; exactly one of prompt / prompt_token_ids.
    ``images`` are encoded image files, one per image placeholder in the prompt (a
    vision-language model). Further keywords are ``SamplingParams`` fields
    (``presence_penalty=0.5``, ``structured_output=pb.StructuredOutput(regex="[a-z]+")``...)."""
    request = pb.GenerateRequest(
        model=model,
        max_tokens=max_tokens,
        request_id=request_id,
        n=n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **sampling),
        stop=pb.StopConditions(
            stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
            include_stop_str_in_output=include_stop_str_in_output,
        ),
    )
    request.resume_after.ids.extend(resume_after)
    request.images.extend(pb.Image(data=data) for data in images)
    if prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    elif prompt is not None:
        request.prompt = prompt
    return request


class DuetClient:
    """A blocking client; safe to share across threads.

    ``target`` is one address (``host:port``), several separated by commas, or a list of them:
    the front doors of one deployment. A stream that breaks with UNAVAILABLE (its front door
    died) resumes on the next address, on a new connection (behind one address served by
    several front doors, the kernel gives it to a live one), from the tokens already received
    (``GenerateRequest.resume_after``), so a greedy stream is token-identical to an unbroken
    one and no token is repeated or skipped (:meth:`stream`).

    ``api_key`` is sent as ``authorization: Bearer KEY`` metadata on every call. With
    ``tls_ca`` (the CA that signed the server's certificate) the channel uses TLS; add
    ``tls_cert`` and ``tls_key`` for a server that requires client certificates.
    """

    # How often one stream resumes before its error is the caller's.
    max_resumes = 3

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        targets = target.split(",") if isinstance(target, str) else list(target)
        self.targets = [address.strip() for address in targets if address.strip()]
        if not self.targets:
            raise ValueError("target: no address given")
        self.target = self.targets[0]
        self._credentials = grpc_channel_credentials(tls_ca, tls_cert, tls_key) if tls_ca or tls_cert else None
        self._next_target = 0
        self._lock = threading.Lock()
        self.resumes = 0  # streams of this client that resumed on another front door
        self._connect()
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def _connect(self) -> None:
        """A new connection to the next address."""
        target = self.targets[self._next_target % len(self.targets)]
        self._next_target += 1
        # A connection of its own: gRPC otherwise shares one among every channel of a process
        # to the same target, and with several front doors behind one port (the kernel picks
        # one per connection) every client of a process would reach the same front door.
        options = [("grpc.use_local_subchannel_pool", 1)]
        if self._credentials is not None:
            self._channel = grpc.secure_channel(target, self._credentials, options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = pb_grpc.DuetStub(self._channel)
        self._admin = pb_grpc.AdminStub(self._channel)

    def _reconnect(self, broken: grpc.Channel) -> None:
        """Move to the next address, unless another thread did already."""
        with self._lock:
            if self._channel is broken:
                self._connect()
                broken.close()

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream responses over the current connection, as they come; cancel by calling
        ``.cancel()`` on the returned iterator. A broken stream is the caller's to resume:
        :meth:`stream` does it."""
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        """Stream responses; a stream that breaks with UNAVAILABLE resumes on another front
        door (the class docstring), at most :attr:`max_resumes` times."""
        received: list[int] = []
        for attempt in range(self.max_resumes + 1):
            resumed = pb.GenerateRequest()
            resumed.CopyFrom(request)
            resumed.resume_after.ids.extend(received)
            channel = self._channel
            try:
                for message in self.generate(resumed if received else request, timeout=timeout):
                    received.extend(message.token_ids)
                    yield message
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.max_resumes:
                    raise
                self.resumes += 1
                self._reconnect(channel)
        raise AssertionError("unreachable")  # every attempt returns or raises

    def generate_ids(self, request: pb.GenerateRequest, timeout: float | None = None) -> tuple[list[int], pb.GenerateResponse]:
        """Run a request to completion (resuming a broken stream): all token ids and the final
        message (finish, usage)."""
        ids: list[int] = []
        last = pb.GenerateResponse()
        for last in self.stream(request, timeout=timeout):
            ids.extend(last.token_ids)
        return ids, last

    def status(self, timeout: float = 10.0) -> pb.ClusterStatus:
        """The cluster's status, from another front door if this one cannot be reached."""
        return self._read(lambda: self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self._metadata))

    def _read(self, call: Callable[[], Any]) -> Any:
        """A call that changes nothing, tried on each address in turn while they are
        UNAVAILABLE (an Admin call that changes the cluster is not repeated: its error is the
        caller's)."""
        for attempt in range(len(self.targets)):
            channel = self._channel
            try:
                return call()
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == len(self.targets) - 1:
                    raise
                self._reconnect(channel)
        raise AssertionError("unreachable")  # every attempt returns or raises

    def scale(self, role: str, replicas: int, timeout: float = 30.0, model: str = "") -> list[str]:
        """Admin: grow or shrink pool ``role`` (of served ``model``; default: the default
        model) to ``replicas`` workers; what changed, a line each."""
        request = pb.ScalePoolRequest(role=role, replicas=replicas, model=model)
        reply = self._admin.ScalePool(request, timeout=timeout, metadata=self._metadata)
        return list(reply.changes)

    def drain(self, worker: str, timeout_s: float | None = None, timeout: float = 30.0) -> list[str]:
        """Admin: remove ``worker`` once its requests finish (or after ``timeout_s``)."""
        request = pb.DrainWorkerRequest(worker=worker, timeout_s=timeout_s)
        return list(self._admin.DrainWorker(request, timeout=timeout, metadata=self._metadata).changes)

    def load_lora_adapter(self, name: str, path: str, timeout: float = 60.0, model: str = "") -> str:
        """Admin: serve the LoRA adapter at ``path`` (on the workers' hosts) as model ``name``,
        on the served model ``model`` (default: the default model)."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path, model=model)
        return self._admin.LoadLoraAdapter(request, timeout=timeout, metadata=self._metadata).changes[0]

    def unload_lora_adapter(self, name: str, timeout: float = 30.0) -> str:
        """Admin: stop serving LoRA adapter ``name``."""
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return self._admin.UnloadLoraAdapter(request, timeout=timeout, metadata=self._metadata).changes[0]

    def add_model(self, model_config: str, timeout: float = 900.0) -> list[str]:
        """Admin: serve another model (``model_config``: one entry of ``models:``, YAML or
        JSON); returns once it serves, or after ``timeout`` seconds."""
        request = pb.AddModelRequest(model_config=model_config)
        return list(self._admin.AddModel(request, timeout=timeout, metadata=self._metadata).changes)

    def remove_model(self, name: str, timeout_s: float | None = None, timeout: float | None = None) -> list[str]:
        """Admin: stop serving model ``name`` once its requests finish (or after ``timeout_s``)."""
        request = pb.RemoveModelRequest(model=name, timeout_s=timeout_s)
        wait = timeout if timeout is not None else 30.0 + (timeout_s if timeout_s is not None else 120.0)
        return list(self._admin.RemoveModel(request, timeout=wait, metadata=self._metadata).changes)

    def list_workers(self, timeout: float = 10.0) -> pb.ClusterStatus:
        return self._read(lambda: self._admin.ListWorkers(pb.GetStatusRequest(), timeout=timeout, metadata=self._metadata))

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
