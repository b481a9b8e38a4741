"""What applications send, duet answers as vLLM's own OpenAI server does (issue 51).

The same request bodies go to duet's OpenAI front door (the shared disaggregated deployment:
prefill and decode workers, KV pulled over NIXL) and to vLLM 0.32's own OpenAI server started
here on the same built-in model with the same engine settings. vLLM's server is the
specification: every kind of request it answers, duet must answer with the same greedy (or
seeded) text, and logprobs within 1e-4. The gRPC API carries the same features, checked
against the HTTP answers.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from duet.router.client import build_request
from duet.router.proto import duet_api_pb2 as pb
from vllm_server import http_post, running_vllm_server

PROMPT = "The router sends the prompt to a prefill worker"
LOGPROB_TOLERANCE = 1e-4
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vllm_server(deployment) -> Iterator[int]:
    """vLLM's own OpenAI server on the deployment's model and engine settings; its port."""
    with running_vllm_server(deployment.config.model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as port:
        yield port


def _both(deployment, vllm_port: int, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"model": deployment.config.model.name, **body}
    duet_status, duet_reply = http_post(deployment.http_port, path, body)
    vllm_status, vllm_reply = http_post(vllm_port, path, body)
    assert vllm_status == 200, f"vLLM refused {body}: {vllm_reply}"
    assert duet_status == 200, f"duet refused what vLLM answers ({body}): {duet_reply}"
    return duet_reply, vllm_reply


def _close(a: Any, b: Any, where: str = "") -> None:
    """Equal, with floats (logprobs) within the tolerance."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and abs(a - b) <= LOGPROB_TOLERANCE, f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a} != {b}"
        for key in a:
            _close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _same_choices(duet: dict[str, Any], vllm: dict[str, Any], chat: bool) -> None:
    assert len(duet["choices"]) == len(vllm["choices"])
    for ours, theirs in zip(sorted(duet["choices"], key=lambda c: c["index"]), sorted(vllm["choices"], key=lambda c: c["index"])):
        assert ours["index"] == theirs["index"]
        if chat:
            assert ours["message"]["content"] == theirs["message"]["content"]
        else:
            assert ours["text"] == theirs["text"]
        assert (ours["finish_reason"], ours["stop_reason"]) == (theirs["finish_reason"], theirs["stop_reason"])
        _close(ours["logprobs"], theirs["logprobs"], f"choice {ours['index']} logprobs")
    assert duet["usage"]["prompt_tokens"] == vllm["usage"]["prompt_tokens"]
    assert duet["usage"]["completion_tokens"] == vllm["usage"]["completion_tokens"]


COMPLETIONS = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": {"17": 40.0, "23": -100.0}},
    "min_tokens": {"min_tokens": 12, "max_tokens": 14},
    "min_p": {"min_p": 0.3, "temperature": 0.9, "seed": 11},
    "bad_words": {"bad_words": ["the", "a"]},
    "logprobs": {"logprobs": 3},
    "echo_with_logprobs": {"echo": True, "logprobs": 2},
    "echo_scoring_only": {"echo": True, "logprobs": 1, "max_tokens": 0},
    "prompt_logprobs": {"prompt_logprobs": 2, "logprobs": 0},
    "n_seeded": {"n": 3, "temperature": 1.0, "seed": 1234},
    "batch": {"prompt": [PROMPT, "Another prompt, of other length"]},
    "batch_with_n_and_logprobs": {"prompt": [[5, 6, 7, 8], [9, 10, 11]], "n": 2, "logprobs": 1, "temperature": 0.7, "seed": 3},
    "regex": {"structured_outputs": {"regex": "[a-z]{3,6}( [a-z]{2,5}){2}"}},
    "choice": {"structured_outputs": {"choice": ["prefill", "decode", "router"]}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": JSON_SCHEMA}}, "max_tokens": 60},
    "include_stop_str": {"stop": ["e"], "include_stop_str_in_output": True, "max_tokens": 30},
    "seeded_sampling": {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 77},
}


