"""Several models from one deployment (issue 56, ``models:``).

One deployment from configs/multi-model.yaml serves the built-in tiny model and the built-in
wide model (another shape: wider, shallower, a KV head per attention head), each disaggregated
with its own prefill and decode workers and KV pulled over NIXL, behind one front door. Each
model's greedy tokens are compared with vLLM's: the tiny model's with the suite's colocated
reference engine, the wide model's with vLLM's own OpenAI server. Then what the front door says
of both (``/v1/models``, status, the unknown-model 404) and that each model's pools are its own
(requests land on them, the Admin API scales one model's pool by name), and a third model added
and removed while the others serve. The config's rules for ``models:`` are checked without
engines.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from duet.cli import main as duet_main
from duet.config import ConfigError, DuetConfig, load_config, parse_config
from duet.router.client import DuetClient, build_request
from vllm_server import http_post, running_vllm_server

MULTI_MODEL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multi-model.yaml"
TINY, WIDE = "duet-tiny-llama", "duet-tiny-llama-wide"


@pytest.fixture(scope="module")
def multi_config() -> DuetConfig:
    """The shipped config, with smaller KV caches (it runs beside the suite's other engines)."""
    data = load_config(MULTI_MODEL_CONFIG).model_dump()
    for served in data["models"]:
        for role in ("prefill", "decode"):
            served[role]["kv_cache_gib"] = 0.25
    data["server"]["metrics_port"] = None
    return parse_config(data)


@pytest.fixture(scope="module")
def multi_deployment(running_deployment: Any, multi_config: DuetConfig) -> Iterator[Any]:
    with running_deployment(multi_config) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def multi_client(multi_deployment: Any) -> Iterator[DuetClient]:
    with DuetClient(f"127.0.0.1:{multi_deployment.port}") as client:
        yield client


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(length)] for _ in range(count)]


def _greedy(client: DuetClient, model: str, prompt: list[int], max_tokens: int = 16) -> list[int]:
    ids, _ = client.generate_ids(build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, model=model))
    return ids


def test_each_model_generates_what_vllm_does(multi_deployment, multi_client, multi_config, reference):
    """Both models served, both exact: the tiny model's tokens equal the colocated reference
    engine's, the wide model's equal vLLM's own server's, each through its own disaggregated
    pools (short and long prompts: one prefilled on the decode worker under the default's
    local-prefill rule, one prefilled remotely with its KV pulled). The two models' answers
    differ, so a request sent to the wrong model's pools would fail this."""
    prompts = [_prompts(1, 24, seed=1)[0], _prompts(1, 1400, seed=2)[0]]
    tiny = [_greedy(multi_client, TINY, prompt) for prompt in prompts]
    assert tiny == reference.greedy(prompts, 16, ignore_eos=True)
    assert [_greedy(multi_client, "", prompt) for prompt in prompts] == tiny  # no name: the default model
    wide = [_greedy(multi_client, WIDE, prompt) for prompt in prompts]
    with running_vllm_server(multi_config.models[1].model) as port:
        for prompt, ours in zip(prompts, wide):
            body = {"model": WIDE, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}
            status, reply = http_post(port, "/v1/completions", body)
            assert status == 200, reply
            assert ours == reply["choices"][0]["token_ids"]
    assert wide != tiny


def test_each_models_requests_run_on_its_own_workers(multi_deployment, multi_client):
    """Status lists every model and each pool's model; a model's requests are served by its
    own workers only (the second model's named after it)."""
    before = _served_by_worker(multi_client.status())
    for prompt in _prompts(3, 40, seed=3):
        _greedy(multi_client, WIDE, prompt, max_tokens=4)
    status = multi_client.status()
    assert list(status.served_models) == [TINY, WIDE] and status.model == TINY
    assert {(pool.model, pool.role) for pool in status.pools} == {
        (TINY, "prefill"), (TINY, "decode"), (WIDE, "prefill"), (WIDE, "decode"),
    }
    after = _served_by_worker(status)
    grew = {name for name, served in after.items() if served > before.get(name, 0)}
    assert grew and all(name.startswith(f"{WIDE}/") for name in grew), grew
    assert {model.model for model in status.models} >= {WIDE}


