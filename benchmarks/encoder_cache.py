"""The encoder cache of E+P+D: encoder time saved when images repeat (``duet bench images``).

One deployment of configs/vision.yaml with two prefill workers, one decode worker and one encode
worker, on this machine's two cores, serving ``builtin-vl-large`` by default: the built-in
vision-language model with an image encoder heavy enough (about 40 ms an image on one core) that
encoder time is not lost in the overheads around it. Each round sends
``--images`` distinct images twice, the repeats shuffled in among the first sends (half the
requests carry an image seen before), as OpenAI chat requests at ``--rate`` requests/s
(Poisson), streamed. It runs two conditions on the same engines, in an order that rotates round
by round (the machine's speed moves between runs):

- ``cache``: a repeat is the same file, found in the encoder cache: each picture encoded once;
- ``no cache``: a repeat is a new file of the same pixels (another digest), as a client that
  encodes its image again sends, so every send is encoded: what serving costs without the cache.

Each condition of each round has files of its own (a text chunk tells them apart), so nothing
one cached serves another. Reported per condition: images the encode pool encoded, cache hits,
the seconds the router waited on the encode pool, TTFT p50/p90; and whether every request's
tokens were the same in both (they must be: the pixels are).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from duet.benchmarks.arguments import write_results
from duet.benchmarks.loadgen import nearest_rank
from duet.config import BUILTIN_VISION_MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "encoder_cache.json"
VISION_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "vision.yaml"
CONDITIONS = ("cache", "no cache")


def pictures(count: int, seed: int, sizes: Sequence[tuple[int, int]] = ()) -> list[Any]:
    """``count`` pictures of random pixels, each of a size drawn from ``sizes`` (width, height),
    or of random size (48-224 pixels a side) without them."""
    from PIL import Image

    rng = random.Random(seed)
    made = []
    for _ in range(count):
        width, height = rng.choice(sizes) if sizes else (rng.randint(48, 224), rng.randint(48, 224))
        made.append(Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)))
    return made


def png(picture: Any, tag: str) -> bytes:
    """``picture`` as a PNG file carrying ``tag`` in a text chunk: files with other tags are
    other files (another digest, so nothing of one is cached for another) of the same pixels."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("duet-bench", tag)
    out = io.BytesIO()
    picture.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def _sends(shown: list[Any], tag: str, cached: bool, seed: int) -> list[bytes]:
    """Each picture sent twice, each repeat at a random place after its first send. ``cached``:
    the repeat is the same file; otherwise a new file of the same pixels (what a client that
    encodes its image again sends), which no cache keyed by the file can save."""
    rng = random.Random(seed)
    firsts = [png(picture, f"{tag}-{index}") for index, picture in enumerate(shown)]
    sends = list(firsts)
    for index, first in enumerate(firsts):
        again = first if cached else png(shown[index], f"{tag}-{index}-again")
        sends.insert(rng.randint(sends.index(first) + 1, len(sends)), again)
    return sends


def image_chat(model: str, image: bytes, max_tokens: int, label: str) -> dict[str, Any]:
    """A greedy streamed chat request: ``label``, then ``image``, then a question. The label
    comes first so that no two requests share a cached prefix: a repeat of an image is saved
    its encoder pass by the encoder cache, not its whole prompt by an engine's prefix cache."""
    return {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": label}, image_part(image), {"type": "text", "text": "describe this"},
        ]}],
    }


