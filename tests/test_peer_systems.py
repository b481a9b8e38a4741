"""The systems `duet bench serve` compares duet with (benchmarks/peer_systems.py), each started
exactly as the benchmark starts it: it must serve a greedy completion identical to a colocated
vLLM engine's (so the comparison is between systems that compute the same thing) and stop
leaving no process of its group. Dynamo's rows are skipped where `make peers` has not installed
it (the default suite does not install peers); vLLM's P/D needs only duet's environment.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from duet.benchmarks.host_overhead import tree_memory_bytes
from duet.benchmarks.peer_systems import PEERS_PYTHON, main
from duet.benchmarks.serve_report import DYNAMO_AGG, DYNAMO_DISAGG, VLLM_PD
from duet.benchmarks.serving_systems import started
from waiting import wait_for

PROMPT = [3 + (i * 29) % 690 for i in range(300)]  # crosses KV block borders
MAX_TOKENS = 16


def _group_members(group: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == group:
                    members.append(int(entry))
            except ProcessLookupError:
                continue
    return members


# vLLM's P/D with each engine on its own core (one OpenMP thread, the one-process executor), and
# Dynamo disaggregated on that and its own conditional disaggregation (its KV router, fed by the
# engines' KV events): the settings the comparison runs them on (docs/benchmarks/serving.md).
@pytest.mark.parametrize("name", [f"{VLLM_PD}@own-core", DYNAMO_AGG, f"{DYNAMO_DISAGG}@conditional"])
def test_peer_serves_exactly_and_stops_cleanly(name: str, duet_config, reference, tmp_path: Path) -> None:
    if not name.startswith(VLLM_PD) and not PEERS_PYTHON.exists():
        pytest.skip("Dynamo is not installed here: `make peers` installs it (benchmark-only)")
    ((_, expected),) = reference.greedy_completions([PROMPT], MAX_TOKENS, ignore_eos=True)
    body = {
        "model": duet_config.model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True,
    }
    with started(name, duet_config, tmp_path) as system:
        group = os.getpgid(system.pid)
        # What the benchmark's footprint table reports: its start-up, and its memory with the
        # engines' (at least their KV caches, 1 GiB an engine).
        assert system.startup_s is not None and 0 < system.startup_s < 600
        assert tree_memory_bytes(system.pid) >= 2**30
        request = urllib.request.Request(
            f"{system.http_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
    assert answer["choices"][0]["text"] == expected, f"{name} computed something else than a colocated engine"
    wait_for(lambda: not _group_members(group), 30, f"every process of {name} gone")


def test_conditional_disaggregation_is_refused_for_a_peer_without_it(capsys) -> None:
    """Only Dynamo disaggregated has a KV router to prefill on its decode worker; elsewhere the
    option would be silently ignored, so the launcher refuses it."""
    with pytest.raises(SystemExit) as exit_:
        main(["vllm-pd", "--model", "m", "--served-model-name", "m", "--port", "1", "--conditional-disagg", "1024"])
    assert exit_.value.code == 2
    assert "--conditional-disagg is dynamo-disagg's option" in capsys.readouterr().err
