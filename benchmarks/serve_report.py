"""Summaries, goodput, tables and plots of a serving comparison: duet disaggregated, duet
colocated and plain vLLM replaying the same trace at the same offered rates.

All three systems are judged on the client's TTFT and TPOT (``client_ttft_s``/``client_tpot_s``),
the only view they share: plain vLLM has no router to measure at, and what a user waits for
includes each system's own front end. A failed request (error, or fewer tokens than asked)
misses every SLO, as an unfinished request does in the simulator.

The report the runner writes, and every function here reads::

    {
      "systems": {
        "duet-disagg" | "duet-colocated" | "vllm": {
          "rates": {
            str(rate): {                          # offered req/s, e.g. "2.0"
              "records": [RequestRecord.to_dict(), ...],
              "summary": {slo_name: summarize(records, slo), ...},
              "cpu_ms_per_token": float,          # serving-path CPU per streamed token
              "front_door_ms_per_token": float,   # of it, the server process alone (optional)
              "cpu_ms_per_request": float,        # the same CPU per request (optional)
              "cpu_affinity": {process: {"affinity", "threads", "cpu_s_by_core"}},  # engines (optional)
              "step_share": {"of_system", "of_machine", "step_cpu_s"} | None,  # (optional)
              "cpu_ms_per_token_above_idle": float,  # less the idle floor's share (optional)
              "rounds": [{...}, ...],             # --rounds: each round's own entry, no records
            },
          },
          "footprint": {                          # optional: measured warm, before the load
            "startup_s": float | None, "idle_cpu_s_per_min": float,
            "memory_gib": float, "memory_gib_after": float,
          },
        },
      },
      "slos": {slo_name: {"ttft_s": float, "tpot_s": float}, ...},
      "images": {                                 # optional: an image trace (benchmarks/image_trace.py)
        "mix": str, "description": str,
        "replays": [{"replay", "seed", "requests", "requests_with_images", "images_sent", "distinct_images"}, ...],
      },
      ...                                         # anything else the runner records (trace, seed)
    }
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from duet.benchmarks.loadgen import RequestRecord, replay_result
from duet.benchmarks.serve_planned import describe, picked
from duet.cluster.placement.simulator import Slo

DISAGG, COLOCATED, VLLM = "duet-disagg", "duet-colocated", "vllm"
# duet disaggregated driven through its OpenAI HTTP API by the client that drives vLLM: the same
# front-end protocol on both sides of the comparison.
DISAGG_HTTP = "duet-disagg-http"
# duet colocated, driven through its OpenAI HTTP API, as every system of a comparison table is.
COLOCATED_HTTP = "duet-colocated-http"
# duet disaggregated with two front doors apart from the control plane (server.front_ends: 2).
DISAGG_FRONT_DOORS = "duet-disagg-2fd"
# The systems users would pick instead (benchmarks/peer_systems.py), each with the settings its
# users could set (benchmarks/system_settings.py).
VLLM_PD, DYNAMO_AGG, DYNAMO_DISAGG = "vllm-pd", "dynamo-agg", "dynamo-disagg"
PEERS = (VLLM_PD, DYNAMO_AGG, DYNAMO_DISAGG)
GOODPUT_TARGET = 0.9  # attainment at which goodput is read off, as in DistServe
# duet's deployments by the mode `duet plan` would choose between (benchmarks/serve_planned.py).
# Conditional disaggregation runs as duet's disaggregated deployment does: both pools.
_POOLS = frozenset({"disaggregated", "conditional"})
DUET_MODES = {
    DISAGG: _POOLS, DISAGG_HTTP: _POOLS, DISAGG_FRONT_DOORS: _POOLS,
    COLOCATED: frozenset({"colocated"}), COLOCATED_HTTP: frozenset({"colocated"}),
}
PLANNED_MARK = " ◆"
# Systems driven through duet's gRPC API; every other one through OpenAI HTTP.
GRPC_SYSTEMS = frozenset({DISAGG, COLOCATED, DISAGG_FRONT_DOORS})


def base_name(system: str) -> str:
    """A system's name without its setting (``vllm-pd@own-core``: ``vllm-pd``)."""
    return system.partition("@")[0]


