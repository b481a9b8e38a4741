"""Profiles the real vLLM CPU engine once with a tiny grid (about 40 s, 3 GB of RAM)."""

import pytest

from duet.cluster.placement.latency_model import LatencyModel

pytest.importorskip("vllm")


@pytest.mark.engine
def test_profile_real_engine_small_grid(tmp_path):
    from duet.cluster.placement.profiler import SMALL_GRID, profile_engine

    model, report = profile_engine("tiny", SMALL_GRID, kv_cache_gib=1.0)
    model.save(tmp_path / "profile.yaml")
    loaded = LatencyModel.load(tmp_path / "profile.yaml")
    engine = loaded.engine(1, 1)
    assert loaded.model == "duet-tiny-llama" and loaded.max_pp == 1 and list(loaded.fits) == [1]
    # longer prompts take longer, bigger batches take longer, and the numbers are plausible
    assert 1 < engine.prefill.batch_ms(64, 64**2) < engine.prefill.batch_ms(2048, 4 * 512**2) < 5000
    assert 0.1 < engine.decode.step_ms(1, 64) <= engine.decode.step_ms(32, 32 * 64) < 1000
    assert "tp=1 pp=1 only" in report
