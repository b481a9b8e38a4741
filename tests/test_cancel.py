"""Cancelling a stream mid-way frees the request on both workers, and duet keeps serving."""

from __future__ import annotations

from duet.router.client import build_request

GENERATED = "vllm:generation_tokens_total"


def test_cancel_mid_stream_frees_both_workers(client, worker_status, wait_until_idle):
    wait_until_idle("decode")  # requests earlier tests cancelled may still be leaving
    before = worker_status("decode").engine_metrics.get(GENERATED, 0)
    stream = client.generate(
        build_request(prompt_token_ids=list(range(10, 400)), max_tokens=3000, ignore_eos=True), timeout=120
    )
    received = 0
    for message in stream:
        received += len(message.token_ids)
        if received >= 8:
            break
    # Mid-way: the decode worker is generating this request right now.
    assert worker_status("decode").requests_inflight == 1
    stream.cancel()

    decode = wait_until_idle("decode")
    prefill = wait_until_idle("prefill")
    assert decode.engine_unfinished == 0 and prefill.engine_unfinished == 0
    generated = decode.engine_metrics.get(GENERATED, 0) - before
    assert generated < 3000, "the decode engine generated the whole request despite the cancel"

    ids, last = client.generate_ids(build_request("still serving?", max_tokens=4, ignore_eos=True), timeout=60)
    assert len(ids) == 4 and last.usage.completion_tokens == 4
