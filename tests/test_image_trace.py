"""``duet bench serve --images``: the image mix, the chat requests it makes, the chat replay's
stream parsing, and the flags (benchmarks/image_trace.py, serve_bench.py, openai_replay.py).
No engines: the replay runs against a loopback aiohttp server streaming as vLLM's chat does."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from duet.benchmarks import serve_bench
from duet.benchmarks.encoder_cache import VISION_CONFIG, image_part, pictures, png
from duet.benchmarks.image_trace import IMAGE_MIXES, chat_bodies, image_plan, plan_counts, prompt_texts
from duet.benchmarks.openai_replay import replay_openai_chat
from duet.benchmarks.serve_report import render_table
from duet.benchmarks.serving_systems import _command
from duet.cluster.placement.trace import Trace
from duet.config import COLOCATED_CONFIG_PATH, load_config
from duet.router.openai_protocol import ChatCompletionRequest, parse
from duet.worker_runtime.tiny_model import CORPUS_WORDS

VQA = IMAGE_MIXES["vqa"]


class WordTokenizer:
    """One token a word, as the built-in tokenizer makes of its corpus words after a space."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [CORPUS_WORDS.index(word) for word in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(CORPUS_WORDS[i] for i in token_ids)


def _trace(n: int) -> Trace:
    return Trace("t", np.arange(n) * 0.05, np.full(n, 12), np.full(n, 3))


def test_the_mix_is_the_same_for_a_seed_and_another_for_another():
    assert image_plan(VQA, 200, seed=4) == image_plan(VQA, 200, seed=4)
    assert image_plan(VQA, 200, seed=4) != image_plan(VQA, 200, seed=5)


def test_the_mix_has_its_stated_proportions_and_repeats():
    plan = image_plan(VQA, 4000, seed=1)
    counts = np.bincount([len(request) for request in plan], minlength=3) / len(plan)
    assert np.allclose(counts, VQA.count_weights, atol=0.03)
    sent = plan_counts(plan)
    assert sent["requests"] == 4000 and sent["requests_with_images"] == sum(1 for request in plan if request)
    repeats = sent["images_sent"] - sent["distinct_images"]
    assert repeats / sent["images_sent"] == pytest.approx(VQA.repeat_share, abs=0.03)
    # New pictures are numbered in order of their first send; any other is an earlier
    # request's (never the same one twice in a request).
    seen: set[int] = set()
    for request in plan:
        assert len(set(request)) == len(request)
        for picture in request:
            if picture not in seen:
                assert picture == len(seen)
                seen.add(picture)


def test_prompt_texts_are_the_traces_lengths_in_tokens():
    tokenizer = WordTokenizer()
    texts = prompt_texts([1, 5, 300], seed=2, tokenizer=tokenizer)
    assert [len(tokenizer.encode(text)) for text in texts] == [1, 5, 300]
    assert texts == prompt_texts([1, 5, 300], seed=2, tokenizer=tokenizer) != prompt_texts([1, 5, 300], 3, tokenizer)


def test_chat_bodies_are_openai_chat_requests_with_the_plans_images():
    trace = _trace(30)
    bodies = chat_bodies("m", trace, seed=7, mix=VQA, tokenizer=WordTokenizer())
    plan = image_plan(VQA, len(trace), seed=7)
    files: dict[int, str] = {}
    for body, images in zip(bodies, plan):
        request = parse(ChatCompletionRequest, body)  # duet's own validation of an OpenAI chat body
        assert request.stream and request.ignore_eos and request.max_tokens == 3 and request.temperature == 0
        assert body["stream_options"] == {"include_usage": True}
        text, *parts = body["messages"][0]["content"]
        assert text["type"] == "text" and len(text["text"].split()) == 12
        assert [part["type"] for part in parts] == ["image_url"] * len(images)
        for picture, part in zip(images, parts):
            url = part["image_url"]["url"]
            assert url.startswith("data:image/png;base64,")
            assert files.setdefault(picture, url) == url  # an image sent again is the same file
    assert len(set(files.values())) == len(files) == plan_counts(plan)["distinct_images"]
    # Each new picture is one of the stated sizes.
    from PIL import Image

    sizes = {Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size for url in files.values()}
    assert sizes <= set(VQA.sizes)
    # The largest request (two of the largest pictures) fits in duet's HTTP body limit.
    largest = max(VQA.sizes, key=lambda size: size[0] * size[1])
    url = image_part(png(pictures(1, seed=0, sizes=[largest])[0], "largest"))["image_url"]["url"]
    assert 2 * len(url) < load_config(VISION_CONFIG).server.http_max_body_bytes * 0.9
    # Another replay's seed sends none of this replay's files.
    other = chat_bodies("m", trace, seed=8, mix=VQA, tokenizer=WordTokenizer())
    other_urls = {part["image_url"]["url"] for body in other for part in body["messages"][0]["content"][1:]}
    assert not other_urls & set(files.values())


async def _chat(request: web.Request) -> web.StreamResponse:
    """Streams as vLLM's chat does: the role chunk with the first token, a token a chunk, usage."""
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(0.02)
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": "x"}}]}] * body["max_tokens"]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": body["max_tokens"], "total_tokens": 9}})
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.sleep(0.005)
    await response.write(b"data: [DONE]\n\n")
    return response


