"""A served model with SIMULATED workers, for tests of the control plane's handling of several
models (SIMULATED engines start in seconds and compute nothing: worker_runtime/simulated_engine.py;
imported by module name: tests/ is on the path)."""

from __future__ import annotations

from typing import Any


def simulated_model(name: str, replicas: int = 1) -> dict[str, Any]:
    """One entry of a config's ``models:`` (or an AddModel body): the built-in model's tokenizer,
    ``replicas`` SIMULATED prefill and decode workers each, on no core of their own."""
    pool = {"engine": "simulated", "replicas": replicas, "num_cpus": 0.01, "cpu_cores": None}
    return {"model": {"name": name, "path": "builtin"}, "mode": "disaggregated", "prefill": pool, "decode": dict(pool)}
