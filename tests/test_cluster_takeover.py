"""A deployment on a Ray cluster outlives its `duet serve`, and an operator can take it over.

Real processes: a Ray cluster started with ``ray start --head`` (its own session, ports and
processes, beside the suite's local Ray), ``duet serve --config`` with ``ray.address`` set to it
and two front doors, over SIMULATED workers (the control plane is what is under test; they start
in seconds). Under load the ``duet serve`` process group is SIGKILLed: no stream fails, and the
control plane, a detached actor, keeps its deployment (status lists both front doors and the
deployment id); a worker killed afterwards is replaced. ``duet serve`` started again with the
same config takes the deployment over with nothing restarted; one with another config on the
same ports is refused, naming the deployment; ``duet stop`` ends it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from duet.config import load_config
from duet.kv_transfer.ports import free_port
from duet.router.client import DuetClient, build_request
from waiting import wait_for

DUET = str(Path(sys.executable).with_name("duet"))
STREAMS = 12
MAX_TOKENS = 300  # seconds of simulated decode steps: in flight when duet serve dies


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """A one-host Ray cluster of its own (``ray start --head --block``), with token
    authentication as docs/guides/ray-cluster.md sets it up (the token in the environment of
    every process of this module: the head, `duet serve`, `duet stop`); its address."""
    port = free_port("127.0.0.1")
    temp_dir = str(tmp_path_factory.mktemp("ray"))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
         "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env={**os.environ, "RAY_worker_niceness": "0"}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: _ray_up(address), 90, "the Ray head answering")
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
        for process in psutil.process_iter(["cmdline"]):  # Ray's daemons and actors of this cluster
            if any(temp_dir in part for part in process.info["cmdline"] or ()):
                with contextlib.suppress(psutil.Error):
                    process.kill()
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            os.environ.pop(name, None)


def _ray_up(address: str) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={address!r}, log_to_driver=False); ray.shutdown()"],
        capture_output=True, timeout=60,
    )
    return probe.returncode == 0


def _config(tmp_path: Path, address: str, grpc_port: int, http_port: int, replicas: int = 1) -> Path:
    data = load_config().model_dump()
    for role in ("prefill", "decode"):
        data[role].update(engine="simulated", replicas=replicas, num_cpus=0.01, cpu_cores=None)
    data["ray"]["address"] = address
    data["server"].update(port=grpc_port, http_port=http_port, metrics_port=None, front_ends=2)
    path = tmp_path / f"cluster-{replicas}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _serve(config: Path) -> tuple[subprocess.Popen, list[str]]:
    """`duet serve --config` in a process group of its own; returns it once it serves, with its lines."""
    server = subprocess.Popen(
        [DUET, "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    assert server.stdout is not None
    for line in server.stdout:
        lines.append(line.rstrip())
        if line.startswith("duet: serving"):
            return server, lines
    raise AssertionError(f"duet serve exited ({server.wait()}) without serving:\n" + "\n".join(lines[-30:]))


def _status(target: str):
    with DuetClient(target) as client:
        return client.status()


def _stream(target: str, prompt: list[int]) -> list[int]:
    with DuetClient(target) as client:
        request = build_request(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [token for message in client.stream(request, timeout=120) for token in message.token_ids]


def _kill_actor(address: str, prefix: str) -> None:
    """Kill the named actor of the cluster whose name starts with ``prefix`` (a worker's)."""
    script = (
        "import ray; from duet.cluster.ray_runtime import RAY_NAMESPACE; "
        f"ray.init(address={address!r}, namespace=RAY_NAMESPACE, log_to_driver=False); "
        f"(name,) = [n for n in ray.util.list_named_actors() if n.startswith({prefix!r})]; "
        "ray.kill(ray.get_actor(name), no_restart=True)"
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert killed.returncode == 0, killed.stderr[-2000:]


@pytest.mark.timeout(600)
def test_a_cluster_deployment_outlives_duet_serve_and_is_taken_over(ray_cluster, tmp_path):
    grpc_port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    config = _config(tmp_path, ray_cluster, grpc_port, http_port)
    target = f"127.0.0.1:{grpc_port}"
    server, lines = _serve(config)
    try:
        deployment_id = _status(target).deployment_id
        assert deployment_id and any(f"started deployment {deployment_id}" in line for line in lines), lines
        before = _status(target)
        doors = {door.index: door.pid for door in before.front_ends}
        prompts = [[(index * 11) % 500 + 3] * (20 + index) for index in range(STREAMS)]
        with ThreadPoolExecutor(STREAMS) as pool:
            streams = [pool.submit(_stream, target, prompt) for prompt in prompts]
            wait_for(lambda: _status(target).requests_inflight == STREAMS, 60, "every stream in flight")
            os.killpg(server.pid, signal.SIGKILL)  # duet serve and its deployment process, at once
            server.wait(30)
            killed_at = time.monotonic()
            results = [stream.result() for stream in streams]
        assert [len(tokens) for tokens in results] == [MAX_TOKENS] * STREAMS, "a stream did not complete"

        # The control plane never went away: status is its own, with both front doors, at once.
        after = wait_for(lambda: (s := _status(target)).control_plane_pid and len(s.front_ends) == 2 and s, 15,
                         "the control plane answering")
        assert time.monotonic() - killed_at < 15
        assert after.deployment_id == deployment_id and after.control_plane_pid == before.control_plane_pid
        assert {door.index: door.pid for door in after.front_ends} == doors, "a front door was restarted"

        # A worker that dies now is replaced by it.
        decode = next(pool for pool in after.pools if pool.role == "decode").workers[0]
        _kill_actor(ray_cluster, f"{deployment_id}/{decode.name}/")
        def replaced() -> bool:
            workers = [w for pool in _status(target).pools for w in pool.workers]
            replaced.seen = [(w.name, w.state, w.restarts, w.error) for w in workers]  # type: ignore[attr-defined]
            return any(w.name == decode.name and w.restarts == 1 for w in workers) and all(w.state.startswith("ready") for w in workers)

        try:
            wait_for(replaced, 90, "the worker replaced")
        except AssertionError as error:
            raise AssertionError(f"{error}; workers: {replaced.seen}") from None  # type: ignore[attr-defined]

        # `duet serve` again, same config: it takes the deployment over, nothing restarted.
        started = time.monotonic()
        server, lines = _serve(config)
        took_s = time.monotonic() - started
        assert took_s < 15, f"the take-over took {took_s:.1f} s"
        assert any(f"took over the running deployment {deployment_id}" in line for line in lines), lines
        again = _status(target)
        assert again.deployment_id == deployment_id and {d.index: d.pid for d in again.front_ends} == doors
        assert _stream(target, prompts[0]) == results[0]

        # Another config on the same ports is refused, naming the deployment and the way out.
        other = _config(tmp_path, ray_cluster, grpc_port, http_port, replicas=2)
        refused = subprocess.run([DUET, "serve", "--config", str(other)], capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0 and deployment_id in refused.stderr and "duet stop" in refused.stderr, refused.stderr

        # duet serve killed again; `duet stop` ends the headless deployment.
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        stopped = subprocess.run([DUET, "stop", "--config", str(config)], capture_output=True, text=True, timeout=300)
        assert stopped.returncode == 0 and deployment_id in stopped.stdout, stopped.stderr
        wait_for(lambda: not _answers(target), 60, "the APIs gone after duet stop")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        subprocess.run([DUET, "stop", "--config", str(config)], capture_output=True, timeout=300)


def _answers(target: str) -> bool:
    try:
        _status(target)
        return True
    except Exception:
        return False
