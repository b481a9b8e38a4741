"""Several hosts on one machine: Linux network namespaces on a bridge, with shaped links.

Each :class:`Host` is a network namespace with one address on a private /24, joined to a bridge
in the root namespace by a veth pair (the root namespace holds the bridge's address too, so a
test or benchmark process reaches every host directly). A host is what a Kubernetes pod gives
a Ray node and nothing less:

- a **default route** (Ray finds its node address by routing towards a public address; without
  one it falls back to 127.0.0.1 and other nodes cannot reach it);
- its own **hostname**, resolving to its own address in its own ``/etc/hosts`` (gloo, the nccl
  transport on CPU, binds to whatever the hostname resolves to), and a resolver that answers at
  once (there is no DNS server; see ``_RESOLV_CONF``);
- its own ``/tmp/ray`` and ``~/.ray`` (Ray's session files and auth token; shared ones would mix
  the nodes' sessions, and touch the machine's own Ray);
- its own ``/dev/shm`` (a pod's is its own too): the host KV pool keeps its blocks there, and a
  shared one would make every host's pool one pool.

Processes start in a fresh mount and UTS namespace inside the host's network namespace, so all
of that stays private to them. Links are shaped with ``tc`` on both ends of each veth (tbf for
bandwidth, netem for delay and loss), i.e. per direction; traffic between two hosts crosses two
shaped links. :meth:`HostNetwork.close` kills every process in every namespace it made and
removes namespaces, veths and bridge, whatever state a failed test left them in.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PREFIX = "duet-"
_INNER_DEV = "eth0"
# The hosts have no DNS server (the machine's is not reachable from the bridge). Without this,
# a lookup (torch's TCPStore resolves every peer's name) waits for the machine's nameserver
# until it times out; with it, the query is refused at once and /etc/hosts answers the names.
_RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no CAP_NET_ADMIN, no iproute2)."""


class ShapingError(RuntimeError):
    """The kernel refused a link shape (e.g. netem is not built in); says which part."""


