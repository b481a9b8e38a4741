"""Side-channel port reservations that never clash between workers sharing a machine.

Each NIXL engine listens on a side-channel port for handshakes. Several duet workers on one
host must each get their own, including workers started at the same moment by different Ray
actors. A port is reserved by holding an exclusive ``flock`` on a per-port lock file for the
worker's lifetime (other duet workers skip it; the kernel drops the lock when the process dies,
so a crashed worker leaks nothing) and by checking that nothing else is bound to it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_LOCK_DIR = Path(tempfile.gettempdir()) / "duet-ports"
_SEARCH_SPAN = 2000


class NoFreePortError(RuntimeError):
    """No port block could be reserved in the searched range."""


@dataclass
class PortReservation:
    """A block of consecutive ports held until ``release()`` or process exit."""

    host: str
    base_port: int
    count: int
    _locks: list[IO[bytes]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for handle in self._locks:
            handle.close()
        self._locks.clear()


def is_bindable(host: str, port: int) -> bool:
    """Whether nothing else listens on ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now, for a server that must be told its port
    before it starts (another process's, or one whose clients are configured first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _try_lock(port: int) -> IO[bytes] | None:
    _LOCK_DIR.mkdir(parents=True, exist_ok=True)
    handle = open(_LOCK_DIR / f"{port}.lock", "wb")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.write(str(os.getpid()).encode())
    handle.flush()
    return handle


def reserve_ports(host: str, start: int, count: int = 1) -> PortReservation:
    """Reserve ``count`` consecutive free ports at or above ``start`` on ``host``.

    vLLM offsets the side-channel port by the worker's tensor-parallel rank, so an engine with
    TP=n needs a block of n ports.
    """
    base = start
    while base + count <= min(start + _SEARCH_SPAN, 65535):
        locks: list[IO[bytes]] = []
        for port in range(base, base + count):
            handle = _try_lock(port)
            if handle is None or not is_bindable(host, port):
                if handle is not None:
                    handle.close()
                break
            locks.append(handle)
        if len(locks) == count:
            return PortReservation(host=host, base_port=base, count=count, _locks=locks)
        for handle in locks:
            handle.close()
        base += len(locks) + 1
    raise NoFreePortError(
        f"no block of {count} free port(s) on {host} in [{start}, {start + _SEARCH_SPAN}); "
        "set kv_transfer.side_channel_base_port to a free range"
    )
