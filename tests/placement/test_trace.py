import numpy as np
import pytest

from duet.cluster.placement.cluster_spec import traces_dir
from duet.cluster.placement.trace import TraceError, load_trace, synthetic


def test_azure_and_mooncake_loaders_match_readme():
    d = traces_dir()
    if not d.exists():
        pytest.skip("shared traces not present")
    conv = load_trace(str(d / "AzureLLMInferenceTrace_conv.csv"))
    assert len(conv) == 19366
    assert np.median(conv.input_len) == 1020
    assert conv.mean_rate == pytest.approx(5.53, abs=0.01)
    moon = load_trace(str(d / "synthetic_trace.jsonl"))
    assert len(moon) == 3993
    assert moon.mean_rate == pytest.approx(3.91, abs=0.01)


def test_at_rate_rescales_times_but_keeps_requests():
    t = synthetic(500, rate=2.0, seed=3)
    fast = t.at_rate(20.0)
    assert fast.mean_rate == pytest.approx(20.0)
    assert np.array_equal(fast.input_len, t.input_len)
    assert np.allclose(np.diff(fast.arrival_s) * 20.0 / t.mean_rate, np.diff(t.arrival_s))


def test_gamma_arrivals_have_the_requested_burstiness():
    for cv in (1.0, 3.0):
        gaps = np.diff(synthetic(20000, rate=5.0, cv=cv, lengths="fixed:10:10").arrival_s)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_sharegpt_like_lengths_follow_distserve_filters():
    t = synthetic(5000, rate=1.0)
    assert np.all(t.input_len + t.output_len < 2048)
    assert np.all(t.input_len >= 4) and np.all(t.output_len >= 4)
    assert 400 < t.input_len.mean() < 800 and 120 < t.output_len.mean() < 260


@pytest.mark.parametrize(
    "spec, message",
    [
        ("synthetic:n=0", "n >= 1"),
        ("synthetic:lengths=zipf", "bad length distribution"),
        ("synthetic:rate=fast", "bad synthetic trace spec"),
        ("/nonexistent/trace.csv", "does not exist"),
    ],
)
def test_bad_trace_specs_are_explained(spec, message):
    with pytest.raises(TraceError, match=message):
        load_trace(spec)


def test_empty_trace_file_is_rejected(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(str(empty))


def test_window_is_a_disjoint_slice_and_head_its_first():
    t = synthetic(100, rate=2.0, seed=4)
    second = t.window(40, 40)
    assert len(second) == 40
    assert np.array_equal(second.input_len, t.input_len[40:80])
    assert np.array_equal(second.arrival_s, t.arrival_s[40:80])
    assert np.array_equal(t.head(40).output_len, t.window(0, 40).output_len)
    # A slice keeps its own arrival pattern when replayed at a rate.
    assert second.at_rate(5.0).mean_rate == pytest.approx(5.0)
