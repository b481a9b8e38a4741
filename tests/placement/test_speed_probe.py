"""The speed probe: the deployment's time on fixed prefill and decode work over the profile's.

The probes run against the suite's deployment (about 10 s, no engines of their own); the
comparison is checked on the records they return with hand-made latency models, where the answer
is known: a profile scaled by the factors a probe measured predicts that probe again (its
prefill exactly; its decode up to the KV pulls, which a speed factor does not scale).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.benchmarks.placement_fidelity import deployed_sim_config, write_cluster
from duet.benchmarks.speed_probe import DECODE_PROBE, PREFILL_PROBE, SpeedFactors, run_probes, speed_factors
from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.latency_model import LatencyModel
from duet.cluster.placement.optimizer import optimize
from duet.cluster.placement.plan import Plan
from duet.cluster.placement.simulator import Slo


def _cluster(model: LatencyModel, folder: Path, name: str) -> ClusterSpec:
    model.save(folder / f"{name}.yaml")
    return ClusterSpec.load(write_cluster(folder / f"cluster-{name}.yaml", folder / f"{name}.yaml"))


def _one_and_one(cluster: ClusterSpec) -> Plan:
    """One prefill and one decode engine, as the cross-validation deploys."""
    sim = deployed_sim_config()
    plan = optimize(cluster, DECODE_PROBE, Slo(1.0, 1.0), rate=1.0, workers=2, sim=sim, modes=["disaggregated"]).plan
    assert "prefill 1 x" in plan.summary() and "decode 1 x" in plan.summary()
    return plan


@pytest.mark.engine
def test_probe_times_every_request_and_its_factors_rescale_the_profile(deployment, linear_model, tmp_path):
    records = run_probes(f"127.0.0.1:{deployment.port}", deployment.config.model.name, seed=41)
    assert len(records.prefill_ttft_s) == len(PREFILL_PROBE)
    assert len(records.decode_tpot_s) == len(DECODE_PROBE)
    assert all(0 < t < 30 for t in records.prefill_ttft_s + records.decode_tpot_s)

    sim = deployed_sim_config()
    model = linear_model(prefill=(10.0, 0.1, 1e-4), decode=(5.0, 0.001, 0.2))
    cluster = _cluster(model, tmp_path, "profile")
    plan = _one_and_one(cluster)
    factors = speed_factors(records, cluster, plan, sim)
    assert factors.prefill > 0 and factors.decode > 0
    rescaled = _cluster(model.scaled(factors.prefill, factors.decode), tmp_path, "rescaled")
    again = speed_factors(records, rescaled, plan, sim)
    assert again.prefill == pytest.approx(1.0, rel=1e-6)
    # TPOT also carries the KV pulls, which do not scale and stagger when requests join the batch.
    assert again.decode == pytest.approx(1.0, rel=0.05)


def test_a_replay_between_two_probes_ran_at_their_geometric_mean():
    between = SpeedFactors.between(SpeedFactors(0.8, 2.0), SpeedFactors(1.25, 0.5))
    assert between == SpeedFactors(pytest.approx(1.0), pytest.approx(1.0))
