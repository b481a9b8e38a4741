"""The serving comparison's pure parts: summaries, goodput, the table and plots, and the
OpenAI-compatible replay's stream parsing against a loopback aiohttp server that streams the way
vLLM's ``/v1/completions`` does (no engines involved)."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from aiohttp import web

from duet.benchmarks.host_overhead import host_cpu_seconds, tree_memory_bytes
from duet.benchmarks.loadgen import RequestRecord, build_requests, prompt_token_ids
from duet.benchmarks.openai_replay import replay_openai
from duet.benchmarks.serve_report import (
    COLOCATED,
    DISAGG,
    VLLM,
    goodput_at,
    goodputs,
    progress_callback,
    ratio,
    render_table,
    summarize,
    write_plots,
)
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import Trace


def _record(
    index: int, ttft: float, tpot: float, tokens: int = 4, error: str = "", e2e: float = 1.0
) -> RequestRecord:
    sent = 0.5 * index
    return RequestRecord(
        index, sent, sent, 10, 4, tokens, ttft, tpot, ttft, tpot, error=error, client_e2e_s=e2e
    )


# ---- summaries ----


def test_summarize_counts_failures_as_misses_and_takes_percentiles_over_completed():
    records = [
        _record(0, 0.1, 0.01),
        _record(1, 0.2, 0.02),
        _record(2, 2.0, 0.03),  # misses TTFT
        _record(3, math.nan, math.nan, tokens=1, error="HTTP 500: boom", e2e=0.1),
    ]
    summary = summarize(records, Slo(1.0, 0.05))
    assert summary["requests"] == 4 and summary["errors"] == 1
    assert summary["attainment"] == 0.5
    assert summary["ttft_attainment"] == 0.5 and summary["tpot_attainment"] == 0.75
    assert summary["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["ttft_p90_s"] == pytest.approx(0.2 + 0.8 * 1.8)
    assert summary["tpot_p50_s"] == pytest.approx(0.02)
    assert summary["e2e_p50_s"] == pytest.approx(1.0)
    # 12 tokens of completed requests, from the first send (0 s) to the last end (1.0 + 1.0 s).
    assert summary["throughput_tok_s"] == pytest.approx(12 / 2.0)


def test_summarize_judges_client_latencies_not_router_ones():
    fast_router_slow_client = RequestRecord(0, 0.0, 0.0, 10, 4, 4, 0.1, 0.01, 3.0, 0.01, client_e2e_s=3.1)
    assert summarize([fast_router_slow_client], Slo(1.0, 0.05))["attainment"] == 0.0


def test_goodput_interpolates_between_the_last_meeting_rate_and_the_next():
    assert goodput_at([4.0, 1.0, 2.0], [0.5, 1.0, 0.95]) == pytest.approx(2.0 + 0.05 / 0.45 * 2.0)
    # Not monotone: the highest meeting rate counts.
    assert goodput_at([1, 2, 3, 4], [1.0, 0.8, 0.9, 0.7]) == pytest.approx(3.0)


def test_goodput_when_no_rate_or_every_rate_meets_the_target():
    assert goodput_at([1.0, 2.0], [0.5, 0.2]) == 0.0
    assert goodput_at([1.0, 2.0], [1.0, 0.95]) == 2.0
    with pytest.raises(ValueError):
        goodput_at([1.0], [1.0, 0.5])


def test_ratio_handles_a_zero_denominator():
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(1.0, 0.0) == math.inf
    assert ratio(0.0, 0.0) is None


# ---- report: table and plots ----

SLOS = {"tight": {"ttft_s": 0.5, "tpot_s": 0.05}, "loose": {"ttft_s": 2.0, "tpot_s": 0.2}}


def _report() -> dict:
    """Three systems at rates 1, 2 and 4 req/s with attainment falling as each saturates."""
    saturation = {DISAGG: 3.0, COLOCATED: 1.5, VLLM: 1.2}
    # CPU ms per token: the whole serving path, and of it the server process alone.
    cpu = {DISAGG: (1.5, 0.9), COLOCATED: (2.0, 1.2), VLLM: (1.0, 1.0)}
    systems = {}
    for system, knee in saturation.items():
        rates = {}
        for rate in (1.0, 2.0, 4.0):
            slow = rate > knee
            records = [
                _record(i, 0.3 * (1 + 5 * slow) + 0.01 * i, 0.03 * (1 + 2 * slow)) for i in range(8)
            ] + [_record(8, math.nan, math.nan, tokens=0, error="got 0 of 4 tokens")]
            rates[str(rate)] = {
                "records": [r.to_dict() for r in records],
                "summary": {name: summarize(records, Slo(**slo)) for name, slo in SLOS.items()},
                "cpu_ms_per_token": cpu[system][0],
                "front_door_ms_per_token": cpu[system][1],
            }
        systems[system] = {"rates": rates}
    # A saved report may key a rate as "2" rather than "2.0".
    systems[VLLM]["rates"]["2"] = systems[VLLM]["rates"].pop("2.0")
    return {"systems": systems, "slos": SLOS}


def test_render_table_has_a_row_per_system_and_rate_then_goodputs_and_ratios():
    report = _report()
    table = render_table(report)
    main_tables = table.split("CPU per streamed token against")[0]
    rows = [line for line in main_tables.splitlines() if line.startswith("|")]
    run_rows = [r for r in rows if r.split("|")[1].strip() in (DISAGG, COLOCATED, VLLM)]
    assert len(run_rows) == 3 * 3 + 3  # the runs, then one goodput row per system
    assert all(r.count("|") == rows[0].count("|") for r in rows[: 2 + 9])
    assert f"| {DISAGG} | 1 | 88.9% | 88.9% |" in table
    ratios = {r.split("|")[1].strip(): r for r in rows if " / " in r}
    # Only systems driven through the same protocol are compared: duet's gRPC against its
    # colocated mode over gRPC, not against vLLM over HTTP.
    assert set(ratios) == {f"{DISAGG} / {COLOCATED}"}
    good = goodputs(report)
    # 8 of 9 met the SLO below the knee: no rate reaches 90%, so every goodput is 0.
    assert good[DISAGG]["tight"] == 0.0 and "n/a" in ratios[f"{DISAGG} / {COLOCATED}"]


def test_render_table_gives_cpu_per_token_against_vllm_at_each_rate():
    table = render_table(_report())
    cpu_table = table.split("CPU per streamed token against vLLM's server at the same rate:")[1]
    rows = {r.split("|")[1].strip(): r for r in cpu_table.splitlines() if r.startswith("| duet")}
    assert set(rows) == {DISAGG, COLOCATED}  # vLLM is the reference, not a row
    # Whole serving path, then front door, at each of the three rates ("2" and "2.0" match).
    assert rows[DISAGG].count("1.50x, 0.90x") == 3 and rows[COLOCATED].count("2.00x, 1.20x") == 3
    without_vllm = _report()
    del without_vllm["systems"][VLLM]
    assert "CPU per streamed token against" not in render_table(without_vllm)


def test_rounds_are_pooled_and_each_is_kept_for_a_ratio_round_by_round():
    from duet.benchmarks.serve_bench import Measurement, rate_entry

    def replayed(cpu_s: float, router_s: float) -> Measurement:
        records = [_record(i, 0.3, 0.03, tokens=100) for i in range(10)]  # 1,000 tokens
        return Measurement(records, {"duet serve": router_s, "raylet": cpu_s - router_s}, router_s, True)

    single = rate_entry([replayed(0.4, 0.3)])
    assert "rounds" not in single and single["cpu_ms_per_token"] == pytest.approx(0.4)
    pooled = rate_entry([replayed(0.4, 0.3), replayed(0.6, 0.5)])
    assert pooled["cpu_ms_per_token"] == pytest.approx(0.5) and pooled["front_door_ms_per_token"] == pytest.approx(0.4)
    assert len(pooled["records"]) == 20 and pooled["streamed_tokens"] == 2000
    assert [r["cpu_ms_per_token"] for r in pooled["rounds"]] == [pytest.approx(0.4), pytest.approx(0.6)]
    assert all("records" not in r for r in pooled["rounds"])

    report = _report()
    report["systems"][DISAGG]["rates"]["1.0"]["rounds"] = pooled["rounds"]
    theirs = rate_entry([replayed(0.5, 0.5), replayed(0.4, 0.4)])["rounds"]
    report["systems"][VLLM]["rates"]["1.0"]["rounds"] = theirs
    table = render_table(report)
    rows = [r for r in table.split("Round by round")[1].splitlines() if r.startswith(f"| {DISAGG}")]
    assert rows == [f"| {DISAGG} | 1 | 0.80x, 1.50x | 1.15x |"]
    assert "Round by round" not in render_table(_report())


def test_cpu_above_the_idle_floor_takes_the_floors_share_of_each_replay_out():
    """A system that spends 0.5 CPU-s a second idle and 0.9 CPU-s over a 1-s replay of 1,000
    tokens spent 0.4 ms per token on them; per request is the whole 0.9 s over 10 requests."""
    from duet.benchmarks.serve_bench import Measurement, rate_entry

    def replayed(cpu_s: float, wall_s: float) -> Measurement:
        records = [_record(i, 0.3, 0.03, tokens=100) for i in range(10)]
        return Measurement(records, {"raylet": cpu_s}, 0.0, True, wall_s)

    entry = rate_entry([replayed(0.9, 1.0), replayed(1.2, 2.0)], idle_cpu_s_per_s=0.5)
    assert entry["cpu_ms_per_token_above_idle"] == pytest.approx(1000 * (2.1 - 1.5) / 2000)
    assert [r["cpu_ms_per_token_above_idle"] for r in entry["rounds"]] == [pytest.approx(0.4), pytest.approx(0.2)]
    assert entry["cpu_ms_per_request"] == pytest.approx(1000 * 2.1 / 20)
    assert "cpu_ms_per_token_above_idle" not in rate_entry([replayed(0.9, 1.0)])  # no floor measured


def test_render_table_lists_each_systems_start_up_memory_and_idle_floor():
    report = _report()
    report["systems"][DISAGG]["footprint"] = {
        "startup_s": 41.6, "idle_cpu_s_per_min": 0.98, "memory_gib": 5.234, "memory_gib_after": 5.61,
    }
    report["systems"][DISAGG]["rates"]["1.0"]["cpu_ms_per_token_above_idle"] = 0.37
    table = render_table(report)
    footprints = table.split("before any load")[1].split("CPU per streamed token")[0]
    assert f"| {DISAGG} | 42 | 5.23 / 5.61 | 0.98 |" in footprints
    assert f"| {COLOCATED} |" not in footprints  # no footprint measured
    assert f"| {DISAGG} | 1 | 88.9% | 88.9% |" in table and " | 0.37 | " in table
    assert "before any load" not in render_table(_report())


def test_tree_memory_counts_a_childs_memory_once():
    """A child that holds 200 MiB raises its parent's tree by about that much; its pages are its
    own, so proportional set size counts them whole."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time\nb=bytearray(200*2**20)\nprint(flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdout.readline()  # allocated (bytearray zero-fills, so the pages are touched)
        alone = tree_memory_bytes(holder.pid)
        assert 200 * 2**20 <= alone < 400 * 2**20
        assert tree_memory_bytes(os.getpid()) >= alone  # the test process's tree includes it
    finally:
        holder.kill()
        holder.wait()


