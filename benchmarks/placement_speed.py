"""Planner speed: 32 nodes x 8 A100s, OPT-13B (DistServe fit), both algorithms.

Prints the wall time of the whole `optimize` call (search, sizing, verification, placement) and
the number of configurations evaluated and pruned. Target: under 30 s on 2 cores.

    python benchmarks/placement_speed.py [--rate 400] [--workers 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.optimizer import optimize
from duet.cluster.placement.plan import validate_against
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import synthetic

CONFIG = Path(__file__).resolve().parents[1] / "cluster" / "placement" / "examples" / "a100-32x8.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=400.0, help="target req/s")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    cluster = ClusterSpec.load(CONFIG)
    trace = synthetic(4000, args.rate, lengths="sharegpt", seed=0)
    start = time.perf_counter()
    # disaggregated only: the search speed the two DistServe algorithms were measured at
    result = optimize(
        cluster, trace, Slo(0.25, 0.1, 0.9), rate=args.rate, algorithm="both", workers=args.workers,
        modes=["disaggregated"],
    )
    wall = time.perf_counter() - start
    plan = result.plan
    validate_against(plan, cluster)
    s = plan.search
    print(f"cluster: {cluster.gpu_count()} GPUs ({len(cluster.node_list())} nodes x 8), target {args.rate:g} req/s")
    print(f"wall time: {wall:.2f} s total, search {s.wall_s:.2f} s on {s.workers} workers")
    print(f"configurations: {s.configs_evaluated} evaluated, {s.configs_pruned} pruned by bound, {s.simulations} simulations")
    print(f"chosen: {plan.summary()}")
    for alt in result.alternatives:
        print(f"other algorithm: {alt.summary()}")


if __name__ == "__main__":
    main()
