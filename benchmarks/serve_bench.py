"""``duet bench serve``: goodput of duet disaggregated, duet colocated and plain vLLM, side by side.

One invocation replays the same trace (its own arrival times, scaled to each offered rate)
against each system in turn, on the same machine, and reports for each: client-side TTFT,
TPOT and end-to-end latency, SLO attainment for a loose and a tight TPOT target, goodput at 90%
attainment, and the serving path's CPU per streamed token (every process of the system except
vLLM's engine processes, whose work is the model itself; the load generator is not counted).
Each system is warmed up first (a fresh engine's first minute is slower: first kernels per
shape). Results go to JSON, a markdown table and PNG plots (docs/benchmarks.md).

``--rounds N`` starts every system at once and measures them in turn, N times over, each round
with prompts of its own and the systems' order reversed every other round: this machine's speed
changes by about 1.4x within minutes, so systems measured one after the other are measured at
different speeds, and a per-token CPU ratio between them moves by more than the differences it
is meant to show. The report pools each system's rounds and keeps every round's own figures, and
the table gives the ratio to vLLM's server round by round (the same prompts, a minute apart).

``--images MIX`` replays the trace as chat requests carrying images (benchmarks/image_trace.py
states the mixes) against a vision-language model: by default configs/vision.yaml on
``builtin-vl-large``, as E+P+D (``duet-disagg-http``), EP+D (``duet-disagg-http@epd``) and
vLLM's server on the same model (colocated, ``duet-colocated-http``, on request), every one
through OpenAI HTTP ``/v1/chat/completions``. ``--config`` gives every system another model and config.

``--endpoint`` benchmarks an already running server instead (``grpc://host:port`` for duet,
``http://host:port`` for an OpenAI-compatible one); pass ``--pid`` to measure its CPU too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from duet.benchmarks.encoder_cache import vision_config
from duet.benchmarks.engine_cores import EngineCoreSampler, machine_busy_s
from duet.benchmarks.host_overhead import host_cpu_seconds, process_name, tree_memory_bytes
from duet.benchmarks.image_trace import IMAGE_MIXES, IMAGE_MODEL, chat_bodies, image_plan, model_tokenizer, plan_counts
from duet.benchmarks.loadgen import RequestRecord, replay
from duet.benchmarks.openai_replay import replay_openai, replay_openai_chat
from duet.benchmarks.request_mix import MIXES
from duet.benchmarks.serve_planned import planned_modes
from duet.benchmarks.serve_report import (
    COLOCATED_HTTP, DISAGG_HTTP, DUET_MODES, VLLM, base_name, progress_callback, render_table, summarize, write_plots,
)
from duet.benchmarks.serve_tune import best_systems, tune
from duet.benchmarks.serving_systems import DEFAULT_SYSTEMS, SYSTEMS, RunningSystem, SystemStartError, started
from duet.benchmarks.system_settings import describe, setting_of
from duet.config import DuetConfig, load_config, parse_config
from duet.cluster.placement.cluster_spec import traces_dir
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import Trace, TraceError, load_trace
from duet.worker_runtime.engine import resolve_model_path

EXIT_BAD_INPUT = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "serve"
SLOS = {"tight": Slo(1.0, 0.04), "loose": Slo(1.0, 0.1)}
WARMUP_S = 60.0
# How long each system is left idle after its warm-up to read its CPU floor: what it spends a
# second whatever the load (Ray's daemons and actors, a frontend's runtime, health checks).
IDLE_WINDOW_S = 20.0
_GIB = 1024**3
T = TypeVar("T")
# The systems an image trace can drive (OpenAI chat over HTTP, images as data: URLs): duet's
# HTTP deployments and vLLM's server. --images compares by default E+P+D, EP+D and vLLM's
# server: duet's two disaggregated modes, and what a user would run instead. Colocated duet
# (duet-colocated-http) takes about 5 GiB more, which with --rounds (every system started at
# once) passes a 24 GiB machine's memory: Ray then kills workers (the first run, 2026-12-04).
IMAGE_SYSTEMS = (DISAGG_HTTP, COLOCATED_HTTP, VLLM)
DEFAULT_IMAGE_SYSTEMS = (DISAGG_HTTP, f"{DISAGG_HTTP}@epd", VLLM)


@dataclass(frozen=True)
class Plan:
    trace: Trace
    trace_label: str
    rates: list[float]
    systems: list[str]
    out: Path
    seed: int
    endpoint: str = ""
    pid: int | None = None
    rounds: int = 1
    # What each request asks for beyond a greedy completion (benchmarks/request_mix.py).
    mix: str = "plain"
    warmup_s: float = WARMUP_S
    idle_window_s: float = IDLE_WINDOW_S
    tune: bool = False  # measure every setting of each system instead (benchmarks/serve_tune.py)
    images: str = ""  # an image mix (benchmarks/image_trace.py): chat requests with images; "": text
    config: Path | None = None  # every system's model and config; None: the default for the trace


def plan_config(plan: Plan) -> DuetConfig:
    """The config every system gets: ``plan.config``, or for an image trace configs/vision.yaml
    on builtin-vl-large (its encoder heavy enough that encoding costs what it costs a real model)
    at the model's full length (the trace's prompts are long), or the embedded default."""
    if plan.config is not None:
        return load_config(plan.config)
    if plan.images:
        return parse_config(vision_config(IMAGE_MODEL, max_model_len=None), "configs/vision.yaml, builtin-vl-large")
    return load_config()


def replay_seed(plan: Plan, round_: int, index: int) -> int:
    """The seed of rate ``index``'s replay in round ``round_``, the same on every system; the
    warm-up's is ``plan.seed``."""
    return plan.seed + 1 + round_ * len(plan.rates) + index


