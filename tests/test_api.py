"""The gRPC surface: streaming, finish reasons, usage, status, health, reflection, backpressure."""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duet.router.client import build_request
from duet.router.proto import duet_api_pb2 as pb


def test_tokens_stream_as_they_are_decoded(client):
    """The streaming contract at any engine speed: the prefill's first token is sent alone and at
    once, and the decode worker's tokens follow in further messages, merged by the engine into at
    most one message per ``output_interval_ms`` (40 ms). 200 tokens take at least 0.9 s even on
    this machine's fast spells (TPOT 4.5 ms), so a stream held back until the end, or merged
    without the interval's bound, arrives in fewer than three messages; a count of messages per
    12 tokens depended on the speed (two on a fast spell)."""
    messages = list(client.generate(build_request("stream me", max_tokens=200, ignore_eos=True), timeout=120))
    assert len(messages[0].token_ids) == 1, "the first token waited for the decode worker's"
    assert len(messages) >= 3, "tokens arrived in one batch instead of as they were decoded"
    assert all(m.token_ids or m.text for m in messages[:-1]), "an empty message before the last"
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 200
    assert messages[-1].usage.prefill_worker == "prefill-0"
    assert messages[-1].usage.decode_worker == "decode-0"


def test_resumed_stream_continues_exactly_where_it_broke(client):
    """A client whose stream broke sends what it received (resume_after): the server continues
    after it, token-identical to the unbroken stream, nothing repeated."""
    request = build_request("resume me", max_tokens=24, ignore_eos=True)
    whole, _ = client.generate_ids(request, timeout=60)
    rest, last = client.generate_ids(build_request("resume me", max_tokens=24, ignore_eos=True, resume_after=whole[:9]), timeout=60)
    assert rest == whole[9:]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 15


def test_stop_token_ends_with_stop(client):
    ids, _ = client.generate_ids(build_request("stop here", max_tokens=8, ignore_eos=True), timeout=60)
    stop_at = ids[3]
    got, last = client.generate_ids(
        build_request("stop here", max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]), timeout=60
    )
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert got == ids[: ids.index(stop_at) + 1]


def test_single_token_is_served_by_prefill_alone(client):
    ids, last = client.generate_ids(build_request("one", max_tokens=1), timeout=60)
    assert len(ids) == 1 and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.decode_worker == ""


