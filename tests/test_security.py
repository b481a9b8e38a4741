"""TLS, mutual TLS, API keys and per-key quotas on both front ends, with real clients.

Each secured pair of front ends (gRPC and HTTP) is started on the session deployment's serving
path with its own keys and TLS settings: the same servers ``duet serve`` starts, without
starting engines again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
import yaml

from duet.config import AuthConfig, BatchesConfig, ConfigError, ServerConfig, TlsConfig
from duet.router.auth import Gatekeeper, QuotaExceeded
from duet.router.client import DuetClient, build_request
from duet.router.admin import AdminServicer
from duet.router.front_ends import FrontEnds, check_exposure
from certs import make_certificates

ALICE = "alice-key-7f3a9c2e"  # two requests per minute
BOB = "bob-key-d41b66f0"  # one request at a time
ROOT = "root-key-5c0ffee1"  # may call the Admin service
CAROL = "carol-key-0a11ce55"  # may use one LoRA adapter only, not the base model
DAVE = "dave-key-9e1d77a4"  # one request a minute to the base model, unlimited overall
PROMPT = "The router sends the prompt to a prefill worker"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"name": "alice", "key": ALICE, "requests_per_minute": 2},
        {"name": "bob", "key": BOB, "max_concurrent_requests": 1},
        {"name": "root", "key": ROOT, "admin": True},
        {"name": "carol", "key": CAROL, "models": ["support-lora"]},
        {"name": "dave", "key": DAVE, "model_quotas": {"duet-tiny-llama": {"requests_per_minute": 1}}},
    ]}))
    return str(path)


def _front_ends(deployment, server: ServerConfig):
    """Start a gRPC + HTTP pair (and the Admin service) on ``deployment``'s serving path with
    ``server``'s security."""
    service = dataclasses.replace(deployment.service, gatekeeper=Gatekeeper.from_config(server.auth, environ={}))
    return deployment.background.run(FrontEnds.start(service, server, 0, 0, admin=AdminServicer(service, deployment)), timeout=30)


@pytest.fixture(scope="module")
def tls_pair(deployment, certs, keys_file, tmp_path_factory):
    """TLS with API keys (server certificate only)."""
    server = ServerConfig(
        tls=TlsConfig(cert_file=certs.server_cert, key_file=certs.server_key), auth=AuthConfig(api_keys_file=keys_file),
        batches=BatchesConfig(directory=str(tmp_path_factory.mktemp("batches"))),
    )
    pair = _front_ends(deployment, server)
    yield pair
    deployment.background.run(pair.stop(), timeout=30)


@pytest.fixture(scope="module")
def mtls_pair(deployment, certs):
    """Mutual TLS, no keys: the client certificate is the credential."""
    tls = TlsConfig(cert_file=certs.server_cert, key_file=certs.server_key, client_ca_file=certs.ca)
    pair = _front_ends(deployment, ServerConfig(tls=tls))
    yield pair
    deployment.background.run(pair.stop(), timeout=30)


def _grpc_client(pair, certs, key=None, client_cert=True) -> DuetClient:
    return DuetClient(
        f"localhost:{pair.grpc_port}",
        api_key=key,
        tls_ca=certs.ca,
        tls_cert=certs.client_cert if client_cert else None,
        tls_key=certs.client_key if client_cert else None,
    )


def _sdk(pair, certs, key="none", client_cert=False) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=certs.ca)
    if client_cert:
        verify.load_cert_chain(certs.client_cert, certs.client_key)
    return openai.OpenAI(
        base_url=f"https://localhost:{pair.http_port}/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.Client(verify=verify),
    )


def _generate(client: DuetClient, max_tokens: int = 3) -> list[int]:
    ids, _ = client.generate_ids(build_request(PROMPT, max_tokens=max_tokens, ignore_eos=True), timeout=60)
    return ids


# ---- TLS ---------------------------------------------------------------------------------


