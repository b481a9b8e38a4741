"""Autoscaling policies and SLO profiles: the shipped ones load, bad ones fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from duet.cluster.autoscaler.policy import POLICY_DIR, SLO_DIR, PolicyError, load_policy, load_slo
from duet.config import ConfigError, load_config, parse_config


def test_shipped_profiles_and_policies_load() -> None:
    assert load_slo("chat").ttft_s == 0.25 and load_slo("chat").tpot_s == 0.1  # DistServe's chatbot
    assert load_slo("code").ttft_s == 0.125
    assert load_slo("summarization").ttft_s == 15
    for path in POLICY_DIR.glob("*.yaml"):
        load_policy(path.stem).slo_profile()
    assert {p.stem for p in SLO_DIR.glob("*.yaml")} >= {"chat", "code", "summarization"}


@pytest.mark.parametrize(
    "policy, field",
    [
        ({"slo": {"ttft_s": 0, "tpot_s": 0.1}}, "slo.SloProfile.ttft_s"),
        ({"slo": {"ttft_s": 0.5, "tpot_s": -1}}, "slo.SloProfile.tpot_s"),
        ({"prefill": {"min": 4, "max": 2}}, "prefill: min (4) is above max (2)"),
        ({"decode": {"min": 2}, "prefill": {"min": 2}, "budget": 3}, "budget (3) is below what the pools' minimums hold (4)"),
        ({"interval_s": 0}, "interval_s"),
        ({"slo": "nonesuch"}, "slo: no SLO profile named 'nonesuch'"),
        ({"scale_down": {"dealy_s": 3}}, "scale_down.dealy_s: unknown field"),
    ],
)
def test_bad_policies_are_rejected_naming_the_field(tmp_path: Path, policy: dict, field: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    with pytest.raises(PolicyError) as error:
        load_policy(str(path))
    assert field in str(error.value)


def test_unknown_policy_name_lists_the_known_ones() -> None:
    with pytest.raises(PolicyError, match="known: .*replay-chat"):
        load_policy("nonesuch")


def test_deployment_config_validates_its_autoscale_policy(tmp_path: Path) -> None:
    data = load_config().model_dump()
    with pytest.raises(ConfigError, match="autoscale: no autoscaling policy named 'nope'"):
        parse_config({**data, "autoscale": "nope"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: {min: 3, max: 1}\n")
    with pytest.raises(ConfigError, match="min \\(3\\) is above max \\(1\\)"):
        parse_config({**data, "autoscale": str(bad)})
    assert parse_config({**data, "autoscale": "local"}).autoscale == "local"