def _chat_bodies(plan: Plan, config: DuetConfig, seed: int) -> list[dict[str, Any]] | None:
    """The image trace's requests of the replay with ``seed`` (None for a text trace), built
    before its clock starts: making images is the client's work."""
    if not plan.images:
        return None
    tokenizer = model_tokenizer(resolve_model_path(config.model))
    return chat_bodies(config.model.name, plan.trace, seed, IMAGE_MIXES[plan.images], tokenizer)


def image_replays(plan: Plan) -> list[dict[str, Any]]:
    """What each replay of an image trace sends (requests with images, images, distinct ones)."""
    mix = IMAGE_MIXES[plan.images]
    seeds = {"warm-up": plan.seed}
    for round_ in range(plan.rounds):
        seeds.update({f"{rate:g} req/s, round {round_ + 1}": replay_seed(plan, round_, i) for i, rate in enumerate(plan.rates)})
    return [{"replay": label, "seed": seed, **plan_counts(image_plan(mix, len(plan.trace), seed))} for label, seed in seeds.items()]


async def _replay(
    system: RunningSystem, model: str, trace: Trace, seed: int, on_done: Any, mix: str, bodies: list[dict[str, Any]] | None
) -> list[RequestRecord]:
    if bodies is not None:
        return await replay_openai_chat(system.http_url, trace, bodies, on_done=on_done)
    if system.grpc_target:
        return await replay(
            system.grpc_target, trace, model=model, seed=seed, on_done=on_done, connections=system.connections, mix=mix
        )
    return await replay_openai(system.http_url, model, trace, seed=seed, on_done=on_done, mix=mix)


def _serving_cpu(pid: int | None) -> dict[int, float]:
    return host_cpu_seconds(pid, include_self=False) if pid is not None else {}


def _spent_during(pid: int | None, work: Callable[[], T]) -> tuple[T, dict[int, float], float]:
    """``work``'s result, the CPU seconds each serving-path process under ``pid`` spent while
    it ran, and how many seconds it ran."""
    before, started = _serving_cpu(pid), time.monotonic()
    result = work()
    after, wall_s = _serving_cpu(pid), time.monotonic() - started
    return result, {p: seconds - before.get(p, 0.0) for p, seconds in after.items()}, wall_s


@dataclass
class Measurement:
    """One replay at one rate: its records and the CPU seconds each process of the system spent."""

    records: list[RequestRecord]
    cpu_s_by_process: dict[str, float] = field(default_factory=dict)
    front_door_s: float = 0.0  # of it, the server process alone: duet's router, vLLM's API server
    measured_cpu: bool = False
    wall_s: float = 0.0  # the replay's duration, first request sent to last answer
    # Where the engines computed (benchmarks/engine_cores.py): per engine process, its cores,
    # threads and CPU seconds per core; and the CPU of their steps, of all engine processes,
    # and of the whole machine (load generator included) over the replay.
    cpu_affinity: dict[str, dict[str, Any]] = field(default_factory=dict)
    step_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    machine_busy_s: float = 0.0

    @property
    def streamed_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records)


