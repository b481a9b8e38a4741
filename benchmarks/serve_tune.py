"""``duet bench serve --tune``: each system's settings measured side by side, and its best picked.

A lead over a peer only counts against that peer's best (issue 53). For every system named in
``--systems``, its settings (benchmarks/system_settings.py) are started together, warmed up and
measured in turn at one rate near the knee (``--rates`` gives exactly one), round by round with
prompts of their own, as ``duet bench serve --rounds`` measures systems. At most
:data:`GROUP_SIZE` run at once (each peer's engines hold a few GiB of this machine's 24): a
system with more settings is measured in groups, each after the first with the best so far
in it, so that every setting is judged beside the current best in the same rounds.

The best setting, by a rule stated before the run: the highest tight-SLO attainment over all
rounds, counting attainments within :data:`ATTAINMENT_TIE` of the highest as equal; among
those, the loose-SLO attainment likewise; then the lowest CPU per streamed token. The report
keeps every setting's measurements and the choice (``best``); ``duet bench serve --tuned
REPORT`` then runs each system on its best.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from duet.benchmarks.serve_report import base_name
from duet.benchmarks.system_settings import DEFAULT, SETTINGS, Setting

GROUP_SIZE = 3
ATTAINMENT_TIE = 0.02
# A tuning run warms each setting up and reads its idle floor for less long than a comparison.
TUNE_WARMUP_S, TUNE_IDLE_WINDOW_S = 30.0, 10.0


def settings_to_try(system: str) -> list[str]:
    """``NAME@SETTING`` for every setting of ``system``'s base that the sweep measures, in the
    catalogue's order (its default first where the sweep can measure it)."""
    name = base_name(system)
    settings = SETTINGS.get(name, {DEFAULT: Setting("as its documentation sets it up")})
    return [f"{name}@{key}" for key, setting in settings.items() if setting.swept]


def _pooled(entry: dict[str, Any], slo: str) -> float:
    return entry["summary"][slo]["attainment"]


def pick_best(entries: dict[str, dict[str, Any]]) -> str:
    """The best of ``{system@setting: rate entry}`` by the rule in the module's docstring."""
    candidates = list(entries)
    for slo in ("tight", "loose"):
        top = max(_pooled(entries[c], slo) for c in candidates)
        candidates = [c for c in candidates if _pooled(entries[c], slo) >= top - ATTAINMENT_TIE]

    def cpu(candidate: str) -> float:
        value = entries[candidate].get("cpu_ms_per_token")
        return value if value is not None else math.inf

    return min(candidates, key=cpu)


def tune(plan: Any, config: Any, bench_interleaved: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """Every setting of every system in ``plan.systems``, measured in groups (see the module's
    docstring) with ``bench_interleaved`` (benchmarks/serve_bench.py); returns the report's
    ``systems`` (every setting measured, by ``NAME@SETTING``; a setting measured in two groups
    keeps its first), ``best`` (by system name), ``groups`` (the settings of each group, by
    system name) and ``group_entries`` (each group's measurements, in order)."""
    systems: dict[str, Any] = {}
    best: dict[str, str] = {}
    groups: dict[str, list[list[str]]] = {}
    # Each group's own measurements (without records): a leader measured again in a later group
    # is compared with that group's settings in those rounds.
    group_entries: list[dict[str, Any]] = []
    for system in plan.systems:
        remaining = settings_to_try(system)
        group, remaining = remaining[:GROUP_SIZE], remaining[GROUP_SIZE:]
        groups[base_name(system)] = []
        while True:
            groups[base_name(system)].append(group)
            measured = bench_interleaved(
                replace(plan, systems=group, warmup_s=TUNE_WARMUP_S, idle_window_s=TUNE_IDLE_WINDOW_S), config
            )
            for name, entry in measured.items():
                systems.setdefault(name, entry)
            group_entries.append({name: _without_records(entry) for name, entry in measured.items()})
            rate = str(plan.rates[0])
            leader = pick_best({name: entry["rates"][rate] for name, entry in measured.items()})
            _save_progress(plan.out, {"systems": systems, "best": {**best, base_name(system): leader}, "groups": groups,
                                      "group_entries": group_entries})
            if not remaining:
                break
            group, remaining = [leader, *remaining[: GROUP_SIZE - 1]], remaining[GROUP_SIZE - 1 :]
        best[base_name(system)] = leader
    return {"systems": systems, "best": best, "groups": groups, "group_entries": group_entries}


def _without_records(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "rates": {rate: {k: v for k, v in run.items() if k != "records"} for rate, run in entry["rates"].items()}}


def _save_progress(out: Path, so_far: dict[str, Any]) -> None:
    """What the sweep has measured so far, in ``out/tune_progress.json``: a sweep of several
    systems runs for an hour or more, and one that is interrupted keeps its groups."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_progress.json").write_text(json.dumps(so_far) + "\n")


def best_systems(report_path: Path, systems: list[str]) -> list[str]:
    """``systems`` with each one a tuning report chose a setting for replaced by its best
    (``--tuned``); ValueError if the file is not a tuning report."""
    try:
        best = json.loads(report_path.read_text())["best"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--tuned {report_path}: not a report of `duet bench serve --tune` ({error})") from None
    return [best.get(base_name(system), system) for system in systems]