def test_seeded_sampling_is_reproducible(client):
    request = build_request("sample", max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    first, _ = client.generate_ids(request, timeout=60)
    second, _ = client.generate_ids(request, timeout=60)
    assert first == second and len(first) == 16


def test_seeded_sampling_survives_a_prompt_prefilled_in_steps(client):
    """A 3,000-token prompt takes two prefill steps (2,048 tokens each at most), the first of
    which samples a token vLLM discards, then rewinds the request's generator in a way only
    CUDA generators allow: on CPU the engine died (worker_runtime/seeded_sampling.py). Sent
    again, the prompt's cached prefix leaves one step: the same tokens show that the discarded
    draw did not move the seeded stream (skipping vLLM's rewind would have)."""
    prompt = random.Random(3000).choices(range(5, 700), k=3000)
    request = build_request(prompt_token_ids=prompt, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    in_two_steps, last = client.generate_ids(request, timeout=120)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(in_two_steps) == 8
    hits_before = _worker_metric(client, "vllm:prefix_cache_hits_total", last.usage.prefill_worker)
    in_one_step, last = client.generate_ids(request, timeout=120)
    hits = _worker_metric(client, "vllm:prefix_cache_hits_total", last.usage.prefill_worker) - hits_before
    assert hits >= 2048, f"the second prefill found {hits:g} tokens cached: it was not one step"
    assert in_one_step == in_two_steps


def _worker_metric(client, name: str, worker: str) -> float:
    """One worker's value of a vLLM metric, from the deployment's Prometheus endpoint."""
    return _metrics(client)[1].get((name, worker), 0.0)


def _metrics(client) -> tuple[str, dict[tuple[str, str | None], float]]:
    """The deployment's Prometheus text, and each sample's value summed by (name, worker label)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{client.status().metrics_endpoint}/metrics", timeout=30).read().decode()
    samples: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("worker"))
            samples[key] = samples.get(key, 0.0) + sample.value
    return text, samples


def test_status_reports_pools_and_requests(client):
    client.generate_ids(build_request("count me", max_tokens=2), timeout=60)
    status = client.status()
    assert status.model == "duet-tiny-llama" and status.kv_transport == "nixl"
    roles = {pool.role: pool for pool in status.pools}
    assert set(roles) == {"prefill", "decode"}
    for pool in roles.values():
        (worker,) = pool.workers
        assert worker.state == "ready" and worker.requests_served >= 1
        assert worker.kv_endpoint.startswith("127.0.0.1:")
    assert roles["prefill"].workers[0].kv_endpoint != roles["decode"].workers[0].kv_endpoint
    assert status.requests_served >= 1


def test_status_reports_kv_transfers(client):
    client.generate_ids(build_request(prompt_token_ids=list(range(5, 300)), max_tokens=3), timeout=60)
    decode = next(pool.workers[0] for pool in client.status().pools if pool.role == "decode")
    assert decode.kv_transfers >= 1 and decode.kv_transfer_bytes > 0 and decode.kv_transfer_seconds > 0


def test_prometheus_endpoint_has_router_and_worker_metrics(client):
    client.generate_ids(build_request(prompt_token_ids=list(range(5, 300)), max_tokens=3), timeout=60)
    text, samples = _metrics(client)
    assert samples[("duet_requests_total", None)] >= 1
    assert 'duet_requests_total{model_name="duet-tiny-llama",outcome="served"}' in text
    assert samples[("duet_ttft_seconds_count", None)] >= 1
    assert samples[("vllm:nixl_xfer_time_seconds_count", "decode-0")] >= 1
    assert samples[("vllm:nixl_bytes_transferred_sum", "decode-0")] > 0
    assert ("vllm:nixl_num_failed_transfers_total", "decode-0") in samples


def test_health_service_reports_serving(deployment, client):
    assert client.is_serving()
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "duet.v1.Duet"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(deployment):
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {service.name for reply in replies for service in reply.list_services_response.service}
    assert {"duet.v1.Duet", "grpc.health.v1.Health"} <= names


def test_overload_gets_resource_exhausted(client, deployment):
    service = deployment.service
    limit = service.max_inflight
    service.max_inflight = 1
    try:
        long_stream = client.generate(
            build_request(prompt_token_ids=[5] * 50, max_tokens=2000, ignore_eos=True), timeout=120
        )
        next(long_stream)  # admitted and running
        with pytest.raises(grpc.RpcError) as raised:
            list(client.generate(build_request("one more", max_tokens=2), timeout=30))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert deployment.cluster.outcomes["overloaded"] >= 1
        long_stream.cancel()
    finally:
        service.max_inflight = limit


def test_start_up_objects_are_exempt_from_garbage_collection(deployment):
    """The router's long-lived start-up heap (vLLM, torch, tokenizers) is frozen out of the
    collector, so decoding engine outputs under load does not walk it again and again."""
    import gc

    assert gc.get_freeze_count() > 100_000


def test_each_worker_reports_how_long_its_engine_waited_for_a_cpu(deployment, client):
    """The health watcher's evidence of starvation (cluster/health.py), read by each real worker's
    actor from its engine core's threads: one count per thread, never going down."""
    for member in (deployment.prefill.members[0], deployment.decode.members[0]):
        first = deployment.background.run(member.engine.threads_cpu_wait(), timeout=30)
        client.generate_ids(build_request("wait for me", max_tokens=4), timeout=60)
        second = deployment.background.run(member.engine.threads_cpu_wait(), timeout=30)
        assert first and len(first) >= 5, f"{member.name}: no engine thread counted"
        common = first.keys() & second.keys()
        assert common and all(second[tid] >= first[tid] for tid in common)
