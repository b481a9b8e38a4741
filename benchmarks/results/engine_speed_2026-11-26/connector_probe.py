"""Batch-1 decode step by the engine's clock: a profile's engine vs a deployment decode engine's
(NIXL connector as kv_consumer, duet's output plugin env), alternating fresh engines.
Engine pinned to core 1, this process (front end) on core 0."""
import asyncio, os, statistics, sys, time, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))

def run(kind: str, samples: int = 12) -> list[float]:
    from duet.config import ModelConfig, KVTransferConfig
    from duet.worker_runtime.engine import apply_environment, cpu_engine_environment, engine_kwargs
    from duet.kv_transfer.config import engine_environment, kv_transfer_config, TransferEndpoint
    from duet.worker_runtime.engine_output import ENV_OUTPUT_INTERVAL_MS
    os.sched_setaffinity(0, {1})
    env = cpu_engine_environment(1, 1)
    transfer = KVTransferConfig()
    kv = None
    if kind in ("nixl", "nixl+out40"):
        endpoint = TransferEndpoint("127.0.0.1", 5650)
        env.update(engine_environment(transfer, endpoint, 1))
        kv = kv_transfer_config(transfer, "decode", endpoint)
    env[ENV_OUTPUT_INTERVAL_MS] = "40" if kind == "nixl+out40" else "0"
    apply_environment(env)
    from prometheus_client import CollectorRegistry
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from duet.router.engine_front_end import new_front_end, shut_down
    kwargs = engine_kwargs(ModelConfig(), kv_cache_gib=1, kv_transfer_config=kv)
    if kind == "profile":  # as cluster/placement/profiler.py builds it
        kwargs.update(enable_prefix_caching=False, max_num_batched_tokens=33792, max_num_seqs=64, seed=0)
    cfg = AsyncEngineArgs(**kwargs).create_engine_config()
    engine = new_front_end(cfg, CollectorRegistry())
    os.sched_setaffinity(0, {0})
    import random
    rng = random.Random(1)
    async def one(i, n, out):
        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        async for o in engine.generate({"prompt_token_ids": [rng.randrange(10, 600) for _ in range(n)]}, params, f"r{i}"):
            last = o
        m = last.metrics
        return (m.last_token_ts - m.first_token_ts) / (out - 1) * 1e3
    async def main():
        await one(-1, 64, 8)
        return [await one(i, 72, 34) for i in range(samples)]
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        shut_down(engine)
        loop.close()

if __name__ == "__main__":
    kind = sys.argv[1]
    steps = run(kind, int(sys.argv[2]) if len(sys.argv) > 2 else 12)
    print("RESULT", kind, round(statistics.median(steps), 2), "quarters", [round(statistics.median(steps[i*len(steps)//4:(i+1)*len(steps)//4]), 2) for i in range(4)], flush=True)
