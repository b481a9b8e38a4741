"""How often an engine loaded a LoRA adapter: what adapter affinity in routing saves.

vLLM keeps a LoRA adapter in two caches, each least recently used out: the adapters read from
their directories into host memory (``max_cpu_loras``), and those active in one of the slots the
forward pass applies (``max_loras``, on a GPU its memory). A request for an adapter in neither is
read from disk first; one not in a slot is copied into one, evicting another. vLLM exports
neither count (``vllm:lora_requests_info`` names the adapters running and waiting, not the
loads), so an engine that swaps adapters all day looks the same as one that never does.

duet's vLLM plugin counts both in every duet engine's worker process (the model runner's LoRA
manager: :meth:`WorkerLoRAManager._load_adapter` reads, :meth:`LRUCacheLoRAModelManager.activate_adapter`
activates), and the engine core answers a utility call with the sums over its workers, which
``duet status`` shows per worker and ``duet bench affinity --adapters`` compares between
routing policies.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

ADAPTER_LOADS_METHOD = "duet_adapter_loads"
# This process's counts: "read" (from the adapter's directory) and "activated" (into a slot).
_LOADS: Counter[str] = Counter()


def _worker_loads(_worker: Any) -> dict[str, int]:
    """Runs in each of the engine's worker processes (``collective_rpc``)."""
    return dict(_LOADS)


def install() -> None:
    """Count adapter reads and slot activations in this process's LoRA managers, and give the
    engine core the utility call that sums them over its workers. Called by duet's vLLM
    plugin in each duet engine process (kv_transfer/vllm_plugin.py)."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.v1.engine.core import EngineCore

    if getattr(WorkerLoRAManager._load_adapter, "_duet_counted", False):
        return
    read = WorkerLoRAManager._load_adapter
    activate = LRUCacheLoRAModelManager.activate_adapter

    def counted_read(self: Any, lora_request: Any) -> Any:
        loaded = read(self, lora_request)
        _LOADS["read"] += 1
        return loaded

    def counted_activate(self: Any, lora_id: int) -> bool:
        activated = activate(self, lora_id)
        if activated:  # False: it was in a slot already
            _LOADS["activated"] += 1
        return activated

    def adapter_loads(self: Any) -> dict[str, int]:
        total: Counter[str] = Counter()
        for loads in self.model_executor.collective_rpc(_worker_loads):
            total.update(loads)
        return {"read": total["read"], "activated": total["activated"]}

    counted_read._duet_counted = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = counted_read  # type: ignore[method-assign]
    LRUCacheLoRAModelManager.activate_adapter = counted_activate  # type: ignore[method-assign]
    setattr(EngineCore, ADAPTER_LOADS_METHOD, adapter_loads)
