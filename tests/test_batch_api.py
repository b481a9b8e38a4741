"""Batch jobs (OpenAI's Files and Batch APIs, ``duet batch``) on the suite's shared deployment.

Driven by the unmodified ``openai`` SDK and by the CLI. What must hold: a batch line is answered
exactly as the same body sent online (token for token, the same fields); a malformed line fails
alone with its error; requests sharing a prefix compute it once (the engines' own counts); a
job keeps to its window; a cancel stops the job and keeps what finished; hostile ids never
reach the file system. (Keys: tests/test_security.py; a front door killed mid-job:
tests/test_front_doors.py.)
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from duet.batch.prefix_order import minimum_prompt_tokens

_VOLATILE = ("id", "created")  # what differs between two answers to the same request


@pytest.fixture(scope="module")
def sdk(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(deployment) -> str:
    return deployment.config.model.name


def _jsonl(lines: list[object]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def _run(sdk: openai.OpenAI, content: bytes, endpoint: str = "/v1/completions", timeout_s: float = 300) -> object:
    uploaded = sdk.files.create(file=("batch.jsonl", content), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch {batch.id} still {batch.status}"
        time.sleep(0.2)
        batch = sdk.batches.retrieve(batch.id)
    return batch


def _lines(sdk: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {line["custom_id"]: line for line in map(json.loads, sdk.files.content(file_id).text.splitlines())}


def _online(endpoint, body: dict, prompt_field: str) -> dict:
    """``body`` sent to the online endpoint by the SDK (vLLM's own fields as its extra body)."""
    rest = {key: value for key, value in body.items() if key not in ("model", prompt_field)}
    reply = endpoint.with_raw_response.create(model=body["model"], **{prompt_field: body[prompt_field]}, extra_body=rest)
    return reply.http_response.json()


def _without_volatile(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in _VOLATILE}


def test_batch_lines_are_answered_as_online_requests(sdk, model):
    completions = {
        "greedy": {"model": model, "prompt": "The decode worker streams", "max_tokens": 12, "temperature": 0},
        "sampled": {"model": model, "prompt": "A prefill worker", "max_tokens": 10, "temperature": 0.9, "seed": 3, "n": 2},
        "logprobs": {"model": model, "prompt": "KV blocks move", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True},
        "batched": {"model": model, "prompt": ["one prompt", "and another"], "max_tokens": 5, "temperature": 0},
        "stopped": {"model": model, "prompt": "Ray actors", "max_tokens": 20, "temperature": 0, "stop": ["e"], "ignore_eos": True},
    }
    lines = [{"custom_id": key, "method": "POST", "url": "/v1/completions", "body": body} for key, body in completions.items()]
    batch = _run(sdk, _jsonl(lines))
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 5, 0)
    outputs = _lines(sdk, batch.output_file_id)
    assert list(outputs) == list(completions), "the output file follows the input's order"
    for key, body in completions.items():
        online = _online(sdk.completions, body, "prompt")
        response = outputs[key]["response"]
        assert response["status_code"] == 200 and outputs[key]["error"] is None
        assert _without_volatile(response["body"]) == _without_volatile(online), key

    chats = {
        f"chat-{index}": {"model": model, "messages": [{"role": "user", "content": f"Question {index}?"}], "max_tokens": 8, "temperature": 0}
        for index in range(3)
    }
    lines = [{"custom_id": key, "method": "POST", "url": "/v1/chat/completions", "body": body} for key, body in chats.items()]
    batch = _run(sdk, _jsonl(lines), endpoint="/v1/chat/completions")
    outputs = _lines(sdk, batch.output_file_id)
    for key, body in chats.items():
        online = _online(sdk.chat.completions, body, "messages")
        assert _without_volatile(outputs[key]["response"]["body"]) == _without_volatile(online), key


