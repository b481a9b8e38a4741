"""Nothing outlives ``duet serve``: a parent that reaps whatever its deployment left behind.

A deployment's processes descend from the ``duet serve`` process: a local Ray's daemons, the
worker and front-door actors, the engine cores. Most end with it, but not all: killed with
SIGKILL (an OOM kill, a crash), it leaves Ray's dashboard and runtime-env agents running,
orphans that ignore SIGTERM. So ``duet serve`` runs its deployment in a child process and stays
the parent, a Linux child subreaper: every orphan of the deployment becomes its child. When the
deployment's process ends, however it ends, the parent kills what is left and exits with its
status. The parent does nothing else (it forwards the stop signals), so it does not die of what
kills a deployment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
# How long the deployment's leftovers get to exit on their own after SIGTERM, and how long the
# reaping may take in all.
_GRACE_S = 2.0
_REAP_LIMIT_S = 60.0


def run_reaped(main: Callable[[], int]) -> int:
    """Run ``main`` in a child process and return its exit status, once no process it started
    is left. Without Linux's subreaper (another OS), ``main`` runs in this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "prctl") or libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return main()
    child = os.fork()
    if child == 0:
        # Killed with this parent (SIGKILL of `duet serve`), the deployment stops as on Ctrl-C.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        code = 1
        try:
            code = main()
        except SystemExit as request:
            code = request.code if isinstance(request.code, int) else 0 if request.code is None else 1
            if isinstance(request.code, str):
                print(request.code, file=sys.stderr)
        except BaseException:  # shown as the interpreter would: os._exit below shows nothing
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
                stream.flush()
            os._exit(code)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # The terminal's Ctrl-C reaches both processes; the deployment stops itself cleanly.
        signal.signal(signum, lambda received, frame: _forward(child, received))
    status = _wait(child)
    _reap_descendants()
    return os.waitstatus_to_exitcode(status)


def _forward(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _wait(child: int) -> int:
    while True:
        try:
            pid, status = os.waitpid(child, 0)
        except InterruptedError:
            continue
        if pid == child:
            return status


def _children() -> list[int]:
    """This process's children (orphans of the deployment are reparented here)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as listing:
            return [int(pid) for pid in listing.read().split()]
    except OSError:
        return []


def _reap_descendants() -> None:
    """SIGTERM everything left, SIGKILL what still runs after a grace period, and collect every
    exit; orphans keep arriving as their parents die, until none is left."""
    terminated: dict[int, float] = {}
    deadline = time.monotonic() + _REAP_LIMIT_S
    while time.monotonic() < deadline:
        _collect_exited()
        children = _children()
        if not children:
            return
        now = time.monotonic()
        for pid in children:
            since = terminated.setdefault(pid, now)
            signum = signal.SIGTERM if since == now else signal.SIGKILL if now - since > _GRACE_S else None
            if signum is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        time.sleep(0.05)


def _collect_exited() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
