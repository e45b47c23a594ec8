"""Tiny "hub + two hosts" network-namespace fixture (Linux, root, iproute2).

    <tag>_hub : br0 10.213.0.1/24 (bridge ports vA, vB)   e.g. launcher + TCPStore master
    <tag>_a   : eth0 10.213.0.2/24 <-veth-> hub:vA         e.g. ranks 0,1
    <tag>_b   : eth0 10.213.0.3/24 <-veth-> hub:vB         e.g. ranks 2,3

The root namespace is never touched: the veths are created inside hub and their peer
is moved straight into a/b.  <tag> = prefix + creator pid + random hex, so parallel
runs never clash (addresses repeat, but every run has its own namespaces).

    ok, why = available()               # -> pytest.skip(why) when not ok
    with two_hosts("mc") as t:          # t.hub, t.a, t.b, t.addr[ns]
        p = run_in(t.a, [sys.executable, "rank.py"], env=env, hostname="host-a")
        cut(t, t.b)                     # b silently partitioned (no RST/ICMP/carrier change)
        restore(t, t.b)
        kill_group(p)                   # tests.faults: SIGKILL the group, reap p
    # on exit (also on exceptions) every process left in the namespaces is SIGKILLed
    # and the namespaces (and with them the veths/bridge) are deleted.
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


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=10)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(_IP, *args, check=check)


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
    a: str
    b: str
    addr: dict  # ns -> IPv4 address

    @property
    def names(self) -> tuple:
        return (self.hub, self.a, self.b)


# Fixed MACs so every namespace can get permanent ARP entries (see _pin_neighbors).
def _mac(i: int) -> str:
    return f"02:13:00:00:00:{i:02x}"


def _dev(t: Topo, ns: str) -> str:
    return "br0" if ns == t.hub else "eth0"


def _port(t: Topo, ns: str) -> str:
    return {t.a: "vA", t.b: "vB"}[ns]


def _pin_neighbors(t: Topo, ns: str) -> None:
    # Without this, ~30-50 s into a cut the ARP entry goes FAILED and new connects
    # flip from "silent timeout" to EHOSTUNREACH after ~3 s: time-dependent behaviour.
    for i, other in enumerate(t.names, 1):
        if other != ns:
            _ip(
                "-n",
                ns,
                "neigh",
                "replace",
                t.addr[other],
                "lladdr",
                _mac(i),
                "dev",
                _dev(t, ns),
                "nud",
                "permanent",
            )


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
def two_hosts(prefix: str = "mc", sysctls: dict | None = None):
    """Create hub/a/b; yield a Topo; always kill their processes and delete them.

    sysctls: applied in every namespace, e.g. {"net.ipv4.tcp_retries2": 3} makes a
    stalled TCP connection with unacked data fail (ETIMEDOUT) after ~6.6 s, not ~15 min.
    """
    cleanup_stale(prefix)
    tag = f"{prefix}{os.getpid()}_{secrets.token_hex(3)}"
    t = Topo(
        f"{tag}_hub",
        f"{tag}_a",
        f"{tag}_b",
        {f"{tag}_hub": f"{SUBNET}.1", f"{tag}_a": f"{SUBNET}.2", f"{tag}_b": f"{SUBNET}.3"},
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
        for i, host in ((2, t.a), (3, t.b)):
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
                _mac(i),
                "netns",
                host,
            )
            _ip("-n", t.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{t.addr[host]}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
        for ns in t.names:
            _pin_neighbors(t, ns)
        yield t
    finally:
        for ns in reversed(made):
            _delete(ns)


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
    """Cut host `ns` (t.a or t.b) off from hub and the other host.

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
