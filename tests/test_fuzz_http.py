"""Property-based fuzzing of the OpenAI-compatible HTTP API (router/http_server.py).

Against the shared real deployment's HTTP port (real vLLM workers behind it), over raw HTTP so
that nothing a client library would tidy up is tidied: JSON bodies of any shape, valid bodies
with one field replaced by a hostile value (both endpoints), hostile headers (Authorization,
X-Request-Id, Content-Type), chunked bodies and bodies past ``server.http_max_body_bytes``, and
raw bytes that are not HTTP at all. Every request must end within its deadline with a complete
answer (200, a completion or an event stream ending in ``[DONE]``) or a 4xx whose body is an
OpenAI error naming the problem; a 5xx would be an exception escaping the server, a timeout a
hang. After all of them both workers hold no request, router side and engine side.
"""

from __future__ import annotations

import http.client
import json
import os
import socket

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

_EXAMPLES = int(os.environ.get("DUET_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 40, derandomize=not _EXAMPLES, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=30)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=12,
)
hostile = st.one_of(
    json_values,
    st.sampled_from([-1, 0, 2**31, 2**64, 1e308, -1e308, "", "\x00", "a" * 5000, [], {}, [[]], [-1], [2**32], True]),
)
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                        "stream_options", "n", "ignore_eos", "stop_token_ids", "logprobs", "echo", "min_tokens", "request_id",
                        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "bad_words",
                        "allowed_token_ids", "prompt_logprobs", "structured_outputs", "response_format",
                        "include_stop_str_in_output", "skip_special_tokens"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                             "stream_options", "n", "ignore_eos", "max_completion_tokens", "request_id",
                             "logprobs", "top_logprobs", "response_format", "structured_outputs", "logit_bias", "min_tokens"],
}


@pytest.fixture(scope="module")
def http_port(deployment) -> int:
    return deployment.http_port


@pytest.fixture(scope="module")
def model(deployment) -> str:
    return deployment.config.model.name


def _valid(endpoint: str, model: str) -> dict:
    body = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if endpoint == "/v1/completions":
        return {**body, "prompt": "fuzz me"}
    return {**body, "messages": [{"role": "user", "content": "fuzz me"}]}


def _post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _answered(status: int, payload: bytes, context: object) -> None:
    """A complete answer, or a 4xx OpenAI error that says what is wrong."""
    assert status < 500, f"{status} {payload[:300]!r} for {context!r}"[:600]
    if status == 200:
        if payload.startswith(b"data: "):
            assert payload.rstrip().endswith(b"data: [DONE]"), f"a stream without its end for {context!r}"[:400]
            events = [json.loads(line[6:]) for line in payload.split(b"\n\n") if line.startswith(b"data: {")]
            assert events and not any("error" in event for event in events), f"{events[-1:]!r} for {context!r}"[:400]
        else:
            assert json.loads(payload)["choices"], f"no choices for {context!r}"
        return
    error = json.loads(payload)["error"]
    assert error["message"] and error["type"], f"an error without a message: {payload!r}"


@FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), body=json_values)
def test_json_bodies_of_any_shape(http_port, endpoint, body):
    status, payload = _post(http_port, endpoint, json.dumps(body).encode())
    _answered(status, payload, body)
    assert status != 200 or isinstance(body, dict)


@FUZZ
@given(field=st.sampled_from([(endpoint, name) for endpoint in ENDPOINTS for name in FIELDS[endpoint]]), value=hostile)
@example(field=("/v1/completions", "max_tokens"), value=2**64)  # past int64: was a 500 from protobuf
@example(field=("/v1/chat/completions", "temperature"), value=2**31)  # past vLLM's [0, 2]: was a 503 from the engine
def test_valid_bodies_with_one_hostile_field(http_port, model, field, value):
    endpoint, name = field
    body = {**_valid(endpoint, model), name: value}
    status, payload = _post(http_port, endpoint, json.dumps(body).encode())
    _answered(status, payload, body)


header_values = st.one_of(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60),
                          st.sampled_from(["Bearer", "Bearer ", "Basic abc", "x" * 8000, "bearer key"]))


@FUZZ
@given(authorization=st.one_of(st.none(), header_values), request_id=st.one_of(st.none(), header_values),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_hostile_headers(http_port, model, authorization, request_id, content_type):
    headers = {"Content-Type": content_type}
    if authorization is not None:
        headers["Authorization"] = authorization
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    status, payload = _post(http_port, "/v1/completions", json.dumps(_valid("/v1/completions", model)).encode(), headers)
    _answered(status, payload, headers)


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; what came back before the server closed or 10 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except TimeoutError:
            pytest.fail(f"the server neither answered nor closed within 10 s for {data[:80]!r}")
        return received


@FUZZ
@given(data=st.binary(max_size=300))
def test_bytes_that_are_not_http(http_port, data):
    answer = _raw(http_port, data)
    assert not answer or answer.startswith(b"HTTP/1.") and not answer[9:10] == b"5", answer[:200]


def test_chunked_bodies_are_read_and_limited(http_port, model, deployment):
    def chunked(body: bytes) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        try:
            parts = (body[i:i + 65536] for i in range(0, len(body), 65536))
            connection.request("POST", "/v1/completions", body=parts, encode_chunked=True,
                               headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()

    assert chunked(json.dumps(_valid("/v1/completions", model)).encode()) == 200
    big = b'{"prompt": "' + b"a" * deployment.config.server.http_max_body_bytes + b'"}'
    assert chunked(big) == 413
    status, payload = _post(http_port, "/v1/completions", big)  # the same with a Content-Length
    assert status == 413 and json.loads(payload)["error"]["message"]


def test_the_fuzzed_requests_left_nothing_behind(client, wait_until_idle):
    """After every input above: no request held by either worker (router side and engine side),
    and the server still answering."""
    wait_until_idle("prefill")
    wait_until_idle("decode")
    assert client.status().pools
