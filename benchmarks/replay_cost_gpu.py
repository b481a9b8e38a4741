"""What token replay costs on a GPU, against moving the KV: a what-if for live migration.

Live migration (worker_runtime/kv_migration.py) saves the target decode worker a prefill of each
moved request's context. On this project's CPU machine the built-in model recomputes a context
about as fast as its KV moves, so the saving does not show (docs/concepts/kv-transfer.md). This
script measures the other side on a GPU: the time a real model's shape (Llama-3-8B's, random
weights, bfloat16, PyTorch's SDPA attention through transformers) takes to prefill the contexts
of ``--streams`` moved requests one after another (what replay costs the target: each stream
waits for its own recomputation and those before it), and sets against it the time their KV
takes over links of given speeds (computed from the KV's size, not measured: no vLLM or NIXL
runs on the GPU machine lent here). It is not duet's serving path, only the two costs the move
trades. Run: ``python benchmarks/replay_cost_gpu.py --out results.json`` on a machine with CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

LLAMA_3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)
# Bytes per second of each link the KV could cross (NVLink within a host; RDMA NICs; Ethernet).
LINKS = {"NVLink 4 (450 GB/s)": 450e9, "RDMA 400 Gbit/s": 50e9, "RDMA 100 Gbit/s": 12.5e9, "TCP 10 Gbit/s": 1.25e9}


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", default="1500,3000", help="LOW,HIGH context tokens")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--out")
    args = parser.parse_args()
    low, high = (int(part) for part in args.context.split(","))
    rng = random.Random(args.seed)
    lengths = [rng.randint(low, high) for _ in range(args.streams)]

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    config = LlamaConfig(**LLAMA_3_8B)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16

    def prefill_s(tokens: int) -> float:
        ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        for _ in range(3):
            prefill_s(2048)  # warm-up: kernels chosen, memory pools grown
        recompute = [prefill_s(length) for length in lengths]
        again = [prefill_s(length) for length in lengths]  # a second pass: how steady the timing is
    recompute = [min(a, b) for a, b in zip(recompute, again)]

    # Replay on one target: each stream's stall ends when its own recomputation does, in turn.
    queued = [sum(recompute[: i + 1]) for i in range(len(recompute))]
    result = {
        "device": torch.cuda.get_device_name(),
        "model_shape": "Llama-3-8B (random weights, bfloat16, SDPA)",
        "context_tokens": lengths,
        "kv_bytes_per_token": kv_bytes_per_token,
        "prefill_s": recompute,
        "prefill_tokens_per_s": sum(lengths) / sum(recompute),
        "replay_stall_median_s": statistics.median(queued),
        "replay_stall_max_s": queued[-1],
        "kv_move": {},
    }
    print(f"{result['device']}: {args.streams} contexts of {low}-{high} tokens, {kv_bytes_per_token / 1024:.0f} KiB of KV per token")
    print(f"prefill {result['prefill_tokens_per_s']:,.0f} tokens/s; one context {statistics.median(recompute) * 1000:.1f} ms "
          f"(median); replay one after another: median stall {result['replay_stall_median_s'] * 1000:.0f} ms, "
          f"longest {result['replay_stall_max_s'] * 1000:.0f} ms")
    for link, rate in LINKS.items():
        # Pulls of all streams share the link: each stall ends when its own bytes are through.
        moved = [sum(lengths[: i + 1]) * kv_bytes_per_token / rate for i in range(len(lengths))]
        median, longest = statistics.median(moved), moved[-1]
        result["kv_move"][link] = {"stall_median_s": median, "stall_max_s": longest,
                                   "median_vs_replay": median / result["replay_stall_median_s"]}
        print(f"  KV over {link:22s}: median stall {median * 1000:7.1f} ms, longest {longest * 1000:7.1f} ms; "
              f"median {median / result['replay_stall_median_s']:.3f}x replay's")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
