"""Config validation names the bad field and says what to fix."""

from __future__ import annotations

import pytest

from duet.config import DEFAULT_CONFIG_PATH, ConfigError, load_config, parse_config


def test_embedded_default_loads():
    config = load_config()
    assert config.prefill.replicas == 1 and config.decode.replicas == 1
    assert config.kv_transfer.transport == "nixl" and config.model.dtype == "float32"
    assert DEFAULT_CONFIG_PATH.name == "local.yaml"


@pytest.mark.parametrize(
    "data, field",
    [
        ({"prefill": {"replicas": 0}}, "prefill.replicas"),
        ({"decode": {"kv_cache_gib": -1}}, "decode.kv_cache_gib"),
        ({"decode": {"output_interval_ms": -5}}, "decode.output_interval_ms"),
        ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport"),
        ({"model": {"dtype": "int3"}}, "model.dtype"),
        ({"model": {"path": "/no/such/model"}}, "model.path"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"prefill": {"replicas": 2, "cpu_cores": [0]}}, "prefill"),
        ({"decode": {"replcas": 2}}, "decode.replcas"),
        ({"prefill": {"max_num_batched_tokens": 0}}, "prefill.max_num_batched_tokens"),
        ({"kv_transfer": {"nixl_progress_thread": True}}, "kv_transfer.nixl_progress_thread"),
    ],
)
def test_bad_field_is_named(data, field):
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    assert f"  {field}:" in str(raised.value)


def test_nixl_progress_thread_off_survives_yaml(tmp_path):
    """An unquoted ``off`` is YAML for false; it must still mean "off"."""
    path = tmp_path / "off.yaml"
    path.write_text("kv_transfer:\n  nixl_progress_thread: off\n")
    assert load_config(path).kv_transfer.nixl_progress_thread == "off"
    assert load_config().kv_transfer.nixl_progress_thread == "wait"


def test_engine_step_budget_is_set_explicitly():
    """The planner simulates the engines' per-step token budget, so duet sets it rather than
    inheriting whatever vLLM's default is for the platform."""
    from duet.worker_runtime.engine import engine_kwargs

    config = parse_config({"prefill": {"max_num_batched_tokens": 512}})
    assert config.decode.max_num_batched_tokens == 2048
    kwargs = engine_kwargs(
        config.model, kv_cache_gib=1, max_num_batched_tokens=config.prefill.max_num_batched_tokens
    )
    assert kwargs["max_num_batched_tokens"] == 512


def test_unreadable_and_malformed_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("prefill: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(scalar)
