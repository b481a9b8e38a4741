"""duet across hosts: the KubeRay manifests' own commands on virtual hosts, KV over the network.

Network namespaces on one machine (deploy/hosts.py): the head runs Ray's head and duet's front
end, prefill and decode run on hosts of their own, each started with its rendered container
command and environment (deploy/virtual_cluster.py). Links are shaped to 1 Gbit/s. For each
transport the output must equal a colocated vLLM engine's token for token, and the KV must have
gone from the prefill host's address to the decode host's. The nixl cluster runs the three-host
plan (deploy/examples/three-hosts-cpu.yaml: a decode worker on each of two hosts), so a drained
decode worker's streams move across the network, and the path between the two decode hosts is
cut while their KV crosses it: the moves must fall back to recomputing, and every stream must
still be exact. One cluster per transport, one after the other, a minute or two each.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from duet.benchmarks.greedy_streams import GreedyStreams
from duet.benchmarks.migration_hosts import THREE_HOSTS_PLAN, admin_key_settings
from duet.deploy.hosts import HostsUnavailable, LinkShape
from duet.deploy.virtual_cluster import TWO_HOSTS_PLAN, VirtualCluster, serve_on_hosts
from duet.router.client import DuetClient, build_request
from test_live_migration import _migration_samples
from waiting import wait_for

# Token ids stay below 700 (above the tiny model's specials); lengths cross KV block borders.
PROMPTS = [[3 + (i * 37 + n * 11) % 690 for i in range(n)] for n in (13, 200, 700, 1500)]
MAX_TOKENS = 16
# A hand-off that has not started decoding after this long is recomputed on the decode side
# (kv_transfer.handoff_timeout_s, 30 s by default): the moves over the cut path wait this long.
HANDOFF_TIMEOUT_S = 10.0
# The cut comes once the drained worker's host has sent this much since the drain: its streams'
# contexts (1,200-2,200 tokens at 4 KiB a token) are under way, none of them complete.
CUT_AFTER_BYTES = 1 << 20
MOVING_RATE_MBIT = 50  # the drained host's link while its KV leaves: seconds of transfer


@pytest.fixture(scope="module", params=["nixl", "nccl"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualCluster]:
    settings: dict = {"kv_transfer": {"transport": request.param, "handoff_timeout_s": HANDOFF_TIMEOUT_S}}
    plan = TWO_HOSTS_PLAN
    if request.param == "nixl":  # two decode hosts, and an admin key to drain one of them
        plan = THREE_HOSTS_PLAN
        settings.update(admin_key_settings(tmp_path_factory.mktemp("keys"), secrets.token_hex(16)))
    try:
        with serve_on_hosts(settings, LinkShape(rate_mbit=1000), plan=plan) as running:
            yield running
    except HostsUnavailable as error:
        pytest.skip(f"network namespaces cannot be created here: {error}")


def test_tokens_cross_hosts_exactly(cluster: VirtualCluster, reference) -> None:
    expected = reference.greedy(PROMPTS, MAX_TOKENS, ignore_eos=True)
    decode_workers = set()
    with _client(cluster) as client:
        for prompt, want in zip(PROMPTS, expected):
            request = build_request(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            got, last = client.generate_ids(request, timeout=120)
            assert got == want, f"{len(prompt)}-token prompt differs from the colocated engine"
            assert last.usage.prefill_worker == "prefill-0"
            decode_workers.add(last.usage.decode_worker)
        status = client.status()
    workers = {worker.name: worker for pool in status.pools for worker in pool.workers}
    decode_hosts = {name: _host_of(cluster, workers[name].kv_endpoint) for name in workers if name.startswith("decode")}
    # Each decode worker's KV channel is on a decode host's address, a host of its own.
    assert sorted(decode_hosts.values()) == sorted(h for h in cluster.network.hosts if h.startswith("decode")), decode_hosts
    for name in decode_workers:
        assert workers[name].kv_transfer_bytes > 0
    assert sum(workers[name].prompt_tokens_transferred for name in decode_workers) == sum(len(p) for p in PROMPTS)


def _process_names(cluster: VirtualCluster, host: str) -> list[str]:
    """What runs on virtual host ``host``: each process's name (its title where it set one)."""
    names = []
    for pid in cluster.network.pids(host):
        try:
            names.append(" ".join(psutil.Process(pid).cmdline()[:2])[:80])
        except psutil.Error:
            continue
    return names


