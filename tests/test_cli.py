"""The ``duet`` command line, run as a user runs it (subprocesses of the installed script)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

DUET = shutil.which("duet") or os.path.join(os.path.dirname(sys.executable), "duet")


def _duet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DUET, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_text_and_reports_usage(deployment, client, tokenizer):
    result = _duet("generate", "Hello duet", "--max-tokens", "8", "--ignore-eos", "--target", f"127.0.0.1:{deployment.port}")
    assert result.returncode == 0, result.stderr
    ids, _ = client.generate_ids(
        __import__("duet.router.client", fromlist=["build_request"]).build_request("Hello duet", max_tokens=8, ignore_eos=True)
    )
    assert result.stdout.rstrip("\n") == tokenizer.decode(ids)
    assert re.search(r"\[length: \d+ prompt \+ 8 generated tokens, TTFT \d+ ms", result.stderr)


def test_generate_bad_input_is_one_line_error(deployment):
    result = _duet("generate", "hi", "--max-tokens", "0", "--target", f"127.0.0.1:{deployment.port}")
    assert result.returncode == 2
    assert "INVALID_ARGUMENT: max_tokens: must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_shows_pools_workers_and_requests(deployment, client):
    result = _duet("status", "--target", f"127.0.0.1:{deployment.port}")
    assert result.returncode == 0, result.stderr
    for text in ("prefill-0", "decode-0", "ready", "served"):
        assert text in result.stdout
    # The host KV pool, once the prefill engine has reported (requests were served above).
    assert re.search(r"KV pool on \S+: \d+ blocks \([\d.]+ of 2048 MiB\), \d+ hits / \d+ misses, \d+ evicted", result.stdout)


def test_no_server_is_a_clear_error():
    result = _duet("status", "--target", "127.0.0.1:1", timeout=60)
    assert result.returncode == 2
    assert "no duet server at 127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr


def test_serve_rejects_bad_config_naming_the_field(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("decode:\n  replicas: -1\n")
    result = _duet("serve", "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert "decode.replicas" in result.stderr and "Traceback" not in result.stderr


def test_serve_rejects_a_directory_that_is_not_a_model(tmp_path):
    result = _duet("serve", "--model", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "model.path" in result.stderr and "not a Hugging Face model directory" in result.stderr


def test_serve_on_a_taken_port_fails_fast_naming_it(deployment):
    started = time.monotonic()
    result = _duet("serve", "--port", str(deployment.port), "--metrics-port", "0", timeout=120)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{deployment.port} for gRPC" in result.stderr and "--port" in result.stderr
    assert time.monotonic() - started < 60, "duet started its workers before finding the port taken"


def _descendant_commands(pid: int) -> list[str]:
    commands = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            commands.append(" ".join(process.cmdline()))
        except psutil.Error:  # exited meanwhile
            pass
    return commands


def _serving_port(server: subprocess.Popen) -> int:
    """The gRPC port `duet serve` reports once it serves."""
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        assert line, f"duet serve exited early with {server.wait()}"
        match = re.search(r"serving duet-tiny-llama on 127\.0\.0\.1:(\d+)", line)
        if match:
            return int(match.group(1))
    raise AssertionError("duet serve did not report that it is serving")


def _alive(processes: list[psutil.Process]) -> list[str]:
    """Those of ``processes`` still running (zombies count as gone)."""
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()) or process.name())
        except psutil.Error:
            pass
    return left


@pytest.mark.timeout(600)
def test_serve_starts_serves_and_stops_on_sigint(deployment):
    """The main job, end to end: `duet serve` as its own process (its own local Ray)."""
    server = subprocess.Popen([DUET, "serve", "--port", "0", "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = _serving_port(server)
        # Its own Ray, without the daemons duet never uses (cluster/ray_runtime.py): the log
        # monitor (worker logs stay local by default, so it would only poll files), the
        # autoscaler monitor and the dashboard head. The generate below shows the actors work.
        ray_processes = _descendant_commands(server.pid)
        assert any("raylet" in command for command in ray_processes), ray_processes
        for stopped in ("log_monitor.py", "autoscaler/_private/monitor.py", "dashboard/dashboard.py"):
            assert not any(stopped in command for command in ray_processes), (stopped, ray_processes)
        result = _duet("generate", "from a separate server", "--max-tokens", "5", "--ignore-eos", "--target", f"127.0.0.1:{port}")
        assert result.returncode == 0 and "5 generated tokens" in result.stderr, result.stderr
        descendants = psutil.Process(server.pid).children(recursive=True)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=120) == 0
        assert not _alive(descendants), f"left running after a clean stop: {_alive(descendants)}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.timeout(600)
def test_serve_killed_leaves_no_process_behind(deployment):
    """`duet serve --front-ends 2` (front doors, control plane and workers in processes of
    their own, actors detached) whose deployment process is SIGKILLed, as an OOM kill does:
    every process it started goes with it, Ray's agents included (cluster/process_reaper.py)."""
    server = subprocess.Popen(
        [DUET, "serve", "--front-ends", "2", "--port", "0", "--http-port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        _serving_port(server)
        (deployment_process,) = psutil.Process(server.pid).children()
        descendants = deployment_process.children(recursive=True)
        commands = " ".join(" ".join(p.cmdline()) for p in descendants if p.is_running())
        for expected in ("raylet", "ray::ControlPlane", "ray::FrontDoor", "ray::PrefillWorker", "ray::DecodeWorker"):
            assert expected in commands, (expected, commands)
        deployment_process.kill()
        assert server.wait(timeout=120) != 0
        assert not _alive(descendants), f"left running after the kill: {_alive(descendants)}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
