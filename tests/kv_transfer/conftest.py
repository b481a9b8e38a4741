"""Fixtures: a Ray runtime and one prefill + one decode engine per test module."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="session")
def ray_runtime(ray_session: None) -> None:
    """The suite's shared Ray (tests/conftest.py), which can import engine_actor."""


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from duet.worker_runtime.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())