def measure_rate(
    system: RunningSystem, model: str, trace: Trace, rate: float, seed: int, mix: str = "plain",
    bodies: list[dict[str, Any]] | None = None,
) -> Measurement:
    """Replay ``trace`` at ``rate`` with prompts from ``seed`` and requests of ``mix`` (or the
    image trace's chat ``bodies``), reading the system's CPU around it."""
    pid = system.pid or None
    busy_before = machine_busy_s()
    with progress_callback(len(trace), f"{system.name} @ {rate:g} req/s") as on_done, EngineCoreSampler(pid) as cores:
        records, spent, wall_s = _spent_during(
            pid, lambda: asyncio.run(_replay(system, model, trace.at_rate(rate), seed, on_done, mix, bodies))
        )
    busy_s = machine_busy_s() - busy_before
    by_process: Counter[str] = Counter()
    for p, seconds in spent.items():
        by_process[process_name(p)] += seconds
    if system.front_door_process:
        front_door_s = by_process[system.front_door_process]
    else:
        front_door = system.front_door_pid or pid
        front_door_s = spent.get(front_door, 0.0) if front_door else 0.0
    return Measurement(
        records, dict(by_process), front_door_s, pid is not None, wall_s,
        cores.report(), cores.step_cpu_s(), cores.engine_cpu_s(), busy_s,
    )


def _pooled_affinity(measurements: list[Measurement]) -> dict[str, dict[str, Any]]:
    """Each engine process's cores and threads, and its CPU seconds per core over every replay."""
    pooled: dict[str, dict[str, Any]] = {}
    for m in measurements:
        for label, process in m.cpu_affinity.items():
            entry = pooled.setdefault(label, {"affinity": process["affinity"], "threads": 0, "cpu_s_by_core": Counter()})
            entry["threads"] = max(entry["threads"], process["threads"])
            entry["cpu_s_by_core"].update(process["cpu_s_by_core"])
    for entry in pooled.values():
        entry["cpu_s_by_core"] = {core: round(s, 3) for core, s in sorted(entry["cpu_s_by_core"].items())}
    return pooled


def _step_share(measurements: list[Measurement], serving_cpu_s: float) -> dict[str, float] | None:
    """The engines' steps as a share of the system's busy CPU (engines and serving path) and of
    the whole machine's over the replays; None where the system's CPU was not measured."""
    step = sum(m.step_cpu_s for m in measurements)
    system = serving_cpu_s + sum(m.engine_cpu_s for m in measurements)
    machine = sum(m.machine_busy_s for m in measurements)
    if not step or not system:
        return None
    return {"of_system": step / system, "of_machine": step / machine if machine else math.nan, "step_cpu_s": round(step, 3)}


def rate_entry(measurements: list[Measurement], idle_cpu_s_per_s: float | None = None) -> dict[str, Any]:
    """The report's entry for one system at one rate: its replays pooled (one, or one per round),
    and with several, each round's own CPU per token and attainment.

    With the system's idle CPU floor (``idle_cpu_s_per_s``, :func:`footprint`), the entry also
    gives the CPU per token above it: what serving the tokens cost beyond what the system spends
    whatever the load. At low rates the floor is most of the total, and systems built of
    different processes (Ray's daemons and actors, a Rust frontend) differ most in it."""
    records = [r for m in measurements for r in m.records]
    tokens = sum(m.streamed_tokens for m in measurements)
    by_process: Counter[str] = Counter()
    for m in measurements:
        by_process.update(m.cpu_s_by_process)
    measured = all(m.measured_cpu for m in measurements)
    cpu_s = sum(by_process.values())
    entry: dict[str, Any] = {
        "records": [r.to_dict() for r in records],
        "summary": {name: summarize(records, slo) for name, slo in SLOS.items()},
        "cpu_ms_per_token": 1000.0 * cpu_s / tokens if tokens and measured else None,
        "cpu_ms_per_request": 1000.0 * cpu_s / len(records) if records and measured else None,
        # The server process alone: duet's router, or vLLM's API server; what the total adds to
        # it for duet is Ray (its worker actors and daemons).
        "front_door_ms_per_token": 1000.0 * sum(m.front_door_s for m in measurements) / tokens if tokens and measured else None,
        "cpu_s_by_process": {k: round(v, 3) for k, v in sorted(by_process.items(), key=lambda kv: -kv[1]) if v > 0.005},
        "streamed_tokens": tokens,
        "cpu_affinity": _pooled_affinity(measurements),
        "step_share": _step_share(measurements, cpu_s) if measured else None,
    }
    if idle_cpu_s_per_s is not None and tokens and measured:
        above = cpu_s - idle_cpu_s_per_s * sum(m.wall_s for m in measurements)
        entry["cpu_ms_per_token_above_idle"] = 1000.0 * above / tokens
    if len(measurements) > 1:
        entry["rounds"] = [
            {k: v for k, v in rate_entry([m], idle_cpu_s_per_s).items() if k not in ("records", "cpu_affinity")} for m in measurements
        ]
    return entry