def test_render_table_reports_goodput_ratios_and_lower_bounds():
    report = _report()
    for system in report["systems"].values():
        for run in system["rates"].values():
            for summary in run["summary"].values():
                summary["attainment"] = min(1.0, summary["attainment"] / 0.8889)
    good = goodputs(report)
    assert good[DISAGG]["loose"] == 4.0  # never saturated under the loose SLO
    table = render_table(report)
    # Tight: met at 2 req/s, missed entirely at 4; loose: met at every rate, so a lower bound.
    assert f"| {DISAGG} | 2.20 | >= 4.00 |" in table
    expected = good[DISAGG]["tight"] / good[VLLM]["tight"]
    assert f"{expected:.2f}x" in table


def test_the_mode_duet_plan_picks_is_marked_on_duets_rows():
    """The planner runs for real (this machine's profile) on a light and a heavy load of the
    same requests: it deploys a mode at the light one and takes no mode's deployment at the
    heavy one; the table marks duet's row of the picked mode at each rate and SLO."""
    from duet.benchmarks.serve_planned import picked, planned_modes

    trace = Trace("short", np.arange(40) * 0.5, np.full(40, 200), np.full(40, 16))
    planned = planned_modes(trace, [1.0, 1000.0], {name: Slo(**slo) for name, slo in SLOS.items()})
    light, heavy = planned["tight"]["1"], planned["tight"]["1000"]
    assert light["mode"] in ("disaggregated", "colocated", "conditional") and 1 <= light["cores"] <= 2
    assert heavy["mode"] is None and {"disaggregated", "colocated"} <= set(heavy["most_rps"])
    assert all(0 < rate < 1000 for rate in heavy["most_rps"].values())
    assert picked(heavy) == max(heavy["most_rps"], key=heavy["most_rps"].get)

    report = _report()
    report["planned_modes"] = {slo: {"1": light, "2": light, "4": heavy} for slo in SLOS}
    table = render_table(report)
    marked = {(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in table.splitlines() if "◆ |" in r and r.startswith("| duet")}
    planned_row = COLOCATED if light["mode"] == "colocated" else DISAGG
    assert {(planned_row, "1"), (planned_row, "2")} <= marked
    assert all(system in (DISAGG, COLOCATED) for system, _ in marked)  # never vLLM's row
    assert "none meets the rate here" in table.split("The mode `duet plan` picks")[1]
    assert "planned" not in json.dumps(_report()) and "◆" not in render_table(_report())


def test_write_plots_writes_an_attainment_plot_and_a_cdf_per_rate(tmp_path):
    paths = write_plots(_report(), tmp_path / "plots")
    assert sorted(p.name for p in paths) == [
        "attainment.png",
        "latency_cdf_1rps.png",
        "latency_cdf_2rps.png",
        "latency_cdf_4rps.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_progress_callback_advances_to_the_total():
    with progress_callback(3, "replay") as on_done:
        for _ in range(3):
            on_done()


# ---- OpenAI-compatible replay against a loopback server ----

TOKEN_GAP_S = 0.01
FIRST_TOKEN_S = 0.05
PROMPTS = web.AppKey("prompts", list)  # what the server was sent, in arrival order


async def _completions(request: web.Request) -> web.StreamResponse:
    """vLLM-like streaming: a chunk per token, then a usage chunk, then ``[DONE]``.

    The model name selects a misbehaviour: ``bad`` is rejected with an OpenAI error body,
    ``short`` stops a token early, ``merged`` sends two tokens per chunk (as vLLM may under load).
    """
    body = await request.json()
    request.app[PROMPTS].append(body["prompt"])
    if body["model"] == "bad":
        error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}
        return web.json_response(error, status=400)
    n = body["max_tokens"] - (body["model"] == "short")
    per_chunk = 2 if body["model"] == "merged" else 1
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_TOKEN_S)
    for sent in range(0, n, per_chunk):
        chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x" * per_chunk}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(TOKEN_GAP_S)
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def _replay(model: str, trace: Trace, seed: int = 0) -> tuple[list[RequestRecord], list[list[int]], int]:
    """Replay ``trace`` against a fresh loopback server: the records, the prompts it got, and
    how many times ``on_done`` was called."""
    done = 0

    def on_done() -> None:
        nonlocal done
        done += 1

    async def run() -> tuple[list[RequestRecord], list[list[int]]]:
        app = web.Application()
        app[PROMPTS] = []
        app.router.add_post("/v1/completions", _completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            records = await replay_openai(f"http://127.0.0.1:{port}/", model, trace, seed, 30.0, on_done)
        finally:
            await runner.cleanup()
        return records, app[PROMPTS]

    records, prompts = asyncio.run(run())
    return records, prompts, done


TRACE = Trace("t", np.array([0.0, 0.05, 0.1]), np.array([5, 6, 7]), np.array([4, 1, 6]))


def test_openai_replay_counts_tokens_and_times_the_stream():
    records, prompts, done = _replay("m", TRACE, seed=3)
    assert done == len(TRACE)
    assert [r.error for r in records] == [""] * 3
    assert [r.completion_tokens for r in records] == [4, 1, 6]
    assert [r.output_len for r in records] == [4, 1, 6]
    for record in records:
        assert FIRST_TOKEN_S <= record.client_ttft_s < record.client_e2e_s < 5
        assert (record.ttft_s, record.tpot_s) == (record.client_ttft_s, record.client_tpot_s)
        assert record.sent_s >= record.scheduled_s - 0.01
    assert records[1].client_tpot_s == 0.0  # a single token has no gap
    assert TOKEN_GAP_S <= records[2].client_tpot_s < 0.5
    # The same prompts loadgen sends duet for this trace and seed.
    assert sorted(prompts) == sorted(prompt_token_ids(TRACE, seed=3))
    assert prompt_token_ids(TRACE, seed=3) == [list(r.prompt_token_ids.ids) for r in build_requests(TRACE, seed=3)]


def test_openai_replay_counts_tokens_from_usage_when_chunks_merge():
    records, _, _ = _replay("merged", TRACE)
    assert [r.error for r in records] == [""] * 3
    assert [r.completion_tokens for r in records] == [4, 1, 6]


def test_openai_replay_records_http_errors_and_short_outputs():
    rejected, _, done = _replay("bad", TRACE)
    assert done == len(TRACE)
    assert all("HTTP 400" in r.error and "max_tokens is too large" in r.error for r in rejected)
    assert all(math.isnan(r.client_ttft_s) and r.completion_tokens == 0 for r in rejected)
    short, _, _ = _replay("short", TRACE)
    assert short[0].error == "got 3 of 4 tokens"
    assert short[1].error == "got 0 of 1 tokens"
    assert summarize(short, Slo(10.0, 10.0))["attainment"] == 0.0


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--rates", "x"], "--rates"),
        (["--rates", "0,4"], "--rates"),
        (["--systems", "duet-disagg,sglang"], "--systems"),
        (["--endpoint", "127.0.0.1:50051"], "--endpoint"),
        (["--requests", "0"], "--requests"),
        (["--rounds", "0"], "--rounds"),
        (["--rounds", "3", "--systems", "vllm"], "--rounds"),
        (["--systems", "vllm@fastest"], "no setting 'fastest'"),
        (["--tune", "--rates", "4,8"], "--tune"),
        (["--tuned", "/nonexistent/report.json"], "--tuned"),
        (["--trace", "/nonexistent.csv"], "does not exist"),
    ],
)
def test_bench_serve_bad_flags_exit_2_with_one_line(flags, names, capsys):
    import argparse

    from duet.benchmarks import serve_bench

    parser = argparse.ArgumentParser()
    serve_bench.register_command(parser.add_subparsers())
    args = parser.parse_args(["serve", *flags])
    assert args.handler(args) == serve_bench.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("duet bench serve: error:") and names in err and err.count("\n") == 1


def _burn_then_wait(ready) -> None:
    """A spawned child (as vLLM starts its engine processes): spend CPU, then idle."""
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    ready.set()
    time.sleep(60)


def test_serving_cpu_leaves_out_spawned_engine_processes_even_when_unnamed():
    """vLLM's engine processes are not the serving path; setproctitle does not always rename
    them, so a multiprocessing-spawned child counts as one by its command line. A plain child
    process (as Ray's daemons are) is counted."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    engine_like = context.Process(target=_burn_then_wait, args=(ready,), daemon=True)
    engine_like.start()
    plain = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()+0.3\nwhile time.process_time()<t: pass\ntime.sleep(60)"])
    try:
        assert ready.wait(60)
        deadline = time.monotonic() + 60
        while host_cpu_seconds(os.getpid()).get(plain.pid, 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.1)
        counted = host_cpu_seconds(os.getpid(), include_self=False)
        assert counted.get(plain.pid, 0.0) >= 0.25
        assert engine_like.pid not in counted
    finally:
        engine_like.terminate()
        plain.kill()
        plain.wait()