@dataclass(frozen=True)
class LinkShape:
    """One direction of a host's link: bandwidth (tbf), one-way delay and loss (netem).

    ``None``/0 leave that property unshaped."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def qdiscs(self) -> list[list[str]]:
        """``tc qdisc`` arguments (after ``dev X``) that install this shape, root first."""
        netem = ["delay", f"{self.delay_ms:g}ms"] if self.delay_ms else []
        netem += ["loss", f"{self.loss_pct:g}%"] if self.loss_pct else []
        tbf = []
        if self.rate_mbit:
            bytes_per_s = self.rate_mbit * 1e6 / 8
            # The bucket must hold a GSO segment (64 KiB) and a timer tick's worth (4 ms) of
            # traffic, or tbf caps the rate below what it was given.
            burst = max(256 * 1024, int(bytes_per_s * 0.004))
            tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
        if netem and tbf:
            return [["root", "handle", "1:", "netem", *netem], ["parent", "1:1", "handle", "10:", *tbf]]
        if netem:
            return [["root", "netem", *netem]]
        return [["root", *tbf]] if tbf else []


@dataclass
class Host:
    """One virtual host; start processes on it with :meth:`HostNetwork.popen`."""

    name: str
    netns: str
    address: str
    hostname: str
    veth: str  # the root-namespace end of its link
    root: Path  # private files: hosts file, Ray's directories, process logs
    shm: Path  # its /dev/shm: a directory of the machine's, so still memory
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result


def _free_subnet() -> ipaddress.IPv4Network:
    """A random /24 in 10.128.0.0/9 that no route or address on this machine overlaps."""
    used = []
    for args in (("-j", "-4", "route", "show", "table", "all"), ("-j", "-4", "addr")):
        for entry in json.loads(_ip(*args).stdout or "[]"):
            for text in [entry.get("dst", "")] + [a.get("local", "") for a in entry.get("addr_info", [])]:
                if text and text[0].isdigit():
                    used.append(ipaddress.ip_network(text if "/" in text else f"{text}/32", strict=False))
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{128 + secrets.randbelow(128)}.{secrets.randbelow(256)}.0/24")
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise RuntimeError("no free /24 in 10.128.0.0/9 for the virtual hosts")


class HostNetwork:
    """Hosts named ``names`` on one bridge, each link shaped as ``shape``; a context manager."""

    def __init__(self, names: list[str], shape: LinkShape = LinkShape()) -> None:
        self.tag = secrets.token_hex(3)
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[-1])  # the bridge's own address in the root namespace
        self.bridge = f"dbr{self.tag}"  # interface names are at most 15 characters
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.tag}-"))
        self.hosts = {
            name: Host(
                name=name,
                netns=f"{PREFIX}{self.tag}-{name}",
                address=str(addresses[i]),
                hostname=f"{name}-{self.tag}",
                veth=f"dv{self.tag}{i}",
                root=self.workdir / name,
                shm=Path("/dev/shm") / f"{PREFIX}{self.tag}-{name}",
            )
            for i, name in enumerate(names)
        }
        self._created: list[str] = []  # namespaces that exist, for close()
        self._bridge_made = False
        self._shape = shape

    def __enter__(self) -> HostNetwork:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ---- building ------------------------------------------------------------------------

    def _create(self) -> None:
        if shutil.which("ip") is None:
            raise HostsUnavailable("iproute2's `ip` is not installed")
        first = next(iter(self.hosts.values()))
        result = _ip("netns", "add", first.netns, check=False)
        if result.returncode != 0:
            raise HostsUnavailable(f"`ip netns add` failed (needs root or CAP_NET_ADMIN): {result.stderr.strip()}")
        self._created.append(first.netns)
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n" + "".join(f"{h.address} {h.hostname}\n" for h in self.hosts.values())
        for host in self.hosts.values():
            if host.netns not in self._created:
                _ip("netns", "add", host.netns)
                self._created.append(host.netns)
            for sub in ("ray-tmp", "ray-home", "logs"):
                (host.root / sub).mkdir(parents=True)
            host.shm.mkdir()
            (host.root / "hosts").write_text(hosts_file)
            (host.root / "resolv.conf").write_text(_RESOLV_CONF)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", _INNER_DEV, "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", _INNER_DEV, netns=host.netns)
            for device in ("lo", _INNER_DEV):
                _ip("link", "set", device, "up", netns=host.netns)
            _ip("route", "add", "default", "via", self.gateway, netns=host.netns)
            self.shape(host.name, self._shape)

    def shape(self, name: str, shape: LinkShape) -> None:
        """Shape host ``name``'s link both ways (replacing any shape it had)."""
        host = self.hosts[name]
        for netns, device in ((None, host.veth), (host.netns, _INNER_DEV)):
            prefix = ["ip", "netns", "exec", netns] if netns else []
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
            for qdisc in shape.qdiscs():
                result = subprocess.run([*prefix, "tc", "qdisc", "add", "dev", device, *qdisc], capture_output=True, text=True)
                if result.returncode != 0:
                    raise ShapingError(f"tc qdisc add dev {device} {' '.join(qdisc)}: {result.stderr.strip()}")

    def set_link(self, name: str, up: bool) -> None:
        """Take host ``name``'s link down (unplugged: nothing in or out) or bring it back."""
        _ip("link", "set", self.hosts[name].veth, "up" if up else "down")

    def set_path(self, a: str, b: str, up: bool) -> None:
        """Cut the path between hosts ``a`` and ``b`` (each silently drops what it would send the
        other: a blackhole route), or mend it. Both keep their links to every other host: a
        failed switch port between two racks, not a host unplugged. TCP connections between them
        stall, as over a cut cable, and carry on if the path is mended before they time out."""
        for here, there in ((a, b), (b, a)):
            route = ("blackhole", f"{self.hosts[there].address}/32")
            _ip("route", "del" if up else "add", *route, netns=self.hosts[here].netns)

    def host_at(self, endpoint: str) -> str | None:
        """The host whose address ``endpoint`` (ADDRESS or ADDRESS:PORT) is on; None if none."""
        address = endpoint.rsplit(":", 1)[0]  # IPv4: a bare address has no colon
        return next((name for name, host in self.hosts.items() if host.address == address), None)

    def bytes_sent(self, name: str) -> int:
        """Bytes host ``name`` has sent over its link so far (its veth's root end received them)."""
        return int(Path(f"/sys/class/net/{self.hosts[name].veth}/statistics/rx_bytes").read_text())

    # ---- processes -----------------------------------------------------------------------

    def popen(self, name: str, command: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        """Start ``command`` on host ``name`` with exactly ``env``; output to ``logs/<log>``."""
        host = self.hosts[name]
        ray_home = Path(env.get("HOME", "/root")) / ".ray"
        for mount_point in (Path("/tmp/ray"), ray_home):
            mount_point.mkdir(parents=True, exist_ok=True)  # outside, empty: only mounted over
        setup = (
            'hostname "$1" && mount --bind "$2/hosts" /etc/hosts && mount --bind "$2/resolv.conf" /etc/resolv.conf '
            '&& mount --bind "$2/ray-tmp" /tmp/ray '
            '&& mount --bind "$2/ray-home" "$3" && mount --bind "$4" /dev/shm && shift 4 && exec "$@"'
        )
        wrapped = [
            "ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts", "--propagation", "private",
            "/bin/sh", "-c", setup, "sh", host.hostname, str(host.root), str(ray_home), str(host.shm), *command,
        ]
        output: IO[bytes] = open(host.root / "logs" / log, "ab")
        with output:
            # A process group of its own (a Ctrl-C at the terminal does not reach it), in this
            # session: a session of its own would be an autogroup of its own (the kernel's
            # sched_autogroup), and the kernel then shares a core between hosts by group, not by
            # thread. Engines of two hosts pinned to one core then starved one another: a decode
            # engine sharing a core with a prefill engine whose NIXL progress thread spun got no
            # CPU for seconds, missed its health pings and was replaced, its requests waiting
            # (tests/test_kv_pool_hosts.py's hang, docs/concepts/kv-pool.md).
            process = subprocess.Popen(wrapped, env=env, stdout=output, stderr=subprocess.STDOUT, process_group=0)
        host.processes.append(process)
        return process

    def log(self, name: str, log: str, tail_lines: int = 40) -> str:
        """The last lines of a process log on host ``name`` (for error messages)."""
        path = self.hosts[name].root / "logs" / log
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail_lines:]) if path.exists() else ""

    def kill_all(self, name: str, grace_s: float = 5.0) -> None:
        """Stop every process on host ``name`` (SIGTERM, then SIGKILL after ``grace_s``): the
        host's power cut, as far as its processes go. Only processes in this host's network
        namespace are touched, and only this harness puts processes there."""
        host = self.hosts[name]
        start = time.monotonic()
        # Bounded even if a process cannot die (stuck in the kernel): deleting the namespace
        # afterwards still detaches it from the links.
        while (pids := self._pids(host.netns)) and time.monotonic() - start < 2 * grace_s:
            sig = signal.SIGTERM if time.monotonic() - start < grace_s else signal.SIGKILL
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for process in host.processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        host.processes.clear()

    def pids(self, name: str) -> list[int]:
        """Every process on host ``name`` (in its network namespace)."""
        return self._pids(self.hosts[name].netns)

    @staticmethod
    def _pids(netns: str) -> list[int]:
        result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        return [int(pid) for pid in result.stdout.split()]

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every process, namespace, link and file this network made; safe to repeat."""
        made = [host.name for host in self.hosts.values() if host.netns in self._created]
        if made:  # every host's power cut at once: one grace period, not one per host
            with ThreadPoolExecutor(len(made)) as killers:
                list(killers.map(self.kill_all, made))
        for netns in self._created:
            _ip("netns", "del", netns, check=False)  # also removes both ends of its veth
        self._created.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
        shutil.rmtree(self.workdir, ignore_errors=True)
        for host in self.hosts.values():
            shutil.rmtree(host.shm, ignore_errors=True)
