"""Profiles the real vLLM CPU engine once with a tiny grid, pinned to core 0, and measures how
much it slows beside a second engine busy on core 1 (about 80 s, 6 GB of RAM). The model is the
built-in vision-language one (the built-in tiny Llama behind an image encoder), so one engine
start profiles both the language model and the encoder.

It runs ``duet profile`` in its own process, as users do: profiling pins the calling process's
threads to the cores it frees for the engine, which must not leak into the test session.
"""

import os
import subprocess
import sys

import pytest

from duet.cluster.placement.latency_model import LatencyModel
from duet.cluster.placement.profiler import DEFAULT_GRID, grid_within

pytest.importorskip("vllm")


@pytest.mark.engine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the co-run measurement needs a second core")
def test_profile_real_engine_small_grid(tmp_path):
    out = tmp_path / "profile.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "duet.cli", "profile", "--model", "builtin-vl-large", "--grid", "small", "--cpus", "0", "--kv-cache-gib", "0.5", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = LatencyModel.load(out)
    engine = loaded.engine(1, 1)
    assert loaded.model == "duet-tiny-idefics3-large" and loaded.max_pp == 1 and list(loaded.fits) == [1]
    # longer prompts take longer, bigger batches take longer, and the numbers are plausible
    assert 1 < engine.prefill.batch_ms(64, 64**2) < engine.prefill.batch_ms(2048, 4 * 512**2) < 5000
    assert 0.1 < engine.decode.step_ms(1, 64) <= engine.decode.step_ms(32, 32 * 64) < 1000
    assert "tp=1 pp=1 only" in done.stdout
    # A fractional KV cache size is the engine's, exactly (vLLM's CPU variable takes whole GiB only).
    assert f"KV capacity: {2**29 // 4096} tokens (0.5 GiB)" in done.stdout
    # The engine ran as a worker runs it: the model in the engine core's process.
    assert "executor 'uni'" in done.stdout
    # The image encoder: tens of ms an image on one core (its 6-layer SigLIP tower on 224x224
    # pixels), and the tokens an image takes once expanded (16, and the markers around them).
    assert 5 < loaded.encoder.batch_ms(1) < loaded.encoder.batch_ms(4) < 2000
    assert 16 <= loaded.encoder.tokens_per_image <= 24 and "image encoder ms = " in done.stdout
    assert "Task was destroyed but it is pending" not in done.stderr  # the engine shut down cleanly
    # The neighbour engine ran (and was measured), and nothing of it is left running.
    assert "beside a busy engine on core 1" in done.stdout
    assert 0.0 <= loaded.serving_path.corun_slowdown < 1.0
    leftover = subprocess.run(["pgrep", "-f", "duet.cluster.placement.neighbour_load"], capture_output=True)
    assert leftover.returncode == 1, f"neighbour engine still running: {leftover.stdout!r}"


def test_the_default_grid_covers_long_prompts_and_drops_what_a_short_context_cannot_hold():
    assert max(grid_within(DEFAULT_GRID, 4096, "tiny").prefill_lengths) == 2048
    assert grid_within(DEFAULT_GRID, 1024, "short").prefill_lengths == (32, 128, 512, 1024)
    with pytest.raises(ValueError, match="needs 528-token contexts; short supports 256"):
        grid_within(DEFAULT_GRID, 256, "short")
