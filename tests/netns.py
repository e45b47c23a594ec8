"""Many hosts on one machine: a hub and N hosts in network namespaces (Linux, root, iproute2).

    <tag>_hub : br0 10.213.0.1/24 (bridge ports v0, v1, ...)  e.g. launcher + TCPStore master
    <tag>_0   : eth0 10.213.0.2/24 <-veth-> hub:v0            e.g. ranks 0,1
    <tag>_1   : eth0 10.213.0.3/24 <-veth-> hub:v1            e.g. ranks 2,3
    ...

Each host's link can be limited with tc (tbf for a rate, netem for a delay), in both
directions, so the link and not the machine's cores decides how long traffic between
hosts takes. The root namespace is never touched: the veths are created inside hub and
their peer is moved straight into the host. <tag> = prefix + creator pid + random hex, so
parallel runs never clash (addresses repeat, but every run has its own namespaces).

    ok, why = available()                       # -> pytest.skip(why) when not ok
    with hosts(4, "mc", rate_bit=2_000_000_000) as t:   # t.hub, t.hosts, t.addr[ns]
        p = run_in(t.hosts[0], [sys.executable, "rank.py"], env=env, hostname="host-0")
        cut(t, t.hosts[1])                      # silently partitioned (no RST/ICMP/carrier change)
        restore(t, t.hosts[1])
        kill_group(p)                           # tests.faults: SIGKILL the group, reap p
    # on exit (also on exceptions) every process left in the namespaces is SIGKILLed
    # and the namespaces (and with them the veths/bridge/qdiscs) are deleted; namespaces
    # of runs whose process is gone (killed, timed out) are deleted at the next start.
    two_hosts("mc") is hosts(2) with t.a, t.b for the two hosts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import time

SUBNET = "10.213.0"
_IP = shutil.which("ip") or "/usr/sbin/ip"
_BRIDGE = shutil.which("bridge") or "/usr/sbin/bridge"
_UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
_TC = shutil.which("tc") or "/usr/sbin/tc"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=10)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(_IP, *args, check=check)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(_TC, "-n", ns, *args, check=check)


def available() -> tuple[bool, str]:
    """(True, "") if the fixture can run here, else (False, reason to skip)."""
    for tool in (_IP, _BRIDGE):
        if not os.path.exists(tool):
            return False, f"{tool} (iproute2) not found"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    name = f"nsprobe{os.getpid()}_{secrets.token_hex(3)}"
    try:
        for args in (
            ("netns", "add", name),
            ("-n", name, "link", "add", "x0", "type", "veth", "peer", "name", "x1"),
            ("-n", name, "link", "add", "b0", "type", "bridge"),
        ):
            r = _ip(*args, check=False)
            if r.returncode != 0:
                return False, f"'ip {' '.join(args)}' failed: {r.stderr.strip()}"
        return True, ""
    except Exception as e:
        return False, f"ip netns unusable: {e}"
    finally:
        _ip("netns", "del", name, check=False)


@dataclasses.dataclass(frozen=True)
class Topo:
    hub: str
    hosts: tuple  # the hosts' namespaces, host i at hosts[i]
    addr: dict  # ns -> IPv4 address
    rate_bit: int | None = None  # each host link's rate, bit/s per direction (None: unlimited)
    delay_us: int = 0  # one-way delay added on each host link, per direction

    @property
    def names(self) -> tuple:
        return (self.hub, *self.hosts)

    @property
    def a(self) -> str:
        return self.hosts[0]

    @property
    def b(self) -> str:
        return self.hosts[1]


# Fixed MACs so every namespace can get permanent ARP entries (see _pin_neighbors).
def _mac(i: int) -> str:
    return f"02:13:00:00:{i // 256:02x}:{i % 256:02x}"


def _index(t: Topo, ns: str) -> int:
    """1 for the hub, 2.. for the hosts (also the last byte of the address)."""
    return t.names.index(ns) + 1


def _dev(t: Topo, ns: str) -> str:
    return "br0" if ns == t.hub else "eth0"


def _port(t: Topo, ns: str) -> str:
    """The hub's bridge port of host `ns`."""
    return f"v{t.hosts.index(ns)}"


