"""The mode ``duet plan`` picks for each SLO and rate of a ``duet bench serve`` run.

duet's disaggregated and colocated deployments are measured in the same rounds; beside them the
report marks which of the two the planner would have deployed: ``duet plan`` given the same
requests at the same rate and SLO, and this machine's cores as its cluster
(``cluster/placement/examples/cpu-hosts/one-host.yaml``: the tiny model's measured profile, one
engine per core). It picks the mode that meets the SLO with the fewest cores (ties: the higher
goodput per core); where no mode meets it on these cores, the mark says so, with the highest
rate each mode could take by the planner's simulation. ``conditional`` (long prompts to the
prefill pool, short ones prefilled where they decode) is deployed as duet's disaggregated
deployment is: a prefill and a decode pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.optimizer import InfeasibleError, optimize
from duet.cluster.placement.simulator import Slo
from duet.cluster.placement.trace import Trace

THIS_MACHINE = Path(__file__).resolve().parents[1] / "cluster" / "placement" / "examples" / "cpu-hosts" / "one-host.yaml"
MODES = ("disaggregated", "colocated", "conditional")


def planned_mode(cluster: ClusterSpec, trace: Trace, slo: Slo, rate: float) -> dict[str, Any]:
    """``{"mode": M, "cores": N}`` for what ``duet plan`` deploys, or ``{"mode": None,
    "most_rps": {mode: R}}`` where no mode meets ``slo`` at ``rate`` on ``cluster``."""
    try:
        plan = optimize(cluster, trace, slo, rate=rate, modes=MODES, workers=1).plan
    except InfeasibleError as error:
        return {"mode": None, "most_rps": _most_rates(error)}
    return {"mode": plan.mode, "cores": plan.gpus}


def _most_rates(error: InfeasibleError) -> dict[str, float]:
    """The highest rate each mode's closest option could take, from the planner's error: one
    per deployment it compared ("disaggregated, high-affinity", "conditional (threshold 512)",
    ...), each with the rate its closest option serves, if any."""
    most: dict[str, float] = {}
    for name, option in error.options.items():
        mode = next(m for m in MODES if name.startswith(m))
        if option.closest_rate_rps is not None:
            most[mode] = max(most.get(mode, 0.0), option.closest_rate_rps)
    return most


def planned_modes(trace: Trace, rates: list[float], slos: dict[str, Slo], cluster_file: Path = THIS_MACHINE) -> dict[str, dict[str, Any]]:
    """``{slo name: {rate: planned_mode(...)}}`` for a serving run's SLOs and rates."""
    cluster = ClusterSpec.load(cluster_file)
    return {name: {f"{rate:g}": planned_mode(cluster, trace, slo, rate) for rate in rates} for name, slo in slos.items()}


def picked(mark: dict[str, Any]) -> str:
    """The mode the planner prefers: the one it deploys, or where none meets the rate on these
    cores, the one that takes the highest rate."""
    if mark["mode"]:
        return mark["mode"]
    return max(mark["most_rps"], key=mark["most_rps"].get) if mark["most_rps"] else ""


def describe(mark: dict[str, Any]) -> str:
    """One table cell: "conditional (2 cores)", or "colocated: none meets the rate here (most
    req/s: colocated 6.85, disaggregated 6.76)"."""
    if mark["mode"]:
        return f"{mark['mode']} ({mark['cores']} core{'s' if mark['cores'] != 1 else ''})"
    most = ", ".join(f"{mode} {rate:.3g}" for mode, rate in sorted(mark["most_rps"].items()))
    return f"{picked(mark) or '-'}: none meets the rate here (most req/s: {most or '-'})"