def image_part(image: bytes) -> dict[str, Any]:
    """An OpenAI chat content part carrying the PNG file ``image`` inline, as a data: URL (no
    server fetches anything)."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}


async def streamed(session: Any, url: str, body: dict[str, Any]) -> tuple[float, float | None, list[int]]:
    """Send ``body`` (a streamed OpenAI request) to ``url``: its TTFT, its TPOT (None for one
    token) and its token ids, as the client saw them."""
    from duet.benchmarks.loadgen import client_tpot
    from duet.benchmarks.openai_replay import sse_data

    started, first, last, tokens = time.perf_counter(), None, 0.0, []
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
        async for event in sse_data(reply.content):
            for choice in event.get("choices") or []:
                last = time.perf_counter()
                first = first or last
                tokens.extend(choice.get("token_ids") or [])
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first - started, client_tpot(first, last, len(tokens)) if len(tokens) > 1 else None, tokens


async def _condition(deployment: Any, sends: list[bytes], rate: float, max_tokens: int, seed: int) -> dict[str, Any]:
    """Replay ``sends`` open-loop at ``rate``; what the encode step and the clients saw."""
    import aiohttp

    from duet.router.client import DuetClient

    def counts() -> Any:
        with DuetClient(f"127.0.0.1:{deployment.port}") as client:
            (cache,) = client.status().encoder_caches
        return cache

    before = await asyncio.to_thread(counts)
    rng = random.Random(seed)
    url = f"http://127.0.0.1:{deployment.http_port}/v1/chat/completions"
    model = deployment.models[0].name
    bodies = [image_chat(model, image, max_tokens, f"request {index}") for index, image in enumerate(sends)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(streamed(session, url, body)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    after = await asyncio.to_thread(counts)
    ttfts = [ttft for ttft, _, _ in results]
    return {
        "requests": len(sends),
        "images_encoded": after.images_encoded - before.images_encoded,
        "cache_hits": after.cache_hits - before.cache_hits,
        "fallbacks": after.fallbacks - before.fallbacks,
        "encode_seconds": after.encode_seconds - before.encode_seconds,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": nearest_rank(ttfts, 0.9),
        "tokens": [tokens for _, _, tokens in results],
    }


def vision_config(model_path: str, max_model_len: int | None = 1024) -> dict[str, Any]:
    """configs/vision.yaml serving the built-in vision model ``model_path``, no metrics port;
    ``max_model_len`` tokens a sequence (the image benchmarks' prompts are short; None: the
    model's own 4,096, for a trace's long prompts)."""
    from duet.config import load_config

    data = load_config(VISION_CONFIG).model_dump(exclude_unset=True)
    data["server"].update(metrics_port=None)
    data["model"].update(
        max_model_len=max_model_len, path=model_path, name=f"duet-tiny-idefics3{model_path.removeprefix('builtin-vl')}"
    )
    return data


def _config(cores: int, model_path: str) -> Any:
    from duet.config import parse_config

    data = vision_config(model_path)
    spread = list(range(cores))
    data["prefill"].update(replicas=2, num_cpus=0, cpu_cores=[spread[0], spread[-1]], kv_cache_gib=0.5)
    data["decode"].update(num_cpus=0, cpu_cores=[spread[-1]], kv_cache_gib=0.5)
    return parse_config(data, "bench images")


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment

    config = _config(os.cpu_count() or 2, args.model)
    deployment = await Deployment(config).start(port=0, http_port=0)
    runs = []
    try:
        warm_up = _sends(pictures(4, seed=1), "warm-up", cached=True, seed=1)
        await _condition(deployment, warm_up, args.rate, args.max_tokens, seed=0)  # every engine's first steps
        for round_index in range(args.rounds):
            shown = pictures(args.images, seed=1000 + round_index)
            order = CONDITIONS[round_index % 2:] + CONDITIONS[: round_index % 2]
            measured = {}
            for condition in order:
                sends = _sends(shown, f"{round_index}-{condition}", cached=condition == "cache", seed=round_index)
                measured[condition] = await _condition(deployment, sends, args.rate, args.max_tokens, seed=round_index)
            identical = measured["cache"].pop("tokens") == measured["no cache"].pop("tokens")
            for condition in order:
                run = {"round": round_index, "condition": condition, "identical_tokens": identical, **measured[condition]}
                print(_line(run), flush=True)
                runs.append(run)
    finally:
        await deployment.stop()
    return {"args": vars(args) | {"handler": None}, "runs": runs, "summary": summarize(runs)}


def _line(run: dict[str, Any]) -> str:
    return (
        f"round {run['round']} {run['condition']:8s}: {run['requests']} requests, {run['images_encoded']} images encoded, "
        f"{run['cache_hits']} cache hits, encode pool {run['encode_seconds']:.2f} s, TTFT p50 {run['ttft_p50_s'] * 1000:.0f} ms "
        f"p90 {run['ttft_p90_s'] * 1000:.0f} ms, tokens identical across conditions: {run['identical_tokens']}"
    )


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, the cache's encode time and TTFT p50 over the no-cache condition's; medians."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["condition"]] = run
    encode_ratios = [pair["cache"]["encode_seconds"] / pair["no cache"]["encode_seconds"] for pair in by_round.values()]
    ttft_ratios = [pair["cache"]["ttft_p50_s"] / pair["no cache"]["ttft_p50_s"] for pair in by_round.values()]
    return {
        "rounds": len(by_round),
        "encode_seconds_ratio_median": statistics.median(encode_ratios),
        "encode_seconds_ratios": encode_ratios,
        "ttft_p50_ratio_median": statistics.median(ttft_ratios),
        "images_encoded": {condition: [pair[condition]["images_encoded"] for pair in by_round.values()] for condition in CONDITIONS},
        "identical_tokens_every_round": all(run["identical_tokens"] for run in runs),
    }


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(args))
    summary = result["summary"]
    print(
        f"encoder cache: encode pool time {summary['encode_seconds_ratio_median']:.2f}x the no-cache condition's "
        f"(median of {summary['rounds']} rounds; {1 - summary['encode_seconds_ratio_median']:.0%} lower), TTFT p50 "
        f"{summary['ttft_p50_ratio_median']:.2f}x; images encoded {summary['images_encoded']}; "
        f"tokens identical in every round: {summary['identical_tokens_every_round']}"
    )
    return write_results(result, args.out, RESULTS)


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "images", help="E+P+D's encoder cache: encode time saved when half the images repeat (real vLLM, built-in vision model)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both conditions (rotating first)")
    parser.add_argument("--images", type=int, default=48, help="distinct images per round (each sent twice)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument(
        "--model", default="builtin-vl-large", choices=BUILTIN_VISION_MODELS,
        help="the built-in vision model: builtin-vl-large's encoder costs about 40 ms an image on one core, builtin-vl's a few",
    )
    parser.add_argument("--out", help=f"where the results go (JSON; default {RESULTS.name} in benchmarks/results)")
    parser.set_defaults(handler=_command)