def test_a_malformed_line_fails_alone_with_its_error(sdk, model):
    good = {"model": model, "prompt": "fine", "max_tokens": 3, "temperature": 0}
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good},
        b"{not json",
        [1, 2],
        {"method": "POST", "url": "/v1/completions", "body": good},
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": good},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": good},
        {"custom_id": "other-url", "method": "POST", "url": "/v1/chat/completions", "body": good},
        {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {**good, "stream": True}},
        {"custom_id": "bad-param", "method": "POST", "url": "/v1/completions", "body": {**good, "max_tokens": -1}},
        {"custom_id": "no-model", "method": "POST", "url": "/v1/completions", "body": {**good, "model": "nope"}},
        {"custom_id": "ok-too", "method": "POST", "url": "/v1/completions", "body": good},
    ]
    batch = _run(sdk, _jsonl(lines))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (11, 2, 9)
    assert set(_lines(sdk, batch.output_file_id)) == {"ok", "ok-too"}
    errors = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    codes = [(e["error"] or {}).get("code") for e in errors]
    assert codes == ["invalid_json", "invalid_request", "missing_custom_id", "duplicate_custom_id", "invalid_method",
                     "mismatched_url", "invalid_request", None, None]
    assert [e["error"]["line"] for e in errors[:7]] == [2, 3, 4, 5, 6, 7, 8]
    bad_param, no_model = errors[7]["response"], errors[8]["response"]
    assert bad_param["status_code"] == 400 and bad_param["body"]["error"]["param"] == "max_tokens"
    assert no_model["status_code"] == 404 and "nope" in no_model["body"]["error"]["message"]


def test_requests_sharing_a_prefix_compute_it_once(sdk, model, worker_status, deployment):
    """Shuffled prompts over three 512-token prefixes: the engines compute the prefix tree's
    minimum (each prefix once, then only each prompt's own tokens), not each prompt whole."""
    vocab = 700  # the built-in model's vocabulary is 753 tokens
    rng = random.Random(time.time_ns())  # prefixes no earlier test left in the prefix cache
    prefixes = [[rng.randrange(10, vocab) for _ in range(512)] for _ in range(3)]
    prompts = [prefix + [rng.randrange(10, vocab) for _ in range(20)] for prefix in prefixes for _ in range(6)]
    rng.shuffle(prompts)
    lines = [
        {"custom_id": f"p{index}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}}
        for index, prompt in enumerate(prompts)
    ]

    def computed() -> int:
        metrics = [worker_status(role).engine_metrics for role in ("prefill", "decode")]
        return int(sum(m.get("vllm:prompt_tokens_by_source_total{source=local_compute}", 0) for m in metrics))

    before = computed()
    batch = _run(sdk, _jsonl(lines))
    assert batch.request_counts.completed == len(prompts)
    deadline = time.monotonic() + 10  # the engines' counters are read from their last metrics
    block = deployment.service.limits.block_size
    assert 512 % block == 0, "the prefixes are whole KV blocks"
    minimum, whole = minimum_prompt_tokens(prompts, block), sum(map(len, prompts))
    while (spent := computed() - before) < minimum and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"prompt tokens computed: {spent} (the tree's minimum {minimum}, {whole} in all)")
    assert minimum <= spent <= minimum * 1.1, f"{spent} prompt tokens computed; the prefix tree's minimum is {minimum}"


def test_cancel_keeps_what_finished_and_listing_pages(sdk, model, deployment):
    """A long job: it never has more than ``server.batches.max_inflight`` requests in flight;
    cancelled once a request is done, it stops and keeps what finished."""
    lines = [
        {"custom_id": f"long-{index}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": f"story {index}", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}}
        for index in range(80)
    ]
    uploaded = sdk.files.create(file=("long.jsonl", _jsonl(lines)), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                               metadata={"purpose": "cancel test"})
    assert batch.status == "validating" and batch.metadata == {"purpose": "cancel test"}
    deadline = time.monotonic() + 120
    most_inflight = 0
    while sdk.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline, "no request of the job finished"
        most_inflight = max(most_inflight, deployment.cluster.inflight)
        time.sleep(0.1)
    assert 1 <= most_inflight <= deployment.config.server.batches.max_inflight
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    while (batch := sdk.batches.retrieve(batch.id)).status == "cancelling":
        assert time.monotonic() < deadline + 60, "the job never stopped"
        time.sleep(0.2)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    finished = _lines(sdk, batch.output_file_id)
    assert 1 <= len(finished) < len(lines) and batch.request_counts.completed == len(finished)
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)

    newest = sdk.batches.list(limit=1)
    assert [b.id for b in newest.data] == [batch.id] and newest.has_more
    following = sdk.batches.list(limit=2, after=batch.id)
    assert batch.id not in [b.id for b in following.data] and len(following.data) == 2
    assert sdk.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


