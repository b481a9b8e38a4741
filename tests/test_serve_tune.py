"""Settings per system, the tuning sweep's groups and its rule, and the comparison tables'
protocols (benchmarks/system_settings.py, serve_tune.py, serve_report.py). Pure: reports are
built here; the settings themselves run in `duet bench serve --tune`."""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.benchmarks.serve_bench import Plan
from duet.benchmarks.serve_report import ratio_pairs, render_table, rounds_versus_table
from duet.benchmarks.serve_tune import GROUP_SIZE, best_systems, pick_best, settings_to_try, tune
from duet.benchmarks.serving_systems import _command
from duet.benchmarks.system_settings import SETTINGS, setting_of
from duet.cluster.placement.trace import load_trace
from duet.config import load_config


def _entry(tight: float, loose: float, cpu: float | None, rounds: list[tuple[float, float, float]] = ()) -> dict:
    entry = {"summary": {"tight": {"attainment": tight}, "loose": {"attainment": loose}}, "cpu_ms_per_token": cpu}
    if rounds:
        entry["rounds"] = [
            {"summary": {"tight": {"attainment": t}, "loose": {"attainment": lo}}, "cpu_ms_per_token": c} for t, lo, c in rounds
        ]
    return entry


def test_the_best_setting_is_the_tight_slos_then_the_loose_then_the_cheapest():
    entries = {"a": _entry(0.90, 1.0, 0.30), "b": _entry(0.91, 0.90, 0.10), "c": _entry(0.895, 1.0, 0.20)}
    assert pick_best(entries) == "c"  # a, b, c tie on tight (2 points); a and c on loose; c is cheaper
    entries["d"] = _entry(0.95, 0.5, 0.5)
    assert pick_best(entries) == "d"  # 4 points ahead at the tight SLO decides
    assert pick_best({"x": _entry(1.0, 1.0, None), "y": _entry(1.0, 1.0, 0.3)}) == "y"  # unmeasured CPU loses


def test_a_system_with_more_settings_than_fit_is_tuned_in_groups_beside_the_best_so_far(tmp_path: Path):
    trace = load_trace("synthetic:n=4,rate=1,cv=1")
    plan = Plan(trace, "t", [8.0], ["duet-disagg-http", "vllm"], tmp_path, 0, rounds=2, tune=True)
    cheapest = {"vllm@stream-4": 0.1, "duet-disagg-http@no-local-prefill": 0.2}
    measured_groups = []

    def bench_interleaved(group_plan: Plan, config) -> dict:
        measured_groups.append(group_plan.systems)
        assert group_plan.warmup_s < plan.warmup_s and group_plan.rounds == 2
        return {s: {"rates": {"8.0": _entry(1.0, 1.0, cheapest.get(s, 0.5))}} for s in group_plan.systems}

    result = tune(plan, load_config(), bench_interleaved)
    duet, vllm = settings_to_try("duet-disagg-http"), settings_to_try("vllm")
    assert duet[0] == "duet-disagg-http@default" and len(duet) == sum(s.swept for s in SETTINGS["duet-disagg-http"].values()) > GROUP_SIZE
    assert measured_groups[0] == duet[:GROUP_SIZE]
    assert all(len(group) <= GROUP_SIZE for group in measured_groups)
    # The first group holds the default and local prefill's two other settings (issue 53's
    # comparison); its best (the cheapest here) goes on into the next group.
    assert measured_groups[0] == ["duet-disagg-http@default", "duet-disagg-http@no-guard", "duet-disagg-http@no-local-prefill"]
    assert measured_groups[1][0] == "duet-disagg-http@no-local-prefill"
    assert result["best"] == {"duet-disagg-http": "duet-disagg-http@no-local-prefill", "vllm": "vllm@stream-4"}
    assert set(result["systems"]) == set(duet) | set(vllm)
    # vLLM's P/D as documented busy-polls both cores idle: not measured beside other settings.
    assert "vllm-pd@default" not in settings_to_try("vllm-pd") and settings_to_try("vllm-pd")[0] == "vllm-pd@nixl-wait"
    # Each group keeps its own measurements: the leader again beside the second group's settings.
    assert [list(group) for group in result["group_entries"]] == measured_groups

    report = tmp_path / "report.json"
    report.write_text('{"best": {"vllm": "vllm@stream-4"}}')
    assert best_systems(report, ["vllm", "duet-disagg-http"]) == ["vllm@stream-4", "duet-disagg-http"]


