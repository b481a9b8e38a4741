"""How long a worker's engine threads have waited for a CPU: what tells a starved engine from a hung one.

A health ping that goes unanswered means either an engine that stopped (hung) or one that had
no CPU to answer with. The kernel knows which: each thread's ``schedstat`` counts the time it
spent runnable but waiting on a run queue. Measured here (2 cores, 2026-11-28): an idle duet
decode engine's threads waited 0.005 s in all over 15 s; the same engine beside another
system's two busy engines pinned to its core waited 1-24 s in all per second, and a plain
sleeping thread on that core woke up to 22 s late, so its pings went unanswered for 5 s at a
time and the health watcher replaced a healthy engine (cluster/health.py).

Threads are counted one by one, by thread id: a thread that exits takes its count with it, so
a process-wide sum could go down.
"""

from __future__ import annotations

import os

import psutil


def threads_cpu_wait_s(pids: list[int]) -> dict[int, float] | None:
    """Seconds each thread of ``pids`` and of their descendants has waited for a CPU so far, by
    thread id; None where the kernel does not say (not Linux, or no scheduler statistics)."""
    waits: dict[int, float] = {}
    for pid in _with_descendants(pids):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # exited meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                    waits[int(tid)] = int(schedstat.read().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
    return waits or None


def waited_between(before: dict[int, float], after: dict[int, float]) -> float:
    """Seconds the threads alive at both readings waited for a CPU in between, in all."""
    return sum(max(0.0, after[tid] - before[tid]) for tid in after.keys() & before.keys())


def _with_descendants(pids: list[int]) -> list[int]:
    found = list(pids)
    for pid in pids:
        try:
            found.extend(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return found
