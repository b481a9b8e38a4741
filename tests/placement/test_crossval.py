"""The cross-validation benchmark's pure parts: which slices it holds back, how its rate ladder
walks to a slice's knee, and how errors are summarised (the measured runs are the benchmark's)."""

from __future__ import annotations

import math

import pytest

from duet.benchmarks.placement_crossval import (
    DEVELOPMENT,
    choose_slices,
    error_summary,
    errors,
    format_summary,
    format_table,
    median_profile,
    next_rate,
    repeat_spread_pp,
    summarise,
    summaries,
)

SIZES = {"azure-conv": 80, "azure-code": 80, "mooncake-conv": 100}


def test_held_out_slices_are_drawn_by_the_seed_and_never_the_development_ones():
    first = choose_slices(SIZES, held_out=2, seed=0)
    assert first == choose_slices(SIZES, held_out=2, seed=0)
    assert first != choose_slices(SIZES, held_out=2, seed=1)
    assert first[0].development and (first[0].trace, first[0].index) == DEVELOPMENT
    held_out = [s for s in first if not s.development]
    assert len(held_out) == 2 * len(SIZES)
    conv = [s.index for s in held_out if s.trace == "azure-conv"]
    assert not {0, 1} & set(conv)  # slice 1 shaped the model too (the issue reported it)
    assert all(0 <= s.index < SIZES[s.trace] for s in held_out)


def test_ladder_climbs_descends_then_fills_the_knee():
    assert next_rate({3.0: 1.0}, 1.5) == pytest.approx(4.5)  # all above 95%: faster
    assert next_rate({3.0: 0.2}, 1.5) == pytest.approx(2.0)  # all below 50%: slower
    # One point in the middle: 95% is above it, so slower first; then 50% is below both.
    assert next_rate({3.0: 0.7}, 1.5) == pytest.approx(2.0)
    assert next_rate({2.0: 0.97, 3.0: 0.7}, 1.5) == pytest.approx(4.5)
    # Bracketed with 80% and 50% missing: the geometric middle of the gap that holds them.
    assert next_rate({3.0: 1.0, 4.5: 0.3}, 1.5) == pytest.approx(math.sqrt(3.0 * 4.5))
    # A point near each of 95%, 80% and 50%: done.
    assert next_rate({3.0: 0.96, 4.5: 0.81, 6.75: 0.5}, 1.5) is None


