"""Configuration of the ``mooncake`` process group.

Every ``MOONCAKE_*`` environment variable the process group reads is read here, in
:func:`env_defaults`; explicit arguments always win over the environment.

| variable | meaning | default |
|---|---|---|
| ``MOONCAKE_TRANSPORT`` | ``auto`` / ``shm`` / ``tcp`` / ``rdma`` | ``auto`` |
| ``MOONCAKE_HOST_ID`` | overrides which ranks count as one host (equal ids share memory) | hostname + boot id |
| ``MOONCAKE_SOCKET_IFNAME`` | network interface the TCP data plane listens on | interface routed to the rendezvous host |
| ``MOONCAKE_DEBUG`` | ``1``: keep a trace of recent ops, dumped on timeout | off |
| ``MOONCAKE_SHM_SLOT_BYTES`` | bytes per rank per pipeline stage of the shm engine | 1 MiB |
| ``MOONCAKE_FAULT_INJECT`` | tests only: ``OP:ROUND`` makes the process SIGKILL itself on collective number ``OP`` (0-based, per group) just before round ``ROUND`` | off |
"""
from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from typing import Optional

_TRANSPORTS = ("auto", "shm", "tcp", "rdma")
_POLICIES = ("raise", "mask", "manual")


@dataclasses.dataclass(kw_only=True)
class MooncakeOptions:
    """Options of one ``mooncake`` process group (pass as ``pg_options``).

    Attributes:
        timeout: failure timeout of each op, seconds (or a ``timedelta``); a peer that
            does not take part in an op within it makes the op raise. Default 30 s.
            ``init_process_group(timeout=...)`` only governs rendezvous.
        transport: ``"auto"`` (shared memory between ranks of one host, TCP between
            hosts), ``"shm"``, ``"tcp"`` (forced, also on one host) or ``"rdma"`` (needs a
            build with ibverbs; raises otherwise). Must agree across ranks.
        max_group_size: number of seats (fixed world size); ``None`` means the world size
            given to ``init_process_group``.
        on_failure: ``"raise"`` / ``"mask"`` / ``"manual"`` (see DESIGN.md).
        is_recovery: this process replaces a dead rank and will call ``join_group``.
        host_ip: address the TCP data plane listens on (default: the interface routed to
            the rendezvous host, or ``MOONCAKE_SOCKET_IFNAME``).
        shm_slot_bytes: bytes per rank per pipeline stage of the shared-memory engine
            (``MOONCAKE_SHM_SLOT_BYTES``); must agree across ranks.
        debug: keep a trace of recent ops and dump it on timeout (``MOONCAKE_DEBUG``).
    """

    timeout: float | timedelta = 30.0
    transport: Optional[str] = None
    max_group_size: Optional[int] = None
    on_failure: str = "raise"
    is_recovery: bool = False
    host_ip: Optional[str] = None
    shm_slot_bytes: Optional[int] = None
    debug: Optional[bool] = None

    def __post_init__(self):
        if isinstance(self.timeout, timedelta):
            self.timeout = self.timeout.total_seconds()
        if not (float(self.timeout) > 0):
            raise ValueError(f"MooncakeOptions: timeout must be > 0 seconds, got {self.timeout}")
        if self.transport is not None and self.transport not in _TRANSPORTS:
            raise ValueError(f"MooncakeOptions: transport must be one of {_TRANSPORTS}, got {self.transport!r}")
        if self.on_failure not in _POLICIES:
            raise ValueError(f"MooncakeOptions: on_failure must be one of {_POLICIES}, got {self.on_failure!r}")
        if self.max_group_size is not None and self.max_group_size < 1:
            raise ValueError(f"MooncakeOptions: max_group_size must be >= 1, got {self.max_group_size}")
        if self.shm_slot_bytes is not None and self.shm_slot_bytes < 4096:
            raise ValueError(f"MooncakeOptions: shm_slot_bytes must be >= 4096, got {self.shm_slot_bytes}")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _int_env(env, name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer (bytes), got {raw!r}") from None


def env_defaults() -> dict:
    """The process group's settings from ``MOONCAKE_*`` variables (the only place they are read)."""
    env = os.environ
    debug = env.get("MOONCAKE_DEBUG", "")
    return {
        "transport": env.get("MOONCAKE_TRANSPORT", "auto") or "auto",
        "host_id": env.get("MOONCAKE_HOST_ID") or f"{socket.gethostname()}/{_boot_id()}",
        "socket_ifname": env.get("MOONCAKE_SOCKET_IFNAME") or None,
        "debug": debug not in ("", "0", "false", "False"),
        "shm_slot_bytes": _int_env(env, "MOONCAKE_SHM_SLOT_BYTES", 1 << 20),
        "fault_inject": env.get("MOONCAKE_FAULT_INJECT") or None,
    }


def resolve(opts: Optional[MooncakeOptions]) -> dict:
    """Merge explicit options over the environment; returns plain values."""
    opts = opts or MooncakeOptions()
    env = env_defaults()
    transport = opts.transport or env["transport"]
    if transport not in _TRANSPORTS:
        raise ValueError(f"MOONCAKE_TRANSPORT must be one of {_TRANSPORTS}, got {transport!r}")
    return {
        "timeout": float(opts.timeout),
        "transport": transport,
        "host_id": env["host_id"],
        "host_ip": opts.host_ip,
        "socket_ifname": env["socket_ifname"],
        "debug": env["debug"] if opts.debug is None else bool(opts.debug),
        "shm_slot_bytes": opts.shm_slot_bytes or env["shm_slot_bytes"],
        "on_failure": opts.on_failure,
        "max_group_size": opts.max_group_size,
        "is_recovery": opts.is_recovery,
        "fault_inject": env["fault_inject"],
    }
