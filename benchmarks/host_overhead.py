"""CPU the serving path spends, measured on a running duet on this machine.

On a CPU node the serving path also costs CPU outside the engines' forward passes: the router's
gRPC streams, the engines' front ends (each step's outputs decoded, detokenized and recorded),
Ray's daemons and actors, and the client. ``duet profile`` times the engine alone, so this is the
part of the deployment it cannot see; on two cores it is large enough to decide the SLO. It is
measured as one number per streamed token (``measure_host_ms_per_token``) and in its parts, per
engine output message, token, request and second (``sample_serving_path``, ``fit_serving_path``), which
the latency model holds as its ``serving_path`` and the simulator charges to the engines (see
the simulator module's docstring).

Counted: every process in the ``duet serve`` process tree except the vLLM engine processes
(``VLLM::Worker`` and ``VLLM::EngineCore``, whose time the profile already holds), plus this
process, which drives the load from the same cores. vLLM names its engine processes with
``setproctitle``, which does not always take (some runs here kept the spawn command line), so a
process that Python's multiprocessing spawned, which is how vLLM starts them, is an engine too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from duet.benchmarks.loadgen import RequestRecord, replay
from duet.cluster.placement.latency_model import ServingPathCost
from duet.cluster.placement.trace import Trace

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_ENGINE_PROCESS_PREFIX = "VLLM::"
_SPAWNED_CHILD = b"multiprocessing.spawn"


def read_proc_stat(path: str) -> tuple[str, list[str]] | None:
    """(command name, the fields after it, state first) of a ``/proc/.../stat`` file; None if
    the process or thread is gone. The name may hold spaces and parentheses: split at the last."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def cpu_seconds(fields: list[str]) -> float:
    """User plus system CPU seconds in the fields :func:`read_proc_stat` returns."""
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, None if it is gone."""
    stat = read_proc_stat(f"/proc/{pid}/stat")
    if stat is None:
        return None
    _, fields = stat
    return int(fields[1]), cpu_seconds(fields)


def is_engine_process(pid: int) -> bool:
    """Whether ``pid`` is a vLLM engine process (see the module's docstring)."""
    try:
        return (
            Path(f"/proc/{pid}/comm").read_text().startswith(_ENGINE_PROCESS_PREFIX)
            or _SPAWNED_CHILD in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
    except OSError:
        return False


def process_tree(root_pid: int, stats: dict[int, tuple[int, float]]) -> list[int]:
    """``root_pid`` and every live process below it, from each process's parent in ``stats``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    tree, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return [pid for pid in tree if pid in stats]


def all_process_stats() -> dict[int, tuple[int, float]]:
    """(parent pid, CPU seconds) of every live process."""
    return {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}


def host_cpu_seconds(root_pid: int, include_self: bool = True) -> dict[int, float]:
    """CPU seconds so far of each serving-path process under ``root_pid``, and of this process
    (the load generator) unless ``include_self`` is False."""
    stats = all_process_stats()
    counted = set(process_tree(root_pid, stats)) | ({os.getpid()} if include_self else set())
    return {pid: stats[pid][1] for pid in counted if not is_engine_process(pid)}


def tree_memory_bytes(root_pid: int) -> int:
    """The memory ``root_pid`` and every process below it hold, engines included: the sum of
    their proportional set sizes (PSS), so that pages they share (torch's and vLLM's libraries,
    mapped by every engine and front end) count once in all, not once per process."""
    total = 0
    for pid in process_tree(root_pid, all_process_stats()):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        total += next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return total


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


@dataclasses.dataclass(frozen=True)
class ServingPathSample:
    """What the serving path did over one replay (or an idle window), to tell its costs apart:
    a cost per engine output message (to decode and record: one per step, or per output interval
    where the engines merge steps), per streamed token, per request, and per second whatever the
    load (Ray's and the health pings')."""

    cpu_s: float
    wall_s: float
    tokens: int
    requests: int
    engine_messages: int


def engine_messages(metrics_url: str) -> int:
    """Output messages the engines have sent so far, summed over every worker
    (``vllm:iteration_tokens_total``'s count, which the front ends record once per message they
    receive: once per engine step, or once per output interval where the engine merges steps)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:iteration_tokens_total_count"
        )
    )


def sample_serving_path(
    target: str, serve_pid: int, metrics_url: str, trace: Trace | None, model: str = "", seed: int = 0, idle_s: float = 10.0
) -> ServingPathSample:
    """Replay ``trace`` (or, with None, wait ``idle_s``) and count what the serving path did."""
    cpu_before, messages_before, started = host_cpu_seconds(serve_pid), engine_messages(metrics_url), time.monotonic()
    if trace is None:
        time.sleep(idle_s)
        records: list[RequestRecord] = []
    else:
        records = asyncio.run(replay(target, trace, model=model, seed=seed))
    wall = time.monotonic() - started
    cpu_after = host_cpu_seconds(serve_pid)
    return ServingPathSample(
        cpu_s=sum(seconds - cpu_before.get(pid, 0.0) for pid, seconds in cpu_after.items()),
        wall_s=wall,
        tokens=sum(r.completion_tokens for r in records),
        requests=len(records),
        engine_messages=engine_messages(metrics_url) - messages_before,
    )


def fit_serving_path(samples: list[ServingPathSample], output_interval_ms: float = 0.0) -> ServingPathCost:
    """The serving path's cost in parts, from an idle window and replays that differ in batch
    size and in tokens per request (at least three, for three unknowns), on a deployment whose
    engines send their outputs at most every ``output_interval_ms`` (recorded with the parts: the
    simulator needs it to know how many messages an engine sends).

    The idle windows give ``idle_cores``; what the replays spent beyond it is split into per
    step, per token and per request by least squares, none of them negative (every subset of
    the three is solved, and the best fit whose parts are all >= 0 is kept). The per-message part
    is ``ms_per_step``.
    """
    idle = [s for s in samples if s.requests == 0]
    loaded = [s for s in samples if s.requests > 0]
    if not idle or len(loaded) < 3:
        raise ValueError("need an idle window and at least three replays")
    idle_cores = sum(s.cpu_s for s in idle) / sum(s.wall_s for s in idle)
    a = np.array([[s.engine_messages, s.tokens, s.requests] for s in loaded], dtype=float)
    b = np.array([s.cpu_s - idle_cores * s.wall_s for s in loaded])
    best, best_residual = np.zeros(3), float(np.sum(b**2))
    for mask in range(1, 8):
        columns = [i for i in range(3) if mask >> i & 1]
        solution, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
        if np.any(solution < 0):
            continue
        residual = float(np.sum((a[:, columns] @ solution - b) ** 2))
        if residual < best_residual:
            best, best_residual = np.zeros(3), residual
            best[columns] = solution
    per_message, per_token, per_request = (float(ms) for ms in 1000.0 * best)
    return ServingPathCost(
        ms_per_token=per_token,
        ms_per_step=per_message,
        ms_per_request=per_request,
        idle_cores=idle_cores,
        output_interval_ms=float(output_interval_ms),
    )