def test_tls_serves_both_apis(tls_pair, certs, client):
    expected = _generate(client, 6)
    with _grpc_client(tls_pair, certs, key=BOB, client_cert=False) as secure:
        assert _generate(secure, 6) == expected
    reply = _sdk(tls_pair, certs, key=BOB).completions.create(
        model="duet-tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == expected


def test_plaintext_client_cannot_talk_to_tls_port(tls_pair):
    with DuetClient(f"127.0.0.1:{tls_pair.grpc_port}", api_key=BOB) as plain:
        with pytest.raises(grpc.RpcError) as raised:
            plain.status(timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_pair.http_port}/health", timeout=5)


def test_mutual_tls_refuses_a_client_without_certificate(mtls_pair, certs):
    with _grpc_client(mtls_pair, certs, client_cert=False) as anonymous:
        with pytest.raises(grpc.RpcError) as raised:
            anonymous.status(timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIConnectionError):
        _sdk(mtls_pair, certs, client_cert=False).models.list()


def test_mutual_tls_serves_a_client_with_certificate(mtls_pair, certs, client):
    with _grpc_client(mtls_pair, certs, client_cert=True) as trusted:
        assert _generate(trusted) == _generate(client)
    assert [m.id for m in _sdk(mtls_pair, certs, client_cert=True).models.list().data] == ["duet-tiny-llama"]


# ---- API keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "wrong-key-123456"], ids=["missing", "wrong"])
def test_requests_without_a_valid_key_are_refused_on_both_apis(tls_pair, certs, key, caplog):
    caplog.set_level(logging.DEBUG)
    with _grpc_client(tls_pair, certs, key=key, client_cert=False) as client:
        for call in (lambda: _generate(client), lambda: client.status()):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    if key is None:  # the SDK always sends a key: a plain HTTP client sends none
        https = httpx.Client(verify=ssl.create_default_context(cafile=certs.ca), base_url=f"https://localhost:{tls_pair.http_port}")
        replies = [https.get("/v1/models"), https.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})]
        assert [reply.status_code for reply in replies] == [401, 401]
        assert replies[0].json()["error"]["code"] == "invalid_api_key"
    else:
        sdk = _sdk(tls_pair, certs, key=key)
        for call in (lambda: sdk.models.list(), lambda: sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)):
            with pytest.raises(openai.AuthenticationError) as raised:
                call()
            assert raised.value.status_code == 401
    if key:
        assert key not in caplog.text and key not in str(raised.value)


def test_health_needs_no_key(tls_pair, certs):
    reply = httpx.get(f"https://localhost:{tls_pair.http_port}/health", verify=ssl.create_default_context(cafile=certs.ca))
    assert reply.status_code == 200
    with _grpc_client(tls_pair, certs, client_cert=False) as client:
        assert client.is_serving()


def test_a_caller_is_known_by_its_key_name_only(keys_file):
    caller = Gatekeeper.from_config(AuthConfig(api_keys_file=keys_file), environ={}).authenticate(ALICE)
    assert caller.name == "alice" and ALICE not in repr(vars(caller))


def test_only_admin_keys_may_operate_the_pools(tls_pair, certs):
    with _grpc_client(tls_pair, certs, key=BOB, client_cert=False) as user:
        with pytest.raises(grpc.RpcError) as raised:
            user.scale("decode", 1)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'bob'" in raised.value.details()
    with _grpc_client(tls_pair, certs, key=None, client_cert=False) as anonymous:
        with pytest.raises(grpc.RpcError) as raised:
            anonymous.list_workers()
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _grpc_client(tls_pair, certs, key=ROOT, client_cert=False) as admin:
        assert [pool.role for pool in admin.list_workers().pools] == ["prefill", "decode"]
        assert admin.scale("decode", 1) == []  # already one: nothing to change


# ---- quotas ------------------------------------------------------------------------------


