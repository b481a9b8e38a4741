"""The CLI subcommands through a tiny argparse harness, as duet/cli.py will call them."""

import argparse

import pytest

from duet.cluster.placement.commands import register_commands
from duet.cluster.placement.plan import Plan

CLUSTER = """
model: facebook/opt-13b
network_gbs: 25
gpu_types:
  a100-80g: {nvlink_gbs: 300, profile: distserve}
nodes:
  - {gpu_type: a100-80g, count: 2, gpus_per_node: 8}
"""


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="duet")
    register_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.handler(args)


@pytest.fixture
def config(tmp_path, opt13b):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return str(path)


def test_plan_then_simulate(tmp_path, config, capsys):
    out = tmp_path / "plan.yaml"
    trace = "synthetic:n=1500,rate=6,lengths=sharegpt"
    assert run("plan", "--config", config, "--trace", trace, "--slo", "ttft=0.25,tpot=0.1",
               "--workers", "1", "--out", str(out)) == 0
    plan = Plan.load(out)
    assert plan.expected.attainment >= 0.9
    printed = capsys.readouterr().out
    assert "configurations evaluated" in printed
    assert all(mode in printed for mode in ("deployment: ", "disaggregated", "conditional", "colocated"))
    assert run("simulate", "--config", config, "--trace", trace, "--slo", "ttft=0.25,tpot=0.1",
               "--plan", str(out), "--colocated-tp", "1") == 0
    printed = capsys.readouterr().out
    assert f"{plan.mode} plan: attainment" in printed and "colocated tp=1" in printed


def test_plan_modes_limit_the_comparison(tmp_path, config, capsys):
    out = tmp_path / "plan.yaml"
    assert run("plan", "--config", config, "--trace", "synthetic:n=600,rate=4", "--slo", "ttft=0.25,tpot=0.1",
               "--workers", "1", "--search-requests", "300", "--modes", "disaggregated", "--out", str(out)) == 0
    assert Plan.load(out).mode == "disaggregated"
    assert "conditional" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run("plan", "--config", config, "--trace", "synthetic:n=10", "--slo", "ttft=1,tpot=1", "--modes", "split")
    assert "choose from disaggregated, colocated, conditional" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "ttft=fast,tpot=0.1"], "is not a number"),
        (["--slo", "ttft=0.25"], "missing tpot"),
        (["--slo", "ttft=0.001,tpot=0.1"], "Closest feasible option"),
        (["--slo", "ttft=0.25,tpot=0.1", "--attainment", "1.5"], "attainment must be in"),
    ],
)
def test_bad_input_exits_2_with_a_message(config, capsys, argv, message):
    rc = run("plan", "--config", config, "--trace", "synthetic:n=300,rate=2", "--workers", "1", *argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_empty_trace_and_unknown_model(tmp_path, config, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run("plan", "--config", config, "--trace", str(empty), "--slo", "ttft=1,tpot=1") == 2
    assert "has no requests" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(CLUSTER.replace("facebook/opt-13b", "facebook/opt-14b"))
    assert run("plan", "--config", str(bad), "--trace", "synthetic:n=10", "--slo", "ttft=1,tpot=1") == 2
    assert "unknown model 'facebook/opt-14b'" in capsys.readouterr().err