def _host_of(cluster: VirtualCluster, endpoint: str) -> str:
    """The virtual host whose address ``endpoint`` (ADDRESS:PORT) is on."""
    host = cluster.network.host_at(endpoint)
    assert host is not None, f"{endpoint} is on none of the hosts"
    return host


def _client(cluster: VirtualCluster) -> DuetClient:
    """A client with the cluster's key: the keys file's (admin) where the config names one,
    which replaces the rendered Secret's key (deploy/render.py)."""
    keys_file = cluster.launch.head_config.config.server.auth.api_keys_file
    if keys_file is None:
        return cluster.client()
    return DuetClient(cluster.targets, api_key=yaml.safe_load(Path(keys_file).read_text())["keys"][0]["key"])


@pytest.mark.parametrize("cluster", ["nixl"], indirect=True)
def test_a_move_whose_path_is_cut_mid_pull_completes_by_recomputing(cluster: VirtualCluster, reference) -> None:
    """Draining a decode worker moves its streams to the other with their KV; the path between
    the two decode hosts is cut while that KV crosses it (both hosts stay up and reach the front door).
    The pulls stall; past the hand-off timeout the target recomputes the contexts instead. The path
    is mended while the streams still run (a stalled read may then complete into blocks freed
    meanwhile: the streams would show it). Every stream ends token-identical, none fails."""
    network = cluster.network
    prompts = [[3 + (i * 53 + seed * 101) % 690 for i in range(1200 + 200 * seed)] for seed in range(6)]
    tokens = 1600  # still decoding when the drain comes, and after the moves resume
    expected = reference.greedy(prompts, tokens, ignore_eos=True)
    with _client(cluster) as client:
        before = _migration_samples(client, cluster.metrics_url)
        streams = GreedyStreams(client, prompts, tokens)
        streams.start(decoding_tokens=2)
        # The worker with more of the streams is drained (the decode policy spreads them by the
        # KV use the last health pings reported, so a burst can land on either).
        leaving, staying = sorted(
            (w for p in client.list_workers().pools for w in p.workers if p.role == "decode"), key=lambda w: -w.requests_inflight
        )
        moving = leaving.requests_inflight
        assert moving > 0
        # Worker names and host names need not match: Ray placed each worker on a decode host.
        source, target = _host_of(cluster, leaving.kv_endpoint), _host_of(cluster, staying.kv_endpoint)
        network.shape(source, LinkShape(rate_mbit=MOVING_RATE_MBIT))
        sent = network.bytes_sent(source)
        client.drain(leaving.name)
        wait_for(lambda: network.bytes_sent(source) - sent > CUT_AFTER_BYTES, 120, f"{leaving.name}'s KV never left its host")
        network.set_path(source, target, up=False)
        cut_at = time.monotonic()
        # Every stream has tokens from after the cut (the moved ones resumed) or has ended.
        wait_for(
            lambda: all(a and a[-1][0] > cut_at for a, t in zip(streams.arrivals, streams.tokens) if len(t) < tokens),
            HANDOFF_TIMEOUT_S + 120, "the moved streams did not resume",
        )
        resumed_after_s = time.monotonic() - cut_at
        print(f"cut after {network.bytes_sent(source) - sent} bytes; {moving} moving; resumed after {resumed_after_s:.1f} s")
        network.set_path(source, target, up=True)
        network.shape(source, LinkShape(rate_mbit=1000))
        streams.join("cut path")
        after = _migration_samples(client, cluster.metrics_url)
    for index, (got, want) in enumerate(zip(streams.tokens, expected)):
        assert got == want, f"stream {index} differs from the colocated engine after the cut"

    def moved(direction: str, worker: str, method: str) -> float:
        key = ("duet_migrations_total", worker, direction, method)
        return after.get(key, 0.0) - before.get(key, 0.0)

    print(f"moved with their KV {moved('in', staying.name, 'kv'):g}, by recomputing {moved('in', staying.name, 'replay'):g}")
    assert moved("out", leaving.name, "kv") + moved("out", leaving.name, "replay") == moving
    assert moved("in", staying.name, "replay") >= 1, f"no move fell back to recomputing (resumed {resumed_after_s:.1f} s after the cut)"