@pytest.mark.parametrize("case", COMPLETIONS, ids=list(COMPLETIONS))
def test_completions_match_vllms_server(deployment, vllm_server, case):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, **COMPLETIONS[case]}
    duet, vllm = _both(deployment, vllm_server, "/v1/completions", body)
    _same_choices(duet, vllm, chat=False)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Where does the KV cache go?"}]
CHATS = {
    "logprobs": {"logprobs": True, "top_logprobs": 4},
    "n_seeded_with_logprobs": {"n": 2, "temperature": 0.8, "seed": 5, "logprobs": True},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": JSON_SCHEMA}}, "max_tokens": 60},
    "json_object": {"response_format": {"type": "json_object"}, "max_tokens": 40},
    "penalties_and_min_tokens": {"presence_penalty": 1.0, "frequency_penalty": 1.0, "min_tokens": 10},
}


@pytest.mark.parametrize("case", CHATS, ids=list(CHATS))
def test_chat_completions_match_vllms_server(deployment, vllm_server, case):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.0, **CHATS[case]}
    duet, vllm = _both(deployment, vllm_server, "/v1/chat/completions", body)
    _same_choices(duet, vllm, chat=True)


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
                       "required": ["city", "days"], "additionalProperties": False},
    }},
    {"type": "function", "function": {
        "name": "route", "parameters": {"type": "object", "properties": {"worker": {"enum": ["prefill", "decode"]}}, "required": ["worker"]},
    }},
]
TOOL_CHOICES = {
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "required": "required",
    "auto": "auto",
    "none": "none",
}


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls") or []]


@pytest.mark.parametrize("choice", TOOL_CHOICES, ids=list(TOOL_CHOICES))
def test_tool_calls_match_vllms_server(deployment, vllm_server, choice):
    """With a tool-call parser configured (hermes), every tool choice is constrained and parsed
    back by vLLM's own parser, as vLLM's server does: the same calls, content and finish."""
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": TOOL_CHOICES[choice], "max_tokens": 60, "temperature": 0.0}
    duet, vllm = _both(deployment, vllm_server, "/v1/chat/completions", body)
    ours, theirs = duet["choices"][0], vllm["choices"][0]
    assert _tool_calls(ours["message"]) == _tool_calls(theirs["message"])
    assert (ours["message"]["content"] or "") == (theirs["message"]["content"] or "")
    assert ours["finish_reason"] == theirs["finish_reason"]
    if choice in ("named", "required"):
        assert _tool_calls(ours["message"]), "a forced tool choice produced no call"


def test_streamed_tool_calls_assemble_to_the_whole_answer(deployment):
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=0)
    for choice in ("named", "required"):
        common = dict(model=deployment.config.model.name, messages=MESSAGES, tools=TOOLS, tool_choice=TOOL_CHOICES[choice],
                      max_tokens=60, temperature=0.5, seed=2)
        whole = sdk.chat.completions.create(**common).choices[0]
        calls: dict[int, list[str]] = {}
        finish = None
        for chunk in sdk.chat.completions.create(**common, stream=True):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                name_and_args = calls.setdefault(delta_call.index, ["", ""])
                name_and_args[0] += delta_call.function.name or ""
                name_and_args[1] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert finish == whole.finish_reason


def test_structured_outputs_hold_their_constraint(deployment):
    """The constrained output fits its constraint (not only equals vLLM's): a regex matches in
    full, a choice is one of the choices, a JSON schema's output that finished parses and fits."""
    pattern = "[a-z]{3,6}( [a-z]{2,5}){2}"
    for constraint, holds in (
        ({"structured_outputs": {"regex": pattern}}, lambda text: re.fullmatch(pattern, text) is not None),
        ({"structured_outputs": {"choice": ["prefill", "decode"]}}, lambda text: text in ("prefill", "decode")),
    ):
        _, reply = http_post(deployment.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.8, "seed": 4, **constraint})
        assert holds(reply["choices"][0]["text"]), (constraint, reply["choices"][0])
    _, reply = http_post(deployment.http_port, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 200, "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": JSON_SCHEMA}},
    })
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":  # the random model may write whitespace until max_tokens
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 8


