"""Shared fixtures: DistServe's OPT-13B A100 model and small hand-made latency models."""

from __future__ import annotations

import pytest

from duet.cluster.placement.cluster_spec import traces_dir
from duet.cluster.placement.latency_model import LatencyModel, TpFit, load_distserve_profile
from duet.cluster.placement.models import get_model


@pytest.fixture(scope="session")
def opt13b() -> LatencyModel:
    d = traces_dir()
    if not (d / "profiler-a100-80g.distserve.json").exists():
        pytest.skip(f"DistServe profiles not found in {d}")
    return load_distserve_profile(
        d / "profiler-a100-80g.distserve.json", get_model("opt-13b"), d / "max_num_tokens.csv"
    )


def _linear_model(
    prefill=(10.0, 0.1, 0.0), decode=(10.0, 0.0, 0.0), kv_tokens: int = 100_000
) -> LatencyModel:
    return LatencyModel(
        model="duet-tiny-llama",
        hardware="test",
        source="test",
        kv_bytes_per_token=1000,
        fits={1: TpFit(prefill, decode, decode, 1 << 30)},
        kv_capacity={(1, 1): kv_tokens},
        max_pp=1,
    )


@pytest.fixture
def linear_model():
    """Build a one-TP model with chosen coefficients, for exact expectations in tests."""
    return _linear_model


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (about 40 s, 3 GB)")
