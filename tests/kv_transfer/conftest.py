"""Fixtures: a Ray runtime and one prefill + one decode engine per test module."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_runtime():
    import ray

    here = os.path.dirname(os.path.abspath(__file__))  # actors import engine_actor from here
    env = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from duet.cluster.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())