def footprint(system: RunningSystem, idle_window_s: float = IDLE_WINDOW_S) -> dict[str, Any]:
    """What a started, warmed-up system costs before any load: its start-up time, the memory its
    processes hold (engines included, :func:`tree_memory_bytes`) and its serving path's CPU a
    minute over ``idle_window_s`` of idleness (engine processes left out, as in every CPU
    figure here). Empty for a server the benchmark did not start and has no process id of."""
    if not system.pid:
        return {}
    _, spent, wall_s = _spent_during(system.pid, lambda: time.sleep(idle_window_s))
    idle_s = sum(spent.values())
    return {
        "startup_s": system.startup_s,
        "idle_cpu_s_per_min": 60.0 * idle_s / wall_s,
        "memory_gib": tree_memory_bytes(system.pid) / _GIB,
    }


def _memory_after_run(measured: dict[str, Any], system: RunningSystem) -> None:
    """Add to a system's :func:`footprint` the memory it holds once every round has run (its
    engines' caches and its front ends' buffers grown)."""
    if measured:
        measured["memory_gib_after"] = tree_memory_bytes(system.pid) / _GIB


def _idle_rate(measured: dict[str, Any]) -> float | None:
    """CPU seconds a second of the system's floor, from its :func:`footprint`."""
    per_min = measured.get("idle_cpu_s_per_min")
    return per_min / 60.0 if per_min is not None else None


def warm_up(system: RunningSystem, plan: Plan, config: DuetConfig) -> None:
    """A minute of the trace (``plan.warmup_s``), with prompts (and images) of its own: a fresh
    engine's first minute is slower (first kernels per shape)."""
    warmup = plan.trace.at_rate(len(plan.trace) / plan.warmup_s)
    bodies = _chat_bodies(plan, config, plan.seed)
    with progress_callback(len(warmup), f"{system.name} warm-up") as on_done:
        asyncio.run(_replay(system, config.model.name, warmup, plan.seed, on_done, plan.mix, bodies))


def bench_system(system: RunningSystem, plan: Plan, config: DuetConfig) -> dict[str, Any]:
    """Warm up, then measure every rate, each with prompts of its own.

    The engines cache prompt prefixes, so a rate that re-sent an earlier rate's prompts would
    skip most of its prefill work; every replay (the warm-up too) therefore draws fresh random
    prompts from its own seed, the same seeds for every system."""
    warm_up(system, plan, config)
    measured = footprint(system, plan.idle_window_s)
    rates = {}
    for index, rate in enumerate(plan.rates):
        seed = replay_seed(plan, 0, index)
        bodies = _chat_bodies(plan, config, seed)
        rates[str(rate)] = rate_entry(
            [measure_rate(system, config.model.name, plan.trace, rate, seed, plan.mix, bodies)], _idle_rate(measured)
        )
    entry = {"footprint": measured, "rates": rates}
    _memory_after_run(measured, system)
    return entry


def bench_interleaved(plan: Plan, config: DuetConfig) -> dict[str, Any]:
    """Every system started at once, then measured in turn at each rate, ``plan.rounds`` times:
    round ``r`` replays rate ``i`` with prompts from seed ``SEED + 1 + r * len(rates) + i`` on
    every system, in the systems' order, reversed in odd rounds (so neither always goes first)."""
    model = config.model.name
    with ExitStack() as stack:
        systems = [stack.enter_context(started(name, config, plan.out / "logs")) for name in plan.systems]
        for system in systems:
            warm_up(system, plan, config)
        # Every system warm and idle: each one's floor is read while the others are idle too.
        measured = {system.name: footprint(system, plan.idle_window_s) for system in systems}
        runs: dict[str, dict[str, list[Measurement]]] = {s.name: {str(rate): [] for rate in plan.rates} for s in systems}
        for round_ in range(plan.rounds):
            for index, rate in enumerate(plan.rates):
                seed = replay_seed(plan, round_, index)
                bodies = _chat_bodies(plan, config, seed)
                for system in systems if round_ % 2 == 0 else reversed(systems):
                    runs[system.name][str(rate)].append(measure_rate(system, model, plan.trace, rate, seed, plan.mix, bodies))
        for system in systems:
            _memory_after_run(measured[system.name], system)
    return {
        name: {
            "footprint": measured[name],
            "rates": {rate: rate_entry(ms, _idle_rate(measured[name])) for rate, ms in by_rate.items()},
        }
        for name, by_rate in runs.items()
    }


