"""A worker the Ray cluster has no room for: ``duet serve`` says which and why when its start
times out, instead of an empty error after ten minutes (SIMULATED workers: no engine starts)."""

from __future__ import annotations

import pytest

from duet.config import load_config, parse_config


def test_a_worker_ray_has_no_room_for_times_out_with_its_name_and_the_free_cpus(ray_session):
    from duet.cluster.deployment import Deployment, WorkerStartError
    from duet.background_loop import BackgroundLoop

    data = load_config().model_dump()
    data["server"].update(metrics_port=None, worker_start_timeout_s=3)
    simulated = {"engine": "simulated", "replicas": 1, "cpu_cores": None}
    data["prefill"].update(simulated, num_cpus=64)  # the suite's Ray has 8
    data["decode"].update(simulated, num_cpus=0.01)
    deployment = Deployment(parse_config(data))
    loop = BackgroundLoop()
    try:
        with pytest.raises(WorkerStartError, match=r"within server.worker_start_timeout_s \(3 s\): prefill-0\. .* CPU and 0 GPU free"):
            loop.run(deployment.start(port=0, http_port=0), timeout=60)
    finally:
        loop.run(deployment.stop(), timeout=60)
        loop.close()
