"""Which local address the TCP data plane listens on, and the rendezvous store's address.

The order (docs/process-group.md, "Addresses"): ``MooncakeOptions.host_ip``, else the address
of ``MOONCAKE_SOCKET_IFNAME``, else the interface routed to the rendezvous store's host (the
``TCPStore`` behind every init method: ``env://``, ``tcp://``, a store passed in,
``mooncake-run``), else to ``MASTER_ADDR``, else 127.0.0.1. A rank that reaches the store
over loopback is on the store's host; when the group turns out to span hosts, the backend
then listens on the interface routed to an address that a rank of another host used for the
store (see ``setup.cpp``), so no hint is needed there either.
"""

from __future__ import annotations

import ipaddress
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


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address (an IP literal) or ``"localhost"``."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def rendezvous_address(store) -> str:
    """The IPv4 address of the host of the ``TCPStore`` under ``store``, else of ``MASTER_ADDR``.

    ``PrefixStore`` layers are unwrapped. Returns "" when neither is known (a ``FileStore`` or
    ``HashStore`` without ``MASTER_ADDR``).
    """
    import torch.distributed as dist

    host = None
    for _ in range(16):
        if isinstance(store, dist.TCPStore):
            host = store.host
            break
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    host = host or os.environ.get("MASTER_ADDR")
    if not host:
        return ""
    try:
        return socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return ""


def listen_address(host_ip: str | None, ifname: str | None, rendezvous: str = "") -> tuple:
    """The address to listen on and whether it was explicit, as ``(address, explicit)``.

    ``host_ip`` if given, else ``ifname``'s address (both explicit), else the interface routed to
    ``rendezvous`` (see :func:`rendezvous_address`), else 127.0.0.1.
    """
    if host_ip:
        return host_ip, True
    if ifname:
        return _ifname_address(ifname), True
    if rendezvous and not is_loopback(rendezvous):
        addr = _route_to(rendezvous)
        if addr:
            return addr, False
    return "127.0.0.1", False
