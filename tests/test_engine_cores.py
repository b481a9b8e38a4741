"""Where engines computed, as ``duet bench serve`` reports it (benchmarks/engine_cores.py), on the
shared deployment's real engines: pinned apart they are reported apart, made to share a core
they are reported together."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from duet.benchmarks.engine_cores import EngineCoreSampler
from duet.benchmarks.serve_report import engine_cores
from duet.router.client import build_request


def _serve_some(client: Any) -> None:
    """Requests enough to keep both engines busy for a second or two."""
    requests = [build_request(f"where do engines compute {i} " * 40, max_tokens=48, ignore_eos=True) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda request: client.generate_ids(request, timeout=120), requests))


def _by_role(sampler: EngineCoreSampler) -> dict[str, dict[str, Any]]:
    """The deployment's two engine processes, by the worker actor above each."""
    found = {}
    for label, process in sampler.report().items():
        for role in ("Prefill", "Decode"):
            if f"under ray::{role}Worker" in label:
                found[role] = process
    assert set(found) == {"Prefill", "Decode"}, sampler.report()
    return found


def _main_core_share(process: dict[str, Any], core: int) -> float:
    by_core = process["cpu_s_by_core"]
    return by_core.get(str(core), 0.0) / sum(by_core.values())


@contextmanager
def _all_threads_on(pids: list[int], core: int) -> Iterator[None]:
    """Every thread of ``pids`` allowed only ``core``; each thread's own affinity restored after."""
    saved: dict[int, set[int]] = {}
    for pid in pids:
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            try:
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {core})
            except OSError:  # exited meanwhile
                pass
    try:
        yield
    finally:
        for tid, cores in saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass


def test_engines_pinned_apart_are_reported_apart_and_together_when_they_share_a_core(client, duet_config):
    prefill_core, decode_core = duet_config.prefill.cpu_cores[0], duet_config.decode.cpu_cores[0]
    assert prefill_core != decode_core
    with EngineCoreSampler(os.getpid()) as apart:
        _serve_some(client)
    engines = _by_role(apart)
    assert engines["Prefill"]["affinity"] == str(prefill_core) and engines["Decode"]["affinity"] == str(decode_core)
    assert _main_core_share(engines["Prefill"], prefill_core) > 0.8
    assert _main_core_share(engines["Decode"], decode_core) > 0.8
    assert engines["Prefill"]["threads"] > 1  # a vLLM engine core runs I/O threads beside its step
    assert apart.step_cpu_s() > 0.5 * apart.engine_cpu_s() > 0

    pids = [int(label.split(" pid ")[1].split()[0]) for label in apart.report() if "Worker" in label.split("under")[1]]
    with _all_threads_on(pids, prefill_core), EngineCoreSampler(os.getpid()) as together:
        _serve_some(client)
    engines = _by_role(together)
    for process in engines.values():
        assert _main_core_share(process, prefill_core) > 0.8, engines
        assert engine_cores(process).startswith(f"{prefill_core} (")