def test_streams_carry_the_same_choices_and_logprobs(deployment):
    """A streamed n = 2 completion with logprobs and echo, through the openai SDK, assembles to
    the same choices as the whole answer."""
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=0)
    common = dict(model=deployment.config.model.name, prompt=PROMPT, max_tokens=10, n=2, temperature=0.9, seed=21, logprobs=2, echo=True)
    whole = sdk.completions.create(**common)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in sdk.completions.create(**common, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens == 20
    for choice in whole.choices:
        assert texts[choice.index] == choice.text and choice.text.startswith(PROMPT)
        assert tokens[choice.index] == choice.logprobs.tokens
    assert whole.choices[0].text != whole.choices[1].text, "two seeded sequences drew the same tokens"

    chat = sdk.chat.completions.create(
        model=deployment.config.model.name, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True,
    )
    content = [entry for chunk in chat for entry in (chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else [])]
    assert len(content) == 8 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_grpc_carries_the_same_features(deployment, client):
    """The gRPC API's fields give what the OpenAI endpoint gives for the same request."""
    _, reply = http_post(deployment.http_port, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 9, "logprobs": 2,
        "presence_penalty": 0.7, "structured_outputs": {"regex": "[a-z ]{5,40}"}, "return_token_ids": True,
    })
    request = build_request(
        PROMPT, max_tokens=12, n=2, temperature=1.0, seed=9, logprobs=2, presence_penalty=0.7,
        structured_output=pb.StructuredOutput(regex="[a-z ]{5,40}"),
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    for message in client.generate(request, timeout=120):
        ids[message.index] += message.token_ids
        logprobs[message.index] += [position.entries[0].logprob for position in message.logprobs]
        assert all(len(position.entries) in (3, 2) for position in message.logprobs)
    for choice in reply["choices"]:
        assert ids[choice["index"]] == choice["token_ids"]
        _close(logprobs[choice["index"]], choice["logprobs"]["token_logprobs"], "grpc logprobs")


BAD = [
    ("/v1/completions", {"n": 2, "temperature": 0}, "n"),  # vLLM refuses it too: greedy sequences are all the same
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 10_000}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logit_bias": {"x": 1.0}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"presence_penalty": 3.0}, "presence_penalty"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs"),
    ("/v1/completions", {"prompt": ["x"] * 65}, "prompt"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
]


@pytest.mark.parametrize("path, fields, field", BAD, ids=[f"{path.rsplit('/', 1)[1]}-{field}-{i}" for i, (path, _, field) in enumerate(BAD)])
def test_bad_new_fields_are_400_naming_the_field(deployment, worker_status, path, fields, field):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    served = worker_status("prefill").requests_served
    status, reply = http_post(deployment.http_port, path, {**base, "max_tokens": 4, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == field, reply
    assert worker_status("prefill").requests_served == served, "a refused request reached a worker"


def test_n_counts_against_admission(deployment):
    service = deployment.service
    limit = service.max_inflight
    service.max_inflight = 3
    try:
        status, reply = http_post(deployment.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 4})
        assert status == 429 and reply["error"]["code"] == "overloaded"
        status, reply = http_post(deployment.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3})
        assert status == 200 and len(reply["choices"]) == 3
    finally:
        service.max_inflight = limit


# ---- a request that resumes or moves keeps its state ----------------------------------------

RESUMED = {
    "penalised_greedy": dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0, min_tokens=18, bad_words=["the"]),
    "regex_seeded": dict(temperature=1.0, seed=5, structured_output=pb.StructuredOutput(regex="[a-z]{2,8}( [a-z]{2,8}){3,9}")),
    "json_schema_seeded": dict(temperature=0.7, seed=8, structured_output=pb.StructuredOutput(json_schema=json.dumps(JSON_SCHEMA))),
    "seeded_top_k": dict(temperature=1.0, seed=42, top_k=50, repetition_penalty=1.2),
}


