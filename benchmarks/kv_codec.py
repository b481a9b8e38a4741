"""``duet bench multinode --codec``: KV sent encoded (kv_transfer/p2p/codec.py) against raw.

Two parts, printed and written to ``results/kv_codec.json``:

- **Hand-off over shaped links.** duet on two virtual hosts (deploy/hosts.py; nccl transport,
  each prompt's KV sent after its prefill) with ``kv_transfer.codec`` ``off`` and ``auto``: each
  round starts a fresh deployment per setting, alternating, and measures every link speed on it
  by reshaping the hosts' links in place (fastest first; a warm-up request at each speed lets
  ``auto`` measure the link). Per request: TTFT, TT2T (the second token, the decode host's
  first) and the hand-off, TT2T - TTFT (the KV crossing plus the decode's first step). Medians
  per setting and speed, and the ratio raw / encoded per round; the greedy tokens of the same
  prompts compared between the two settings.
- **Accuracy**, in transformers on the same built-in model: the prompt's KV through the codec
  in groups of ``head_dim`` (as the CPU backend's LBHNC blocks hold it), its relative RMSE, the
  first decode step's logits from the decoded KV against the exact ones (cosine), and greedy
  tokens generated from each (agreement).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from duet.benchmarks.multinode import PROMPT_TOKENS, distinct_prompt, timed_request
from duet.deploy.hosts import LinkShape
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kv_codec.json"
MAX_TOKENS = 16
SETTINGS = ("off", "auto")


def _request(client: Any, prompt: list[int]) -> tuple[float, float, list[int]]:
    """One measured request (a 100 Mbit/s hand-off takes seconds: a longer deadline)."""
    return timed_request(client, prompt, MAX_TOKENS, timeout_s=300)


def _reshape(cluster: VirtualCluster, rate_mbit: float) -> None:
    for name in cluster.network.hosts:
        cluster.network.shape(name, LinkShape(rate_mbit=rate_mbit))


def measure_setting(codec: str, rates_mbit: list[float], requests: int, round_index: int) -> dict[str, Any]:
    """One deployment with ``kv_transfer.codec: codec``, every link speed measured on it."""
    settings = {"kv_transfer": {"transport": "nccl", "layerwise": False, "codec": codec}}
    out: dict[str, Any] = {}
    print(f"bench multinode --codec: round {round_index + 1}, codec {codec} ...", file=sys.stderr, flush=True)
    with serve_on_hosts(settings, LinkShape(rate_mbit=rates_mbit[0])) as cluster, cluster.client() as client:
        for speed, rate in enumerate(rates_mbit):
            _reshape(cluster, rate)
            _request(client, distinct_prompt(seed=20_000 + int(rate)))  # warm-up: auto measures the link
            # Prompts distinct across speeds and rounds (no prefix cache hits), the same for both settings.
            seeds = [1_000 * round_index + 100 * speed + i for i in range(requests)]
            runs = [_request(client, distinct_prompt(seed)) for seed in seeds]
            out[f"{rate / 1000:g}"] = {
                "ttft_s": [first for first, _, _ in runs],
                "tt2t_s": [second for _, second, _ in runs],
                "handoff_s": [second - first for first, second, _ in runs],
                "tokens": [tokens for _, _, tokens in runs],
            }
    return out


def hand_off(rates_mbit: list[float], requests: int, rounds: int) -> dict[str, Any]:
    """Both settings, alternating round by round; medians, per-round ratios, token agreement."""
    per_round = []
    for index in range(rounds):
        order = SETTINGS if index % 2 == 0 else SETTINGS[::-1]
        per_round.append({codec: measure_setting(codec, rates_mbit, requests, index) for codec in order})
    speeds = []
    for rate in rates_mbit:
        key = f"{rate / 1000:g}"
        row: dict[str, Any] = {"link_gbit_per_s": rate / 1000}
        for codec in SETTINGS:
            runs = [r[codec][key] for r in per_round]
            for metric in ("ttft_s", "tt2t_s", "handoff_s"):
                row[f"{codec}_{metric}_median"] = statistics.median(x for run in runs for x in run[metric])
        row["handoff_s_per_round"] = {codec: [r[codec][key]["handoff_s"] for r in per_round] for codec in SETTINGS}
        row["handoff_raw_over_encoded_per_round"] = [
            statistics.median(r["off"][key]["handoff_s"]) / statistics.median(r["auto"][key]["handoff_s"]) for r in per_round
        ]
        pairs = [(a, b) for r in per_round for ta, tb in zip(r["off"][key]["tokens"], r["auto"][key]["tokens"]) for a, b in zip(ta, tb)]
        row["greedy_tokens_agreeing"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        speeds.append(row)
    return {"requests_per_speed_and_round": requests, "rounds": rounds, "max_tokens": MAX_TOKENS, "speeds": speeds}


def accuracy(prompts: int, new_tokens: int = 32) -> dict[str, Any]:
    """The codec's error on the built-in model's real KV, and what it does to decoding."""
    import torch
    from transformers import AutoModelForCausalLM

    from duet.kv_transfer.p2p import codec
    from duet.worker_runtime.tiny_model import ensure_tiny_model

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    errors, cosines, agreeing, total = [], [], 0, 0
    with torch.no_grad():
        for seed in range(prompts):
            ids = torch.tensor([distinct_prompt(seed=50_000 + seed)])
            first = model(ids, use_cache=True)
            exact_cache = first.past_key_values
            decoded_cache = copy.deepcopy(exact_cache)
            originals, decodeds = [], []
            for layer in decoded_cache.layers:
                for name in ("keys", "values"):
                    original = getattr(layer, name)
                    group = original.shape[-1]
                    frame = codec.encode(original.contiguous(), group)
                    decoded = torch.empty_like(original)
                    codec.decode(torch.frombuffer(bytearray(frame), dtype=torch.uint8), group, decoded)
                    setattr(layer, name, decoded)
                    originals.append(original.flatten())
                    decodeds.append(decoded.flatten())
            errors.append(codec.relative_rmse(torch.cat(originals), torch.cat(decodeds)))
            token = first.logits[:, -1:].argmax(-1)
            streams = {"exact": (exact_cache, token), "decoded": (decoded_cache, token)}
            generated: dict[str, list[int]] = {"exact": [], "decoded": []}
            for step in range(new_tokens):
                logits = {}
                for name, (cache, last) in streams.items():
                    out = model(last, past_key_values=cache, use_cache=True)
                    logits[name] = out.logits[0, -1]
                    nxt = logits[name].argmax().view(1, 1)
                    streams[name] = (out.past_key_values, nxt)
                    generated[name].append(int(nxt))
                if step == 0:
                    cosines.append(torch.nn.functional.cosine_similarity(logits["exact"], logits["decoded"], dim=0).item())
            agreeing += sum(a == b for a, b in zip(generated["exact"], generated["decoded"]))
            total += new_tokens
    return {
        "prompts": prompts,
        "prompt_tokens": PROMPT_TOKENS,
        "kv_relative_rmse_max": max(errors),
        "first_step_logits_cosine_min": min(cosines),
        "greedy_tokens_agreeing": f"{agreeing}/{total}",
        "greedy_new_tokens_per_prompt": new_tokens,
    }


def format_table(result: dict[str, Any]) -> str:
    rows = [
        "| link | hand-off raw | hand-off auto | raw / auto per round | TTFT raw / auto | tokens agreeing |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["hand_off"]["speeds"]:
        ratios = ", ".join(f"{x:.2f}x" for x in r["handoff_raw_over_encoded_per_round"])
        rows.append(
            f"| {r['link_gbit_per_s']:g} Gbit/s | {r['off_handoff_s_median'] * 1000:.0f} ms | {r['auto_handoff_s_median'] * 1000:.0f} ms "
            f"| {ratios} | {r['off_ttft_s_median'] * 1000:.0f} / {r['auto_ttft_s_median'] * 1000:.0f} ms | {r['greedy_tokens_agreeing']} |"
        )
    a = result["accuracy"]
    rows.append(
        f"\naccuracy ({a['prompts']} prompts of {a['prompt_tokens']} tokens): KV relative RMSE at most {a['kv_relative_rmse_max']:.3%}, "
        f"first decode step's logits cosine at least {a['first_step_logits_cosine_min']:.6f}, greedy tokens agreeing {a['greedy_tokens_agreeing']}"
    )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    """``duet bench multinode --codec``'s handler (its --links, --requests, --rounds, --out)."""
    rates = sorted((float(rate) * 1000 for rate in args.links.split(",")), reverse=True)
    result = {
        "benchmark": "duet bench multinode --codec",
        "prompt_tokens": PROMPT_TOKENS,
        "accuracy": accuracy(prompts=4),
        "hand_off": hand_off(rates, args.requests, args.rounds),
    }
    out = args.out or DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"wrote {out}")
    return 0
