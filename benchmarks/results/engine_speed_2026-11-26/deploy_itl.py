"""Decode step inside a running deployment: client clock vs the decode engine core's own clock
(vllm:request_time_per_output_token_seconds from the worker's front end), outputs unmerged."""
import contextlib, statistics, subprocess, sys, tempfile, time, random, urllib.request
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from duet.router.client import DuetClient, build_request


@contextlib.contextmanager
def serving(edits):
    """A client of the default deployment with ``edits`` (old, new) applied to configs/local.yaml,
    on ports 50071 (gRPC) and 9471 (metrics), HTTP off; stopped with Ctrl-C on exit."""
    cfg = (REPO / "configs/local.yaml").read_text()
    for old, new in [("port: 50051", "port: 50071"), ("http_port: 8000", "http_port: null"), ("metrics_port: 9400", "metrics_port: 9471"), *edits]:
        cfg = cfg.replace(old, new)
    work = Path(tempfile.mkdtemp(prefix="duet-probe-"))
    (work / "probe.yaml").write_text(cfg)
    server = subprocess.Popen([str(REPO / ".venv/bin/duet"), "serve", "--config", str(work / "probe.yaml")], stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        with DuetClient("127.0.0.1:50071") as client:
            t0 = time.time()
            while not client.is_serving():
                time.sleep(1)
                assert time.time() - t0 < 300
            yield client
    finally:
        server.send_signal(2)
        server.wait(60)

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
    with serving([("output_interval_ms: 40", f"output_interval_ms: {interval}")]) as c:
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