@pytest.mark.parametrize("path", [
    "/v1/files/..%2F..%2Fetc%2Fpasswd", "/v1/files/file-../content", "/v1/batches/batch_..%2F..", "/v1/batches/%00",
    "/v1/files/file-" + "a" * 200,
])
def test_hostile_ids_are_404(deployment, path):
    connection = http.client.HTTPConnection("127.0.0.1", deployment.http_port, timeout=10)
    connection.request("GET", path)
    response = connection.getresponse()
    body = json.loads(response.read())
    assert response.status == 404 and "error" in body


def test_bad_uploads_and_batches_are_400(sdk, deployment):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        sdk.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="UTF-8"):
        sdk.files.create(file=("x.jsonl", b"\xff\xfe\n"), purpose="batch")
    uploaded = sdk.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="metadata"):
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                           metadata={"k": "v" * 600})
    connection = http.client.HTTPConnection("127.0.0.1", deployment.http_port, timeout=10)
    connection.request("POST", "/v1/files", body=b"{}", headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 400 and b"multipart" in response.read()


def test_duet_batch_writes_the_results_beside_the_file(deployment, model, tmp_path: Path):
    source = tmp_path / "questions.jsonl"
    source.write_bytes(_jsonl([
        {"custom_id": f"q{index}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": f"question {index}", "max_tokens": 4, "temperature": 0}}
        for index in range(3)
    ] + [b"garbage"]))
    url = f"http://127.0.0.1:{deployment.http_port}"
    run = subprocess.run([sys.executable, "-m", "duet.cli", "batch", str(source), "--url", url],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "completed, 3 completed, 1 failed of 4" in run.stderr
    outputs = [json.loads(line) for line in (tmp_path / "questions.output.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in outputs] == ["q0", "q1", "q2"]
    errors = (tmp_path / "questions.errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["error"]["code"] == "invalid_json"

    nobody = subprocess.run([sys.executable, "-m", "duet.cli", "batch", str(source), "--url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 2 and "no duet HTTP API at http://127.0.0.1:9" in nobody.stderr


def test_engines_serve_online_prompts_before_a_batch_jobs(reference):
    """duet's engines schedule by priority (worker_runtime/engine.py), and a batch line is a
    request of BATCH_PRIORITY: a batch prompt still waiting in the engine's queue waits behind
    an online one that arrived after it (first come, first served would compute it first). The
    engine is the suite's colocated reference, which has duet's engine settings.

    Four 1,100-token prompts, three batch then one online; a step's budget (2,048 tokens) holds
    one whole and part of another. The engine starts on the first as soon as it arrives, and
    the second may join that step; the third (the last batch prompt) is still waiting when the
    online one arrives, and its prefill cannot end in the step where the online one's does."""
    from vllm import SamplingParams

    from duet.router.http_server import PreparedRequest
    from duet.router.validation import ValidatedRequest
    from duet.worker_runtime.worker_api import BATCH_PRIORITY, SamplingSpec

    line = PreparedRequest(None, None, [ValidatedRequest("r", [5, 6], SamplingSpec(max_tokens=2))], None)  # type: ignore[arg-type]
    line.in_background()
    assert line.prompts[0].background and line.prompts[0].sampling.priority == BATCH_PRIORITY
    prompts = [{"prompt_token_ids": [(31 * index + offset) % 650 + 3 for offset in range(1100)]} for index in range(4)]
    outputs = reference.llm.generate(
        prompts, SamplingParams(max_tokens=1), priority=[BATCH_PRIORITY] * 3 + [0], use_tqdm=False
    )
    first_token_at = [output.metrics.first_token_ts for output in outputs]
    assert first_token_at[3] < first_token_at[2], first_token_at
