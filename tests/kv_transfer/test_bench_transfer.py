"""The KV-transfer benchmark's cheap parts: its ceilings, its metric reading, its command line.

The full benchmark starts seven engines; these tests check what its numbers rest on instead:
the raw transports really move the bytes (each ceiling returns NaN when the received buffer is
wrong), the deployment's transfer metrics count exactly one transfer of the prompt's KV per
request, and bad input is a one-line error with exit code 2.
"""

from __future__ import annotations

import argparse
import math

import grpc
import pytest

from duet.benchmarks import kv_transfer as bench
from duet.worker_runtime.engine import resolve_model_path
from duet.kv_transfer.p2p.config import P2pConfig
from duet.router.proto import duet_api_pb2_grpc as pb_grpc

NBYTES = 4 << 20


@pytest.mark.parametrize(
    "measure",
    [
        lambda: bench.raw_gloo_seconds(NBYTES, reps=2),
        lambda: bench.raw_nixl_seconds(NBYTES, reps=2, descriptors=4),
        lambda: bench.memcpy_seconds(NBYTES, reps=2),
        lambda: bench.p2p_link_seconds(bench.KVGeometry(layers=4, bytes_per_token_per_layer=1024), 1024, reps=2),
    ],
    ids=["gloo", "nixl", "memcpy", "p2p-link"],
)
def test_ceiling_moves_the_bytes(measure):
    seconds = measure()
    assert math.isfinite(seconds) and 0 < seconds < 5


def test_prompt_bytes_are_whole_blocks(deployment):
    geometry = bench.KVGeometry.of(resolve_model_path(deployment.config.model))
    # tiny model: 4 layers x (K, V) x 4 KV heads x 32 dims x fp32 = 4 KiB per token
    assert geometry.prompt_bytes(1) == geometry.prompt_bytes(128) == 128 * 4096
    assert geometry.prompt_bytes(129) == 256 * 4096


def test_nixl_metrics_count_one_transfer_of_the_prompt_kv(deployment):
    """What the benchmark reads from a real deployment: one NIXL read per request, of the
    prompt's blocks, with a positive duration."""
    geometry = bench.KVGeometry.of(resolve_model_path(deployment.config.model))
    prompts = {"1k": bench.prompt_pairs(1000, 2)}

    async def measure():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
            stub = pb_grpc.DuetStub(channel)
            raw = bench.raw_seconds_for(bench.VARIANTS[0], {"1k": 1000}, geometry, reps=2)
            return await bench.measure_sizes(deployment, stub, "nixl", prompts, raw)

    run = deployment.background.run(measure(), timeout=600)["1k"]  # on the loop its engines live on
    # The shared deployment merges a decode engine's outputs (40 ms), so its second to fourth
    # tokens may arrive together; the benchmark's own deployments send every step.
    assert all(0 < t.first_s < t.second_s <= t.token_s[-1] and t.step_s >= 0 for t in run.timings)
    assert len(run.colocated_ttft_s) == 2 and min(run.colocated_ttft_s) > 0
    assert run.transfer.transfers == 2
    assert run.transfer.bytes == 2 * geometry.prompt_bytes(1000)
    assert run.transfer.gib_per_s > 0
    assert len(run.raw_s) == 2 and all(0 < t < 5 for t in run.raw_s), "raw NIXL measured before and after"


def test_hidden_fraction_is_the_unexposed_share_of_wire_time():
    ceilings = bench.Ceilings(1 << 20, memcpy=10.0, gloo=3.0, nixl=4.0, p2p_link=2.5)  # up front; the ratio uses raw_s
    run = bench.SizeRun(
        timings=[bench.Timing((0.1, 0.2, 0.21, 0.22))],
        colocated_ttft_s=[0.09],
        transfer=bench.TransferMetrics(transfers=1, bytes=2**30, seconds=1.0, exposed_s=0.25),
        raw_s=[2**20 / 2**30, 2**20 / 2**31],  # 1 GiB/s before the requests, 2 GiB/s after: the best counts
    )
    cell = bench.variant_result(run, ceilings, bench.VARIANTS[1])
    assert cell["hidden_fraction"] == pytest.approx(0.75)
    assert cell["ratio_to_raw"] == pytest.approx(0.5) and cell["ratio_to_memcpy"] == pytest.approx(0.1)
    assert cell["raw_gib_per_s"] == pytest.approx(2.0) and cell["raw_up_front_gib_per_s"] == 3.0
    assert cell["colocated_tt2t_s"] == pytest.approx(0.1)  # prefill alone + one decode step
    assert cell["added_tt2t_s"] == pytest.approx(0.1) and cell["added_ttft_s"] == pytest.approx(0.01)
    assert cell["added_handoff_s"] == pytest.approx(0.09)  # 0.1 s from first to second token, less a step


@pytest.mark.parametrize("sizes", ["", "1x", "0k", "64k", "1k,,abc"])
def test_bad_sizes_exit_2_with_one_line(sizes, capsys):
    parser = argparse.ArgumentParser()
    bench.register_command(parser.add_subparsers())
    args = parser.parse_args(["transfer", "--sizes", sizes])
    assert args.handler(args) == bench.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("duet bench transfer: error: --sizes") and err.count("\n") == 1


def test_layerwise_flag_parses_strings():
    assert P2pConfig.from_extra_config({"p2p_layerwise": "false"}).layerwise is False
    assert P2pConfig.from_extra_config({"p2p_layerwise": False}).layerwise is False
    assert P2pConfig.from_extra_config({}).layerwise is True
