"""The kernel's count of how long a worker's threads waited for a CPU (worker_runtime/cpu_wait.py),
read from real processes: what the health watcher takes as proof of starvation."""

from __future__ import annotations

import subprocess
import sys
import time

from duet.worker_runtime.cpu_wait import threads_cpu_wait_s, waited_between

_SPIN = "import os, time\nos.sched_setaffinity(0, {0})\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"


def _waited(pids: list[int], seconds: float) -> float:
    before = threads_cpu_wait_s(pids)
    time.sleep(seconds)
    after = threads_cpu_wait_s(pids)
    assert before is not None and after is not None
    return waited_between(before, after)


def test_threads_sharing_one_core_are_seen_waiting_and_a_sleeping_one_is_not():
    """Three processes spinning on one core each run a third of the time and wait the rest:
    about 2 s of waiting in all per second. A sleeping process waits for nothing."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(3)]
    sleeper = subprocess.Popen(["sleep", "5"])
    try:
        time.sleep(0.5)  # started and pinned
        assert _waited([spinner.pid for spinner in spinners], 1.0) >= 1.0
        assert _waited([sleeper.pid], 1.0) < 0.1
    finally:
        for process in (*spinners, sleeper):
            process.kill()
            process.wait()


def test_a_thread_that_exits_between_readings_does_not_count():
    """A thread's count leaves with it; only threads alive at both readings are compared."""
    assert waited_between({1: 5.0, 2: 3.0}, {1: 5.5, 3: 0.2}) == 0.5
