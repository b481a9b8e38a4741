"""TTFT at low load inside a running deployment: client clock vs the prefill engine's own prefill
time (vllm:request_prefill_time_seconds) and queue time, one request at a time."""
import statistics, sys, time, random
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy_itl import build_request, metric, serving

if __name__ == "__main__":
    with serving([("local_prefill_queue_tokens: 1024", "local_prefill_queue_tokens: 0")]) as c:
            rng = random.Random(int(time.time()))
            def one(n, out):
                req = build_request(prompt_token_ids=[rng.randrange(10, 700) for _ in range(n)], max_tokens=out, ignore_eos=True)
                start = time.perf_counter(); first = None
                for r in c.generate(req, timeout=120):
                    if first is None:
                        first = time.perf_counter() - start
                return first
            one(64, 8)
            names = ["vllm:request_prefill_time_seconds", "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"]
            for n in (700, 1500, 1800):  # the first run (results.txt) had 700 and 1500 only
                for rnd in range(2):
                    before = {k: metric(k, "prefill") for k in names}
                    ttfts = [one(n, 8) * 1e3 for _ in range(8)]
                    time.sleep(0.5)
                    after = {k: metric(k, "prefill") for k in names}
                    parts = {k.split(":")[1].replace("_seconds", ""): 1e3 * (after[k][k + "_sum"] - before[k][k + "_sum"]) / max(1, after[k][k + "_count"] - before[k][k + "_count"]) for k in names}
                    print(f"RESULT prompt {n}: client TTFT median {statistics.median(ttfts):.1f} ms; prefill engine means " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), [round(x) for x in ttfts], flush=True)
