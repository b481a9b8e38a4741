"""LoRA adapters, served as vLLM's own server serves them (issue 56).

One disaggregated deployment (prefill and decode workers, KV pulled over NIXL, local prefill on
as in the embedded default, two front doors apart from the control plane) serves the built-in
model with two random-weight adapters made by ``duet lora make``'s code; vLLM 0.32's own OpenAI
server is started beside it with the same adapters (``--enable-lora --lora-modules``, runtime
updates allowed), and a colocated worker with the same adapters. Every answer is compared with
vLLM's: the adapters' greedy tokens through both prefill paths and colocated, mixed adapters in
one batch, ``/v1/models``, the unknown-model error, and an adapter loaded and unloaded at run
time (also fuzzed). Then the per-model metrics and status counts, and each engine's adapter loads.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duet.cli import main as duet_main
from duet.config import COLOCATED_CONFIG_PATH, ConfigError, DuetConfig, load_config, parse_config
from duet.router.client import DuetClient, build_request
from duet.worker_runtime.tiny_lora import make_tiny_lora
from vllm_server import http_post, running_vllm_server

ADAPTER_SEEDS = {"lora-one": 1, "lora-two": 2}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_tiny_lora(root / name, seed=seed) for name, seed in ADAPTER_SEEDS.items()}


@pytest.fixture(scope="module")
def lora_config(duet_config: DuetConfig, adapters: dict[str, Path]) -> DuetConfig:
    data = duet_config.model_dump()
    data["model"]["lora"] = {"adapters": [{"name": name, "path": str(path)} for name, path in adapters.items()]}
    # Two front doors: a load goes through one to the control plane, which tells both.
    data["server"]["front_ends"] = 2
    return parse_config(data)


@pytest.fixture(scope="module")
def lora_deployment(running_deployment: Any, lora_config: DuetConfig) -> Iterator[Any]:
    with running_deployment(lora_config) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def colocated_lora_deployment(running_deployment: Any, lora_config: DuetConfig) -> Iterator[Any]:
    """The same adapters on one colocated worker (``mode: colocated``), one front door."""
    data = load_config(COLOCATED_CONFIG_PATH).model_dump()
    data["model"]["lora"] = lora_config.model.lora.model_dump()
    data["colocated"].update(replicas=1, cpu_cores=[1])
    data["server"]["metrics_port"] = None
    with running_deployment(parse_config(data)) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def lora_client(lora_deployment: Any) -> Iterator[DuetClient]:
    with DuetClient(f"127.0.0.1:{lora_deployment.port}") as client:
        yield client


@pytest.fixture(scope="module")
def vllm_lora_server(lora_config: DuetConfig, adapters: dict[str, Path]) -> Iterator[int]:
    lora = lora_config.model.lora
    assert lora is not None
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with running_vllm_server(
        lora_config.model, "--enable-lora", "--max-loras", str(lora.max_loras),
        "--max-lora-rank", str(lora.max_lora_rank), "--lora-modules", *modules,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    ) as port:
        yield port


def _completion(port: int, model: str, prompt: Any, max_tokens: int = 16) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    status, reply = http_post(port, "/v1/completions", body)
    assert status == 200, reply
    return reply


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(length)] for _ in range(count)]


def test_each_adapter_generates_what_vllm_serves_with_it(lora_deployment, vllm_lora_server):
    """The base model and each adapter, a short prompt (prefilled where the guard allows, on
    the decode worker) and a long one (prefilled remotely, its KV pulled): duet's tokens and
    text are vLLM's. The same prompt under the base model first: an adapter request must not
    reuse the base model's cached KV."""
    names = [lora_deployment.config.model.name, *ADAPTER_SEEDS]
    for prompt in ("The prefill worker sends the cache", _prompts(1, 1500, seed=56)[0]):
        outputs = []
        for name in names:
            ours = _completion(lora_deployment.http_port, name, prompt)
            theirs = _completion(vllm_lora_server, name, prompt)
            assert ours["model"] == theirs["model"] == name
            assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"], name
            assert ours["choices"][0]["text"] == theirs["choices"][0]["text"], name
            outputs.append(tuple(ours["choices"][0]["token_ids"]))
        assert len(set(outputs)) == len(names), "an adapter generated what the base model or another adapter did"


def test_colocated_serving_generates_what_vllm_serves_with_each_adapter(colocated_lora_deployment, vllm_lora_server):
    """The third side of the exactness goal: a colocated worker (prompt and decode in one
    engine) with each adapter generates vLLM's tokens, as the disaggregated deployment does."""
    for prompt in ("The prefill worker sends the cache", _prompts(1, 900, seed=57)[0]):
        for name in (colocated_lora_deployment.config.model.name, *ADAPTER_SEEDS):
            ours = _completion(colocated_lora_deployment.http_port, name, prompt)
            theirs = _completion(vllm_lora_server, name, prompt)
            assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"], name


