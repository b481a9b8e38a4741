"""``run_reaped`` (cluster/process_reaper.py), which every ``duet serve`` and ``duet bench`` runs
under: what the command did, its exit status and its error, reach the caller as if it had run
in the caller's own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

_RUN = """
import sys
from duet.cluster.process_reaper import run_reaped
def main():
    print("working", flush=True)
    {body}
sys.exit(run_reaped(main))
"""


@pytest.mark.parametrize(
    "body, status, shown",
    [
        ("return 3", 3, ""),
        ("raise RuntimeError('the cluster did not start')", 1, "RuntimeError: the cluster did not start"),
        ("sys.exit('bad option: --x')", 1, "bad option: --x"),
        ("sys.exit(0)", 0, ""),
    ],
    ids=["status", "exception", "exit-message", "exit-0"],
)
def test_the_commands_status_and_error_reach_the_caller(body, status, shown):
    done = subprocess.run([sys.executable, "-c", _RUN.format(body=body)], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == "working\n"
    assert shown in done.stderr and (shown or "Traceback" not in done.stderr), done.stderr