def test_errors_are_points_for_attainment_and_relative_for_latency():
    measured = {"attainment": 0.8, "ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "tpot_p50_s": 0.01, "tpot_p90_s": 0.02}
    predicted = {"attainment": 0.7, "ttft_p50_s": 0.6, "ttft_p90_s": 0.5, "tpot_p50_s": 0.01, "tpot_p90_s": 0.03}
    e = errors(measured, predicted)
    assert e["attainment_pp"] == pytest.approx(-10.0)
    assert e["ttft_p50_s"] == pytest.approx(0.2)
    assert e["ttft_p90_s"] == pytest.approx(-0.5)
    assert e["tpot_p90_s"] == pytest.approx(0.5)
    summary = error_summary([{"errors": e}, {"errors": {**e, "attainment_pp": 4.0, "ttft_p50_s": math.nan}}])
    assert summary["attainment_pp"] == {"mean": pytest.approx(7.0), "worst": pytest.approx(10.0)}
    assert summary["ttft_p50_s"]["worst"] == pytest.approx(0.2)  # the undefined error is left out


def _point(measured: float, predicted: float, repeats: list[float] | None = None) -> dict:
    latencies = {"ttft_p50_s": 0.5, "ttft_p90_s": 1.0, "tpot_p50_s": 0.01, "tpot_p90_s": 0.02}
    point = {"rate_rps": 2.0, "measured": {"attainment": measured, **latencies}, "predicted": {"attainment": predicted, **latencies}}
    point["errors"] = errors(point["measured"], point["predicted"])
    if repeats is not None:
        point["repeat_attainments"] = repeats
    return point


def test_repeated_points_report_how_far_their_repeats_fell_apart():
    single, repeated = _point(0.8, 0.9), _point(0.8, 0.9, repeats=[0.72, 0.88])
    assert repeat_spread_pp(single) == 0.0
    assert repeat_spread_pp(repeated) == pytest.approx(16.0)
    results = [
        {"slice": "azure-conv#0", "role": "development", "points": [single]},
        {"slice": "azure-conv#5", "role": "held-out", "points": [repeated, _point(0.5, 0.5, repeats=[0.48, 0.52])]},
    ]
    summary = summarise(results, "errors")
    assert summary["held-out"]["repeat_spread_pp"] == {"mean": pytest.approx(10.0), "worst": pytest.approx(16.0)}
    assert "repeat_spread_pp" not in summary["development"]  # one run each: no spread to report
    assert "held-out 10.0 / 16.0" in format_summary(summary)
    table = format_table(results)
    assert "| azure-conv#5 | held-out | 2.00 | 80.0% / 90.0% (+10.0) | 16.0 |" in table


def test_the_profile_made_after_the_measurements_is_summarised_when_every_point_has_it():
    point = _point(0.8, 0.9)
    point["errors_per_token_cost"] = point["errors"]
    results = [{"slice": "azure-conv#5", "role": "held-out", "points": [point]}]
    assert set(summaries(results)) == {"summary", "summary_per_token_cost"}
    point["errors_profile_after"] = {**point["errors"], "attainment_pp": -3.0}
    after = summaries(results)["summary_profile_after"]
    assert after["held-out"]["attainment_pp"] == {"mean": pytest.approx(3.0), "worst": pytest.approx(3.0)}


def test_the_median_profile_is_the_one_of_median_prefill_speed(linear_model, tmp_path):
    paths = []
    for name, per_token_ms in (("slow", 0.2), ("fast", 0.1), ("middle", 0.15)):
        paths.append(tmp_path / f"{name}.yaml")
        linear_model(prefill=(10.0, per_token_ms, 1e-4), decode=(5.0, 0.001, 0.1)).save(paths[-1])
    assert median_profile(paths).name == "middle.yaml"
    assert median_profile(paths[:1]) == paths[0]
    assert median_profile(paths[:2]).name == "fast.yaml"  # of two, the faster: never a mix


def test_repredict_simulates_a_saved_runs_points_again_from_its_work_files(linear_model, tmp_path):
    import json

    from duet.benchmarks.placement_crossval import TRACES, repredict
    from duet.benchmarks.placement_fidelity import deployed_sim_config, predict, write_cluster
    from duet.cluster.placement.cluster_spec import ClusterSpec, traces_dir
    from duet.cluster.placement.optimizer import optimize
    from duet.cluster.placement.simulator import Slo
    from duet.cluster.placement.trace import load_trace

    if not (traces_dir() / TRACES["azure-conv"]).exists():
        pytest.skip(f"Azure traces not found in {traces_dir()}")
    linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.001, 0.1)).save(tmp_path / "profile.yaml")
    for name in ("cluster-host.yaml", "cluster-pt.yaml"):
        write_cluster(tmp_path / name, tmp_path / "profile.yaml")
    cluster, slo, sim = ClusterSpec.load(tmp_path / "cluster-host.yaml"), Slo(1.0, 0.1, 0.9), deployed_sim_config()
    trace = load_trace(str(traces_dir() / TRACES["azure-conv"])).capped(1800, 96).window(30, 30)  # slice #1 of 30
    plan = optimize(cluster, trace, slo, rate=1.0, workers=1, sim=sim, modes=["disaggregated"]).plan
    plan.save(tmp_path / "plan.yaml")
    # "Measured" here is the simulator's own answer at 2 req/s, so re-predicting the right
    # requests at the right rate must give errors of zero.
    measured = predict(cluster, plan, trace, slo, 2.0, sim)
    report = {
        "requests_per_slice": 30,
        "caps": {"input": 1800, "output": 96},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "slices": [{"slice": "azure-conv#1", "role": "held-out", "points": [{"rate_rps": 2.0, "measured": measured}]}],
    }
    (tmp_path / "run.json").write_text(json.dumps(report))
    repredict(tmp_path / "run.json", tmp_path, tmp_path / "again.json")

    again = json.loads((tmp_path / "again.json").read_text())
    point = again["slices"][0]["points"][0]
    assert point["predicted"] == pytest.approx(measured)
    assert again["summary"]["held-out"]["attainment_pp"] == {"mean": 0.0, "worst": 0.0}
    assert again["sim_config"]["chunked_prefill"] is True
    assert "predicted_profile_after" not in point and "summary_profile_after" not in again

    # A run made with --reprofile left the after-profile's cluster: it is predicted again too.
    write_cluster(tmp_path / "cluster-host-after.yaml", tmp_path / "profile.yaml")
    repredict(tmp_path / "run.json", tmp_path, tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["slices"][0]["points"][0]["predicted_profile_after"] == pytest.approx(measured)
    assert again["summary_profile_after"]["held-out"]["attainment_pp"] == {"mean": 0.0, "worst": 0.0}

    # Work files name their profiles relative to themselves: a copied run predicts again.
    import shutil

    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.copytree(tmp_path, moved)
    (tmp_path / "profile.yaml").unlink()
    repredict(moved / "run.json", moved, moved / "again.json")
    assert json.loads((moved / "again.json").read_text())["slices"][0]["points"][0]["predicted"] == pytest.approx(measured)


def test_a_probed_point_is_predicted_again_at_the_speed_around_it(linear_model, tmp_path):
    from duet.benchmarks.placement_crossval import predict_speed_tracked
    from duet.benchmarks.placement_fidelity import deployed_sim_config, predict, write_cluster
    from duet.cluster.placement.cluster_spec import ClusterSpec
    from duet.cluster.placement.optimizer import optimize
    from duet.cluster.placement.simulator import Slo
    from duet.cluster.placement.trace import synthetic

    model = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.001, 0.1))
    model.save(tmp_path / "profile.yaml")
    cluster = ClusterSpec.load(write_cluster(tmp_path / "cluster.yaml", tmp_path / "profile.yaml"))
    slo, sim = Slo(1.0, 0.1, 0.9), deployed_sim_config()
    trace = synthetic(40, rate=2.0, lengths="uniform:600:20", seed=3)
    plan = optimize(cluster, trace, slo, rate=1.0, workers=2, sim=sim, modes=["disaggregated"]).plan
    as_profiled = predict(cluster, plan, trace, slo, 4.0, sim)

    unprobed = {"rate_rps": 4.0, "measured": as_profiled}
    predict_speed_tracked(unprobed, trace, model, tmp_path, "synthetic#0", plan, slo, sim)
    assert "predicted_speed_tracked" not in unprobed

    probes = {"before": {"prefill": 0.5, "decode": 2.0}, "after": {"prefill": 2.0, "decode": 0.5}}
    same_speed = {**unprobed, "speed_probe": probes}
    predict_speed_tracked(same_speed, trace, model, tmp_path, "synthetic#0", plan, slo, sim)
    assert same_speed["predicted_speed_tracked"]["ttft_p90_s"] == pytest.approx(as_profiled["ttft_p90_s"])
    assert same_speed["errors_speed_tracked"]["attainment_pp"] == pytest.approx(0.0)

    probes = {"before": {"prefill": 1.5, "decode": 1.0}, "after": {"prefill": 1.5, "decode": 1.0}}
    slower = {**unprobed, "speed_probe": probes}
    predict_speed_tracked(slower, trace, model, tmp_path, "synthetic#0", plan, slo, sim)
    assert slower["predicted_speed_tracked"]["ttft_p50_s"] > 1.4 * as_profiled["ttft_p50_s"]
    assert (tmp_path / "speed-tracked" / "profile-synthetic-0-4.000.yaml").exists()

    point = {**slower, "errors": slower["errors_speed_tracked"]}
    results = [{"slice": "synthetic#0", "role": "held-out", "points": [point]}]
    assert "summary_speed_tracked" in summaries(results)