def run(plan: Plan, config: DuetConfig) -> dict[str, Any]:
    report: dict[str, Any] = {
        "trace": plan.trace_label,
        "requests": len(plan.trace),
        "seed": plan.seed,
        "slos": {name: {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s} for name, slo in SLOS.items()},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": str(plan.config) if plan.config else "default",
        "model": config.model.path,
        "systems": {},
    }
    if plan.images:
        report["images"] = {"mix": plan.images, "description": IMAGE_MIXES[plan.images].description, "replays": image_replays(plan)}
    if plan.endpoint:
        grpc_target = plan.endpoint.removeprefix("grpc://") if plan.endpoint.startswith("grpc://") else ""
        system = RunningSystem("endpoint", plan.pid or 0, grpc_target=grpc_target, http_url="" if grpc_target else plan.endpoint)
        report["systems"]["endpoint"] = bench_system(system, plan, config)
    if plan.tune:
        report["rounds"] = plan.rounds
        report.update(tune(plan, config, bench_interleaved))
    elif plan.rounds > 1:
        report["rounds"] = plan.rounds
        report["systems"].update(bench_interleaved(plan, config))
    else:
        for name in plan.systems:
            with started(name, config, plan.out / "logs") as system:
                report["systems"][name] = bench_system(system, plan, config)
    report["settings"] = {system: describe(system) for system in report["systems"] if system != "endpoint"}
    report["machine"]["loadavg_after"] = os.getloadavg()
    # `duet plan` simulates text prompts on the built-in text model: no plan for an image trace.
    if not plan.images and any(system in DUET_MODES for system in report["systems"]):
        report["planned_modes"] = planned_modes(plan.trace, plan.rates, SLOS)
    return report


# ---- command line ------------------------------------------------------------------------


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=str(traces_dir() / "AzureLLMInferenceTrace_conv.csv"),
                        help="Azure .csv, Mooncake .jsonl, or synthetic:n=240,rate=4,cv=1 (default: Azure conversation)")
    parser.add_argument("--requests", type=int, default=240, help="first N requests of the trace (default 240)")
    parser.add_argument("--max-input", type=int, default=1800, help="cap prompt lengths (default 1800)")
    parser.add_argument("--max-output", type=int, default=96, help="cap output lengths (default 96)")
    parser.add_argument("--rates", default="2,4,6,8,12,16", help="offered req/s, comma-separated")
    parser.add_argument(
        "--systems",
        help=f"which to start, from {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)}; "
        f"with --images {','.join(DEFAULT_IMAGE_SYSTEMS)})",
    )
    parser.add_argument("--endpoint", default="", help="bench a running server: grpc://HOST:PORT or http://HOST:PORT")
    parser.add_argument("--pid", type=int, help="with --endpoint: the server's process id, to measure its CPU")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="prompts: the warm-up uses SEED, rate i SEED+1+i")
    parser.add_argument(
        "--rounds", type=int, default=1, help="start the systems together and measure them in turn this many times"
    )
    parser.add_argument(
        "--tune", action="store_true",
        help="measure every setting of each system (NAME@SETTING, benchmarks/system_settings.py) at one rate, interleaved, "
        "and pick each one's best",
    )
    parser.add_argument("--tuned", type=Path, help="run each system on the best setting this --tune report.json picked")
    parser.add_argument(
        "--mix", choices=sorted(MIXES), default="plain",
        help="what each request asks for: plain greedy completions, or features (logprobs, penalties, a regex output)",
    )
    parser.add_argument(
        "--images", choices=sorted(IMAGE_MIXES),
        help="replay the trace as chat requests with images, on a vision-language model (default: text); "
        + "; ".join(f"{name}: {mix.description}" for name, mix in IMAGE_MIXES.items())
        + ". Each new image has random pixels (the model's processor resizes it); each replay has images of its own",
    )
    parser.add_argument(
        "--config", type=Path,
        help="the duet config every system serves, its model given to vLLM's server too (default: the embedded "
        "default; with --images configs/vision.yaml on builtin-vl-large)",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=WARMUP_S,
        help=f"each system's warm-up: the trace replayed over this many seconds (default {WARMUP_S:g})",
    )
    parser.set_defaults(handler=_bench_serve)


