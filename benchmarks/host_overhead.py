"""CPU the serving path spends per streamed token, measured on a running duet on this machine.

On a CPU node every streamed token also costs CPU outside the engines' forward passes: the
router's gRPC stream, Ray's streaming of each chunk from the decode actor, the engine front end in
the actor, and the client. ``duet profile`` times the engine alone, so this is the part of the
deployment it cannot see; on two cores it is large enough to decide the SLO (about 1 ms per token
here, against 4-8 ms for a whole decode step). The result goes into the latency model as
``host_ms_per_token``, which the simulator charges to the engines as tokens stream (see the
simulator module's docstring).

Counted: every process in the ``duet serve`` process tree except the vLLM engine processes
(``VLLM::Worker`` and ``VLLM::EngineCore``, whose time the profile already holds), plus this
process, which drives the load from the same cores.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from duet.benchmarks.loadgen import RequestRecord, replay
from duet.cluster.placement.trace import Trace

_TICKS = os.sysconf("SC_CLK_TCK")
_ENGINE_PROCESS_PREFIX = "VLLM::"


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _is_engine(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith(_ENGINE_PROCESS_PREFIX)
    except OSError:
        return False


def host_cpu_seconds(root_pid: int, include_self: bool = True) -> dict[int, float]:
    """CPU seconds so far of each serving-path process under ``root_pid``, and of this process
    (the load generator) unless ``include_self`` is False."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    tree, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    counted = {*tree, os.getpid()} if include_self else set(tree)
    return {pid: stats[pid][1] for pid in counted if pid in stats and not _is_engine(pid)}


def process_name(pid: int) -> str:
    """The process's name as ``ps`` shows it (``ray::DecodeWorker``, ``raylet``, ...)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "exited"


def measure_host_ms_per_token(
    target: str, serve_pid: int, trace: Trace, model: str = "", seed: int = 0
) -> tuple[float, list[RequestRecord]]:
    """Replay ``trace`` and return the serving path's CPU ms per streamed token, and the records."""
    before = host_cpu_seconds(serve_pid)
    records = asyncio.run(replay(target, trace, model=model, seed=seed))
    after = host_cpu_seconds(serve_pid)
    spent = sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())
    tokens = sum(r.completion_tokens for r in records)
    return (1000.0 * spent / tokens if tokens else 0.0), records
