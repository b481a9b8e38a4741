"""duet across hosts: the KubeRay manifests' own commands on virtual hosts, KV over the network.

Three network namespaces on one machine (deploy/hosts.py): the head runs Ray's head and duet's
front end, prefill and decode run on hosts of their own (deploy/examples/two-hosts-cpu.yaml),
each started with its rendered container command and environment (deploy/virtual_cluster.py).
Links are shaped to 1 Gbit/s. For each transport the output must equal a colocated vLLM engine's
token for token, and the KV must have gone from the prefill host's address to the decode host's.
One cluster per transport, one after the other (two engines alive at a time), about a minute each.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from duet.deploy.hosts import HostsUnavailable, LinkShape
from duet.deploy.virtual_cluster import VirtualCluster, serve_on_hosts
from duet.router.client import build_request

# Token ids stay below 700 (above the tiny model's specials); lengths cross KV block borders.
PROMPTS = [[3 + (i * 37 + n * 11) % 690 for i in range(n)] for n in (13, 200, 700, 1500)]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["nixl", "nccl"])
def cluster(request: pytest.FixtureRequest) -> Iterator[VirtualCluster]:
    settings = {"kv_transfer": {"transport": request.param}}
    try:
        with serve_on_hosts(settings, LinkShape(rate_mbit=1000)) as running:
            yield running
    except HostsUnavailable as error:
        pytest.skip(f"network namespaces cannot be created here: {error}")


def test_tokens_cross_hosts_exactly(cluster: VirtualCluster, reference) -> None:
    expected = reference.greedy(PROMPTS, MAX_TOKENS, ignore_eos=True)
    with cluster.client() as client:
        for prompt, want in zip(PROMPTS, expected):
            request = build_request(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            got, last = client.generate_ids(request, timeout=120)
            assert got == want, f"{len(prompt)}-token prompt differs from the colocated engine"
            assert (last.usage.prefill_worker, last.usage.decode_worker) == ("prefill-0", "decode-0")
        status = client.status()
    workers = {worker.name: worker for pool in status.pools for worker in pool.workers}
    decode_host = cluster.network["decode-0"].address
    assert workers["decode-0"].kv_endpoint.startswith(f"{decode_host}:"), "KV channel not on the decode host's address"
    assert workers["decode-0"].prompt_tokens_transferred == sum(len(p) for p in PROMPTS)
    assert workers["decode-0"].kv_transfer_bytes > 0


def test_link_shapes_are_tbf_under_netem() -> None:
    """Bandwidth alone is one tbf; delay or loss put netem at the root with tbf beneath it."""
    assert LinkShape().qdiscs() == []
    (only_rate,) = LinkShape(rate_mbit=1000).qdiscs()
    assert only_rate[:4] == ["root", "tbf", "rate", "1000mbit"]
    root, child = LinkShape(rate_mbit=10000, delay_ms=2, loss_pct=0.1).qdiscs()
    assert root == ["root", "handle", "1:", "netem", "delay", "2ms", "loss", "0.1%"]
    assert child[:5] == ["parent", "1:1", "handle", "10:", "tbf"]


def test_the_three_host_plan_puts_each_decode_worker_on_a_host_of_its_own(tmp_path) -> None:
    """`duet bench migrate --link-gbit`'s plan: a moved request's KV crosses hosts only if the
    two decode workers have a host each (and the prefill engine a core of its own)."""
    from duet.benchmarks.migration_hosts import THREE_HOSTS_PLAN
    from duet.cluster.placement.plan import Plan
    from duet.deploy.render import RenderOptions, plan_launch
    from duet.deploy.virtual_cluster import host_groups

    plan = Plan.load(THREE_HOSTS_PLAN)
    base = tmp_path / "base.yaml"
    base.write_text("{}\n")
    assert list(host_groups(plan_launch(plan, RenderOptions(), base))) == ["head", "prefill-0", "decode-0", "decode-1"]
    decode_nodes = [stage.node for replica in plan.decode.placement for stage in replica.stages]
    assert len(set(decode_nodes)) == 2 and plan.prefill.placement[0].stages[0].node not in decode_nodes