def _sequences(client, request) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for message in client.generate(request, timeout=300):
        tokens.setdefault(message.index, []).extend(message.token_ids)
    return tokens


@pytest.mark.parametrize("case", RESUMED, ids=list(RESUMED))
def test_a_resumed_stream_continues_with_its_sampling_state(client, case):
    """A client resuming a broken stream (``resume_after``, as after its front door's death)
    gets the tokens an unbroken stream would have sent: the engines count the tokens already
    sent as generated (penalties, min_tokens, bad words), the grammar has consumed them and the
    seeded generator has drawn them (worker_runtime/resumed_requests.py)."""
    fields = RESUMED[case]
    unbroken = _sequences(client, build_request(PROMPT, max_tokens=24, **fields))[0]
    assert len(unbroken) > 8, unbroken
    for cut in (1, 7):
        resumed = _sequences(client, build_request(PROMPT, max_tokens=24, resume_after=unbroken[:cut], **fields))
        assert resumed[0] == unbroken[cut:], f"resumed after {cut} tokens, the stream went elsewhere"


def test_a_killed_decode_worker_loses_no_state_of_a_constrained_seeded_n2_stream(client, deployment):
    """Two seeded sequences with penalties and a regex constraint, their decode worker killed as
    the first token arrives: each resumes on the replacement and ends as it would have unbroken."""
    import random
    import threading

    import ray

    prompt = random.Random(3).choices(range(3, 700), k=3000)
    request = build_request(
        prompt_token_ids=prompt, max_tokens=160, n=2, temperature=0.9, seed=17, presence_penalty=0.8,
        frequency_penalty=0.4, structured_output=pb.StructuredOutput(regex="([a-z]{1,6} ){40,400}"),
    )
    unbroken = _sequences(client, request)
    decode = deployment.decode.members[0]
    restarts = decode.restarts
    received: dict[int, list[int]] = {0: [], 1: []}
    first = threading.Event()

    def consume() -> None:
        for message in client.generate(request, timeout=600):
            received[message.index] += message.token_ids
            first.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert first.wait(120), "no first token"
    ray.kill(decode.actor, no_restart=True)
    consumer.join(600)
    assert not consumer.is_alive()
    assert received == unbroken, "a sequence resumed after the kill differs from its unbroken run"
    deadline = time.monotonic() + 300
    while not (decode.restarts > restarts and decode.state == "ready"):
        assert time.monotonic() < deadline, f"{decode.name} was not replaced"
        time.sleep(0.5)


TOKENIZE = {
    "prompt": {"prompt": PROMPT},
    "prompt_without_special_tokens": {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True},
    "messages": {"messages": MESSAGES},
    "messages_without_generation_prompt": {"messages": MESSAGES, "add_generation_prompt": False},
}


@pytest.mark.parametrize("case", TOKENIZE, ids=list(TOKENIZE))
def test_tokenize_and_detokenize_match_vllms_server(deployment, vllm_server, case):
    duet, vllm = _both(deployment, vllm_server, "/tokenize", TOKENIZE[case])
    assert duet == vllm
    duet, vllm = _both(deployment, vllm_server, "/detokenize", {"tokens": duet["tokens"]})
    assert duet == vllm


ANTHROPIC = {
    "plain": {"system": "You are terse.", "messages": [{"role": "user", "content": "Where does the KV cache go?"}]},
    "stop_sequences": {"messages": [{"role": "user", "content": "Say something."}], "stop_sequences": ["e"], "top_k": 20},
    "tools": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tool_choice": {"type": "tool", "name": "get_weather"},
              "tools": [{"name": "get_weather", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}]},
}