def test_rate_quota_is_shared_across_apis(tls_pair, certs):
    """alice may send two requests a minute: one over gRPC, one over HTTP, the third is refused."""
    with _grpc_client(tls_pair, certs, key=ALICE, client_cert=False) as client:
        assert len(_generate(client)) == 3
        sdk = _sdk(tls_pair, certs, key=ALICE)
        sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as http_refusal:
            sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
        with pytest.raises(grpc.RpcError) as grpc_refusal:
            _generate(client)
    retry_after = int(http_refusal.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 30 and http_refusal.value.body["code"] == "rate_limit_exceeded"
    assert grpc_refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit" in grpc_refusal.value.details()
    assert 1 <= int(dict(grpc_refusal.value.trailing_metadata())["retry-after"]) <= 30


def test_concurrency_quota_on_both_apis(tls_pair, certs):
    """bob may have one request in flight: a second one, over either API, is refused until it ends."""
    with _grpc_client(tls_pair, certs, key=BOB, client_cert=False) as client:
        long_stream = client.generate(build_request(PROMPT, max_tokens=2000, ignore_eos=True), timeout=120)
        next(long_stream)  # admitted and streaming
        sdk = _sdk(tls_pair, certs, key=BOB)
        with pytest.raises(openai.RateLimitError) as http_refusal:
            sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
        with pytest.raises(grpc.RpcError) as grpc_refusal:
            _generate(client)
        long_stream.cancel()
        assert "requests in flight" in http_refusal.value.message
        assert grpc_refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Once the long request has ended, bob's slot is free again.
        deadline = time.monotonic() + 10
        while True:
            try:
                sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "bob's slot was not released after his request ended"
                time.sleep(0.1)


def test_a_key_limited_to_some_models_is_refused_the_others_and_sees_only_its_own(tls_pair, certs):
    """carol may use the adapter ``support-lora`` only: the base model is refused over both APIs
    before any worker is touched (403 / PERMISSION_DENIED, naming what she may use), and
    ``/v1/models`` lists nothing else to her; the other keys see the model."""
    sdk = _sdk(tls_pair, certs, key=CAROL)
    with pytest.raises(openai.PermissionDeniedError) as http_refusal:
        sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
    assert "may not use model 'duet-tiny-llama'" in http_refusal.value.message and "support-lora" in http_refusal.value.message
    with _grpc_client(tls_pair, certs, key=CAROL, client_cert=False) as client:
        with pytest.raises(grpc.RpcError) as grpc_refusal:
            _generate(client)
    assert grpc_refusal.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [model.id for model in sdk.models.list()] == []
    assert [model.id for model in _sdk(tls_pair, certs, key=ROOT).models.list()] == ["duet-tiny-llama"]


def test_a_keys_files_and_batch_jobs_are_its_own(tls_pair, certs):
    """A file and a job belong to the key that made them: another key, an admin key included,
    gets 404 for them and lists none of them; without a key, 401."""
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "duet-tiny-llama", "prompt": "x", "max_tokens": 1}}\n'
    # root (unlimited) owns the job, so that it runs without touching the others' quotas.
    root, others = _sdk(tls_pair, certs, key=ROOT), [_sdk(tls_pair, certs, key=key) for key in (ALICE, BOB)]
    uploaded = root.files.create(file=("job.jsonl", line), purpose="batch")
    batch = root.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert root.batches.retrieve(batch.id).id == batch.id and root.files.retrieve(uploaded.id).id == uploaded.id
    alices = others[0].files.create(file=("mine.jsonl", line), purpose="batch")
    with pytest.raises(openai.NotFoundError):  # an admin key is no exception
        root.files.retrieve(alices.id)
    for other in others:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert batch.id not in [b.id for b in other.batches.list().data]
        assert uploaded.id not in [f.id for f in other.files.list().data]
    with pytest.raises(openai.AuthenticationError):
        _sdk(tls_pair, certs, key="not-a-key").batches.list()


def test_a_quota_for_one_model_refuses_that_model_over_both_apis(tls_pair, certs):
    """dave may send one request a minute to ``duet-tiny-llama``: the second, over either API,
    is refused naming the model's quota."""
    sdk = _sdk(tls_pair, certs, key=DAVE)
    sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as http_refusal:
        sdk.completions.create(model="duet-tiny-llama", prompt=PROMPT, max_tokens=2)
    assert "for model 'duet-tiny-llama'" in http_refusal.value.message
    with _grpc_client(tls_pair, certs, key=DAVE, client_cert=False) as client:
        with pytest.raises(grpc.RpcError) as grpc_refusal:
            _generate(client)
    assert grpc_refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_only_admin_keys_may_load_lora_adapters(tls_pair, certs):
    """vLLM's adapter endpoints are admin calls: bob's key is refused (403) before the body is
    read; root's reaches the deployment, whose config has no LoRA (400 saying how to turn it on)."""
    for key, status, words in ((BOB, 403, "not an admin key"), (ROOT, 400, "set model.lora")):
        reply = httpx.post(
            f"https://localhost:{tls_pair.http_port}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"},
            headers={"Authorization": f"Bearer {key}"}, verify=ssl.create_default_context(cafile=certs.ca), timeout=30,
        )
        assert reply.status_code == status and words in reply.json()["error"]["message"], reply.text


