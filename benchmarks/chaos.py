"""Chaos under load: a real trace through real vLLM workers while processes are killed and hung.

``duet bench chaos`` starts duet as ``duet serve --front-ends 2`` runs it (the control plane in
a Ray actor, two front-door actors, a prefill and a decode worker with real vLLM engines) and
replays a trace twice through it with resuming clients (``DuetClient.stream``): once with no
fault, which gives every request's reference tokens (greedy, float32: a request's tokens do not
depend on what else runs), then again while faults are injected one after another from a seeded
schedule. Each fault waits for the cluster to be back at full capacity (every worker and front
door ready, the victim replaced) before the next, and the time that took is reported per fault.

Every request of the faulted replay ends in one of: ``exact`` (the reference tokens), an
explicit gRPC error status, ``altered`` (other tokens: a duplicated, missing or wrong token) or
``lost`` (no tokens and no status). The goal is 0 altered and 0 lost. At the end no process of
the deployment may be left stopped (a hung engine that was replaced must be gone, not frozen).

Fault kinds (``--kinds``):
  kill-prefill-engine, kill-decode-engine   SIGKILL of a worker's vLLM engine-core process
  hang-prefill-engine, hang-decode-engine   SIGSTOP of it, never continued (found by health pings)
  kill-prefill-actor, kill-decode-actor     SIGKILL of the worker's Ray actor process
  delay-kv                                  the prefill engine stopped for 2 s then continued:
                                            KV pulls and first tokens wait
  kill-front-door                           SIGKILL of a front door (its streams resume on the other)
  kill-control-plane                        SIGKILL of the control plane (Ray restarts it; it
                                            takes the running deployment over)
  drain-decode                              a decode worker drained while it serves (as scaling
                                            down does), after a replacement was started

``--hosts`` runs the three-host plan on virtual hosts instead, where a host's link can be cut
(benchmarks/chaos_hosts.py has its fault kinds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import psutil

from duet.benchmarks.apart_cluster import ClusterProcesses, running_apart
from duet.benchmarks.chaos_hosts import HOST_KINDS, HostsProcesses


RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
KINDS = (
    "kill-prefill-engine", "kill-decode-engine", "hang-prefill-engine", "hang-decode-engine",
    "kill-prefill-actor", "kill-decode-actor", "delay-kv", "kill-front-door", "kill-control-plane", "drain-decode",
)
DELAY_KV_S = 2.0


@dataclass
class Outcome:
    """What became of one request of the faulted replay."""

    index: int
    result: str  # exact | altered | lost | an error status name
    tokens: int
    resumes: int


@dataclass
class FaultRecord:
    kind: str
    at_s: float  # since the faulted replay started
    victim: str
    recovered_s: float | None  # to full capacity; None: not within the bound given
    detail: str = ""


@dataclass
class ChaosReport:
    seed: int
    requests: int
    rate: float
    outcomes: dict[str, int] = field(default_factory=dict)
    resumed: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    stopped_processes_left: list[int] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def altered_or_lost(self) -> int:
        return self.outcomes.get("altered", 0) + self.outcomes.get("lost", 0)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _scale_away(cluster: ClusterProcesses) -> tuple[str, str, Callable[[dict[str, int]], bool]]:
    """A decode worker drained while it serves: a new one is started and made ready first (not
    part of the fault), then the oldest is drained as ``duet drain`` does; recovered once it is
    gone and the pool is back at its size with every worker ready."""
    names = [name for name, _, _ in cluster.workers("decode")]
    with cluster.client() as client:
        client.scale("decode", len(names) + 1)
        deadline = time.monotonic() + 900
        while len(cluster.workers("decode")) <= len(names):
            if time.monotonic() > deadline:
                raise RuntimeError("the extra decode worker never became ready")
            time.sleep(1.0)
        victim = names[0]
        client.drain(victim)

    def gone(_: dict[str, int]) -> bool:
        listed = [w.name for pool in cluster.status().pools if pool.role == "decode" for w in pool.workers]
        return victim not in listed and len(listed) == len(names)

    return victim, "drained while serving, after a replacement started", gone


def inject(cluster: ClusterProcesses, kind: str) -> tuple[str, str, Callable[[dict[str, int]], bool], float]:
    """Inject one fault into a deployment on this machine (an :data:`Injector` once
    ``cluster`` is bound)."""
    if kind == "drain-decode":
        victim, detail, gone = _scale_away(cluster)
        return victim, detail, gone, time.monotonic()
    when = time.monotonic()
    return (*_inject_failure(cluster, kind), when)


def _inject_failure(cluster: ClusterProcesses, kind: str) -> tuple[str, str, Callable[[dict[str, int]], bool]]:
    before = cluster.restarts()
    if kind == "kill-front-door":
        door = random.choice([d for d in cluster.status().front_ends if d.state == "ready"])
        _signal(door.pid, signal.SIGKILL)
        key = f"front-door-{door.index}"
        return key, f"pid {door.pid}", lambda now: now.get(key, 0) > before[key]
    if kind == "kill-control-plane":
        import ray

        pid = ray.get(cluster.control.actor.pid.remote(), timeout=30)
        _signal(pid, signal.SIGKILL)
        return "control plane", f"pid {pid}", lambda now: now["control"] > before["control"]
    role = "decode" if "decode" in kind else "prefill"
    name, actor_pid, engine_pid = cluster.workers(role)[0]
    if kind == "delay-kv":
        _signal(engine_pid, signal.SIGSTOP)
        time.sleep(DELAY_KV_S)
        _signal(engine_pid, signal.SIGCONT)
        return name, f"engine pid {engine_pid} stopped {DELAY_KV_S:g} s", lambda now: True
    victim = actor_pid if kind.endswith("actor") else engine_pid
    _signal(victim, signal.SIGSTOP if kind.startswith("hang") else signal.SIGKILL)
    return name, f"pid {victim}", lambda now: now.get(name, 0) > before[name]


def stopped_processes() -> list[int]:
    """Processes of this user left stopped (state T): a hung engine nobody cleaned up."""
    me = os.getuid()
    stopped = []
    for process in psutil.process_iter(["pid", "status", "uids"]):
        try:
            if process.info["status"] == psutil.STATUS_STOPPED and process.info["uids"].real == me:
                stopped.append(process.info["pid"])
        except (psutil.Error, AttributeError):
            continue
    return stopped


# ---- load ------------------------------------------------------------------------------------


def _send(connect: Callable[[], Any], request: Any, timeout_s: float) -> tuple[list[int], int, str]:
    """One request through a resuming client (``connect()``, a new DuetClient): (tokens,
    resumes, error status or "")."""
    import grpc

    with connect() as client:
        tokens: list[int] = []
        try:
            for message in client.stream(request, timeout=timeout_s):
                tokens.extend(message.token_ids)
        except grpc.RpcError as error:
            return tokens, client.resumes, error.code().name
        return tokens, client.resumes, ""


def replay(connect: Callable[[], Any], requests: list[Any], arrivals: list[float], timeout_s: float) -> list[tuple[list[int], int, str]]:
    """Send each request at its arrival time (open loop), each on a client of its own; every
    result, in request order."""
    with ThreadPoolExecutor(max_workers=64) as pool:
        start = time.monotonic()
        futures = []
        for request, at in zip(requests, arrivals):
            time.sleep(max(0.0, start + at - time.monotonic()))
            futures.append(pool.submit(_send, connect, request, timeout_s))
        return [future.result() for future in futures]


def classify(reference: list[int] | None, tokens: list[int], error: str) -> str:
    if error:
        return error
    if not tokens:
        return "lost"
    return "exact" if tokens == reference else "altered"


# ---- the run ---------------------------------------------------------------------------------


def fault_schedule(kinds: list[str], faults: int, seed: int) -> list[tuple[float, str]]:
    """``faults`` faults drawn from ``kinds``, each after a pause of 2-8 s (counted from the
    cluster's recovery from the one before): (pause, kind), seeded."""
    rng = random.Random(seed)
    return [(round(rng.uniform(2.0, 8.0), 2), rng.choice(kinds)) for _ in range(faults)]


class ChaosCluster(Protocol):
    """What the harness needs of a running deployment: clients, and whether it is at full
    capacity (``ClusterProcesses`` on one machine, ``HostsProcesses`` across virtual hosts)."""

    def client(self) -> Any: ...

    def missing_capacity(self, replaced: Callable[[dict[str, int]], bool] | None = None) -> str: ...


# Injects one fault of a kind: (victim, detail, recovered, when), where ``recovered(restarts)``
# says whether the cluster has dealt with it, given the restart counts read now, and ``when``
# is the fault's moment (time.monotonic).
Injector = Callable[[str], tuple[str, str, Callable[[dict[str, int]], bool], float]]


def run_chaos(
    cluster: ChaosCluster, inject: Injector, requests: list[Any], arrivals: list[float], schedule: list[tuple[float, str]],
    seed: int = 0, recovery_timeout_s: float = 600.0, log: Callable[[str], None] = partial(print, flush=True),
) -> ChaosReport:
    """The fault-free replay, then the faulted one with the faults of ``schedule`` in turn."""
    log(f"reference replay: {len(requests)} requests, no fault")
    reference = replay(cluster.client, requests, arrivals, timeout_s=600)
    broken = [index for index, (tokens, _, error) in enumerate(reference) if error or not tokens]
    if broken:
        raise RuntimeError(f"the fault-free replay failed {len(broken)} requests (first: {reference[broken[0]][2]})")

    random.seed(seed)  # which front door a kill-front-door picks
    report = ChaosReport(seed=seed, requests=len(requests), rate=len(requests) / max(arrivals[-1], 1e-9))
    with ThreadPoolExecutor(max_workers=1) as load:
        started = time.monotonic()
        results = load.submit(replay, cluster.client, requests, arrivals, 600)
        for number, (pause, kind) in enumerate(schedule):
            time.sleep(pause)
            if results.done():
                log(f"the load ended after {number} faults")
                break
            victim, detail, recovered, when = inject(kind)
            at = when - started
            deadline = time.monotonic() + recovery_timeout_s
            back: float | None = None
            seen: list[str] = []  # what the cluster waited for, in turn
            while time.monotonic() < deadline:
                missing = cluster.missing_capacity(replaced=recovered)
                if not missing:
                    back = time.monotonic() - started - at
                    break
                if not seen or seen[-1] != missing:
                    seen.append(missing)
                time.sleep(0.25)
            detail += "; waited for: " + " -> ".join(seen) if seen else ""
            report.faults.append(FaultRecord(kind, round(at, 2), victim, None if back is None else round(back, 2), detail))
            log(f"fault {number + 1}/{len(schedule)} at {at:6.1f} s: {kind} ({victim}, {detail}); "
                + (f"full capacity after {back:.1f} s" if back is not None else "NOT back within the bound"))
        faulted = results.result()
        report.duration_s = round(time.monotonic() - started, 1)

    outcomes = [Outcome(i, classify(reference[i][0], tokens, error), len(tokens), resumes)
                for i, (tokens, resumes, error) in enumerate(faulted)]
    report.outcomes = dict(Counter(outcome.result for outcome in outcomes))
    report.resumed = sum(1 for outcome in outcomes if outcome.resumes)
    time.sleep(2.0)
    report.stopped_processes_left = stopped_processes()
    return report


def summary(report: ChaosReport) -> dict[str, Any]:
    """The report with recovery times per fault kind."""
    by_kind: dict[str, list[float | None]] = {}
    for fault in report.faults:
        by_kind.setdefault(fault.kind, []).append(fault.recovered_s)
    recovery = {}
    for kind, times in sorted(by_kind.items()):
        back = [t for t in times if t is not None]
        recovery[kind] = {
            "faults": len(times), "not_recovered": len(times) - len(back),
            "recovered_s_median": statistics.median(back) if back else None, "recovered_s_max": max(back, default=None),
        }
    return {**asdict(report), "altered_or_lost": report.altered_or_lost, "recovery_by_kind": recovery}


def _requests(args: argparse.Namespace) -> tuple[list[Any], list[float]]:
    from duet.benchmarks.loadgen import build_requests
    from duet.cluster.placement.trace import load_trace

    trace = load_trace(args.trace).head(args.requests).capped(args.max_input, args.max_output).at_rate(args.rate)
    arrivals = [float(t - trace.arrival_s[0]) for t in trace.arrival_s]
    return build_requests(trace, seed=args.seed), arrivals


def _command(args: argparse.Namespace) -> int:
    from duet.cluster.placement.cluster_spec import traces_dir

    known = HOST_KINDS if args.hosts else KINDS
    args.kinds = args.kinds or list(known)
    unknown = sorted(set(args.kinds) - set(known))
    if unknown:
        where = "with --hosts" if args.hosts else "on one machine (--hosts for links)"
        print(f"duet bench chaos: --kinds: unknown {where}: {', '.join(unknown)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.hosts and args.config:
        print("duet bench chaos: --config is for runs on one machine; --hosts runs the three-host plan", file=sys.stderr)
        return 2
    if not args.hosts and args.front_ends < 2 and "kill-front-door" in args.kinds:
        print("duet bench chaos: kill-front-door needs --front-ends 2 or more", file=sys.stderr)
        return 2
    args.trace = args.trace or str(traces_dir() / "AzureLLMInferenceTrace_conv.csv")
    requests, arrivals = _requests(args)
    schedule = fault_schedule(args.kinds, args.faults, args.seed)
    with (_on_hosts(args) if args.hosts else _on_this_machine(args)) as (cluster, injector, described):
        try:
            report = run_chaos(cluster, injector, requests, arrivals, schedule, args.seed)
        except Exception:  # shown now: Ray's shutdown can end this process before it is printed
            traceback.print_exc()
            sys.stderr.flush()
            raise
        # Written before Ray shuts down: its shutdown can end this process abruptly (a raylet
        # that exits first makes the core worker quit), which lost a soak's results once.
        result = {**described(), **summary(report)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(format_report(result), flush=True)
        print(f"results: {args.out}", file=sys.stderr, flush=True)
    return 0 if report.altered_or_lost == 0 and not report.stopped_processes_left else 1


# A deployment for a chaos run: the cluster, its injector, and what describes the deployment in
# the results (read once the run is over).
Deployment = tuple[ChaosCluster, Injector, Callable[[], dict[str, Any]]]


@contextmanager
def _on_this_machine(args: argparse.Namespace) -> Iterator[Deployment]:
    """duet as ``duet serve --front-ends N`` runs it, on this machine's Ray."""
    from duet.config import load_config

    config = load_config(args.config)
    if "drain-decode" in args.kinds:
        # drain-decode starts a decode worker before it drains one: a CPU of headroom for it
        # (a local Ray otherwise offers one per core, all taken by the default deployment).
        cpus = (config.ray.num_cpus or os.cpu_count() or 1) + 1
        config = config.model_copy(update={"ray": config.ray.model_copy(update={"num_cpus": cpus})})
    with running_apart(config, args.front_ends) as (control, target):
        processes = ClusterProcesses(control, target)
        yield processes, partial(inject, processes), lambda: {"deployment": f"this machine, {args.front_ends} front doors"}


@contextmanager
def _on_hosts(args: argparse.Namespace) -> Iterator[Deployment]:
    """The three-host plan on virtual hosts (benchmarks/chaos_hosts.py)."""
    from duet.benchmarks.migration_hosts import THREE_HOSTS_PLAN
    from duet.deploy.hosts import LinkShape
    from duet.deploy.virtual_cluster import serve_on_hosts

    with serve_on_hosts({}, LinkShape(rate_mbit=args.link_gbit * 1000), plan=THREE_HOSTS_PLAN) as running:
        processes = HostsProcesses(running, args.outage_s)
        yield processes, processes.inject, lambda: {
            "deployment": f"virtual hosts ({THREE_HOSTS_PLAN.name})", "link_gbit": args.link_gbit, "outage_s": args.outage_s,
            "host_nodes_restarted": len(processes.node_restarts),
        }


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['requests']} requests at {result['rate']:.2f} req/s, {len(result['faults'])} faults in "
        f"{result['duration_s']:.0f} s: outcomes {result['outcomes']} ({result['resumed']} resumed); "
        f"altered or lost: {result['altered_or_lost']}; processes left stopped: {len(result['stopped_processes_left'])}",
        f"{'fault kind':<22}{'faults':>7}{'not back':>9}{'median s':>10}{'max s':>8}",
    ]
    for kind, row in result["recovery_by_kind"].items():
        median = "-" if row["recovered_s_median"] is None else f"{row['recovered_s_median']:.1f}"
        longest = "-" if row["recovered_s_max"] is None else f"{row['recovered_s_max']:.1f}"
        lines.append(f"{kind:<22}{row['faults']:>7}{row['not_recovered']:>9}{median:>10}{longest:>8}")
    return "\n".join(lines)


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser("chaos", help="faults injected under load (real vLLM): nothing lost, duplicated or altered")
    parser.add_argument("--config", help="deployment YAML (default: configs/local.yaml)")
    parser.add_argument("--front-ends", type=int, default=2, help="front doors (2 or more, so that one can die)")
    parser.add_argument("--trace", help="trace file (default: the Azure conversation trace in ../shared/traces)")
    parser.add_argument("--requests", type=int, default=300, help="requests replayed, twice: reference, then faulted")
    parser.add_argument("--rate", type=float, default=1.5, help="offered req/s")
    parser.add_argument("--max-input", type=int, default=512, help="cap prompt lengths")
    parser.add_argument("--max-output", type=int, default=48, help="cap output lengths")
    parser.add_argument("--faults", type=int, default=10, help="faults injected, one after another")
    parser.add_argument("--kinds", type=lambda text: text.split(","),
                        help=f"comma-separated, from {', '.join(KINDS)}; with --hosts from {', '.join(HOST_KINDS)} (default: all)")
    parser.add_argument("--hosts", action="store_true",
                        help="run the three-host plan on virtual hosts (needs root), where links can be cut")
    parser.add_argument("--outage-s", type=float, default=30.0, help="with --hosts: how long a cut link stays down")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="with --hosts: every host's link, Gbit/s")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's and the prompts' seed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result")
    parser.set_defaults(handler=_command)
