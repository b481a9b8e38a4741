"""The autoscaler driving a live deployment: the real router, pools, pool managers and drains.

First with SIMULATED engines (DistServe's OPT-13B timing, no model computed) so the predictive
sizing sees the engines its latency model describes; then with real vLLM workers on CPU, where
a reactive-only policy must add the worker the bottleneck calls for and drain it afterwards.
Both check that no request is lost or changed while pools grow and shrink.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from duet.config import load_config, parse_config
from duet.worker_runtime.simulated_engine import simulated_tokens
from duet.router.client import DuetClient, build_request
from waiting import wait_for


MULTI_MODEL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multi-model.yaml"


def _policy(tmp_path: Path, **fields: Any) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


class SizeRecorder:
    """Samples the pools' active sizes in the background (the deployment runs in its own loop):
    the default model's by role, and every served model's units."""

    def __init__(self, deployment: Any) -> None:
        self.deployment = deployment
        self.samples: list[dict[str, int]] = []
        self.units: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append({role: len(m.active()) for role, m in self.deployment.managers.items()})
            self.units.append({served.name: served.units_held() for served in self.deployment.models})
            time.sleep(0.2)

    def peak(self, role: str) -> int:
        return max(sample[role] for sample in self.samples)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _sizes(deployment: Any) -> dict[str, int]:
    return {role: len(manager.pool.members) for role, manager in deployment.managers.items()}


def test_simulated_cluster_follows_a_load_step(running_deployment, tmp_path: Path) -> None:
    data = load_config().model_dump()
    for role in ("prefill", "decode"):
        data[role].update(engine="simulated", replicas=1, num_cpus=0.01, cpu_cores=None)
    data["server"].update(metrics_port=0, http_port=None)
    data["autoscale"] = _policy(
        tmp_path, slo="chat", latency_model="distserve:opt-13b", interval_s=0.5, startup_s=1, settle_s=1,
        forecast_window_s=2, prefill={"min": 1, "max": 6}, decode={"min": 1, "max": 6},
        scale_down={"delay_s": 4, "step": 1},
    )
    with running_deployment(parse_config(data, "autoscale test")) as deployment:
        recorder = SizeRecorder(deployment)
        prompts = [[(i * 13) % 600 + 3] * 1500 for i in range(240)]  # ~190 ms of OPT-13B prefill each
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:

            def send(index: int) -> tuple[list[int], Any]:
                time.sleep(index / 24)  # 24 requests/s for ten seconds: several prefill workers' worth
                return client.generate_ids(build_request(prompt_token_ids=prompts[index], max_tokens=8), timeout=120)

            with ThreadPoolExecutor(96) as pool:
                results = list(pool.map(send, range(len(prompts))))
            vocab = deployment.service.limits.vocab_size
            for prompt, (ids, _) in zip(prompts, results):
                assert ids == simulated_tokens(prompt, 8, vocab), "a request was lost or changed"
            assert recorder.peak("prefill") >= 2, f"the prefill pool never grew: {recorder.samples[-5:]}"
            # Idle now: after the scale-down window both pools drain back to their minimum.
            wait_for(lambda: _sizes(deployment) == {"prefill": 1, "decode": 1}, 60, "the pools to shrink back")
            recorder.stop()
            assert deployment.autoscaler is not None
            metrics = deployment.cluster.metrics.registry
            grew = metrics.get_sample_value("duet_autoscaler_decisions_total", {"model": "duet-tiny-llama", "role": "prefill", "direction": "up", "reason": "forecast"})
            grew_reactively = sum(
                metrics.get_sample_value("duet_autoscaler_decisions_total", {"model": "duet-tiny-llama", "role": "prefill", "direction": "up", "reason": reason}) or 0
                for reason in ("slo_missed", "queue")
            )
            assert (grew or 0) + grew_reactively >= 1
            assert metrics.get_sample_value("duet_autoscaler_decisions_total", {"model": "duet-tiny-llama", "role": "prefill", "direction": "down", "reason": "forecast"}) >= 1
            assert metrics.get_sample_value("duet_slo_target_seconds", {"model": "duet-tiny-llama", "metric": "ttft"}) == 0.25
            status = client.status()
            assert any("autoscaling: policy" in note for note in status.routing)


def test_two_models_autoscale_within_a_shared_budget(running_deployment, tmp_path: Path) -> None:
    """Two models (SIMULATED engines: a control-plane test), each with its own autoscaling
    policy allowing 6 workers a pool, share an autoscale_budget of 5 units, all held: the first
    model 2, the idle second 3 (two prefill workers). A load step on the first puts it below its
    SLO; the second, meeting its own, gives a prefill worker back at once (its scale-down
    window is a minute), and the first grows into that unit only (3 workers at most, 5 units
    held together at every moment, a draining worker counted until it is gone). Each model's
    decisions and SLO are exported under its own label."""
    simulated = {"engine": "simulated", "replicas": 1, "num_cpus": 0.01, "cpu_cores": None}
    policy = _policy(
        tmp_path, slo="chat", latency_model="distserve:opt-13b", interval_s=0.5, startup_s=1, settle_s=1,
        forecast_window_s=2, prefill={"min": 1, "max": 6}, decode={"min": 1, "max": 6},
        scale_down={"delay_s": 60, "step": 1},
    )
    data = load_config(MULTI_MODEL_CONFIG).model_dump(exclude_unset=True)
    for served in data["models"]:
        served.update(prefill=simulated, decode=simulated, autoscale=policy)
    data["models"][1]["prefill"] = {**simulated, "replicas": 2}
    data["autoscale_budget"] = 5
    data["server"].update(metrics_port=0, http_port=None)
    with running_deployment(parse_config(data, "shared budget test")) as deployment:
        recorder = SizeRecorder(deployment)
        tiny, wide = (served.name for served in deployment.models)
        prompts = [[(i * 13) % 600 + 3] * 1500 for i in range(240)]
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:

            def send(index: int) -> None:
                time.sleep(index / 24)  # as in the one-model load step above, all for the first model
                client.generate_ids(build_request(prompt_token_ids=prompts[index], max_tokens=8, model=tiny), timeout=120)

            with ThreadPoolExecutor(96) as pool:
                list(pool.map(send, range(len(prompts))))
        recorder.stop()
        assert recorder.units[0] == {tiny: 2, wide: 3}, recorder.units[0]
        assert max(sample[tiny] for sample in recorder.units) == 3, f"the first model never grew: {recorder.units[-5:]}"
        assert min(sample[wide] for sample in recorder.units) == 2, f"the second gave nothing back: {recorder.units[-5:]}"
        assert all(sum(sample.values()) <= 5 for sample in recorder.units), recorder.units
        metrics = deployment.cluster.metrics.registry
        trimmed = metrics.get_sample_value(
            "duet_autoscaler_target_workers", {"model": tiny, "role": "prefill"}
        )
        assert trimmed is not None and trimmed <= 2
        for model in (tiny, wide):
            assert metrics.get_sample_value("duet_slo_target_seconds", {"model": model, "metric": "ttft"}) == 0.25


def test_real_vllm_decode_pool_grows_under_load_and_drains_after(deployment, tmp_path: Path) -> None:
    """Reactive only (no latency model for the tiny model on this CPU): a TPOT target the
    single decode worker cannot hold under 24 streams makes the autoscaler add a decode
    worker, which serves; when the load stops, the added worker is drained and removed. Every
    stream completes, and copies of one prompt get the same tokens from whichever worker."""
    from duet.cluster.autoscaler.live import LiveAutoscaler
    from duet.cluster.autoscaler.policy import load_policy

    policy = load_policy(
        _policy(
            tmp_path, slo={"ttft_s": 30.0, "tpot_s": 0.005}, latency_model=None, interval_s=1, startup_s=60,
            settle_s=5, forecast_window_s=2, prefill={"min": 1, "max": 1}, decode={"min": 1, "max": 2},
            scale_down={"delay_s": 4, "step": 1},
        )
    )
    pools = {"prefill": deployment.prefill, "decode": deployment.decode}
    scaler = LiveAutoscaler(policy, pools, deployment.service.load, deployment)

    async def start() -> None:
        scaler.start()

    deployment.background.run(start())
    original = {m.name for m in deployment.decode.members}
    recorder = SizeRecorder(deployment)
    stop = threading.Event()
    prompts = [[(i * 37) % 600 + 3 for i in range(k, k + 40)] for k in range(4)]
    results: list[tuple[int, list[int], str]] = []
    lock = threading.Lock()
    try:
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:

            def stream(worker: int) -> None:
                k = 0
                while not stop.is_set():
                    index = (worker + k) % len(prompts)
                    ids, last = client.generate_ids(build_request(prompt_token_ids=prompts[index], max_tokens=24), timeout=300)
                    with lock:
                        results.append((index, ids, last.usage.decode_worker))
                    k += 1

            def added_worker_served() -> bool:
                with lock:
                    return any(worker not in original for _, _, worker in results)

            with ThreadPoolExecutor(24) as pool:
                futures = [pool.submit(stream, w) for w in range(24)]
                try:
                    wait_for(added_worker_served, 240, "an added decode worker to serve")
                finally:
                    stop.set()
                for future in futures:
                    future.result()  # a lost request raises here
            assert recorder.peak("decode") == 2
            wait_for(lambda: _sizes(deployment)["decode"] == 1, 90, "the added decode worker to drain away")
        assert {m.name for m in deployment.decode.members} == original, "the original worker should stay"
        by_prompt: dict[int, set[tuple[int, ...]]] = {}
        for index, ids, _ in results:
            assert len(ids) == 24
            by_prompt.setdefault(index, set()).add(tuple(ids))
        assert all(len(outputs) == 1 for outputs in by_prompt.values()), "workers disagree on a greedy output"
    finally:
        stop.set()
        recorder.stop()
        scaler.stop()
