"""Waiting for a condition in tests that watch real processes change state, and the front
doors as ``duet status`` lists them (imported by module name: tests/ is on the path)."""

from __future__ import annotations

import time
from typing import Any, Callable

from duet.router.client import DuetClient
from duet.router.proto import duet_api_pb2 as pb


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``condition()``'s first truthy result, polled every 0.2 s; fails naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(0.2)
    return result


def front_doors(target: str) -> list[pb.FrontEnd]:
    """The deployment's front doors, from ``duet status`` at ``target``."""
    with DuetClient(target) as client:
        return list(client.status().front_ends)
