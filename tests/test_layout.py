"""The layout keeps the control plane and the serving path apart (docs/concepts/architecture.md).

- router/ is the serving path (front doors: APIs, validation, admission, routing, the request
  lifecycle), and batch/ the batch jobs every front door runs. Neither imports anything of the
  control plane, so a front door runs without it.
- cluster/ is the control plane (pools, health, front doors' membership, autoscaling,
  placement, deployment). It builds and tells front doors through their interface only.
- worker_runtime/, prefill_worker/, decode_worker/ and kv_transfer/ are the workers' side and
  import neither (the SIMULATED engine borrows the placement planner's latency model only).
- duet/config.py and worker_runtime/worker_api.py are the vocabulary everyone shares.

Read from the source's import statements (function-level ones included), so a new import
that crosses a line fails here with the file and module named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the control plane may use of the serving path: the front-door actor and how a front door
# is assembled, the membership interface (pools and the engines' front ends in them), the
# Admin service it answers, the LoRA adapters it serves, and the status and metrics views. Not its internals: routing
# policies, the request lifecycle, validation, the wire formats, the API servers themselves.
SERVING_PATH_INTERFACE = {
    "actor_channel",
    "admin",
    "assembly",
    "auth",
    "control_channel",
    "engine_front_end",
    "front_door",
    "front_ends",
    "load_meter",
    "lora_adapters",
    "metrics",
    "pools",
    "proto",
    "served_models",
    "serving",
    "status",
    "worker_engines",
}


def duet_imports(folder: str) -> list[tuple[str, str]]:
    """(file, imported duet module) for every import of a duet module under ``folder``."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), name) for name in names if name.startswith("duet.")]
    return found


def test_the_layout_is_what_this_test_reads():
    """Guards the rules below against passing vacuously after a rename."""
    assert len(duet_imports("router")) > 50
    assert len(duet_imports("cluster")) > 50
    assert any(module == "duet.router.front_door" for _, module in duet_imports("cluster"))


@pytest.mark.parametrize("folder", ["router", "batch"])
def test_serving_path_imports_nothing_of_the_control_plane(folder: str):
    """batch/ runs in every front door beside router/, so it keeps the same rule."""
    assert duet_imports(folder), f"{folder}/ imports no duet module: the rule would pass vacuously"
    crossing = [(file, module) for file, module in duet_imports(folder) if module.startswith("duet.cluster")]
    assert crossing == []


def test_control_plane_uses_only_the_serving_paths_interface():
    crossing = [
        (file, module)
        for file, module in duet_imports("cluster")
        if module.startswith("duet.router.") and module.split(".")[2] not in SERVING_PATH_INTERFACE
    ]
    assert crossing == []


@pytest.mark.parametrize("folder", ["worker_runtime", "prefill_worker", "decode_worker", "kv_transfer"])
def test_workers_import_neither(folder: str):
    crossing = [
        (file, module)
        for file, module in duet_imports(folder)
        if module.startswith("duet.router")
        or (module.startswith("duet.cluster") and not module.startswith("duet.cluster.placement"))
    ]
    assert crossing == []