def _served_by_worker(status: Any) -> dict[str, int]:
    return {worker.name: worker.requests_served for pool in status.pools for worker in pool.workers}


def test_an_adapter_may_not_take_another_models_name(multi_deployment):
    """vLLM's /v1/load_lora_adapter on the front door checks the name against every served
    model, not only the default one's (whose requests would otherwise take the other's name)."""
    status, reply = http_post(
        multi_deployment.http_port, "/v1/load_lora_adapter", {"lora_name": WIDE, "lora_path": "/nonexistent"}
    )
    assert status == 400 and "conflicts with a served base model" in str(reply), reply


def test_models_and_the_unknown_model_error_name_both_models(multi_deployment):
    """``/v1/models`` lists both models (OpenAI SDK); a request naming neither gets vLLM's 404
    over HTTP and INVALID_ARGUMENT over gRPC, naming what is served."""
    import openai

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{multi_deployment.http_port}/v1", api_key="unused", max_retries=0)
    assert [model.id for model in sdk.models.list().data] == [TINY, WIDE]
    reply = sdk.completions.create(model=WIDE, prompt="the cache moves", max_tokens=4, temperature=0.0)
    assert reply.model == WIDE and reply.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    status, reply = http_post(multi_deployment.http_port, "/tokenize", {"model": WIDE, "prompt": "the cache"})
    assert status == 200 and reply["count"] > 0
    with DuetClient(f"127.0.0.1:{multi_deployment.port}") as client:
        with pytest.raises(grpc.RpcError) as error:
            client.generate_ids(build_request(prompt="hello", max_tokens=2, model="no-such-model"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert TINY in error.value.details() and WIDE in error.value.details()


def test_the_admin_api_scales_one_models_pool_by_name(multi_deployment, multi_client, capsys):
    """ScalePool names the model: an unknown one is refused naming the served models; the wide
    model's decode pool grows by a worker named after it while the tiny model's stays, then
    shrinks back (`duet scale --model`). `duet status` prints each pool under its model."""
    with pytest.raises(grpc.RpcError) as error:
        multi_client.scale("decode", 2, model="no-such-model")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and WIDE in error.value.details()
    changes = multi_client.scale("decode", 2, model=WIDE)
    assert changes == [f"{WIDE}/decode-1: starting"], changes
    tiny_decode = len(multi_deployment.decode.members)
    assert len(multi_deployment.models[1].decode.members) == 2 and tiny_decode == 1
    target = f"127.0.0.1:{multi_deployment.port}"
    assert duet_main(["scale", "decode=1", "--model", WIDE, "--target", target]) == 0
    removed = capsys.readouterr().out.strip().splitlines()
    assert len(removed) == 1 and removed[0].startswith(f"{WIDE}/decode-"), removed
    assert duet_main(["status", "--target", target]) == 0
    printed = capsys.readouterr().out
    assert f"{WIDE} decode" in printed and f"{TINY} prefill" in printed, printed


COPY = "duet-tiny-llama-copy"
# The tiny model again, colocated on one worker, with LoRA on: added and removed while the
# others serve, and given an adapter at run time.
COPY_CONFIG = f"""
model: {{name: {COPY}, path: builtin, lora: {{max_loras: 1}}}}
mode: colocated
colocated: {{replicas: 1, kv_cache_gib: 0.25, num_cpus: 0, cpu_cores: [1]}}
"""


@pytest.mark.parametrize(
    "model_config, message",
    [
        ("model: [unclosed", "not YAML or JSON"),
        (f"model: {{name: {WIDE}, path: builtin}}", f"{WIDE} already served"),
        ("model: {name: x}\nprefil: {replicas: 1}", "prefil"),
        ("model: {name: x}\nmode: colocated\nautoscale: local", "colocated deployment has neither"),
    ],
    ids=["not-yaml", "name-taken", "unknown-section", "per-model-rule"],
)
def test_a_model_that_cannot_be_added_is_refused_naming_why(multi_client, model_config, message):
    with pytest.raises(grpc.RpcError) as error:
        multi_client.add_model(model_config, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()


def test_a_model_added_and_removed_while_the_others_serve(multi_deployment, multi_client, reference, tmp_path: Path, capsys):
    """`duet model add` starts a third model's worker while the other two keep answering; once
    it returns the new model serves (its greedy tokens are the reference engine's: it is the
    tiny model, colocated), and is listed; an adapter is loaded onto it. `duet model remove`
    stops it: its name and its adapter's are refused at once, its worker leaves status; the default model cannot be removed."""
    config_file = tmp_path / "copy.yaml"
    config_file.write_text(COPY_CONFIG)
    target = f"127.0.0.1:{multi_deployment.port}"
    with ThreadPoolExecutor(1) as pool:
        adding = pool.submit(duet_main, ["model", "add", str(config_file), "--target", target])
        answered = 0
        while not adding.done():
            assert len(_greedy(multi_client, WIDE, _prompts(1, 20, seed=answered)[0], max_tokens=2)) == 2
            answered += 1
        assert adding.result() == 0
    assert answered >= 3, "the served models stopped answering while a model was added"
    assert capsys.readouterr().out.strip() == f"{COPY}: serving ({COPY}/colocated-0)"
    prompts = _prompts(2, 60, seed=5)
    assert [_greedy(multi_client, COPY, prompt) for prompt in prompts] == reference.greedy(prompts, 16, ignore_eos=True)
    assert list(multi_client.status().served_models) == [TINY, WIDE, COPY]
    status, listed = _get_models(multi_deployment.http_port)
    assert [model["id"] for model in listed["data"]] == [TINY, WIDE, COPY]
    _load_an_adapter_onto(multi_deployment, multi_client, tmp_path, capsys)

    with pytest.raises(grpc.RpcError) as error:
        multi_client.remove_model(TINY)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "default model" in error.value.details()
    assert duet_main(["model", "remove", COPY, "--target", target]) == 0
    assert capsys.readouterr().out.strip() == f"{COPY}: removed ({COPY}/colocated-0)"
    for name in (COPY, COPY_LORA):  # the model's adapters leave with it
        with pytest.raises(grpc.RpcError) as error:
            _greedy(multi_client, name, prompts[0])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = multi_client.status()
    assert list(status.served_models) == [TINY, WIDE] and COPY not in {pool.model for pool in status.pools}
    assert _greedy(multi_client, TINY, prompts[0]) == reference.greedy(prompts[:1], 16, ignore_eos=True)[0]


COPY_LORA = "copy-lora"


def _load_an_adapter_onto(deployment: Any, client: DuetClient, tmp_path: Path, capsys: Any) -> None:
    """vLLM's /v1/load_lora_adapter with ``base_model_name`` puts an adapter on a model other
    than the default: read by that model's engine only, served under its own name, listed with
    that model as its parent. An unknown base model is a 404 naming the served ones; a model
    without LoRA is a 400 saying what to set."""
    adapter = tmp_path / COPY_LORA
    assert duet_main(["lora", "make", str(adapter), "--seed", "4"]) == 0
    capsys.readouterr()

    def reads() -> dict[str, int]:
        return {worker.name: worker.lora_adapter_reads for pool in client.status().pools for worker in pool.workers}

    before = reads()
    port = deployment.http_port
    status, reply = http_post(port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter), "base_model_name": "no-such"})
    assert status == 404 and COPY in str(reply), reply
    status, reply = http_post(port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter), "base_model_name": WIDE})
    assert status == 400 and f"LoRA is off for model '{WIDE}'" in str(reply), reply
    status, reply = http_post(port, "/v1/load_lora_adapter", {"lora_name": COPY_LORA, "lora_path": str(adapter), "base_model_name": COPY})
    assert status == 200, reply
    grew = {name: count - before.get(name, 0) for name, count in reads().items() if count != before.get(name, 0)}
    assert grew == {f"{COPY}/colocated-0": 1}, grew
    assert len(_greedy(client, COPY_LORA, _prompts(1, 30, seed=9)[0], max_tokens=4)) == 4
    _, listed = _get_models(port)
    assert [(model["id"], model["parent"]) for model in listed["data"]][-1] == (COPY_LORA, COPY)


