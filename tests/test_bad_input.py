"""Bad input gets INVALID_ARGUMENT naming the field; the server keeps serving afterwards."""

from __future__ import annotations

import grpc
import pytest

from duet.router.client import build_request
from duet.router.proto import duet_api_pb2 as pb

CASES = {
    "empty prompt": (dict(prompt=""), "prompt"),
    "no prompt at all": (dict(), "prompt"),
    "empty token ids": (dict(prompt_token_ids=[]), "prompt_token_ids"),
    "token id outside vocabulary": (dict(prompt_token_ids=[1, 10_000_000]), "prompt_token_ids"),
    "max_tokens zero": (dict(prompt="hi", max_tokens=0), "max_tokens"),
    "max_tokens negative": (dict(prompt="hi", max_tokens=-5), "max_tokens"),
    "max_tokens over the model limit": (dict(prompt="hi", max_tokens=100_000), "max_tokens"),
    "prompt longer than the context": (dict(prompt_token_ids=[5] * 5000), "prompt_token_ids"),
    "text prompt longer than the context": (dict(prompt="a " * 5000), "prompt"),
    "unknown model": (dict(prompt="hi", model="gpt-17"), "model"),
    "negative temperature": (dict(prompt="hi", temperature=-0.5), "sampling.temperature"),
    "top_p zero": (dict(prompt="hi", top_p=0.0), "sampling.top_p"),
    "resumed with nothing left": (dict(prompt="hi", max_tokens=3, resume_after=[5, 6, 7]), "resume_after"),
    "resumed token outside vocabulary": (dict(prompt="hi", resume_after=[10_000_000]), "resume_after"),
}


def _request(kwargs: dict) -> pb.GenerateRequest:
    kwargs = dict(kwargs)
    kwargs.setdefault("max_tokens", 4)
    return build_request(kwargs.pop("prompt", None), **kwargs)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_request_is_invalid_argument_naming_the_field(client, case):
    kwargs, field = CASES[case]
    with pytest.raises(grpc.RpcError) as raised:
        list(client.generate(_request(kwargs), timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"{field}:"), raised.value.details()


def _raw_generate(deployment, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        call = channel.unary_stream(
            "/duet.v1.Duet/Generate", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as raised:
            list(call(payload, timeout=30))
    return raised.value


def test_invalid_utf8_prompt_names_the_field(deployment):
    # field 2 (prompt), length-delimited, two bytes that are not UTF-8; field 4 (max_tokens) = 4
    error = _raw_generate(deployment, b"\x12\x02\xff\xfe\x20\x04")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("prompt:") and "UTF-8" in error.details()


def test_invalid_utf8_in_nested_stop_string_names_the_field(deployment):
    # field 6 (stop conditions) holding field 1 (stop) = b"\xc3"
    error = _raw_generate(deployment, b"\x12\x02hi\x32\x03\x0a\x01\xc3")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("stop.stop:")


def test_garbage_bytes_are_invalid_argument(deployment):
    error = _raw_generate(deployment, b"\xff\xff\xff\xff")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_server_still_serves_after_bad_requests(client):
    for kwargs, _ in CASES.values():
        with pytest.raises(grpc.RpcError):
            list(client.generate(_request(kwargs), timeout=30))
    ids, last = client.generate_ids(build_request("fine", max_tokens=3, ignore_eos=True), timeout=60)
    assert len(ids) == 3 and last.finish_reason == pb.FINISH_REASON_LENGTH