def test_adapters_mixed_in_one_batch_match_vllm(lora_deployment, vllm_lora_server, lora_client):
    """Twelve requests at once over the base model and both adapters, through gRPC: each
    stream's tokens are what vLLM's server gives that request alone."""
    names = ["", *ADAPTER_SEEDS]
    prompts = [prompt for length in (40, 300, 900) for prompt in _prompts(4, length, seed=length)]
    jobs = [(names[i % 3], prompt) for i, prompt in enumerate(prompts)]

    def ours(job: tuple[str, list[int]]) -> list[int]:
        name, prompt = job
        ids, last = lora_client.generate_ids(
            build_request(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, model=name), timeout=300
        )
        assert last.finish_reason != 0
        return ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ours, jobs))
    base = lora_deployment.config.model.name
    want = [_completion(vllm_lora_server, name or base, prompt)["choices"][0]["token_ids"] for name, prompt in jobs]
    assert got == want


def test_models_lists_each_adapter_as_vllm_does(lora_deployment, vllm_lora_server):
    def listed(port: int) -> list[tuple[str, str | None, str]]:
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/v1/models")
        models = json.loads(connection.getresponse().read())["data"]
        # The base model's root is vLLM's model path, duet's the model's name (no path shown).
        return [(model["id"], model["parent"], model["root"] if model["parent"] else None) for model in models]

    ours, theirs = listed(lora_deployment.http_port), listed(vllm_lora_server)
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 1 + len(ADAPTER_SEEDS)


def test_an_unknown_model_is_the_404_vllm_answers(lora_deployment, vllm_lora_server):
    body = {"model": "lora-three", "prompt": "hi", "max_tokens": 4}
    ours, theirs = http_post(lora_deployment.http_port, "/v1/completions", body), http_post(vllm_lora_server, "/v1/completions", body)
    assert ours[0] == theirs[0] == 404
    assert ours[1]["error"]["message"] == theirs[1]["error"]["message"]
    assert ours[1]["error"]["type"] == theirs[1]["error"]["type"] == "NotFoundError"


def test_status_names_the_adapters(lora_client):
    assert list(lora_client.status().lora_adapters) == list(ADAPTER_SEEDS)