def register_command(benches: argparse._SubParsersAction) -> None:
    """Add ``bench serve`` to duet's CLI."""
    _add_arguments(benches.add_parser("serve", help="goodput of duet vs plain vLLM on a trace, side by side"))


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The run the arguments ask for; ValueError (or TraceError) naming the bad flag."""
    try:
        rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--rates {args.rates!r}: expected numbers like 4,8,16") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates {args.rates!r}: give at least one rate, all > 0")
    named = args.systems or ",".join(DEFAULT_IMAGE_SYSTEMS if args.images else DEFAULT_SYSTEMS)
    systems = [s.strip() for s in named.split(",") if s.strip()] if not args.endpoint else []
    unknown = sorted({s for s in systems if s.partition("@")[0] not in SYSTEMS})
    if unknown:
        raise ValueError(f"--systems: unknown {', '.join(unknown)} (choose from {', '.join(SYSTEMS)}, each as NAME or NAME@SETTING)")
    for system in systems:
        try:
            setting_of(system)
        except ValueError as error:
            raise ValueError(f"--systems: {error}") from None
    if args.tuned:
        systems = best_systems(args.tuned, systems)
    if args.tune and (len(rates) != 1 or args.endpoint or args.tuned):
        raise ValueError("--tune: give exactly one rate (near the knee), and neither --endpoint nor --tuned")
    if args.endpoint and not args.endpoint.startswith(("grpc://", "http://", "https://")):
        raise ValueError(f"--endpoint {args.endpoint!r}: must start with grpc:// or http://")
    if args.requests < 1:
        raise ValueError(f"--requests {args.requests}: must be at least 1")
    if args.rounds < 1 or (args.rounds > 1 and not args.tune and (args.endpoint or len(systems) < 2)):
        raise ValueError(f"--rounds {args.rounds}: must be at least 1, and above 1 only with two or more --systems")
    if args.warmup_s <= 0:
        raise ValueError(f"--warmup-s {args.warmup_s:g}: must be above 0")
    if args.images:
        _check_image_trace(args, systems)
    trace = load_trace(args.trace).head(args.requests).capped(args.max_input, args.max_output)
    label = f"{Path(args.trace).name}, first {len(trace)} requests, input <= {args.max_input}, output <= {args.max_output}"
    if args.mix != "plain":
        label += f", request mix {args.mix}"
    if args.images:
        label += f", as chats with images: {args.images}"
    return Plan(
        trace, label, rates, systems, args.out, args.seed, args.endpoint, args.pid, args.rounds, args.mix,
        warmup_s=args.warmup_s, tune=args.tune, images=args.images or "", config=args.config,
    )


def _check_image_trace(args: argparse.Namespace, systems: list[str]) -> None:
    """ValueError naming the flag unless every system can be sent the image trace's chat requests."""
    other = [system for system in systems if base_name(system) not in IMAGE_SYSTEMS]
    if other:
        raise ValueError(
            f"--images: {', '.join(other)} cannot take it (images go as OpenAI chat requests over HTTP; choose from "
            f"{', '.join(IMAGE_SYSTEMS)}, each as NAME or NAME@SETTING)"
        )
    if args.endpoint.startswith("grpc://"):
        raise ValueError("--images: the image trace is sent as OpenAI chat requests; give an http:// --endpoint")
    if args.mix != "plain":
        raise ValueError(f"--mix {args.mix}: only plain with --images")


def _bench_serve(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
        config = plan_config(plan)
    except (ValueError, TraceError) as error:  # a bad --config too (ConfigError)
        print(f"duet bench serve: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        report = run(plan, config)
    except SystemStartError as error:
        print(f"duet bench serve: error: {error}", file=sys.stderr)
        return 1
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    table = render_table(report)
    (plan.out / "table.md").write_text(table + "\n")
    plots = write_plots(report, plan.out)
    print(table)
    print(f"\nwrote {plan.out / 'report.json'}, {plan.out / 'table.md'} and {len(plots)} plots")
    return 0
