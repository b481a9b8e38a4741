"""Parse-failure explanations name the field that is not UTF-8."""

from __future__ import annotations

from duet.router.proto import duet_api_pb2 as pb
from duet.router.wire import describe_decode_error

DESCRIPTOR = pb.GenerateRequest.DESCRIPTOR


def test_names_top_level_string_field():
    assert describe_decode_error(DESCRIPTOR, b"\x0a\x01\xff").startswith("model:")


def test_names_nested_repeated_string_field():
    payload = b"\x20\x04" + b"\x32\x05" + b"\x0a\x03ok\xe2"
    assert describe_decode_error(DESCRIPTOR, payload).startswith("stop.stop:")


def test_truncated_message_gets_a_generic_reason():
    assert describe_decode_error(DESCRIPTOR, b"\x12\x09abc") == "the request is not a valid duet.v1.GenerateRequest message"