def test_an_adapter_loaded_at_run_time_is_served_by_every_front_door_within_10_s(
    lora_deployment, vllm_lora_server, tmp_path: Path
):
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, sent to both servers:
    the same answers (status and text) for a load, a second load of the same name, an unload
    and a second unload; in between, the adapter generates what vLLM generates with it, on
    fresh connections (spread over both front doors), within 10 s of the load call."""
    path = str(make_tiny_lora(tmp_path / "lora-three", seed=3))
    ports = {"duet": lora_deployment.http_port, "vllm": vllm_lora_server}

    def both(endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
        answers = {name: http_post(port, endpoint, body) for name, port in ports.items()}
        assert answers["duet"][0] == answers["vllm"][0], answers
        if answers["duet"][0] == 200:
            assert answers["duet"][1] == answers["vllm"][1]
        else:
            assert answers["duet"][1]["error"]["message"].startswith(answers["vllm"][1]["error"]["message"][:40]), answers
        return answers["duet"]

    started = time.monotonic()
    assert both("/v1/load_lora_adapter", {"lora_name": "lora-three", "lora_path": path})[0] == 200
    prompt = _prompts(1, 200, seed=3)[0]
    want = _completion(vllm_lora_server, "lora-three", prompt)["choices"][0]["token_ids"]
    first = _completion(lora_deployment.http_port, "lora-three", prompt)["choices"][0]["token_ids"]
    assert time.monotonic() - started < 10, "the adapter was not served within 10 s of its load call"
    assert first == want
    for _ in range(5):
        assert _completion(lora_deployment.http_port, "lora-three", prompt)["choices"][0]["token_ids"] == want
    assert both("/v1/load_lora_adapter", {"lora_name": "lora-three", "lora_path": path})[0] == 400
    assert both("/v1/unload_lora_adapter", {"lora_name": "lora-three"})[0] == 200
    for _ in range(4):
        status, reply = http_post(lora_deployment.http_port, "/v1/completions", {"model": "lora-three", "prompt": "hi", "max_tokens": 2})
        assert status == 404 and reply["error"]["type"] == "NotFoundError"
    assert both("/v1/unload_lora_adapter", {"lora_name": "lora-three"})[0] == 404


@pytest.mark.parametrize(
    "case, body, field",
    [
        ("not an adapter directory", {"lora_name": "bad", "lora_path": "/tmp"}, "lora_path"),
        ("the base model's name", {"lora_name": "duet-tiny-llama", "lora_path": "ADAPTER"}, "conflicts with a served base model"),
        ("a path for a name", {"lora_name": "../../etc", "lora_path": "ADAPTER"}, "lora_name"),
        ("no name", {"lora_path": "ADAPTER"}, "must be provided"),
        ("an unknown field", {"lora_name": "x", "lora_path": "ADAPTER", "load_inplace": True}, "load_inplace"),
    ],
)
def test_a_bad_runtime_load_is_refused_and_changes_nothing(lora_deployment, lora_client, adapters, case, body, field):
    body = {key: str(adapters["lora-one"]) if value == "ADAPTER" else value for key, value in body.items()}
    status, reply = http_post(lora_deployment.http_port, "/v1/load_lora_adapter", body)
    assert status == 400 and field in reply["error"]["message"] + str(reply["error"].get("param")), (case, reply)
    assert list(lora_client.status().lora_adapters) == list(ADAPTER_SEEDS)


hostile_names = st.one_of(
    st.text(max_size=70), st.sampled_from(["../x", "a/b", "a\x00b", "-x", "x" * 65, "duet-tiny-llama", "lora-one", "~root"])
)
hostile_paths = st.one_of(st.text(max_size=60), st.sampled_from(["/", "/dev/null", "/proc/self", "~", "~nobody-here", "\x00", "a" * 5000]))
any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=3)),
    max_leaves=8,
)


@settings(
    max_examples=int(os.environ.get("DUET_FUZZ_EXAMPLES", "0")) or 40, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    endpoint=st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]),
    body=st.one_of(
        any_json,
        st.fixed_dictionaries({"lora_name": hostile_names, "lora_path": hostile_paths}),
        st.fixed_dictionaries({"lora_name": st.one_of(hostile_names, any_json), "lora_path": any_json}),
    ),
)
def test_hostile_loads_and_unloads_are_refused_with_a_message(lora_deployment, lora_client, endpoint, body):
    """Fuzzed: vLLM's runtime load and unload endpoints with bodies of any shape and hostile
    names and paths answer 4xx with an OpenAI error naming the problem (never a 5xx, never a
    hang), and the served adapters stay as they were."""
    status, reply = http_post(lora_deployment.http_port, endpoint, body)
    assert 400 <= status < 500, (status, reply, body)
    assert reply["error"]["message"], reply
    assert list(lora_client.status().lora_adapters) == list(ADAPTER_SEEDS)


def test_the_admin_api_loads_and_unloads_adapters(lora_deployment, lora_client, tmp_path: Path):
    """The same through gRPC's Admin service (``duet lora load``/``unload``): INVALID_ARGUMENT
    and NOT_FOUND name the problem."""
    path = str(make_tiny_lora(tmp_path / "lora-four", seed=4))
    assert "added successfully" in lora_client.load_lora_adapter("lora-four", path)
    assert "lora-four" in lora_client.status().lora_adapters
    ids, last = lora_client.generate_ids(build_request("The cache", max_tokens=4, model="lora-four"), timeout=120)
    assert len(ids) == 4 and last.finish_reason != 0
    assert "removed successfully" in lora_client.unload_lora_adapter("lora-four")
    with pytest.raises(grpc.RpcError) as refused:
        lora_client.unload_lora_adapter("lora-four")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as refused:
        lora_client.load_lora_adapter("lora-five", str(tmp_path))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in refused.value.details()


def test_metrics_and_status_count_every_front_doors_requests_by_model(lora_deployment, lora_client, capsys):
    """With front doors apart, the control plane's ``/metrics`` gathers each front door's
    request metrics, labelled ``front_door`` and ``model_name`` (an adapter's requests under its
    own name); summed, they are what ``duet status`` counts per front door and per model."""
    base = lora_deployment.config.model.name
    for index in range(6):  # connections of their own: the kernel spreads them over both doors
        _completion(lora_deployment.http_port, (base, *ADAPTER_SEEDS)[index % 3], "count me", max_tokens=2)
    status = lora_client.status()
    samples = _scrape(status.metrics_endpoint)

    def summed(name: str, by: str, **labels: str) -> dict[str, float]:
        sums: dict[str, float] = {}
        for (sample, sample_labels), value in samples.items():
            found = dict(sample_labels)
            if sample == name and all(found.get(key) == want for key, want in labels.items()):
                sums[found[by]] = sums.get(found[by], 0.0) + value
        return sums

    by_door = {str(door.index): door.requests_served for door in status.front_ends if door.requests_served}
    by_model = {model.model: model.requests_served for model in status.models}
    assert summed("duet_requests_total", "front_door", outcome="served") == by_door
    assert summed("duet_requests_total", "model_name", outcome="served") == by_model
    assert summed("duet_ttft_seconds_count", "model_name") == by_model
    assert {base, *ADAPTER_SEEDS} <= set(by_model) and min(by_model[name] for name in ADAPTER_SEEDS) >= 2
    assert sum(by_model.values()) == status.requests_served
    assert duet_main(["status", "--target", f"127.0.0.1:{lora_deployment.port}"]) == 0
    printed = capsys.readouterr().out
    for model in status.models:
        assert f"{model.model}: {model.requests_served} served" in printed


def test_status_counts_each_engines_adapter_loads(lora_deployment, lora_client):
    """Every engine read the served adapters when it started (counted: vLLM exports no such
    count); requests for adapters already in a slot read and activate nothing more."""
    def loads() -> dict[str, tuple[int, int]]:
        return {
            worker.name: (worker.lora_adapter_reads, worker.lora_adapter_activations)
            for pool in lora_client.status().pools for worker in pool.workers
        }

    before = loads()
    assert set(before) == {"prefill-0", "decode-0"}
    assert all(reads >= len(ADAPTER_SEEDS) and activated >= len(ADAPTER_SEEDS) for reads, activated in before.values()), before
    for name in (*ADAPTER_SEEDS, *ADAPTER_SEEDS):
        _completion(lora_deployment.http_port, name, _prompts(1, 300, seed=7)[0], max_tokens=2)
    assert loads() == before


def _scrape(endpoint: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The deployment's Prometheus samples, by name and labels."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ---- quick: the adapter maker and the config's checks ----------------------------------------


def test_lora_make_is_deterministic_per_seed(tmp_path: Path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert duet_main(["lora", "make", str(tmp_path / name), "--seed", str(seed)]) == 0
    weights = {name: (tmp_path / name / "adapter_model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.parametrize(
    "case, adapter, settings, message",
    [
        ("no adapter_config.json", {"name": "x", "path": "EMPTY"}, {}, "not a LoRA adapter directory"),
        ("rank above the limit", {"name": "x", "path": "RANK16"}, {"max_lora_rank": 8}, "above max_lora_rank (8)"),
        ("a rank vLLM does not take", {"name": "x", "path": "RANK16"}, {"max_lora_rank": 12}, "must be one of"),
        ("the base model's name", {"name": "duet-tiny-llama", "path": "RANK16"}, {}, "the base model's name"),
        ("a name with a slash", {"name": "../x", "path": "RANK16"}, {}, "model.lora.adapters.0.name"),
        ("not a LoRA", {"name": "x", "path": "PROMPT_TUNING"}, {}, "peft_type must be LORA"),
    ],
)
def test_a_bad_adapter_is_refused_before_any_worker_sees_it(tmp_path: Path, case, adapter, settings, message):
    (tmp_path / "EMPTY").mkdir()
    make_tiny_lora(tmp_path / "RANK16", rank=16)
    prompt_tuning = make_tiny_lora(tmp_path / "PROMPT_TUNING")
    (prompt_tuning / "adapter_config.json").write_text(json.dumps({"peft_type": "PROMPT_TUNING", "r": 8}))
    data = load_config().model_dump()
    data["model"]["lora"] = {"adapters": [{**adapter, "path": str(tmp_path / adapter["path"])}], **settings}
    with pytest.raises(ConfigError, match="lora") as error:
        parse_config(data)
    assert message in str(error.value), case


def test_every_load_gets_an_id_never_issued_before(adapters):
    """An id reaches the engines with the first try to load it: a load that failed on one
    engine, or an adapter unloaded before a control plane restarted, must never lend its id
    (the engines would serve its cached weights under another name)."""
    from duet.router.lora_adapters import AdapterRegistry
    from duet.worker_runtime.worker_api import vllm_lora_request

    data = load_config().model_dump()
    data["model"]["lora"] = {"adapters": [{"name": "lora-one", "path": str(adapters["lora-one"])}]}
    registry = AdapterRegistry(parse_config(data).model)
    failed = registry.new_adapter("lora-x", str(adapters["lora-two"]))  # never added: its load failed
    loaded = registry.new_adapter("lora-x", str(adapters["lora-two"]))
    registry.add(loaded)
    registry.remove("lora-x")
    restarted = AdapterRegistry(parse_config(data).model)  # a new control plane knows only what is served
    restarted.adopt(registry.adapters)
    again = restarted.new_adapter("lora-x", str(adapters["lora-two"]))
    ids = [registry.adapters[0].lora_id, failed.lora_id, loaded.lora_id, again.lora_id]
    assert len(set(ids)) == 4
    # The engines' name for a load carries its id: a name loaded again is a new adapter to them.
    assert vllm_lora_request("lora-x", loaded.lora_id, loaded.path) != vllm_lora_request("lora-x", again.lora_id, again.path)