def _anthropic_events(port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", "/v1/messages", body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        raw = connection.getresponse().read().decode()
    finally:
        connection.close()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


def _streamed_message(events: list[dict[str, Any]]) -> tuple[str, str | None]:
    text = "".join(e["delta"].get("text", "") + e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    stops = [e["delta"].get("stop_reason") for e in events if e["type"] == "message_delta"]
    return text, stops[-1] if stops else None


@pytest.mark.parametrize("case", ANTHROPIC, ids=list(ANTHROPIC))
def test_anthropic_messages_match_vllms_server(deployment, vllm_server, case):
    """Anthropic's Messages API, whole and streamed, through vLLM's own conversions around
    duet's chat endpoint: the same content, stop reason and usage as vLLM's server."""
    body = {"model": deployment.config.model.name, "max_tokens": 24, "temperature": 0.0, **ANTHROPIC[case]}
    duet, vllm = _both(deployment, vllm_server, "/v1/messages", body)
    strip = lambda blocks: [{k: v for k, v in block.items() if k != "id"} for block in blocks]  # noqa: E731
    assert strip(duet["content"]) == strip(vllm["content"])
    assert (duet["stop_reason"], duet["usage"]["output_tokens"]) == (vllm["stop_reason"], vllm["usage"]["output_tokens"])
    ours, theirs = _anthropic_events(deployment.http_port, body), _anthropic_events(vllm_server, body)
    assert _streamed_message(ours) == _streamed_message(theirs)
    assert [e["type"] for e in ours][:1] == ["message_start"] and ours[-1]["type"] == "message_stop"


def test_responses_api_through_the_openai_sdk(deployment, vllm_server):
    """OpenAI's Responses API (stateless): the SDK's whole and streamed calls give the text
    vLLM's server gives for the same input and instructions."""
    common = dict(model=deployment.config.model.name, instructions="You are terse.", input="Where does the KV cache go?",
                  max_output_tokens=16, temperature=0.0)
    ours = openai.OpenAI(base_url=f"http://127.0.0.1:{deployment.http_port}/v1", api_key="unused", max_retries=0)
    theirs = openai.OpenAI(base_url=f"http://127.0.0.1:{vllm_server}/v1", api_key="unused", max_retries=0)
    whole = ours.responses.create(**common)
    assert whole.output_text == theirs.responses.create(**common).output_text and whole.output_text
    assert whole.status == ("incomplete" if whole.usage.output_tokens == 16 else "completed")
    streamed = "".join(event.delta for event in ours.responses.create(**common, stream=True) if event.type == "response.output_text.delta")
    assert streamed == whole.output_text
    with pytest.raises(openai.BadRequestError):
        ours.responses.create(**common, previous_response_id="resp_nothing")


def test_n_sequences_compute_their_prompt_once(deployment, worker_status):
    """The first of a prompt's n sequences is prefilled alone; the others start once its first
    token is out and find the prompt's full KV blocks in the prefill worker's prefix cache."""
    import random

    computed = "vllm:prompt_tokens_by_source_total{source=local_compute}"
    prompt = random.Random(11).choices(range(3, 700), k=900)
    before = worker_status("prefill").engine_metrics.get(computed, 0.0)
    status, reply = http_post(deployment.http_port, "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True,
    })
    assert status == 200 and len(reply["choices"]) == 3
    spent = worker_status("prefill").engine_metrics.get(computed, 0.0) - before
    # Once in full, then the partial last block (900 % 128 = 4 tokens, and the block before
    # it when a hit must leave one to compute) for each of the two others: far below 3 x 900.
    assert len(prompt) <= spent < 1.5 * len(prompt), spent


def test_a_constraint_slow_to_compile_is_refused_without_stalling_the_front_door(deployment):
    """Constraints compile in a thread, bounded by api.structured_output_timeout_s: here a bound
    no compilation meets, so the request is refused (400 naming the field), and a plain request
    is served meanwhile."""
    from dataclasses import replace

    service = deployment.service
    limits = service.limits
    service.limits = replace(limits, structured_output_timeout_s=1e-6)
    try:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
        status, reply = http_post(deployment.http_port, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        })
        assert status == 400 and reply["error"]["param"] == "structured_outputs" and "did not compile" in reply["error"]["message"]
    finally:
        service.limits = limits
    status, reply = http_post(deployment.http_port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200