def test_settings_reach_the_command_the_environment_and_the_config(tmp_path: Path):
    config = load_config()
    command, env = _command("vllm-pd@own-core", config, 8123, tmp_path)
    assert env == {"OMP_NUM_THREADS": "1"} and command[-4:] == ["--own-core", "--one-process-executor", "--nixl-progress", "wait"]
    command, env = _command("vllm@bind-0-1", config, 8123, tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    command, _ = _command("duet-disagg-http@no-local-prefill", config, 8123, tmp_path)
    written = load_config(command[command.index("--config") + 1])
    assert written.router.local_prefill_queue_tokens == 0 and written.model == config.model
    command, _ = _command("duet-disagg-http@tpot-100", config, 8123, tmp_path)
    assert load_config(command[command.index("--config") + 1]).router.local_prefill_tpot_s == 0.1
    # Dynamo's own conditional disaggregation (its launcher needs `make peers`: the setting only).
    conditional = setting_of("dynamo-disagg@conditional")
    assert conditional.env == {"OMP_NUM_THREADS": "1"} and conditional.args[-2:] == ("--conditional-disagg", "1024")
    command, _ = _command("duet-colocated-http", config, 8123, tmp_path)
    assert load_config(command[command.index("--config") + 1]).mode == "colocated"
    assert command[command.index("--http-port") + 1] == "8123"
    with pytest.raises(ValueError, match="choose from default"):
        setting_of("dynamo-agg@own-core")


def test_comparisons_pair_systems_driven_through_the_same_protocol():
    pairs = ratio_pairs(["duet-disagg-http", "duet-colocated-http@interval-10", "vllm-pd@own-core", "duet-disagg", "vllm"])
    assert set(pairs) == {
        ("duet-disagg-http", "vllm-pd@own-core"), ("duet-disagg-http", "vllm"),
        ("duet-colocated-http@interval-10", "vllm-pd@own-core"), ("duet-colocated-http@interval-10", "vllm"),
        ("duet-disagg-http", "duet-colocated-http@interval-10"),
    }
    # Settings of one system: the first in the run against each other one.
    assert ratio_pairs(["vllm@one-process", "vllm", "vllm@stream-4"]) == [("vllm@one-process", "vllm"), ("vllm@one-process", "vllm@stream-4")]


def test_rounds_versus_table_counts_the_rounds_duet_is_at_or_above():
    slos = {"tight": {"ttft_s": 1.0, "tpot_s": 0.04}, "loose": {"ttft_s": 1.0, "tpot_s": 0.1}}
    ours = _entry(0.8, 1.0, 0.2, rounds=[(0.9, 1.0, 0.2), (0.5, 1.0, 0.2), (0.7, 0.9, 0.3)])
    theirs = _entry(0.7, 0.9, 0.4, rounds=[(0.8, 0.9, 0.4), (0.6, 0.9, 0.4), (0.7, 1.0, 0.4)])
    report = {"slos": slos, "systems": {"duet-disagg-http": {"rates": {"8.0": ours}}, "vllm-pd@own-core": {"rates": {"8.0": theirs}}}}
    table = rounds_versus_table(report)
    assert "| duet-disagg-http / vllm-pd@own-core | 8 | **2 of 3** (90/80, 50/60, 70/70) | **2 of 3** (100/90, 100/90, 90/100) | 0.50x |" in table
    for system in report["systems"].values():
        for entry in system["rates"].values():
            entry["summary"]["tight"].update(ttft_p90_s=0.1, tpot_p50_s=0.01)
    report["settings"] = {"vllm-pd@own-core": "each engine on its own core"}
    assert "| vllm-pd@own-core | OpenAI HTTP | each engine on its own core |" in render_table(report)