def test_the_chat_replay_records_each_request_with_the_traces_lengths():
    trace = _trace(4)
    bodies = chat_bodies("m", trace, seed=0, mix=VQA, tokenizer=WordTokenizer())

    async def run() -> list:
        app = web.Application(client_max_size=4 * 2**20)  # duet's server.http_max_body_bytes
        app.router.add_post("/v1/chat/completions", _chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await replay_openai_chat(f"http://127.0.0.1:{runner.addresses[0][1]}", trace, bodies, 30.0)
        finally:
            await runner.cleanup()

    records = asyncio.run(run())
    assert [r.error for r in records] == [""] * 4
    assert [(r.input_len, r.output_len, r.completion_tokens) for r in records] == [(12, 3, 3)] * 4
    assert all(0.02 <= r.client_ttft_s < r.client_e2e_s for r in records)


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_bench.register_command(parser.add_subparsers())
    return parser.parse_args(["serve", "--trace", "synthetic:n=8,rate=1,cv=1", *flags])


def test_images_default_to_duets_disaggregated_modes_and_vllm_on_the_vision_config():
    plan = serve_bench.plan_from_args(_args("--images", "vqa", "--rates", "1,2", "--rounds", "2", "--warmup-s", "5"))
    assert plan.systems == ["duet-disagg-http", "duet-disagg-http@epd", "vllm"]
    assert (plan.images, plan.warmup_s) == ("vqa", 5.0) and "vqa" in plan.trace_label
    config = serve_bench.plan_config(plan)
    assert config.model.path == "builtin-vl-large" and config.encode.replicas == 1 and config.model.max_model_len is None
    # Every replay's images, as the report gives them: the warm-up's and each rate's in each round.
    replays = serve_bench.image_replays(plan)
    assert [r["replay"] for r in replays] == ["warm-up", "1 req/s, round 1", "2 req/s, round 1", "1 req/s, round 2", "2 req/s, round 2"]
    assert len({r["seed"] for r in replays}) == 5 and all(r["requests"] == 8 for r in replays)
    # Without --images, today's systems and the embedded default.
    text = serve_bench.plan_from_args(_args())
    assert not text.images and text.systems == list(serve_bench.DEFAULT_SYSTEMS)
    assert serve_bench.plan_config(text) == load_config()


def test_each_duet_way_and_vllm_serve_the_same_vision_model(tmp_path: Path):
    config = serve_bench.plan_config(serve_bench.plan_from_args(_args("--images", "vqa")))

    def written(system: str):
        command, _ = _command(system, config, 8123, tmp_path)
        return load_config(command[command.index("--config") + 1])

    assert written("duet-disagg-http").encode.replicas == 1
    assert written("duet-disagg-http@epd").encode.replicas == 0
    colocated = written("duet-colocated-http")
    assert colocated.mode == "colocated" and colocated.encode.replicas == 0
    assert colocated.colocated == load_config(COLOCATED_CONFIG_PATH).colocated  # two workers, one core each
    assert {written(s).model for s in ("duet-disagg-http", "duet-disagg-http@epd", "duet-colocated-http")} == {config.model}
    command, env = _command("vllm", config, 8123, tmp_path)
    assert Path(command[command.index("--model") + 1]).name.startswith("duet-tiny-idefics3-large-")
    assert command[command.index("--served-model-name") + 1] == config.model.name
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # duet's prefill and decode caches together
    # The text default's colocated config is configs/colocated.yaml's, as before.
    command, _ = _command("duet-colocated-http", load_config(), 8123, tmp_path)
    assert load_config(command[command.index("--config") + 1]).model_dump(exclude={"router"}) == (
        load_config(COLOCATED_CONFIG_PATH).model_dump(exclude={"router"})
    )


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--images", "vqa", "--systems", "duet-disagg,vllm"], "--images: duet-disagg cannot"),
        (["--images", "vqa", "--systems", "vllm-pd"], "--images: vllm-pd cannot"),
        (["--images", "vqa", "--systems", "duet-colocated"], "--images: duet-colocated cannot"),
        (["--images", "vqa", "--endpoint", "grpc://127.0.0.1:50051"], "--endpoint"),
        (["--images", "vqa", "--mix", "features"], "--mix features"),
        (["--warmup-s", "0"], "--warmup-s"),
        (["--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    ],
)
def test_bad_image_trace_flags_exit_2_naming_the_flag(flags, names, capsys):
    args = _args(*flags)
    assert args.handler(args) == serve_bench.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("duet bench serve: error:") and names in err and err.count("\n") == 1


def test_the_table_of_an_image_trace_is_titled_with_its_mix():
    report = {
        "slos": {"tight": {"ttft_s": 1.0, "tpot_s": 0.04}},
        "images": {"mix": "vqa", "description": VQA.description, "replays": [
            {"replay": "warm-up", "seed": 0, "requests": 8, "requests_with_images": 6, "images_sent": 7, "distinct_images": 4},
        ]},
        "systems": {},
    }
    table = render_table(report)
    assert table.startswith(f"Image trace `vqa`: {VQA.description}.")
    assert "| warm-up | 0 | 6 of 8 | 7 | 4 |" in table
    assert not render_table({**report, "images": None}).startswith("Image trace")
