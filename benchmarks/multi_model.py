"""Two models from one deployment, each against its own SLO (``duet bench multi-model``).

One deployment from configs/multi-model.yaml serves the built-in tiny model and the built-in
wide model, each disaggregated, one engine of each on each of the machine's two cores. Each
model gets its own Poisson load (its own seed, ``--rate`` requests/s, ShareGPT-like lengths
capped at ``--max-input``/``--max-output`` tokens) and is judged against its own SLO
(``--slo NAME=TTFT,TPOT``). Each round runs three conditions on the same engines, in an order
that rotates round by round (the machine's speed moves between runs; see the project brief):
both models loaded together, and each alone while the other idles. Together against alone
is what sharing the cores and the front door costs each model; together against its SLO is
whether one deployment holds both.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

from duet.benchmarks.arguments import write_results

RESULTS = Path(__file__).resolve().parent / "results" / "multi_model.json"
MULTI_MODEL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multi-model.yaml"
DEFAULT_SLOS = {"duet-tiny-llama": (1.0, 0.1), "duet-tiny-llama-wide": (2.0, 0.15)}


def _slos(specs: list[str]) -> dict[str, tuple[float, float]]:
    """``NAME=TTFT,TPOT`` (seconds) over the defaults; ValueError naming a bad one."""
    slos = dict(DEFAULT_SLOS)
    for spec in specs:
        name, _, targets = spec.partition("=")
        try:
            ttft, tpot = (float(value) for value in targets.split(","))
        except ValueError:
            raise ValueError(f"--slo {spec!r}: expected NAME=TTFT_SECONDS,TPOT_SECONDS") from None
        slos[name] = (ttft, tpot)
    return slos


async def _condition(deployment: Any, traces: dict[str, Any], models: list[str], slos: dict[str, Any]) -> dict[str, Any]:
    """Replay each of ``models``' traces at once; each model's attainment against its SLO."""
    from duet.benchmarks.loadgen import replay, replay_result

    target = f"127.0.0.1:{deployment.port}"
    replies = await asyncio.gather(*(replay(target, traces[model], model=model, seed=index) for index, model in enumerate(models)))
    result = {}
    for model, records in zip(models, replies):
        summary = replay_result(records, client=True).summary(slos[model])
        summary["failed"] = sum(1 for record in records if record.error)
        result[model] = summary
    return result


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment
    from duet.cluster.placement.simulator import Slo
    from duet.cluster.placement.trace import load_trace
    from duet.config import load_config, parse_config

    data = load_config(MULTI_MODEL_CONFIG).model_dump(exclude_unset=True)
    data["server"].update(metrics_port=None, http_port=None)
    config = parse_config(data, "bench multi-model")
    names = [served.model.name for served in config.served()]
    targets = _slos(args.slo)
    slos = {name: Slo(*targets[name], args.attainment) for name in names}
    traces = {
        name: load_trace(f"synthetic:n={args.requests},rate={args.rate},seed={index + 1}").capped(args.max_input, args.max_output)
        for index, name in enumerate(names)
    }
    conditions = ["together", *(f"{name} alone" for name in names)]
    deployment = await Deployment(config).start(port=0, http_port=None)
    runs = []
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(conditions)
            for condition in conditions[shift:] + conditions[:shift]:
                models = names if condition == "together" else [condition.removesuffix(" alone")]
                measured = await _condition(deployment, traces, models, slos)
                for model, summary in measured.items():
                    run = {"round": round_index, "condition": "together" if condition == "together" else "alone", "model": model, **summary}
                    print(_line(run, slos[model]), flush=True)
                    runs.append(run)
    finally:
        await deployment.stop()
    return {
        "args": vars(args) | {"handler": None},
        "slos": {name: {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment} for name, slo in slos.items()},
        "runs": runs,
        "summary": summarize(runs, slos),
    }


def _line(run: dict[str, Any], slo: Any) -> str:
    return (
        f"round {run['round']} {run['condition']:8s} {run['model']}: attainment {run['attainment']:.0%} "
        f"(SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s), TTFT p90 {run['ttft_p90_s']:.3f} s, "
        f"TPOT p90 {run['tpot_p90_s'] * 1000:.1f} ms, failed {run['failed']}"
    )


def summarize(runs: list[dict[str, Any]], slos: dict[str, Any]) -> dict[str, Any]:
    """Per model: median attainment together and alone, the rounds in which it met its SLO's
    attainment together, and the median ratio of its TTFT/TPOT p90 together to alone."""
    summary: dict[str, Any] = {}
    for model, slo in slos.items():
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for run in runs:
            if run["model"] == model:
                by_round.setdefault(run["round"], {})[run["condition"]] = run
        pairs = [pair for pair in by_round.values() if {"together", "alone"} <= set(pair)]
        together = [pair["together"] for pair in pairs]
        summary[model] = {
            "rounds": len(pairs),
            "attainment_together_median": statistics.median(run["attainment"] for run in together) if pairs else None,
            "attainment_alone_median": statistics.median(pair["alone"]["attainment"] for pair in pairs) if pairs else None,
            "rounds_meeting_slo_together": sum(1 for run in together if run["attainment"] >= slo.attainment),
            "ttft_p90_ratio_median": _median_ratio(pairs, "ttft_p90_s"),
            "tpot_p90_ratio_median": _median_ratio(pairs, "tpot_p90_s"),
            "failed": sum(run["failed"] for run in runs if run["model"] == model),
        }
    return summary


def _median_ratio(pairs: list[dict[str, dict[str, Any]]], key: str) -> float | None:
    ratios = [pair["together"][key] / pair["alone"][key] for pair in pairs if pair["alone"][key] > 0]
    return statistics.median(ratios) if ratios else None


def _command(args: argparse.Namespace) -> int:
    try:
        _slos(args.slo)
    except ValueError as error:
        print(f"duet bench multi-model: error: {error}", file=sys.stderr)
        return 2
    result = asyncio.run(run_benchmark(args))
    for model, summary in result["summary"].items():
        print(
            f"{model}: attainment together {summary['attainment_together_median']:.0%} (median; alone "
            f"{summary['attainment_alone_median']:.0%}), its SLO's {args.attainment:.0%} met together in "
            f"{summary['rounds_meeting_slo_together']} of {summary['rounds']} rounds; TTFT p90 together/alone "
            f"{summary['ttft_p90_ratio_median']:.2f}x, TPOT p90 {summary['tpot_p90_ratio_median']:.2f}x; failed {summary['failed']}"
        )
    return write_results(result, args.out, RESULTS)


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "multi-model", help="two models from one deployment, each against its own SLO, together and alone (real vLLM)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running all three conditions (rotating first)")
    parser.add_argument("--requests", type=int, default=60, help="requests per model per condition")
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s per model (Poisson)")
    parser.add_argument("--max-input", type=int, default=1024, help="prompt tokens at most")
    parser.add_argument("--max-output", type=int, default=64, help="output tokens at most")
    parser.add_argument(
        "--slo", action="append", default=[], metavar="NAME=TTFT,TPOT",
        help=f"a model's SLO in seconds (default: {', '.join(f'{n}={t},{p}' for n, (t, p) in DEFAULT_SLOS.items())})",
    )
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    parser.add_argument("--out", help=f"where the results go (JSON; default {RESULTS.name} in benchmarks/results)")
    parser.set_defaults(handler=_command)
