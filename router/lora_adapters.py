"""The LoRA adapters a deployment serves, and loading or unloading one while it serves.

Each adapter is a model name of its own on the base model. The control plane owns the list: an
Admin call (or vLLM's ``/v1/load_lora_adapter``, on any front door) reaches it, it checks the
adapter, preloads it on every engine and then tells every front door, whose requests resolve
model names against their copy (``ModelLimits.adapters``). vLLM's integer id for each load
comes from here and is never reused (with the name it makes the engines' name for the load,
worker_runtime/worker_api.py), so no engine can mistake a reloaded adapter for the one it
cached under the same name.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from duet.config import ADAPTER_NAME_PATTERN, ModelConfig, adapter_rank
from duet.worker_runtime.worker_api import ServedAdapter

_NAME = re.compile(ADAPTER_NAME_PATTERN)


class AdapterError(Exception):
    """A load or unload that cannot be done; ``kind`` says how the APIs answer it."""

    def __init__(self, kind: Literal["invalid", "not_found", "off", "unavailable"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


class AdapterAdmin(Protocol):
    """Loads and unloads adapters for the whole deployment (the control plane, or a front
    door's channel to it); each returns vLLM's success message or raises AdapterError."""

    async def load_adapter(self, name: str, path: str, model: str = "") -> str: ...

    async def unload_adapter(self, name: str) -> str: ...


def served_adapters(model: ModelConfig) -> tuple[ServedAdapter, ...]:
    """The config's adapters; vLLM's id for each is its place in the list (from 1)."""
    if model.lora is None:
        return ()
    return tuple(
        ServedAdapter(adapter.name, lora_id, _resolved(adapter.path))
        for lora_id, adapter in enumerate(model.lora.adapters, start=1)
    )


def _resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve())


class AdapterRegistry:
    """The adapters served now, with the checks vLLM's server makes before loading one."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.adapters = served_adapters(model)
        self._issued = {adapter.lora_id for adapter in self.adapters}

    def adopt(self, adapters: tuple[ServedAdapter, ...]) -> None:
        """Take over a running deployment's adapters (a control plane started again)."""
        self.adapters = adapters
        self._issued |= {adapter.lora_id for adapter in adapters}

    def _new_id(self) -> int:
        """An id for a load at run time: drawn at random above the config's (1..N), so that a
        control plane started again, which knows only the adapters served now, never gives an
        id an engine may still hold for an adapter unloaded before (a repeat is a 1 in 2^31
        chance per pair of loads)."""
        while True:
            lora_id = 1024 + secrets.randbelow(2**31 - 1025)
            if lora_id not in self._issued:
                self._issued.add(lora_id)
                return lora_id

    def new_adapter(self, name: str, path: str) -> ServedAdapter:
        """The adapter ``name`` at ``path`` would be served as; AdapterError if it may not be."""
        lora = self.model.lora
        if lora is None:
            raise AdapterError("off", f"LoRA is off for model {self.model.name!r}: set model.lora in its config to serve adapters")
        if not name or not path:
            raise AdapterError("invalid", "Both 'lora_name' and 'lora_path' must be provided.")
        if not _NAME.match(name):
            raise AdapterError("invalid", f"lora_name: {name!r} is not a plain name (letters, digits, '.', '_', '-'; at most 64)")
        if name == self.model.name:
            raise AdapterError("invalid", f"The lora adapter '{name}' conflicts with a served base model.")
        if self.serves(name):
            raise AdapterError("invalid", f"The lora adapter '{name}' has already been loaded.")
        try:
            rank = adapter_rank(path)
        except ValueError as error:
            raise AdapterError("invalid", f"lora_path: {error}") from None
        if rank > lora.max_lora_rank:
            raise AdapterError("invalid", f"lora_path: the adapter's rank {rank} is above model.lora.max_lora_rank ({lora.max_lora_rank})")
        return ServedAdapter(name, self._new_id(), _resolved(path))

    def serves(self, name: str) -> bool:
        """Whether an adapter named ``name`` is served now."""
        return any(adapter.name == name for adapter in self.adapters)

    def add(self, adapter: ServedAdapter) -> None:
        self.adapters = (*self.adapters, adapter)

    def remove(self, name: str) -> None:
        if not name:
            raise AdapterError("invalid", "'lora_name' needs to be provided to unload a LoRA adapter.")
        if not self.serves(name):
            raise AdapterError("not_found", f"The lora adapter '{name}' cannot be found.")
        self.adapters = tuple(adapter for adapter in self.adapters if adapter.name != name)


class ControlPlaneAdapters:
    """A front door's :class:`AdapterAdmin`: the call goes to the control plane over the
    private channel (``control`` gives its current stub), errors come back as AdapterError."""

    def __init__(self, control: Callable[[], Any]) -> None:
        self.control = control

    async def load_adapter(self, name: str, path: str, model: str = "") -> str:
        from duet.router.proto import duet_api_pb2 as pb

        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path, model=model)
        return await self._call(self.control().LoadLoraAdapter(request))

    async def unload_adapter(self, name: str) -> str:
        from duet.router.proto import duet_api_pb2 as pb

        return await self._call(self.control().UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name=name)))

    async def _call(self, call: Any) -> str:
        import grpc

        try:
            reply = await call
        except grpc.aio.AioRpcError as error:
            kinds = {
                grpc.StatusCode.NOT_FOUND: "not_found", grpc.StatusCode.FAILED_PRECONDITION: "off",
                grpc.StatusCode.INVALID_ARGUMENT: "invalid",
            }
            kind = kinds.get(error.code(), "unavailable")  # the control plane restarting, or not answering
            detail = error.details() or error.code().name
            raise AdapterError(kind, detail if kind != "unavailable" else f"the control plane cannot be reached: {detail}") from None
        return reply.changes[0] if reply.changes else ""