@pytest.mark.parametrize("cluster", ["nixl"], indirect=True)
def test_the_hosts_chaos_harness_finds_each_worker_and_its_engine(cluster: VirtualCluster) -> None:
    """``duet bench chaos --hosts`` (benchmarks/chaos_hosts.py) acts on hosts by what runs on
    them: each worker's host from its KV channel's address, the engine core among the host's
    processes; and it reads full capacity from the status. Checked here without a fault (the
    faults themselves run in the benchmark)."""
    from duet.benchmarks.chaos_hosts import HostsProcesses

    processes = HostsProcesses(cluster, outage_s=30.0, connect=lambda: _client(cluster))
    assert [host for _, host in processes.workers("prefill")] == ["prefill-0"]
    seen: list[str] = []

    def each_ready_decode_worker_and_its_engine() -> list[tuple[str, str, int]] | None:
        """The ready decode workers with their hosts and engine cores, once the harness's view
        and the status agree. The cut-path test before this one drains one of the two decode
        workers and moves its streams to the other; a worker the status still calls ready whose
        engine core has just exited is marked restarting, then replaced, at the next health check
        (cluster/health.py), and the harness must then find the replacement's."""
        decode = processes.workers("decode")
        with _client(cluster) as client:
            ready = [w.name for p in client.list_workers().pools if p.role == "decode" for w in p.workers if w.state == "ready"]
        found = []
        for name, host in decode:
            try:
                found.append((name, host, processes.engine_pid(host)))
            except RuntimeError as error:
                seen.append(f"{error}; on it: {_process_names(cluster, host)}")
                return None
        if sorted(name for name, _ in decode) != sorted(ready) or not ready:
            seen.append(f"the harness found {decode}, the status calls {ready} ready")
            return None
        return found

    try:
        found = wait_for(each_ready_decode_worker_and_its_engine, 120, "the harness's view and the status agreeing")
    except AssertionError as error:
        raise AssertionError(f"{error}; first and last looks: {seen[:1] + seen[-1:]}") from None
    if seen:  # what the first looks saw, for the log: an engine that exited shows up here
        print("before the view settled:", *seen[:3], sep="\n  ")
    hosts = [host for _, host, _ in found]
    assert len(set(hosts)) == len(hosts) and all(host.startswith("decode-") for host in hosts), found
    for _, host, engine in found:
        assert engine in cluster.network.pids(host)
        assert all(engine not in cluster.network.pids(other) for other in cluster.network.hosts if other != host)
    # Full capacity is the status with every worker ready; the worker the cut-path test drained
    # may still be listed as draining (its engine holds the moved requests until their KV is
    # released), and then that is what keeps the cluster from it.
    def reported_as_in_the_status() -> bool:
        with _client(cluster) as client:
            not_ready = [f"{w.name} {w.state}" for p in client.list_workers().pools for w in p.workers if w.state != "ready"]
        return processes.missing_capacity() == ", ".join(not_ready)

    wait_for(reported_as_in_the_status, 30, "missing_capacity() disagrees with the workers' states")


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
