"""Text requests beside image requests: what the image encoder costs text prompts in E+P+D, EP+D
and colocated serving (``duet bench image-load``).

A Poisson stream of text-only chats (``--text-rate``, prompts of ``--text-words`` random words,
``--output-tokens`` tokens) of ``--duration`` seconds' worth of requests, alone or beside a Poisson
stream of image chats (``--image-rate``, each a new image, so every one is encoded). The model is
``builtin-vl-large`` by default, whose image encoder costs about 40 ms an image on one core.

Two deployments, one after the other, on this machine's two cores:

- **apart**: configs/vision.yaml with its prefill worker on core 0, and the decode worker and
  the encode worker on core 1. Three conditions a round, in an order that rotates round by
  round: text alone; text beside images in E+P+D (the encode worker encodes); text beside images
  in EP+D (the router's encode step is bypassed, so the prefill engine encodes each image
  itself, as with ``encode.replicas: 0``).
- **colocated**: two colocated workers, one a core; text alone and text beside images.

Reported per condition: the text requests' TTFT p50/p90 and TPOT p50, and the image requests'
TTFT p50; and per mode, the text TTFT p50 beside images over alone, round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path
from typing import Any

from duet.benchmarks.arguments import write_results
from duet.benchmarks.loadgen import nearest_rank
from duet.benchmarks.encoder_cache import image_chat, pictures, png, streamed, vision_config
from duet.config import BUILTIN_VISION_MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "image_load.json"
_WORDS = ("red", "green", "blue", "cat", "dog", "tree", "house", "river", "stone", "cloud", "light", "road")


def _text_chat(model: str, rng: random.Random, words: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True,
        "messages": [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(words))}],
    }


async def _stream_of(session: Any, url: str, bodies: list[dict[str, Any]], rate: float, seed: int) -> list[Any]:
    """Send ``bodies`` open-loop at ``rate`` (Poisson); every result."""
    rng = random.Random(seed)
    tasks = []
    for body in bodies:
        tasks.append(asyncio.create_task(streamed(session, url, body)))
        await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


async def _condition(deployment: Any, args: argparse.Namespace, images: bool, tag: str, seed: int) -> dict[str, Any]:
    import aiohttp

    url = f"http://127.0.0.1:{deployment.http_port}/v1/chat/completions"
    model = deployment.models[0].name
    # Every request made before the clock starts (encoding images is client work), each text
    # its own (no condition's prompts are cached by another's).
    text_rng = random.Random(f"{tag}-text")
    texts = [_text_chat(model, text_rng, args.text_words, args.output_tokens) for _ in range(round(args.text_rate * args.duration))]
    shown = pictures(round(args.image_rate * args.duration), seed=seed) if images else []
    files = [image_chat(model, png(picture, f"{tag}-{index}"), args.output_tokens, tag) for index, picture in enumerate(shown)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        streams = [_stream_of(session, url, texts, args.text_rate, seed)]
        if images:
            streams.append(_stream_of(session, url, files, args.image_rate, seed + 1))
        results = await asyncio.gather(*streams)
    text = results[0]
    measured = {
        "text_requests": len(text),
        "text_ttft_p50_s": statistics.median(ttft for ttft, _, _ in text),
        "text_ttft_p90_s": nearest_rank([ttft for ttft, _, _ in text], 0.9),
        "text_tpot_p50_s": statistics.median(tpot for _, tpot, _ in text if tpot is not None),
    }
    if images:
        measured.update(image_requests=len(results[1]), image_ttft_p50_s=statistics.median(ttft for ttft, _, _ in results[1]))
    return measured


def _configs(args: argparse.Namespace) -> dict[str, Any]:
    from duet.config import parse_config

    apart = vision_config(args.model)
    apart["prefill"].update(cpu_cores=[0], kv_cache_gib=0.5)
    apart["decode"].update(cpu_cores=[1], kv_cache_gib=0.5)
    apart["encode"].update(cpu_cores=[1])
    colocated = vision_config(args.model)
    colocated.update(mode="colocated", colocated={"replicas": 2, "cpu_cores": [0, 1], "kv_cache_gib": 0.5})
    for mode in ("prefill", "decode", "encode"):
        colocated.pop(mode, None)
    return {"apart": parse_config(apart, "bench image-load"), "colocated": parse_config(colocated, "bench image-load")}


# Each deployment's conditions: (name, with images, with the encode step).
_CONDITIONS = {
    "apart": [("text alone", False, True), ("text + images, E+P+D", True, True), ("text + images, EP+D", True, False)],
    "colocated": [("text alone", False, True), ("text + images, colocated", True, True)],
}


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duet.cluster.deployment import Deployment

    runs = []
    for mode, config in _configs(args).items():
        deployment = await Deployment(config).start(port=0, http_port=0)
        try:
            lifecycle = deployment.models[0].service.lifecycle
            encoder = lifecycle.encoder
            warm = argparse.Namespace(**{**vars(args), "duration": 3.0})
            await _condition(deployment, warm, images=True, tag=f"{mode}-warm", seed=1)
            conditions = _CONDITIONS[mode]
            for round_index in range(args.rounds):
                shift = round_index % len(conditions)
                for name, images, encoding in conditions[shift:] + conditions[:shift]:
                    lifecycle.encoder = encoder if encoding else None
                    measured = await _condition(deployment, args, images, f"{mode}-{round_index}-{name}", seed=100 + round_index)
                    run = {"mode": mode, "round": round_index, "condition": name, **measured}
                    print(_line(run), flush=True)
                    runs.append(run)
            lifecycle.encoder = encoder
        finally:
            await deployment.stop()
    return {"args": vars(args) | {"handler": None}, "runs": runs, "summary": summarize(runs)}


def _line(run: dict[str, Any]) -> str:
    images = f", images TTFT p50 {run['image_ttft_p50_s'] * 1000:.0f} ms ({run['image_requests']})" if "image_requests" in run else ""
    return (
        f"{run['mode']} round {run['round']} {run['condition']:26s}: text TTFT p50 {run['text_ttft_p50_s'] * 1000:.0f} ms "
        f"p90 {run['text_ttft_p90_s'] * 1000:.0f} ms, TPOT p50 {run['text_tpot_p50_s'] * 1000:.1f} ms "
        f"({run['text_requests']} requests){images}"
    )


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition with images: its text TTFT p50 (and TPOT p50) over the same round's text
    alone on the same deployment, round by round, and the median."""
    alone = {(run["mode"], run["round"]): run for run in runs if run["condition"] == "text alone"}
    summary: dict[str, Any] = {}
    for run in runs:
        if run["condition"] == "text alone":
            continue
        base = alone[run["mode"], run["round"]]
        entry = summary.setdefault(run["condition"], {"ttft_p50_ratios": [], "tpot_p50_ratios": []})
        entry["ttft_p50_ratios"].append(run["text_ttft_p50_s"] / base["text_ttft_p50_s"])
        entry["tpot_p50_ratios"].append(run["text_tpot_p50_s"] / base["text_tpot_p50_s"])
    for entry in summary.values():
        entry["ttft_p50_ratio_median"] = statistics.median(entry["ttft_p50_ratios"])
        entry["tpot_p50_ratio_median"] = statistics.median(entry["tpot_p50_ratios"])
    return summary


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(args))
    for condition, entry in result["summary"].items():
        print(
            f"{condition}: text TTFT p50 {entry['ttft_p50_ratio_median']:.2f}x text alone's, TPOT p50 "
            f"{entry['tpot_p50_ratio_median']:.2f}x (median of {len(entry['ttft_p50_ratios'])} rounds)"
        )
    return write_results(result, args.out, RESULTS)


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "image-load", help="text TTFT beside image requests in E+P+D, EP+D and colocated (real vLLM, built-in vision model)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per deployment, each running its conditions (rotating first)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds each condition sends for")
    parser.add_argument("--text-rate", type=float, default=4.0, help="text requests/s (Poisson)")
    parser.add_argument("--text-words", type=int, default=200, help="words in a text prompt")
    parser.add_argument("--image-rate", type=float, default=6.0, help="image requests/s (Poisson), each a new image")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--model", default="builtin-vl-large", choices=BUILTIN_VISION_MODELS, help="the built-in vision model")
    parser.add_argument("--out", help=f"where the results go (JSON; default {RESULTS.name} in benchmarks/results)")
    parser.set_defaults(handler=_command)
