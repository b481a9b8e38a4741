"""Explain why a protobuf message failed to parse, naming the field.

protobuf's parser only says "Error parsing message". The usual cause from a real client is a
``string`` field holding bytes that are not UTF-8 (proto3 requires UTF-8); walking the wire
format against the message descriptor finds which field it was.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _Truncated(Exception):
    pass


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise _Truncated
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _find_bad_field(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    """The dotted name of the first string field that is not UTF-8, else None."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _read_varint(data, pos)
            continue
        if wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            continue
        if wire_type != _LENGTH_DELIMITED:
            raise _Truncated
        length, pos = _read_varint(data, pos)
        payload, pos = data[pos : pos + length], pos + length
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        name = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _find_bad_field(field.message_type, payload, f"{name}.")
            if found:
                return found
    return None


def describe_decode_error(descriptor: Descriptor, data: bytes) -> str:
    """A client-facing reason why ``data`` is not a valid ``descriptor`` message."""
    try:
        field = _find_bad_field(descriptor, data, "")
    except _Truncated:
        field = None
    if field is not None:
        return f"{field}: is not valid UTF-8 (string fields must be UTF-8 text)"
    return f"the request is not a valid {descriptor.full_name} message"