def protocol(system: str) -> str:
    return "gRPC" if base_name(system) in GRPC_SYSTEMS else "OpenAI HTTP"


def ratio_pairs(systems: Sequence[str]) -> list[tuple[str, str]]:
    """The comparisons the table reports for the systems a run included, each between two
    systems driven through the same protocol: every duet deployment against every other
    system, duet disaggregated against duet colocated, and the first setting of a system in the
    run against each of its other settings."""
    duet = [s for s in systems if base_name(s) in DUET_MODES]
    others = [s for s in systems if base_name(s) not in DUET_MODES]
    pairs = [(top, bottom) for top in duet for bottom in others if protocol(top) == protocol(bottom)]
    colocated = [s for s in duet if DUET_MODES[base_name(s)] == {"colocated"}]
    pairs += [
        (top, bottom) for top in duet for bottom in colocated
        if top not in colocated and protocol(top) == protocol(bottom)
    ]
    firsts: dict[str, str] = {}
    for system in systems:
        first = firsts.setdefault(base_name(system), system)
        if first != system:
            pairs.append((first, system))
    return pairs


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(records: Sequence[RequestRecord], slo: Slo) -> dict[str, float]:
    """Attainment, latency percentiles and throughput of one replay, from the client's view.

    Attainment counts failures as misses; the latency percentiles are over completed requests
    (what was served; failures show in ``errors`` and ``attainment``). Throughput is the output
    tokens of completed requests per second from the first send to the last request's end.
    """
    result = replay_result(list(records), client=True)
    done = [r for r in records if not r.error]
    ends = [r.sent_s + r.client_e2e_s for r in records if math.isfinite(r.client_e2e_s)]
    span = max(ends) - min(r.sent_s for r in records) if ends else math.nan
    tokens = sum(r.completion_tokens for r in done)
    return {
        "requests": len(records),
        "errors": len(records) - len(done),
        "attainment": result.attainment(slo),
        "ttft_attainment": result.attainment(slo.only_ttft()),
        "tpot_attainment": result.attainment(slo.only_tpot()),
        **{f"ttft_p{q}_s": _pct([r.client_ttft_s for r in done], q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": _pct([r.client_tpot_s for r in done], q) for q in (50, 90, 99)},
        **{f"e2e_p{q}_s": _pct([r.client_e2e_s for r in done], q) for q in (50, 90)},
        "throughput_tok_s": tokens / span if span > 0 else math.nan,
    }


def goodput_at(rates: Sequence[float], attainments: Sequence[float], target: float = GOODPUT_TARGET) -> float:
    """The highest offered rate whose attainment is at least ``target``.

    Linearly interpolated between the highest measured rate that meets the target and the next
    measured rate, which misses it; 0.0 if no rate meets it. If the highest rate measured meets
    it, that rate is returned and is only a lower bound: the system was not driven to its limit.
    """
    if len(rates) != len(attainments):
        raise ValueError(f"{len(rates)} rates but {len(attainments)} attainments")
    points = sorted(zip(rates, attainments))
    meeting = [i for i, (_, attainment) in enumerate(points) if attainment >= target]
    if not meeting:
        return 0.0
    i = meeting[-1]
    if i == len(points) - 1:
        return points[i][0]
    (r0, a0), (r1, a1) = points[i], points[i + 1]
    return r0 + (a0 - target) / (a0 - a1) * (r1 - r0)


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; inf when only the denominator is 0, None when both are."""
    if denominator == 0:
        return math.inf if numerator > 0 else None
    return numerator / denominator


def _by_rate(report: Mapping[str, Any], system: str) -> list[tuple[float, dict[str, Any]]]:
    """A system's runs, ordered by offered rate (the report keys rates as strings)."""
    return sorted((float(rate), run) for rate, run in report["systems"][system]["rates"].items())


def _attainments(report: Mapping[str, Any], system: str, slo_name: str) -> tuple[list[float], list[float]]:
    runs = _by_rate(report, system)
    return [rate for rate, _ in runs], [run["summary"][slo_name]["attainment"] for _, run in runs]


def goodputs(report: Mapping[str, Any], target: float = GOODPUT_TARGET) -> dict[str, dict[str, float]]:
    """``{system: {slo_name: goodput req/s}}`` by :func:`goodput_at` over the measured rates."""
    return {
        system: {slo: goodput_at(*_attainments(report, system, slo), target) for slo in report["slos"]}
        for system in report["systems"]
    }


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return "inf" if value == math.inf else format(value, spec)


def _times(value: float | None) -> str:
    """A ratio as the tables print it: ``1.14x``, or ``inf`` / ``n/a`` without the ``x``."""
    return _fmt(value, ".2f") + ("x" if value is not None and math.isfinite(value) else "")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_table(report: Mapping[str, Any], target: float = GOODPUT_TARGET) -> str:
    """Markdown: per system and rate, the attainments and latencies; then goodputs and ratios.

    A goodput marked ``>=`` met the target at every measured rate (a lower bound).
    """
    slos = list(report["slos"])
    header = ["system", "rate (req/s)", *(f"attainment {s}" for s in slos)]
    header += ["TTFT p90 (s)", "TPOT p50 (ms)", "CPU ms/token", "of it, front door", "above idle", "CPU ms/request"]
    header += ["engine steps, of system CPU"]
    lines = [_row(header), _row(["---"] * len(header))]
    planned = report.get("planned_modes", {})
    for system in report["systems"]:
        for rate, run in _by_rate(report, system):
            summary = run["summary"][slos[0]]  # latencies do not depend on the SLO
            lines.append(
                _row(
                    [
                        system,
                        f"{rate:g}",
                        *(_fmt(run["summary"][s]["attainment"], ".1%") + _planned_mark(planned, system, s, rate) for s in slos),
                        _fmt(summary["ttft_p90_s"], ".3f"),
                        _fmt(1000 * summary["tpot_p50_s"], ".1f"),
                        _fmt(run.get("cpu_ms_per_token"), ".2f"),
                        _fmt(run.get("front_door_ms_per_token"), ".2f"),
                        _fmt(run.get("cpu_ms_per_token_above_idle"), ".2f"),
                        _fmt(run.get("cpu_ms_per_request"), ".1f"),
                        _fmt((run.get("step_share") or {}).get("of_system"), ".1%"),
                    ]
                )
            )

    good = goodputs(report, target)
    header = ["goodput (req/s)", *slos]
    lines += ["", f"Goodput at {target:.0%} attainment:", "", _row(header), _row(["---"] * len(header))]
    for system in report["systems"]:
        cells = []
        for slo in slos:
            _, attainments = _attainments(report, system, slo)
            bound = ">= " if min(attainments) >= target else ""
            cells.append(bound + _fmt(good[system][slo], ".2f"))
        lines.append(_row([system, *cells]))
    for top, bottom in ratio_pairs(list(report["systems"])):
        if top in good and bottom in good:
            times = [ratio(good[top][s], good[bottom][s]) for s in slos]
            cells = [_times(t) for t in times]
        else:
            cells = ["n/a"] * len(slos)
        lines.append(_row([f"{top} / {bottom}", *cells]))
    return (
        _images_title(report) + "\n".join(lines) + "\n" + _settings_table(report) + _best_table(report) + _cores_table(report) + _footprint_table(report)
        + _planned_table(planned) + rounds_versus_table(report) + _cpu_ratio_table(report)
    )


def _images_title(report: Mapping[str, Any]) -> str:
    """Markdown above an image trace's table: its mix, and what each replay sent; empty for text."""
    images = report.get("images")
    if not images:
        return ""
    header = ["replay", "seed", "requests with images", "images sent", "distinct images"]
    rows = [
        _row([r["replay"], str(r["seed"]), f"{r['requests_with_images']} of {r['requests']}", str(r["images_sent"]), str(r["distinct_images"])])
        for r in images["replays"]
    ]
    return "\n".join([f"Image trace `{images['mix']}`: {images['description']}.", "", _row(header), _row(["---"] * len(header)),
                      *rows, "", ""])


def engine_cores(process: Mapping[str, Any], least_share: float = 0.1) -> str:
    """The cores an engine process computed on, each with its share of the process's CPU
    (cores under ``least_share`` left out): ``1 (97%)``, ``0 (55%), 1 (45%)``."""
    by_core = process.get("cpu_s_by_core", {})
    total = sum(by_core.values())
    if not total:
        return "idle"
    shares = sorted(((core, s / total) for core, s in by_core.items()), key=lambda cs: -cs[1])
    return ", ".join(f"{core} ({share:.0%})" for core, share in shares if share >= least_share)


def _cores_table(report: Mapping[str, Any]) -> str:
    """Markdown: each engine process of each system at its highest rate: its allowed cores, its
    threads, and the cores its CPU went to (benchmarks/engine_cores.py)."""
    lines = []
    for system in report["systems"]:
        runs = _by_rate(report, system)
        if not runs:
            continue
        rate, run = runs[-1]
        for label, process in run.get("cpu_affinity", {}).items():
            seconds = sum(process.get("cpu_s_by_core", {}).values())
            lines.append(_row([system, label, process["affinity"], str(process["threads"]), engine_cores(process), f"{seconds:.1f}"]))
    if not lines:
        return ""
    header = ["system", "engine process", "allowed cores", "threads", "computed on (share of its CPU)", "CPU s"]
    return "\n".join(["", "Where each engine computed, at each system's highest rate (all rounds):", "",
                      _row(header), _row(["---"] * len(header)), *lines]) + "\n"


def _best_table(report: Mapping[str, Any]) -> str:
    """Markdown, for a tuning run: each system's best setting (benchmarks/serve_tune.py)."""
    best = report.get("best", {})
    if not best:
        return ""
    lines = [_row([system, chosen, report.get("settings", {}).get(chosen, "")]) for system, chosen in best.items()]
    header = ["system", "best setting", "what it sets"]
    rule = ("highest tight-SLO attainment (within 2 points counts as equal), then loose, then the lowest CPU per token")
    return "\n".join(["", f"Best setting per system ({rule}):", "", _row(header), _row(["---"] * 3), *lines]) + "\n"


def _settings_table(report: Mapping[str, Any]) -> str:
    """Markdown: the settings each system ran with (benchmarks/system_settings.py)."""
    settings = report.get("settings", {})
    if not settings:
        return ""
    lines = [_row([system, protocol(system), text]) for system, text in settings.items()]
    header = ["system", "driven through", "settings"]
    return "\n".join(["", "Settings:", "", _row(header), _row(["---"] * 3), *lines]) + "\n"


def _footprint_table(report: Mapping[str, Any]) -> str:
    """Markdown: each started system's start-up time, memory and idle CPU floor."""
    rows = [(system, entry["footprint"]) for system, entry in report["systems"].items() if entry.get("footprint")]
    if not rows:
        return ""
    header = ["system", "start-up (s)", "memory, warm idle / after the run (GiB)", "idle CPU (s a minute)"]
    lines = ["", "What each system costs before any load (engines' memory included, their CPU not):", "",
             _row(header), _row(["---"] * len(header))]
    for system, measured in rows:
        memory = f"{_fmt(measured.get('memory_gib'), '.2f')} / {_fmt(measured.get('memory_gib_after'), '.2f')}"
        lines.append(_row([system, _fmt(measured.get("startup_s"), ".0f"), memory, _fmt(measured.get("idle_cpu_s_per_min"), ".2f")]))
    return "\n".join(lines) + "\n"


def _planned_mark(planned: Mapping[str, Any], system: str, slo: str, rate: float) -> str:
    """The mark on a duet deployment's attainment where it runs the mode `duet plan` picks."""
    mark = planned.get(slo, {}).get(f"{rate:g}")
    return PLANNED_MARK if mark and picked(mark) in DUET_MODES.get(base_name(system), ()) else ""


def _planned_table(planned: Mapping[str, Any]) -> str:
    """Markdown: the mode `duet plan` picks for this machine's cores, per rate and SLO."""
    if not planned:
        return ""
    slos = list(planned)
    header = ["rate (req/s)", *(f"`duet plan`, {slo} SLO" for slo in slos)]
    lines = ["", f"The mode `duet plan` picks for this machine's cores, simulating the same requests ({PLANNED_MARK.strip()} above):", "",
             _row(header), _row(["---"] * len(header))]
    for rate in planned[slos[0]]:
        lines.append(_row([rate, *(describe(planned[slo][rate]) for slo in slos)]))
    return "\n".join(lines) + "\n"


def _cpu_ratio_table(report: Mapping[str, Any]) -> str:
    """Markdown: each system's CPU per streamed token over vLLM's at the same rate, for the whole
    serving path and for the front door alone (router against API server); empty without vLLM."""
    reference = next((s for s in report["systems"] if base_name(s) == VLLM), None)
    if reference is None:
        return ""
    vllm_runs = dict(_by_rate(report, reference))
    header = ["CPU per token / vllm's", *(f"{rate:g} req/s: total, front door" for rate in vllm_runs)]
    lines = ["", "CPU per streamed token against vLLM's server at the same rate:", "", _row(header), _row(["---"] * len(header))]
    for system in report["systems"]:
        if system == reference:
            continue
        runs = dict(_by_rate(report, system))
        cells = []
        for rate, theirs in vllm_runs.items():
            run = runs.get(rate, {})
            times = [ratio(run.get(key) or 0.0, theirs.get(key) or 0.0) for key in ("cpu_ms_per_token", "front_door_ms_per_token")]
            cells.append(", ".join(_times(t) for t in times))
        lines.append(_row([system, *cells]))
    return "\n".join(lines) + "\n" + _rounds_table(report, reference, vllm_runs)


def _rounds_table(report: Mapping[str, Any], reference: str, vllm_runs: Mapping[float, Mapping[str, Any]]) -> str:
    """Markdown, for a run of several rounds: each round's total CPU per token over vLLM's in the
    same round (the same prompts, minutes apart at most), and their median."""
    lines = []
    for system in report["systems"]:
        if system == reference:
            continue
        for rate, run in _by_rate(report, system):
            pairs = zip(run.get("rounds", []), vllm_runs.get(rate, {}).get("rounds", []))
            times = [ratio(ours.get("cpu_ms_per_token") or 0.0, theirs.get("cpu_ms_per_token") or 0.0) for ours, theirs in pairs]
            finite = [t for t in times if t is not None and math.isfinite(t)]
            if finite:
                lines.append(_row([system, f"{rate:g}", ", ".join(_times(t) for t in times), _times(float(np.median(finite)))]))
    if not lines:
        return ""
    header = ["CPU per token / vllm's, by round", "rate (req/s)", "rounds", "median"]
    return "\n".join(["", "Round by round (the systems measured in turn, each round with its own prompts):", "", _row(header), _row(["---"] * len(header)), *lines]) + "\n"


def rounds_versus_table(report: Mapping[str, Any]) -> str:
    """Markdown, for a run of several rounds: each pair of :func:`ratio_pairs` measured in the
    same rounds, round by round at each rate: attainment at each SLO (``duet/other``, in
    percent) and how many rounds duet was at or above; CPU per token over the other's (median
    of rounds, in total and above each system's idle floor)."""
    slos = list(report["slos"])
    lines = []
    # A tuning run measured its settings in groups (benchmarks/serve_tune.py): each group's own.
    runs = [{"systems": group} for group in report.get("group_entries", [])] or [report]
    for run, (top, bottom) in ((run, pair) for run in runs for pair in ratio_pairs(list(run["systems"]))):
        theirs_by_rate = dict(_by_rate(run, bottom))
        for rate, ours in _by_rate(run, top):
            pairs = list(zip(ours.get("rounds", []), theirs_by_rate.get(rate, {}).get("rounds", [])))
            if not pairs:
                continue
            cells = []
            for slo in slos:
                got = [(a["summary"][slo]["attainment"], b["summary"][slo]["attainment"]) for a, b in pairs]
                ahead = sum(1 for a, b in got if a >= b)
                cells.append(f"**{ahead} of {len(got)}** (" + ", ".join(f"{100 * a:.0f}/{100 * b:.0f}" for a, b in got) + ")")
            for key in ("cpu_ms_per_token", "cpu_ms_per_token_above_idle"):
                times = [ratio(a.get(key) or 0.0, b.get(key) or 0.0) for a, b in pairs]
                finite = [t for t in times if t is not None and math.isfinite(t)]
                cells.append(_times(float(np.median(finite))) if finite else "n/a")
            lines.append(_row([f"{top} / {bottom}", f"{rate:g}", *cells]))
    if not lines:
        return ""
    header = ["round by round", "rate (req/s)", *(f"{slo}: rounds at or above (attainment %)" for slo in slos)]
    header += ["CPU/token ratio, median", "above idle, median"]
    return "\n".join(["", "Side by side in the same rounds (the first system's figures first):", "",
                      _row(header), _row(["---"] * len(header)), *lines]) + "\n"


def _cdf(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted completed values and their fraction of *all* requests: failures keep it below 1."""
    values = np.sort([r[key] for r in records if not r["error"]])
    return values, np.arange(1, len(values) + 1) / max(len(records), 1)


def write_plots(report: Mapping[str, Any], out_dir: Path, target: float = GOODPUT_TARGET) -> list[Path]:
    """PNG plots of ``report`` in ``out_dir``; returns their paths.

    ``attainment.png``: attainment against offered rate, a panel per SLO, a line per system.
    ``latency_cdf_<rate>rps.png`` for each rate: the client TTFT and TPOT CDFs, a line per system
    and the SLO targets; a curve stays below 1 by the share of requests that failed.
    Drawn on matplotlib's Agg canvas through :class:`~matplotlib.figure.Figure`, without pyplot,
    so no display or global backend is involved.
    """
    from matplotlib.figure import Figure  # plotting only: keep the replay modules free of it

    out_dir.mkdir(parents=True, exist_ok=True)
    systems, slos = list(report["systems"]), report["slos"]
    paths = []

    fig = Figure(figsize=(5 * len(slos), 4), layout="constrained")
    for ax, slo in zip(fig.subplots(1, len(slos), squeeze=False)[0], slos):
        for system in systems:
            ax.plot(*_attainments(report, system, slo), marker="o", label=system)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        limits = slos[slo]
        ax.set(
            title=f"{slo}: TTFT <= {limits['ttft_s']:g} s, TPOT <= {limits['tpot_s'] * 1000:g} ms",
            xlabel="offered rate (req/s)",
            ylabel="SLO attainment",
            ylim=(0, 1.05),
        )
        ax.legend()
    paths.append(out_dir / "attainment.png")
    fig.savefig(paths[-1], dpi=120)

    runs = {system: dict(_by_rate(report, system)) for system in systems}
    for rate in sorted({rate for by_rate in runs.values() for rate in by_rate}):
        fig = Figure(figsize=(10, 4), layout="constrained")
        ttft_ax, tpot_ax = fig.subplots(1, 2)
        for system in systems:
            run = runs[system].get(rate)
            if run is None:
                continue
            ttft_ax.step(*_cdf(run["records"], "client_ttft_s"), where="post", label=system)
            tpot_ax.step(*_cdf(run["records"], "client_tpot_s"), where="post", label=system)
        for ax, metric in ((ttft_ax, "ttft"), (tpot_ax, "tpot")):
            for style, (slo, limits) in zip((":", "-.", "--"), slos.items()):
                ax.axvline(limits[f"{metric}_s"], color="grey", linestyle=style, linewidth=1, label=f"{slo} SLO")
            name = metric.upper()
            ax.set(title=f"{name} at {rate:g} req/s", xlabel=f"{name} (s)", ylabel="fraction of requests")
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.legend()
        paths.append(out_dir / f"latency_cdf_{rate:g}rps.png")
        fig.savefig(paths[-1], dpi=120)
    return paths


@contextmanager
def progress_callback(total: int, description: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar of ``total`` requests; yields the ``on_done`` that advances it.

    Drawn on stderr so that a runner printing its results to stdout is not interleaved with it.
    """
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)
