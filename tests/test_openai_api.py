"""The OpenAI-compatible HTTP API, exercised with the unmodified ``openai`` SDK and raw HTTP.

Same deployment as the gRPC tests: the HTTP front end runs on the same RequestService, so the
same greedy request must give the same tokens through either API.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import pytest

from duet.router.client import build_request

PROMPT = "The router sends the prompt to a prefill worker"
KV_USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def sdk(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(deployment) -> str:
    return deployment.config.model.name


def _grpc(client, **kwargs) -> tuple[list[int], str]:
    text = ""
    ids: list[int] = []
    for message in client.generate(build_request(**kwargs), timeout=120):
        ids += message.token_ids
        text += message.text
    return ids, text


def _chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_completion_matches_grpc(sdk, model, client):
    ids, text = _grpc(client, prompt=PROMPT, max_tokens=12, ignore_eos=True)
    reply = sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == ids
    assert reply.usage.completion_tokens == 12 and reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_streamed_completion_matches_grpc_and_reports_usage(sdk, model, client):
    ids, text = _grpc(client, prompt=PROMPT, max_tokens=10, ignore_eos=True)
    chunks = list(sdk.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
    ))
    streamed = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in streamed) == text
    assert [i for chunk in streamed for i in chunk.choices[0].model_extra["token_ids"]] == ids
    assert streamed[-1].choices[0].finish_reason == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert all(chunk.usage is None for chunk in streamed)


def test_chat_uses_the_chat_template_and_matches_grpc(sdk, model, client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Where does KV go?"}]
    ids, text = _grpc(client, prompt_token_ids=_chat_prompt_ids(tokenizer, messages), max_tokens=9, ignore_eos=True)
    reply = sdk.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(_chat_prompt_ids(tokenizer, messages))

    stream = sdk.chat.completions.create(
        model=model, messages=messages, max_tokens=9, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_health(sdk, model, deployment):
    assert [m.id for m in sdk.models.list().data] == [model]
    status, _ = _request(deployment.http_port, "GET", "/health")
    assert status == 200


def _wait_for_grpc_health(client, serving: bool) -> None:
    deadline = time.monotonic() + 5
    while client.is_serving() != serving:
        assert time.monotonic() < deadline, f"grpc.health.v1 did not turn {'SERVING' if serving else 'NOT_SERVING'}"
        time.sleep(0.1)


def test_no_ready_worker_is_503(sdk, model, deployment, client):
    """With no decode worker ready (none restarting either), health and requests say so: HTTP
    503, and the gRPC health service NOT_SERVING until a worker is ready again."""
    members = deployment.decode.members
    saved = [member.state for member in members]
    try:
        for member in members:
            member.state = "failed"
        status, body = _request(deployment.http_port, "GET", "/health")
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        with pytest.raises(openai.InternalServerError) as raised:
            sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert raised.value.status_code == 503 and "no decode worker" in raised.value.message
        _wait_for_grpc_health(client, serving=False)
    finally:
        for member, state in zip(members, saved):
            member.state = state
    _wait_for_grpc_health(client, serving=True)


def test_overload_is_429_with_retry_after(sdk, model, deployment):
    service = deployment.service
    limit = service.max_inflight
    service.max_inflight = 1
    try:
        with sdk.completions.with_streaming_response.create(
            model=model, prompt=PROMPT, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        ) as running:
            # Admitted and streaming. The line iterator must stay referenced: dropped, it closes
            # the connection, and the server cancels the request.
            lines = running.iter_lines()
            next(lines)
            with pytest.raises(openai.RateLimitError) as raised:
                sdk.with_options(max_retries=0).completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert raised.value.response.headers["Retry-After"] == "1"
        assert raised.value.body["code"] == "overloaded"
    finally:
        service.max_inflight = limit


def test_client_disconnect_aborts_the_request(deployment, client, wait_until_idle, worker_status):
    """A client that goes away mid-stream frees the request on both workers."""
    wait_until_idle("decode")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", deployment.http_port), timeout=30) as raw:
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        received = b""
        while received.count(b"data: ") < 5:  # streaming: several chunks in
            received += raw.recv(65536)
    assert b"200 OK" in received
    wait_until_idle("decode")
    wait_until_idle("prefill")
    # The decode worker held the request's KV (pulled from prefill before it streamed). vLLM's
    # usage gauge is computed at each engine step and an abort is not one, so one short request
    # runs a step first: after it, nothing may be left held.
    ids, _ = client.generate_ids(build_request(prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True), timeout=60)
    assert len(ids) == 2
    assert wait_until_idle("decode").engine_metrics.get(KV_USAGE, 0.0) == 0.0


# ---- bad input ---------------------------------------------------------------------------


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        data = reply.read()
        return reply.status, (json.loads(data) if data else None)
    finally:
        connection.close()


def _completion(**fields) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": 4, **fields}).encode()


BAD_BODIES = [
    ("malformed JSON", b'{"prompt": "x", "max_tokens": ', "body"),
    ("not an object", b'["prompt"]', "body"),
    ("invalid UTF-8", b'{"prompt": "caf\xc3\x28", "max_tokens": 4}', "body"),
    ("wrong type", _completion(max_tokens="four"), "max_tokens"),
    ("wrong type in a list", _completion(stop=["ok", 7]), "stop.1"),
    ("unknown field", _completion(maximum_tokens=4), "maximum_tokens"),
    ("missing prompt", json.dumps({"max_tokens": 4}).encode(), "prompt"),
    ("out of range", _completion(temperature=-1), "temperature"),
    ("too long for the model", _completion(max_tokens=10**6), "max_tokens"),
    ("unsupported feature", _completion(use_beam_search=True), "use_beam_search"),
]


@pytest.mark.parametrize("case, body, field", BAD_BODIES, ids=[case[0] for case in BAD_BODIES])
def test_bad_input_is_400_naming_the_field(deployment, case, body, field):
    status, reply = _request(deployment.http_port, "POST", "/v1/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}:")
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_404_as_vllm_answers_it(deployment):
    status, reply = _request(deployment.http_port, "POST", "/v1/completions", _completion(model="gpt-9"))
    assert status == 404, reply
    assert reply["error"] == {
        "message": "The model `gpt-9` does not exist. Valid aliases: duet-tiny-llama.", "type": "NotFoundError",
        "param": "model", "code": 404,
    }


def test_bad_chat_input_names_the_field(deployment):
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    status, reply = _request(deployment.http_port, "POST", "/v1/chat/completions", body.encode())
    assert status == 400 and reply["error"]["param"].startswith("messages.0.content.0")


def test_oversized_body_is_413(deployment):
    body = _completion(prompt="word " * (deployment.config.server.http_max_body_bytes // 4))
    try:
        status, reply = _request(deployment.http_port, "POST", "/v1/completions", body)
    except (BrokenPipeError, ConnectionResetError):
        pytest.fail("the server dropped the connection instead of answering 413")
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_unknown_path_is_json_404(deployment):
    status, reply = _request(deployment.http_port, "POST", "/v1/embeddings", b"{}")
    assert status == 404 and "error" in reply


def test_bad_input_never_reaches_a_worker_and_the_server_keeps_serving(sdk, model, deployment, worker_status):
    before = {role: worker_status(role) for role in ("prefill", "decode")}
    for _, body, _ in BAD_BODIES:
        _request(deployment.http_port, "POST", "/v1/completions", body)
    for role, earlier in before.items():
        now = worker_status(role)
        assert now.requests_served == earlier.requests_served and now.requests_inflight == 0
        assert now.engine_metrics.get(KV_USAGE, 0.0) == earlier.engine_metrics.get(KV_USAGE, 0.0)
    reply = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    assert deployment.cluster.outcomes["invalid"] >= len(BAD_BODIES)
