"""Which local address the TCP data plane listens on."""

from __future__ import annotations

import os
import socket


def _route_to(host: str) -> str | None:
    try:
        infos = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    for *_, addr in infos:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(addr)  # no packet is sent
            return s.getsockname()[0]
        except OSError:
            continue
        finally:
            s.close()
    return None


def _ifname_address(ifname: str) -> str:
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(
            s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode())
        )  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        raise ValueError(
            f"MOONCAKE_SOCKET_IFNAME={ifname!r}: no IPv4 address on that interface"
        ) from e
    finally:
        s.close()


def listen_address(host_ip: str | None, ifname: str | None) -> str:
    """``host_ip`` if given, else ``ifname``'s address, else the interface routed to the
    rendezvous host (``MASTER_ADDR``), else 127.0.0.1 (single host)."""
    if host_ip:
        return host_ip
    if ifname:
        return _ifname_address(ifname)
    master = os.environ.get("MASTER_ADDR")
    if master and master not in ("localhost", "127.0.0.1", "::1"):
        addr = _route_to(master)
        if addr:
            return addr
    return "127.0.0.1"
