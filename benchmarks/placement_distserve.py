"""Disaggregated vs colocated goodput per GPU with DistServe's OPT-13B A100 profile.

Workload: ShareGPT-like lengths (trace.sharegpt_like_lengths), Poisson arrivals. SLO: TTFT
0.25 s, TPOT 0.1 s, 90% attainment (DistServe's chatbot OPT-13B setting). Every configuration
is sized alone with the simulator by bisection over the rate (as the planner does, no pruning
here so that the whole table is shown); then the planner's plan for a large target rate gives
the disaggregated goodput per GPU with integer replica counts, checked on the whole plan.

    python benchmarks/placement_distserve.py [--rate 400] [--requests 2000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.goodput import Candidate, SearchContext, evaluate
from duet.cluster.placement.optimizer import optimize
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import synthetic

CONFIG = Path(__file__).resolve().parents[1] / "cluster" / "placement" / "examples" / "a100-32x8.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=400.0, help="target req/s for the plan")
    parser.add_argument("--requests", type=int, default=2000, help="requests per simulation")
    args = parser.parse_args()

    cluster = ClusterSpec.load(CONFIG)
    slo = Slo(0.25, 0.1, 0.9)
    trace = synthetic(max(4000, args.requests), 1.0, lengths="sharegpt", seed=0)
    model = cluster.latency_model("a100-80g")
    ctx = SearchContext(
        trace=trace.head(args.requests),
        slo=slo,
        models={"a100-80g": model},
        kv_bytes_per_token=cluster.model_spec.kv_bytes_per_token,
        network_bytes_per_s=cluster.network_gbs * 1e9,
        nvlink_bytes_per_s={"a100-80g": 300e9},
    )
    print(
        f"OPT-13B on A100-80G (DistServe fit); ShareGPT-like lengths: mean input "
        f"{trace.input_len.mean():.0f}, mean output {trace.output_len.mean():.0f}; SLO TTFT "
        f"{slo.ttft_s} s / TPOT {slo.tpot_s} s @ {slo.attainment:.0%}\n"
    )
    start = time.perf_counter()
    best: dict[str, tuple[float, Candidate]] = {}
    print("| configuration | goodput (req/s) | GPUs | req/s per GPU |")
    print("|---|---:|---:|---:|")
    shapes = [(tp, pp) for tp, pp in model.parallelisms(8)]
    candidates = [Candidate("prefill", "a100-80g", pp, prefill=(tp, 1)) for tp, pp in shapes]
    candidates += [Candidate("decode", "a100-80g", pp, decode=(tp, 1)) for tp, pp in shapes]
    candidates += [Candidate("colocated", "a100-80g", 1, prefill=(tp, 1)) for tp, pp in shapes if pp == 1]
    for cand in candidates:
        ev = evaluate(ctx, cand)
        per_gpu = ev.goodput_rps / cand.gpus
        print(f"| {cand.describe()} | {ev.goodput_rps:.2f} | {cand.gpus} | {per_gpu:.2f} |")
        if per_gpu > best.get(cand.kind, (0.0, None))[0]:
            best[cand.kind] = (per_gpu, cand)
    (gp, cp), (gd, cd), (gc, cc) = best["prefill"], best["decode"], best["colocated"]
    pair = 1.0 / (1.0 / gp + 1.0 / gd)
    print(f"\nsizing took {time.perf_counter() - start:.1f} s")
    print(f"best prefill: {cp.describe()} ({gp:.2f}/GPU); best decode: {cd.describe()} ({gd:.2f}/GPU)")
    print(f"disaggregated, fractional replicas (DistServe's per-GPU goodput): {pair:.2f} req/s per GPU")
    print(f"colocated, best ({cc.describe()}): {gc:.2f} req/s per GPU")
    print(f"ratio: {pair / gc:.2f}x\n")

    result = optimize(
        cluster, trace, slo, rate=args.rate, workers=2, search_requests=args.requests, modes=["disaggregated"]
    )
    plan = result.plan
    print(f"plan: {plan.summary()}")
    print(f"plan vs best colocated, per GPU: {plan.expected.goodput_per_gpu / gc:.2f}x")
    for line in plan.explanation:
        print(f"  {line}")


if __name__ == "__main__":
    main()