def _get_models(port: int) -> tuple[int, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as reply:
        return reply.status, json.load(reply)


@pytest.mark.quick
def test_models_config_gives_each_model_its_sections():
    """``served()`` gives each listed model the shared sections with its own; the default
    first. A one-model config is its own only entry."""
    config = load_config(MULTI_MODEL_CONFIG)
    tiny, wide = config.served()
    assert (tiny.model.name, wide.model.name) == (TINY, WIDE) and wide.model.path == "builtin-wide"
    assert tiny.server == wide.server == config.server and wide.kv_transfer == config.kv_transfer
    assert wide.prefill.num_cpus == 0 and tiny.prefill.num_cpus == 1
    assert load_config().served() == [load_config()]


@pytest.mark.quick
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(model={"name": "x"}), "leave the top-level one"),
        (lambda d: d["models"][1]["model"].update(name=TINY), "repeated: duet-tiny-llama"),
        (lambda d: d["models"][1].update(mode="colocated", autoscale="local"), "models.1 (duet-tiny-llama-wide)"),
        (lambda d: d["models"][0]["prefill"].update(replicas=0), "models.0.prefill.replicas"),
    ],
    ids=["top-level-model-too", "repeated-name", "per-model-rule", "bad-pool"],
)
def test_a_bad_models_list_is_refused_naming_the_field(change, message):
    data = load_config(MULTI_MODEL_CONFIG).model_dump(exclude_unset=True)
    change(data)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(data)


