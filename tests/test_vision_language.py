"""Vision-language serving: the built-in model (an Idefics3 that transformers loads whole, with
the image token count it is made for, read by vLLM as transformers reads it), and images through
both of duet's APIs on a disaggregated deployment of it, token for token what vLLM's own chat
rendering and engine make of them, and refused naming the image when they are bad (issue 55;
that the model is deterministic and cached is tested with the text model's, in
test_tiny_model.py).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Idefics3ForConditionalGeneration

from duet.worker_runtime import tiny_vision_model as vision
from duet.worker_runtime.tiny_vision_model import IMAGE_TOKEN, TOKENS_PER_IMAGE


@pytest.mark.parametrize("shape", sorted(vision.VISION_SHAPES))
def test_an_image_is_sixteen_tokens_and_changes_the_output(shape):
    path = vision.ensure_tiny_vision_model(shape)
    processor = AutoProcessor.from_pretrained(path)
    model, loading = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(loading.values()), loading  # every weight saved is loaded, none missing
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    logits = []
    for colour in ((200, 30, 40), (20, 180, 90)):
        inputs = processor(text=f"{IMAGE_TOKEN}\nwhat is this", images=Image.new("RGB", (80, 60), colour), return_tensors="pt")
        assert int((inputs["input_ids"] == image_id).sum()) == TOKENS_PER_IMAGE
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1]), "the vision tower's output reaches the language model"


def test_a_config_names_it_builtin_vl():
    from duet.config import ModelConfig
    from duet.worker_runtime.engine import resolve_model_path

    model = ModelConfig(name="duet-tiny-idefics3", path="builtin-vl")
    assert resolve_model_path(model) == vision.ensure_tiny_vision_model()


@pytest.fixture(scope="module")
def vision_engine():
    """A vLLM engine on the built-in vision model, with duet's engine settings."""
    from vllm import LLM

    from duet.config import ModelConfig
    from duet.worker_runtime.engine import cpu_engine_environment, engine_kwargs, is_cpu_only

    if is_cpu_only():
        os.environ.update(cpu_engine_environment(cpu_core=None, one_process_executor=False))
    llm = LLM(**engine_kwargs(ModelConfig(name="duet-tiny-idefics3", path="builtin-vl", max_model_len=1024), kv_cache_gib=0.25))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_vllm_reads_images_as_transformers_does(vision_engine):
    """vLLM on CPU serves the model with an image: the same prompt tokens as the Hugging Face
    processor makes, and the same greedy tokens as transformers; text alone works too."""
    from vllm import SamplingParams

    path = vision.ensure_tiny_vision_model()
    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = f"{IMAGE_TOKEN}\nwhat is this"
    for colour in ((200, 30, 40), (20, 180, 90)):
        image = Image.new("RGB", (80, 60), colour)
        (out,) = vision_engine.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}], params, use_tqdm=False)
        inputs = processor(text=prompt, images=image, return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == expected[0, inputs["input_ids"].shape[1]:].tolist()
    (text_only,) = vision_engine.generate([{"prompt": "hello there"}], params, use_tqdm=False)
    assert len(text_only.outputs[0].token_ids) == 8


# ---- images through duet's APIs ---------------------------------------------------------------

MODEL = "duet-tiny-idefics3"
MAX_TOKENS = 12


def _png(width: int, height: int, seed: int) -> bytes:
    """A PNG with a pattern of its own (a gradient in a colour the seed picks)."""
    red, green, blue = (seed * 67) % 256, (seed * 131) % 256, (seed * 29) % 256
    image = Image.new("RGB", (width, height))
    image.putdata([((red + x * 3) % 256, (green + y * 5) % 256, (blue + x * y) % 256) for y in range(height) for x in range(width)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": _data_url(data)}}


RED, GREEN, WIDE = _png(80, 60, 1), _png(64, 64, 2), _png(200, 40, 3)
# Chats as an application sends them: an image with a question, two images in one message, an
# image alone, images in two turns, the same image twice.
CHATS = [
    [{"role": "user", "content": [_image_part(RED), {"type": "text", "text": "what is in this picture"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "compare"}, _image_part(RED), _image_part(WIDE), {"type": "text", "text": "which is wider"}]}],
    [{"role": "user", "content": [_image_part(GREEN)]}],
    [
        {"role": "system", "content": "you describe images"},
        {"role": "user", "content": [_image_part(GREEN), {"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "a green square"},
        {"role": "user", "content": [{"type": "text", "text": "and this one"}, _image_part(RED)]},
    ],
    [{"role": "user", "content": [_image_part(WIDE), _image_part(WIDE), {"type": "text", "text": "twice"}]}],
]


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """An HTTP server on loopback with one image (``/red.png``) and a path that never answers
    in time (``/slow.png``): what a front door allowed to fetch URLs meets."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                time.sleep(10)
            if self.path not in ("/red.png", "/slow.png"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def vision_deployment(running_deployment) -> Iterator[Any]:
    """configs/vision.yaml (E+P+D: an encode worker, a prefill worker that loads the images'
    encoder outputs, a decode worker) on free ports, with bounds on images small enough to test
    and URLs allowed from loopback."""
    from duet.config import load_config, parse_config

    data = load_config("configs/vision.yaml").model_dump()
    data["server"].update(port=0, http_port=0, metrics_port=0)
    data["model"]["max_model_len"] = 1024
    for role in ("prefill", "decode"):
        data[role]["kv_cache_gib"] = 0.25
    data["api"]["images"].update(
        max_per_request=4, max_bytes=64 * 1024, max_pixels=400 * 400, fetch_domains=["127.0.0.1"], fetch_timeout_s=1.0
    )
    with running_deployment(parse_config(data)) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(vision_deployment) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{vision_deployment.http_port}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def _reference_chat(engine, messages: list[dict]) -> tuple[list[int], list[int]]:
    """vLLM's own chat handling of ``messages`` (its chat parsing, the model's template, its
    processor) and its greedy tokens: what vLLM's server answers."""
    from vllm import SamplingParams

    (out,) = engine.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return list(out.prompt_token_ids), list(out.outputs[0].token_ids)


def test_chat_with_images_is_token_identical_to_vllm(vision_deployment, vision_engine, sdk):
    """The ``openai`` SDK's chats with images, through prefill and decode workers: the same
    prompt tokens and greedy tokens as vLLM's own chat rendering on one engine."""
    for messages in CHATS:
        reply = sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        prompt_ids, output_ids = _reference_chat(vision_engine, messages)
        assert reply.model_extra["prompt_token_ids"] == prompt_ids, "duet's prompt differs from vLLM's"
        assert reply.choices[0].model_extra["token_ids"] == output_ids, "duet's tokens differ from vLLM's"
        assert reply.usage.prompt_tokens == len(prompt_ids)


def test_a_streamed_chat_and_a_fetched_url_answer_the_same(vision_deployment, vision_engine, sdk, image_server):
    """An image by URL (from a host the config allows) is the image its data: URL is; streaming
    changes nothing."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_server}/red.png"}}, {"type": "text", "text": "what"}]}]
    tokens: list[int] = []
    for chunk in sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ):
        if chunk.choices:
            tokens.extend(chunk.choices[0].model_extra.get("token_ids") or [])
    inline = [{"role": "user", "content": [_image_part(RED), {"type": "text", "text": "what"}]}]
    assert tokens == _reference_chat(vision_engine, inline)[1]


def test_grpc_takes_images_as_bytes(vision_deployment, vision_engine):
    """A gRPC prompt with the model's placeholder per image and the files' bytes: vLLM's tokens
    for the same prompt and images; a text-only prompt on the same deployment too."""
    from vllm import SamplingParams

    from duet.router.client import DuetClient, build_request

    tokenizer = vision_engine.get_tokenizer()
    prompt = f"{IMAGE_TOKEN}\ndescribe\n{IMAGE_TOKEN}\nand compare"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in (GREEN, WIDE)]
    (expected,) = vision_engine.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], params, use_tqdm=False)
    (text_only,) = vision_engine.generate([{"prompt": "no picture here"}], params, use_tqdm=False)
    with DuetClient(f"127.0.0.1:{vision_deployment.port}") as client:
        got, _ = client.generate_ids(build_request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, images=[GREEN, WIDE]))
        as_ids, _ = client.generate_ids(build_request(
            prompt_token_ids=tokenizer.encode(prompt), max_tokens=MAX_TOKENS, ignore_eos=True, images=[GREEN, WIDE],
        ))
        plain, _ = client.generate_ids(build_request("no picture here", max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == as_ids == list(expected.outputs[0].token_ids)
    assert plain == list(text_only.outputs[0].token_ids)


# ---- E+P+D: the encode pool and the encoder cache ------------------------------------------------


def _encoder_counts(port: int) -> dict[str, int]:
    from duet.router.client import DuetClient

    with DuetClient(f"127.0.0.1:{port}") as client:
        (cache,) = client.status().encoder_caches
    return {"encoded": cache.images_encoded, "hits": cache.cache_hits, "fallbacks": cache.fallbacks, "held": cache.images_held}


def _chat_tokens(sdk: openai.OpenAI, messages: list[dict]) -> list[int]:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, timeout=300,
    )
    return reply.choices[0].model_extra["token_ids"]


def _ask(*images: bytes) -> list[dict]:
    return [{"role": "user", "content": [*(_image_part(data) for data in images), {"type": "text", "text": "what"}]}]


def test_each_distinct_image_is_encoded_once_by_the_encode_pool(vision_deployment, vision_engine, sdk, capsys):
    """Images new to the deployment go to the encode worker, once each; an image sent again
    (alone, or beside another) is a cache hit; a text-only chat skips the step. Every answer is
    vLLM's own; `duet status` shows the encode pool and the counts."""
    from duet.cli import main as duet_main

    first, second = _png(70, 50, 101), _png(50, 70, 102)
    before = _encoder_counts(vision_deployment.port)
    for images, encoded, hits in (((first,), 1, 0), ((second,), 2, 0), ((first, second), 2, 2), ((first,), 2, 3)):
        assert _chat_tokens(sdk, _ask(*images)) == _reference_chat(vision_engine, _ask(*images))[1]
        counts = _encoder_counts(vision_deployment.port)
        assert (counts["encoded"] - before["encoded"], counts["hits"] - before["hits"]) == (encoded, hits), images
    _chat_tokens(sdk, [{"role": "user", "content": "no picture"}])
    assert _encoder_counts(vision_deployment.port) == counts
    assert counts["fallbacks"] == before["fallbacks"] and counts["held"] >= 2
    capsys.readouterr()
    assert duet_main(["status", "--target", f"127.0.0.1:{vision_deployment.port}"]) == 0
    printed = capsys.readouterr().out
    assert "encode-0" in printed and f"images: {counts['encoded']} encoded by the encode pool" in printed, printed


def test_the_prefill_engine_reads_the_encode_pools_output(vision_deployment, vision_engine, sdk):
    """The prefill engine computes from the encoder output in the cache, not with its own
    encoder: an image whose folder holds another image's output (as if another front door had
    left it there) is answered as that other image is, and not encoded again."""
    import shutil

    from duet.worker_runtime.images import image_digest

    shown, named = _png(60, 60, 103), _png(60, 60, 104)
    expected = _reference_chat(vision_engine, _ask(shown))[1]
    assert expected != _reference_chat(vision_engine, _ask(named))[1]
    assert _chat_tokens(sdk, _ask(shown)) == expected
    folder = vision_deployment.models[0].config.encode.cache_path
    shutil.copytree(os.path.join(folder, image_digest(shown)), os.path.join(folder, image_digest(named)))
    before = _encoder_counts(vision_deployment.port)
    assert _chat_tokens(sdk, _ask(named)) == expected, "the prefill engine encoded the image itself"
    after = _encoder_counts(vision_deployment.port)
    assert (after["encoded"], after["hits"]) == (before["encoded"], before["hits"] + 1)


def test_an_encode_worker_killed_mid_request_loses_no_request(vision_deployment, vision_engine, sdk):
    """The encode worker's engine hangs with a request's image in it and is then killed: the
    request is answered, vLLM's tokens, its prefill engine encoding the image (EP+D); the
    worker is replaced and encodes new images again."""
    import signal
    import threading

    import ray

    encode = vision_deployment.models[0].encode.members[0]
    restarts = encode.restarts
    pid = ray.get(encode.actor.__ray_call__.remote(lambda actor: actor._engine_processes.processes[0].pid), timeout=30)
    image, later = _png(90, 40, 104), _png(40, 90, 105)
    before = _encoder_counts(vision_deployment.port)
    answers: list[list[int]] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=lambda: answers.append(_chat_tokens(sdk, _ask(image))))
        asking.start()
        time.sleep(2)
        assert not answers, "the request did not wait for its image's encoding"
    finally:
        os.kill(pid, signal.SIGKILL)
    asking.join(timeout=300)
    assert answers == [_reference_chat(vision_engine, _ask(image))[1]]
    assert _encoder_counts(vision_deployment.port)["fallbacks"] == before["fallbacks"] + 1
    deadline = time.monotonic() + 300
    while not (encode.restarts > restarts and encode.state == "ready"):
        assert time.monotonic() < deadline, f"{encode.name} was not replaced: {encode.state} {encode.error}"
        time.sleep(0.5)
    assert _chat_tokens(sdk, _ask(later)) == _reference_chat(vision_engine, _ask(later))[1]
    assert _encoder_counts(vision_deployment.port)["encoded"] == before["encoded"] + 1


def test_an_image_sent_while_the_decode_worker_is_replaced_waits_for_it(vision_deployment, vision_engine, sdk):
    """The decode worker's engine is killed; a chat with an image sent while it is being
    replaced (no worker's engine in the front door to check images with) waits for the
    replacement, as any request waits for a worker, and is answered with vLLM's tokens. It was
    refused as if the model took no images (`duet bench serve --images`, workers killed for
    memory)."""
    import signal

    import ray

    decode = vision_deployment.models[0].decode.members[0]
    restarts = decode.restarts
    pid = ray.get(decode.actor.__ray_call__.remote(lambda actor: actor._engine_processes.processes[0].pid), timeout=30)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while decode.state == "ready":
        assert time.monotonic() < deadline, f"{decode.name}'s death was not noticed"
        time.sleep(0.05)
    image = _png(70, 50, 106)
    assert _chat_tokens(sdk, _ask(image)) == _reference_chat(vision_engine, _ask(image))[1]
    assert decode.restarts > restarts and decode.state == "ready"


def test_images_computed_whole_on_one_worker_answer_the_same(vision_deployment, vision_engine, sdk):
    """Colocated serving's path: with every prompt computed by the decode worker itself (as a
    colocated worker computes it, local prefill forced on), the decode engine encodes the
    images, nothing goes through the encode step, and the answers are vLLM's."""
    lifecycle = vision_deployment.models[0].service.lifecycle
    before = _encoder_counts(vision_deployment.port)
    lifecycle.local_prefill_max_tokens = 1 << 20
    try:
        for messages in (_ask(_png(30, 90, 106)), _ask(_png(90, 30, 107), _png(64, 64, 108))):
            assert _chat_tokens(sdk, messages) == _reference_chat(vision_engine, messages)[1]
    finally:
        lifecycle.local_prefill_max_tokens = 0
    assert _encoder_counts(vision_deployment.port) == before


def _noise_png(width: int, height: int) -> bytes:
    rng = random.Random(width * height)
    image = Image.frombytes("RGB", (width, height), bytes(rng.getrandbits(8) for _ in range(width * height * 3)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _solid_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(out, format="PNG")
    return out.getvalue()


TOO_BIG_FILE = _noise_png(160, 160)  # noise: over 64 KiB as PNG, well under 400x400 pixels
BAD_CHAT_PARTS = [
    ("not an image", {"type": "image_url", "image_url": {"url": _data_url(b"hello, not a picture")}}, "not an image"),
    ("damaged image", {"type": "image_url", "image_url": {"url": _data_url(RED[: len(RED) // 2])}}, "could not be decoded"),
    ("bad base64", {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
    ("not base64", {"type": "image_url", "image_url": {"url": "data:text/plain,hello"}}, "base64"),
    ("too many pixels", _image_part(_solid_png(401, 400)), "api.images.max_pixels"),
    ("too many bytes", _image_part(TOO_BIG_FILE), "api.images.max_bytes"),
    ("a host not allowed", {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}, "api.images.fetch_domains"),
    ("a file URL", {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "api.images.fetch_domains"),
    ("no url", {"type": "image_url", "image_url": {}}, "required"),
    ("unknown detail", {"type": "image_url", "image_url": {"url": _data_url(RED), "detail": "extreme"}}, "'auto'"),
    ("unknown part type", {"type": "video_url", "video_url": {"url": "x"}}, ""),
]


@pytest.mark.parametrize("case, part, says", BAD_CHAT_PARTS, ids=[case[0] for case in BAD_CHAT_PARTS])
def test_a_bad_image_is_refused_naming_its_part(vision_deployment, case, part, says):
    assert len(TOO_BIG_FILE) > 64 * 1024
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    status, reply = _post(vision_deployment.http_port, {"model": MODEL, "messages": messages, "max_tokens": 4})
    assert status == 400, reply
    assert reply["error"]["param"].startswith("messages.0.content.1"), reply
    assert says in reply["error"]["message"], reply


def test_too_many_images_a_url_that_times_out_and_placeholders_that_do_not_match(vision_deployment, image_server):
    port = vision_deployment.http_port
    five = [{"role": "user", "content": [_image_part(RED)] * 5}]
    status, reply = _post(port, {"model": MODEL, "messages": five, "max_tokens": 4})
    assert status == 400 and reply["error"]["param"] == "messages.0.content.4", reply
    assert "api.images.max_per_request" in reply["error"]["message"]
    slow = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_server}/slow.png"}}]}]
    started = time.monotonic()
    status, reply = _post(port, {"model": MODEL, "messages": slow, "max_tokens": 4})
    assert status == 400 and "api.images.fetch_timeout_s" in reply["error"]["message"], reply
    assert time.monotonic() - started < 6, "the front door waited past the fetch timeout (1 s) for the 10 s answer"
    missing = [{"role": "user", "content": [_image_part(RED), {"type": "text", "text": "404"}]}]
    missing[0]["content"][0]["image_url"]["url"] = f"{image_server}/none.png"
    status, reply = _post(port, {"model": MODEL, "messages": missing, "max_tokens": 4})
    assert status == 400 and "HTTP 404" in reply["error"]["message"], reply
    extra = [{"role": "user", "content": [{"type": "text", "text": f"{IMAGE_TOKEN} {IMAGE_TOKEN}"}, _image_part(RED)]}]
    status, reply = _post(port, {"model": MODEL, "messages": extra, "max_tokens": 4})
    assert status == 400 and reply["error"]["param"] == "messages", reply


def test_grpc_refuses_bad_images_naming_them(vision_deployment):
    import grpc

    from duet.router.client import DuetClient, build_request

    cases = [
        (build_request(f"{IMAGE_TOKEN} one", images=[RED, GREEN]), "images", "placeholder"),
        (build_request(f"{IMAGE_TOKEN} {IMAGE_TOKEN} two", images=[RED, b"junk"]), "images.1", "not an image"),
        (build_request(f"{IMAGE_TOKEN} big", images=[_solid_png(500, 400)]), "images.0", "max_pixels"),
        (build_request(" ".join([IMAGE_TOKEN] * 5), images=[RED] * 5), "images", "max_per_request"),
    ]
    with DuetClient(f"127.0.0.1:{vision_deployment.port}") as client:
        for request, field, says in cases:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate_ids(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"{field}:") and says in refused.value.details(), refused.value.details()


def test_fuzzed_content_parts_are_answered_or_refused_never_failed(vision_deployment):
    """Random content parts (types, fields, URLs, bytes): every answer is a 200 or a 400 that
    names a field under ``messages``, never a server error; the deployment serves after."""
    rng = random.Random(55)
    port = vision_deployment.http_port

    def part() -> Any:
        kind = rng.choice(["text", "image_url", "image_url", "other", "junk"])
        if kind == "text":
            return {"type": "text", "text": rng.choice(["", "hi", IMAGE_TOKEN, "x" * 50])}
        if kind == "image_url":
            url = rng.choice([
                _data_url(RED), _data_url(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))),
                "data:image/png;base64," + "A" * rng.randint(0, 9), "data:,", "http://", "https://127.0.0.1:1/x.png", "",
                _data_url(GREEN)[: rng.randint(20, 200)],
            ])
            return {"type": "image_url", "image_url": rng.choice([{"url": url}, {"url": url, "detail": "low"}, {"uri": url}, url])}
        if kind == "other":
            return {"type": rng.choice(["input_audio", "image", "", None]), "text": "x"}
        return rng.choice([None, 7, "text", [], {}])

    for _ in range(60):
        content = [part() for _ in range(rng.randint(0, 4))]
        status, reply = _post(port, {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
        assert status in (200, 400), (content, reply)
        if status == 400:
            assert reply["error"]["param"].startswith("messages"), (content, reply)
    status, reply = _post(port, {"model": MODEL, "messages": CHATS[0], "max_tokens": 2})
    assert status == 200, reply


def _post(port: int, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()
