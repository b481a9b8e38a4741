"""Decode step inside a running deployment: client clock vs the decode engine core's own clock
(vllm:request_time_per_output_token_seconds from the worker's front end), outputs unmerged."""
import re, statistics, subprocess, sys, time, random, urllib.request
sys.path.insert(0, "/work/main")
from duet.router.client import DuetClient, build_request

def metric(name, role="decode"):
    text = urllib.request.urlopen("http://127.0.0.1:9471/metrics").read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith(name) and f'role="{role}"' in line:
            key = line.split("{")[0]
            vals[key] = vals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return vals

if __name__ == "__main__":
    interval = sys.argv[1] if len(sys.argv) > 1 else "0"
    cfg = open("/work/main/configs/local.yaml").read().replace("output_interval_ms: 40", f"output_interval_ms: {interval}").replace("port: 50051", "port: 50071").replace("http_port: 8000", "http_port: null").replace("metrics_port: 9400", "metrics_port: 9471")
    open("/tmp/y/probe.yaml", "w").write(cfg)
    server = subprocess.Popen(["/work/main/.venv/bin/duet", "serve", "--config", "/tmp/y/probe.yaml"], stdout=open("/tmp/y/serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        with DuetClient("127.0.0.1:50071") as c:
            t0 = time.time()
            while not c.is_serving():
                time.sleep(1)
                assert time.time() - t0 < 300
            rng = random.Random(int(time.time()))
            def one(n, out):
                req = build_request(prompt_token_ids=[rng.randrange(10, 700) for _ in range(n)], max_tokens=out, ignore_eos=True)
                stamps = []
                for r in c.generate(req, timeout=120):
                    stamps += [time.perf_counter()] * max(len(r.token_ids), 1)
                return stamps
            one(64, 8)
            name = "vllm:request_time_per_output_token_seconds"
            for rnd in range(4):
                before = metric(name)
                steps = []
                for _ in range(6):
                    s = one(72, 34)
                    steps.append((s[-1] - s[1]) / (len(s) - 2) * 1e3)
                after = metric(name)
                eng = 1e3 * (after[name + "_sum"] - before[name + "_sum"]) / (after[name + "_count"] - before[name + "_count"])
                print(f"RESULT deploy interval={interval} client median {statistics.median(steps):.2f} ms  engine-clock mean {eng:.2f} ms", [round(x, 1) for x in steps], flush=True)
    finally:
        server.send_signal(2)
        server.wait(60)