@pytest.mark.quick
def test_a_models_own_router_keeps_its_explicit_nulls():
    """A model's ``router`` replaces the deployment's as written: a null in it stays null (the
    default would be 0.04 s), and the other model keeps the deployment's."""
    data = load_config(MULTI_MODEL_CONFIG).model_dump(exclude_unset=True)
    data["models"][1]["router"] = {"local_prefill_tpot_s": None, "prefill_policy": "least_requests"}
    tiny, wide = parse_config(data).served()
    assert wide.router.local_prefill_tpot_s is None and wide.router.prefill_policy == "least_requests"
    assert tiny.router.local_prefill_tpot_s == 0.04


@pytest.mark.quick
def test_lora_make_adapts_either_built_in_model(tmp_path: Path, capsys):
    """`duet lora make --base builtin-wide` writes an adapter of the wide model's shape: one the
    wide model's config takes and whose weights differ in width from the tiny model's."""
    from safetensors import safe_open

    assert duet_main(["lora", "make", str(tmp_path / "wide"), "--seed", "3", "--base", "builtin-wide"]) == 0
    assert duet_main(["lora", "make", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    assert "builtin-wide" in capsys.readouterr().out
    widths = {}
    for name in ("wide", "tiny"):
        with safe_open(str(tmp_path / name / "adapter_model.safetensors"), "pt") as weights:
            widths[name] = weights.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").shape[1]
    assert widths == {"wide": 384, "tiny": 256}
    data = load_config(MULTI_MODEL_CONFIG).model_dump(exclude_unset=True)
    data["models"][1]["model"]["lora"] = {"adapters": [{"name": "wide-lora", "path": str(tmp_path / "wide")}]}
    assert parse_config(data).served()[1].model.adapter_names() == ("wide-lora",)