# ---- configuration -----------------------------------------------------------------------


def test_keys_file_errors_name_the_field(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"name": "x", "key": "short", "requests_per_minute": -1}]}))
    with pytest.raises(ConfigError) as raised:
        Gatekeeper.from_config(AuthConfig(api_keys_file=str(path)), environ={})
    message = str(raised.value)
    assert "keys.0.key" in message and "keys.0.requests_per_minute" in message and "short" not in message


def test_keys_from_the_environment():
    gatekeeper = Gatekeeper.from_config(
        AuthConfig(max_concurrent_requests=3), environ={"DUET_API_KEYS": "ci:ci-secret-1234, plain-secret-5678"}
    )
    assert gatekeeper.authenticate("ci-secret-1234").name == "ci"
    assert gatekeeper.authenticate("plain-secret-5678").max_concurrent_requests == 3


def test_a_model_quota_counts_on_top_of_the_keys_own(tmp_path):
    """A request counts against the key's quota and its model's; a refusal by either takes
    nothing from the other, and other models draw on the key's quota alone."""
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{
        "name": "tenant", "key": "tenant-secret-1", "requests_per_minute": 3, "max_concurrent_requests": 3,
        "model_quotas": {"big": {"max_concurrent_requests": 1}, "rare": {"requests_per_minute": 1}},
    }]}))
    caller = Gatekeeper.from_config(AuthConfig(api_keys_file=str(path)), environ={}).authenticate("tenant-secret-1")
    caller.acquire("big")
    with pytest.raises(QuotaExceeded, match="for model 'big' has 1 requests in flight"):
        caller.acquire("big")
    assert caller.inflight == 1  # the refused request took no slot of the key's
    caller.acquire("rare")
    with pytest.raises(QuotaExceeded, match="for model 'rare' is over its rate limit"):
        caller.acquire("rare")
    caller.acquire("small")  # the key's third request a minute: the refusal above refunded its token
    with pytest.raises(QuotaExceeded, match="API key 'tenant' (has 3|is over)"):
        caller.acquire("small")
    caller.release("big")
    with pytest.raises(QuotaExceeded, match="API key 'tenant' is over its rate limit"):
        caller.acquire("big")  # a slot for big again, but the key's rate is spent
    assert caller.model_quotas["big"].inflight == 0 and caller.inflight == 2


def test_public_address_without_keys_needs_the_explicit_flag(certs):
    no_keys = Gatekeeper([])
    assert check_exposure(ServerConfig(host="127.0.0.1"), no_keys) is None
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        check_exposure(ServerConfig(host="0.0.0.0"), no_keys)
    warning = check_exposure(ServerConfig(host="0.0.0.0", allow_unauthenticated=True), no_keys)
    assert warning and "WITHOUT authentication" in warning
    with_keys = Gatekeeper.from_config(AuthConfig(), environ={"DUET_API_KEYS": "some-secret-key"})
    assert check_exposure(ServerConfig(host="0.0.0.0"), with_keys) is None
    mutual_tls = TlsConfig(cert_file=certs.server_cert, key_file=certs.server_key, client_ca_file=certs.ca)
    assert check_exposure(ServerConfig(host="0.0.0.0", tls=mutual_tls), no_keys) is None


def test_serve_on_a_public_address_without_keys_fails_fast():
    """`duet serve --host 0.0.0.0` refuses in seconds, before any engine starts."""
    finished = subprocess.run(
        [sys.executable, "-m", "duet.cli", "serve", "--host", "0.0.0.0", "--port", "0", "--http-port", "0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120,
        env={name: value for name, value in os.environ.items() if name != "DUET_API_KEYS"},
    )
    assert finished.returncode == 2
    assert "--allow-unauthenticated" in finished.stderr and "Traceback" not in finished.stderr
