"""Property-based fuzzing of duet's gRPC services: ``Generate``, ``GetStatus`` and Admin.

Against the shared real deployment (real vLLM prefill and decode workers, the real gRPC server,
over loopback): well-formed requests with hostile values in every field (token ids past the
vocabulary and at the uint32 limit, NaN and infinite sampling values, extreme integers,
control characters and odd Unicode in strings) and raw bytes that are not a request at all.
Every call must end within its deadline with either a complete answer or a status that names
the problem: ``INVALID_ARGUMENT`` (or ``RESOURCE_EXHAUSTED``, backpressure). ``UNKNOWN`` or
``INTERNAL`` would be an exception escaping the server (a traceback), and a timeout a hang.
After each batch both workers hold no request, router side and engine side: nothing left behind.
Raw bytes that are not a protobuf message are refused by every method (Duet and Admin) with
INVALID_ARGUMENT naming where the message broke (duet parses requests itself,
router/server.py ``add_parsing_handlers``). The Admin service gets hostile roles, counts, worker
names and timeouts that must be refused or change nothing.
"""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from duet.router.client import build_request
from duet.router.proto import duet_api_pb2 as pb
from duet.router.proto import duet_api_pb2_grpc as pb_grpc

_EXAMPLES = int(os.environ.get("DUET_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 40, derandomize=not _EXAMPLES, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ANSWERED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UINT32, INT32 = 2**32 - 1, 2**31 - 1

hostile_text = st.one_of(
    st.text(max_size=40), st.sampled_from(["", "\x00", "\ud7ff\ufffd", "a" * 5000, "<|endoftext|>", "{{ 1/0 }}"])
)
token_ids = st.lists(st.one_of(st.integers(3, 700), st.integers(0, UINT32)), max_size=24)
floats32 = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, -1.0, 1e-45]))


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    kind = draw(st.sampled_from(["text", "ids", "none"]))
    return build_request(
        draw(hostile_text) if kind == "text" else None,
        prompt_token_ids=draw(token_ids) if kind == "ids" else None,
        # Valid lengths are kept short so that the batches take seconds, not minutes.
        max_tokens=draw(st.sampled_from([-(2**31), -1, 0, 1, 2, 5, INT32])),
        temperature=draw(floats32),
        top_p=draw(st.one_of(st.none(), floats32)),
        top_k=draw(st.one_of(st.integers(-(2**31), INT32), st.sampled_from([0, -1, 1, 50]))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        stop=draw(st.lists(hostile_text, max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(0, UINT32), max_size=3)),
        ignore_eos=draw(st.booleans()),
        model=draw(st.one_of(st.just(""), hostile_text)),
        request_id=draw(st.one_of(st.just(""), hostile_text)),
        resume_after=draw(st.lists(st.one_of(st.integers(3, 700), st.integers(0, UINT32)), max_size=4)),
        n=draw(st.sampled_from([-(2**31), -1, 0, 1, 2, 3, INT32])),
        logprobs=draw(st.one_of(st.none(), st.sampled_from([-1, 0, 2, 20, 21, INT32]))),
        prompt_logprobs=draw(st.one_of(st.none(), st.sampled_from([-1, 0, 1, 21]))),
        presence_penalty=draw(st.one_of(st.none(), floats32)),
        frequency_penalty=draw(st.one_of(st.none(), floats32)),
        repetition_penalty=draw(st.one_of(st.none(), floats32)),
        min_p=draw(st.one_of(st.none(), floats32)),
        min_tokens=draw(st.sampled_from([-(2**31), -1, 0, 1, 3, INT32])),
        logit_bias=draw(st.dictionaries(st.one_of(st.integers(3, 700), st.integers(0, UINT32)), floats32, max_size=3)),
        bad_words=draw(st.lists(hostile_text, max_size=2)),
        allowed_token_ids=draw(st.lists(st.one_of(st.integers(3, 700), st.integers(0, UINT32)), max_size=3)),
        structured_output=draw(st.one_of(
            st.none(),
            st.builds(lambda text: pb.StructuredOutput(regex=text), hostile_text),
            st.builds(lambda text: pb.StructuredOutput(json_schema=text), hostile_text),
            st.builds(lambda text: pb.StructuredOutput(grammar=text), hostile_text),
            st.builds(lambda texts: pb.StructuredOutput(choice=pb.Choices(choices=texts)), st.lists(hostile_text, max_size=3)),
            st.just(pb.StructuredOutput(json_object=True)),
            st.just(pb.StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}')),
        )),
    )


def _ends_well(client, request: pb.GenerateRequest) -> None:
    try:
        messages = list(client.generate(request, timeout=60))
    except grpc.RpcError as error:
        assert error.code() in ANSWERED, f"{error.code()}: {error.details()} for {request}"
        assert error.details(), "a refusal must say why"
        return
    finished = {m.index for m in messages if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert finished == set(range(max(request.n, 1))), f"a sequence without its final message for {request}"
    for index in finished:
        tokens = sum(len(m.token_ids) for m in messages if m.index == index)
        assert tokens <= request.max_tokens - len(request.resume_after.ids)


@FUZZ
@given(batch=st.lists(requests(), min_size=1, max_size=4))
# Past vLLM's [0, 2]: the engine refused it and the caller got UNAVAILABLE (found by `duet bench fuzz`).
@example(batch=[build_request("fuzz", max_tokens=2, temperature=2.5)])
def test_generate_with_hostile_values(client, wait_until_idle, batch):
    for request in batch:
        _ends_well(client, request)
    wait_until_idle("prefill")
    wait_until_idle("decode")


@pytest.fixture(scope="module")
def target(deployment) -> str:
    return f"127.0.0.1:{deployment.port}"


def _pools(client) -> list[tuple[str, str]]:
    """Every worker's (name, state): what the Admin calls below must leave as it was."""
    return sorted((w.name, w.state) for pool in client.status().pools for w in pool.workers)


@pytest.fixture(scope="module")
def pools_before(client) -> list[tuple[str, str]]:
    """The pools before the Admin and raw-byte fuzzing (compared after each Admin example, and
    once after all)."""
    return _pools(client)


# Valid roles and workers with counts and timeouts that must change nothing on the shared
# deployment (one worker per pool, every core taken): fewer than one worker is refused, one
# is what it has, a million does not fit, and the last worker of a pool is never drained.
roles = st.one_of(hostile_text, st.sampled_from(["prefill", "decode", "colocated", "PREFILL", " decode"]))
replicas = st.one_of(st.integers(-(2**31), 0), st.sampled_from([1, 10**6, INT32]))
workers = st.one_of(hostile_text, st.sampled_from(["prefill-0", "decode-0", "decode-9", "decode-0 "]))
timeouts = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@FUZZ
@given(role=roles, count=replicas, worker=workers, timeout=timeouts)
def test_admin_with_hostile_values(admin, client, pools_before, role, count, worker, timeout):
    calls = (
        lambda: admin.ScalePool(pb.ScalePoolRequest(role=role, replicas=count), timeout=30),
        lambda: admin.DrainWorker(pb.DrainWorkerRequest(worker=worker, timeout_s=timeout), timeout=30),
    )
    for call in calls:
        try:
            call()
        except grpc.RpcError as error:
            assert error.code() in ANSWERED, f"{error.code()}: {error.details()} ({role!r}, {count}, {worker!r}, {timeout})"
            assert error.details(), "a refusal must say why"
    assert _pools(client) == pools_before, f"changed by ({role!r}, {count}, {worker!r}, {timeout})"


@pytest.fixture(scope="module")
def admin(target):
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.AdminStub(channel)


METHODS = [
    ("/duet.v1.Duet/Generate", True), ("/duet.v1.Duet/GetStatus", False), ("/duet.v1.Admin/ScalePool", False),
    ("/duet.v1.Admin/DrainWorker", False), ("/duet.v1.Admin/ListWorkers", False),
]


@FUZZ
@given(raw=st.binary(max_size=200))
def test_every_method_with_raw_bytes(target, pools_before, raw):
    with grpc.insecure_channel(target) as channel:
        for method, streaming in METHODS:
            call = (channel.unary_stream if streaming else channel.unary_unary)(
                method, request_serializer=lambda data: data, response_deserializer=lambda data: data
            )
            try:
                answer = call(raw, timeout=60)
                if streaming:
                    list(answer)
            except grpc.RpcError as error:
                assert error.code() in ANSWERED, f"{method}: {error.code()}: {error.details()}"
                assert error.details(), "a refusal must say why"


def test_bytes_that_are_no_message_are_refused_naming_the_problem(target):
    """A truncated varint is no protobuf message: INVALID_ARGUMENT saying where it broke, from
    every method (gRPC's own deserializer ended such calls with UNKNOWN or INTERNAL)."""
    with grpc.insecure_channel(target) as channel:
        for method, streaming in METHODS:
            call = (channel.unary_stream if streaming else channel.unary_unary)(
                method, request_serializer=lambda data: data, response_deserializer=lambda data: data
            )
            with pytest.raises(grpc.RpcError) as refused:
                answer = call(b"\x08\xff", timeout=30)
                if streaming:
                    list(answer)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert refused.value.details(), method


def test_the_fuzzed_admin_calls_changed_no_pool(client, pools_before):
    """After every hostile Admin call and raw-byte input above: the same workers, in the same
    states, and the server still answering."""
    assert _pools(client) == pools_before
