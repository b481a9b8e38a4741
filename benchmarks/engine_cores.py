"""Where each engine process of a served system computed during a replay, read from ``/proc``.

Two engines that share a core halve each other's speed, and a benchmark that lets that happen
to one system and not another compares set-ups, not systems (issue 53: both engines of vLLM's
P/D computed on core 1). So every replay of ``duet bench serve`` samples, about four times a
second, every thread of every engine process under the system's root process: which core it
last ran on and the CPU it used since the previous sample, charged to that core. The report
(``cpu_affinity`` in ``report.json``) gives, per engine process, its allowed cores, its thread
count and its CPU seconds per core; anyone can see whether two engines shared a core.

It also splits the system's CPU into the engines' steps and everything else. An engine's step
(forward pass, scheduler, sampler) runs in the process that holds the model: vLLM's
``VLLM::Worker`` where the multiprocessing executor starts one, else the engine core itself
(duet's engines, vLLM's one-process executor). Its threads count as step, except those named
for I/O (ZMQ's, gloo's, UCX's and NIXL's); an engine core that hands its steps to a
worker process only waits on it, and counts as the rest, as do front ends, proxies and Ray.
Python threads in the model's process that serve sockets cannot be told apart by name and
count as step: the share is an upper bound.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from duet.benchmarks.host_overhead import (
    CLOCK_TICKS_PER_S,
    all_process_stats,
    cpu_seconds,
    is_engine_process,
    process_name,
    process_tree,
    read_proc_stat,
)

SAMPLE_INTERVAL_S = 0.25
# Threads of an engine process that move bytes, not tensors (by their kernel names).
_IO_THREAD_PREFIXES = ("ZMQbg", "ucx", "UCX", "nixl", "NIXL", "progress", "gloo", "pt_gloo")
_WORKER_PROCESS = "VLLM::Worker"


def _thread_stat(pid: int, tid: int) -> tuple[str, int, float] | None:
    """(name, core it last ran on, CPU seconds) of one thread; None if it is gone."""
    stat = read_proc_stat(f"/proc/{pid}/task/{tid}/stat")
    if stat is None:
        return None
    name, fields = stat
    return name, int(fields[36]), cpu_seconds(fields)


def _cores_text(cores: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _display_name(pid: int) -> str:
    """A Ray actor's or vLLM process's title in full (``ray::PrefillWorker``), else its name:
    the kernel's name is cut at 15 characters."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        title = ""
    return title.split(" ")[0].split(".")[0] if "::" in title else process_name(pid)


@dataclass
class _Process:
    pid: int
    name: str
    parent: str
    affinity: str
    parent_pid: int = 0
    threads: int = 0
    cpu_s_by_core: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    io_cpu_s: float = 0.0  # of it, its I/O threads'
    last: dict[int, float] = field(default_factory=dict)  # CPU seconds by thread at the last sample

    def label(self) -> str:
        return f"{self.name} pid {self.pid} (under {self.parent})"


class EngineCoreSampler:
    """Samples the engine processes under ``root_pid`` while a replay runs (a context manager);
    :meth:`report` gives what each computed where, :meth:`step_cpu_s` the split above. With
    ``root_pid`` None (a server started elsewhere) it samples nothing."""

    def __init__(self, root_pid: int | None, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self._processes: dict[int, _Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-core-sampler", daemon=True)

    def __enter__(self) -> EngineCoreSampler:
        self._sample(baseline=True)  # CPU before the replay is not charged
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, baseline: bool = False) -> None:
        if self.root_pid is None:
            return
        stats = all_process_stats()
        for pid in process_tree(self.root_pid, stats):
            if not is_engine_process(pid):
                continue
            process = self._processes.get(pid)
            if process is None:
                process = self._processes[pid] = self._new_process(pid, stats)
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            process.threads = len(tids)
            for tid in tids:
                stat = _thread_stat(pid, tid)
                if stat is None:
                    continue
                name, core, cpu_s = stat
                previous = process.last.get(tid)
                process.last[tid] = cpu_s
                if previous is None:  # a thread not seen before: from the baseline, nothing is charged
                    previous = cpu_s if baseline else 0.0
                spent = cpu_s - previous
                if spent <= 0:
                    continue
                process.cpu_s_by_core[core] += spent
                if name.startswith(_IO_THREAD_PREFIXES):
                    process.io_cpu_s += spent

    @staticmethod
    def _new_process(pid: int, stats: dict[int, tuple[int, float]]) -> _Process:
        try:
            affinity = _cores_text(os.sched_getaffinity(pid))  # its main thread's: the one that steps
        except OSError:
            affinity = "?"
        parent = stats.get(pid, (0, 0.0))[0]
        return _Process(pid, _display_name(pid), _display_name(parent), affinity, parent)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per engine process (``name pid N (under parent)``): its allowed cores, thread count
        and CPU seconds per core over the sampled span."""
        return {
            process.label(): {
                "affinity": process.affinity,
                "threads": process.threads,
                "cpu_s_by_core": {str(core): round(s, 3) for core, s in sorted(process.cpu_s_by_core.items()) if s > 0},
            }
            for process in self._processes.values()
        }

    def engine_cpu_s(self) -> float:
        """CPU seconds of every engine process over the sampled span."""
        return sum(sum(p.cpu_s_by_core.values()) for p in self._processes.values())

    def step_cpu_s(self) -> float:
        """CPU seconds the engines spent in their steps (see the module's docstring)."""
        handing_off = {p.parent_pid for p in self._processes.values() if p.name.startswith(_WORKER_PROCESS)}
        total = 0.0
        for process in self._processes.values():
            if process.pid in handing_off:
                continue  # an engine core handing its steps to its worker process
            total += sum(process.cpu_s_by_core.values()) - process.io_cpu_s
        return total


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has been busy since boot (``/proc/stat``: all but
    idle and I/O wait), to take the machine's whole CPU around a replay."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / CLOCK_TICKS_PER_S