def _pin_neighbors(t: Topo, ns: str) -> None:
    # Without this, ~30-50 s into a cut the ARP entry goes FAILED and new connects
    # flip from "silent timeout" to EHOSTUNREACH after ~3 s: time-dependent behaviour.
    for other in t.names:
        if other != ns:
            _ip(
                "-n",
                ns,
                "neigh",
                "replace",
                t.addr[other],
                "lladdr",
                _mac(_index(t, other)),
                "dev",
                _dev(t, ns),
                "nud",
                "permanent",
            )


def delay_available() -> tuple[bool, str]:
    """(True, "") if this kernel has netem (needed for delay_us), else (False, why)."""
    name = f"nsprobe{os.getpid()}_{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "add", "x0", "type", "veth", "peer", "name", "x1")
        r = _tc(name, "qdisc", "add", "dev", "x0", "root", "netem", "delay", "1us", check=False)
        if r.returncode != 0:
            return False, f"tc netem unavailable in this kernel ({r.stderr.strip()})"
        return True, ""
    finally:
        _ip("netns", "del", name, check=False)


def _shape(ns: str, dev: str, rate_bit: int | None, delay_us: int) -> None:
    """Egress of `dev` in `ns`: netem (delay) with tbf (rate) below it.

    tbf's bucket holds 1 ms at the rate (at least 64 KiB, so a full GSO segment of the
    veth passes without being split) and its queue 20 ms, enough for TCP to keep a
    rate-limited link full without building a standing queue of seconds.
    """
    parent = "root"
    if delay_us:
        _tc(
            ns, *f"qdisc add dev {dev} root handle 1: netem delay {delay_us}us limit 100000".split()
        )
        parent = "parent 1:1"
    if rate_bit:
        burst = max(64 * 1024, rate_bit // 8 // 1000)
        tbf = f"tbf rate {rate_bit}bit burst {burst} latency 20ms"
        _tc(ns, *f"qdisc add dev {dev} {parent} handle 2: {tbf}".split())


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL whatever still runs in `ns` (only processes we started live there)."""
    for _ in range(100):
        r = _ip("netns", "pids", ns, check=False)
        pids = [int(x) for x in r.stdout.split()] if r.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete(ns: str) -> None:
    if os.path.exists(f"/run/netns/{ns}"):
        _kill_ns_pids(ns)
        _ip("netns", "del", ns, check=False)  # veths and bridge die with the namespace


def cleanup_stale(prefix: str) -> None:
    """Delete namespaces <prefix><pid>_* left behind by runs whose process is gone."""
    with contextlib.suppress(FileNotFoundError):
        for ns in os.listdir("/run/netns"):
            pid = ns[len(prefix) :].split("_", 1)[0] if ns.startswith(prefix) else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _delete(ns)


@contextlib.contextmanager
def hosts(
    n: int,
    prefix: str = "mc",
    rate_bit: int | None = None,
    delay_us: int = 0,
    sysctls: dict | None = None,
):
    """Create a hub and `n` hosts on its bridge; yield a Topo; always kill their processes
    and delete the namespaces (also on exceptions; stale ones of dead runs at start).

    rate_bit / delay_us: every host link limited to `rate_bit` bit/s and delayed by
    `delay_us` in each direction (the host's eth0 egress and the hub's port towards it), a
    full-duplex link as a NIC has. sysctls: applied in every namespace, e.g.
    {"net.ipv4.tcp_retries2": 3} makes a stalled TCP connection with unacked data fail
    (ETIMEDOUT) after ~6.6 s, not ~15 min.
    """
    if not 1 <= n <= 250:
        raise ValueError(f"netns.hosts: n must be in [1, 250], got {n}")
    if delay_us:
        ok, why = delay_available()
        if not ok:
            raise RuntimeError(f"netns.hosts(delay_us={delay_us}): {why}")
    cleanup_stale(prefix)
    tag = f"{prefix}{os.getpid()}_{secrets.token_hex(3)}"
    names = [f"{tag}_hub"] + [f"{tag}_{i}" for i in range(n)]
    t = Topo(
        names[0],
        tuple(names[1:]),
        {ns: f"{SUBNET}.{i}" for i, ns in enumerate(names, 1)},
        rate_bit,
        delay_us,
    )
    made: list = []
    try:
        for ns in t.names:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # IPv4 only: no DAD / router solicitations / MLD noise on the links.
            settings = {
                "net.ipv6.conf.all.disable_ipv6": 1,
                "net.ipv6.conf.default.disable_ipv6": 1,
                **(sysctls or {}),
            }
            _ip("netns", "exec", ns, "sysctl", "-qw", *(f"{k}={v}" for k, v in settings.items()))
        # STP off, forward_delay 0: ports forward immediately after (re)enabling.
        _ip(
            "-n",
            t.hub,
            "link",
            "add",
            "br0",
            "address",
            _mac(1),
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        )
        _ip("-n", t.hub, "addr", "add", f"{t.addr[t.hub]}/24", "dev", "br0")
        _ip("-n", t.hub, "link", "set", "br0", "up")
        for host in t.hosts:
            port = _port(t, host)
            _ip(
                "-n",
                t.hub,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "address",
                _mac(_index(t, host)),
                "netns",
                host,
            )
            _ip("-n", t.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{t.addr[host]}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            if rate_bit or delay_us:
                _shape(host, "eth0", rate_bit, delay_us)
                _shape(t.hub, port, rate_bit, delay_us)
        for ns in t.names:
            _pin_neighbors(t, ns)
        yield t
    finally:
        for ns in reversed(made):
            _delete(ns)


@contextlib.contextmanager
def two_hosts(prefix: str = "mc", sysctls: dict | None = None):
    """hosts(2): t.a and t.b are the two hosts."""
    with hosts(2, prefix, sysctls=sysctls) as t:
        yield t


def run_in(
    ns: str, argv: list, env: dict | None = None, hostname: str | None = None, **popen_kw
) -> subprocess.Popen:
    """Popen argv inside `ns`, as leader of its own session / process group.

    `ip netns exec` (and unshare, sh) exec in place, so p.pid is the program itself.
    hostname: give the process (and its children) a private UTS namespace with this
    hostname -- otherwise every namespace reports the root's hostname (same "host").
    """
    pre = [_IP, "netns", "exec", ns]
    if hostname:
        pre += [_UNSHARE, "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
    popen_kw.setdefault("start_new_session", True)
    return subprocess.Popen([*pre, *argv], env=env, **popen_kw)


def cut(t: Topo, ns: str, mode: str = "drop") -> None:
    """Cut host `ns` (one of t.hosts) off from the hub and the other hosts.

    "drop":     hub's bridge port -> disabled. Frames silently dropped both ways; no
                carrier change, ICMP or RST: TCP just stalls on both ends; connects time out.
    "linkdown": `eth0 down` inside ns. Connects *from* ns fail at once (ENETUNREACH);
                established sockets and the peers' side still stall silently.
    """
    if mode == "drop":
        # NB: `ip link set vB type bridge_slave state 0` is silently ignored; use `bridge`.
        _run(_BRIDGE, "-n", t.hub, "link", "set", "dev", _port(t, ns), "state", "0")
    elif mode == "linkdown":
        _ip("-n", ns, "link", "set", "eth0", "down")
    else:
        raise ValueError(mode)


def restore(t: Topo, ns: str) -> None:
    """Undo cut() (either mode). Stalled TCP resumes at its next retransmission."""
    _ip("-n", ns, "link", "set", "eth0", "up")
    _pin_neighbors(t, ns)  # eth0 down flushes even permanent neighbour entries
    _run(_BRIDGE, "-n", t.hub, "link", "set", "dev", _port(t, ns), "state", "3")  # forwarding
