"""Configuration of the ``mooncake`` process group.

Every ``MOONCAKE_*`` environment variable the process group reads is read here, in
:func:`env_defaults`; explicit arguments always win over the environment. Boolean
variables take ``1/true/yes/on`` or ``0/false/no/off`` in any case (:func:`bool_env`).

| variable | meaning | default |
|---|---|---|
| ``MOONCAKE_TRANSPORT`` | ``auto`` / ``shm`` / ``tcp`` / ``rdma`` | ``auto`` |
| ``MOONCAKE_HOST_ID`` | overrides which ranks count as one host (equal ids share memory) | hostname + boot id |
| ``MOONCAKE_SOCKET_IFNAME`` | network interface the TCP data plane listens on | interface routed to the rendezvous host |
| ``MOONCAKE_DEBUG`` | ``1``: keep a trace of recent ops, dumped on timeout | off |
| ``MOONCAKE_SHM_SLOT_BYTES`` | bytes per rank per pipeline stage of the shm engine, at least 4096 | 1 MiB |
| ``MOONCAKE_ACTIVE_RANKS`` | comma-separated seats that found the default group; the others are extension seats (``mooncake-run`` sets it) | every seat |
| ``MOONCAKE_IS_RECOVERY`` | ``1``: this process replaces a dead rank or fills an extension seat (``mooncake-run`` sets it on respawn) | off |
| ``MOONCAKE_RDMA_DEVICE`` | transport ``rdma``: ``DEVICE[:PORT]`` (e.g. ``mlx5_0:1``) | the first device port in state ``PORT_ACTIVE`` |
| ``MOONCAKE_RDMA_GID_INDEX`` | transport ``rdma``: GID index | RoCE: the first RoCE v2 IPv4-mapped GID; InfiniBand: none (LID routing) |
| ``MOONCAKE_CUDA_IPC`` | CUDA builds: ``0`` stages CUDA tensors through pinned host memory even when every rank is on one host (default: ``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` of CUDA tensors go through CUDA IPC there) | ``1`` |
| ``MOONCAKE_FAULT_INJECT`` | tests only: ``OP:ROUND`` makes the process SIGKILL itself on collective number ``OP`` (0-based, per group) just before round ``ROUND`` | off |
| ``MOONCAKE_FAULT_DELAY`` | tests only: ``OP:PEER:MS`` makes the process take rank ``PEER``'s part of collective number ``OP`` (0-based, per group) ``MS`` ms late, as if it were still in flight | off |
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

_TRANSPORTS = ("auto", "shm", "tcp", "rdma")
_POLICIES = ("raise", "mask", "manual")
# Op timeout bounds, seconds. The floor is a round number below any practical op timeout:
# much shorter ones declare live peers failed over ordinary scheduling delays (1e-9 s does
# so on an idle host). The ceiling keeps the backend's deadlines, int64 nanoseconds of the
# monotonic clock (2**63 ns is about 9.2e9 s), from overflowing: there, 1e10 s or an
# infinite timeout ends an op at once instead of never.
MIN_TIMEOUT_S = 0.1
MAX_TIMEOUT_S = 1e9
# The shared-memory engine's smallest slot (MooncakeBackend::setup refuses less).
MIN_SHM_SLOT_BYTES = 4096


@dataclasses.dataclass(kw_only=True)
class MooncakeOptions:
    """Options of one ``mooncake`` process group (pass as ``pg_options``).

    Attributes:
        timeout: failure timeout of each op, seconds (or a ``timedelta``); a peer that
            does not take part in an op within it makes the op raise. Default 30 s; at
            least 0.1 s and at most 1e9 s (finite).
            ``init_process_group(timeout=...)`` only governs rendezvous.
        transport: ``"auto"`` (shared memory between ranks of one host, TCP between
            hosts), ``"shm"``, ``"tcp"`` (forced, also on one host) or ``"rdma"``
            (collectives over RDMA RC queue pairs, p2p over TCP; needs a build with
            ibverbs and an active RDMA port on every rank, see ``MOONCAKE_RDMA_DEVICE``;
            otherwise init raises on every rank). Must agree across ranks.
        max_group_size: number of seats (fixed world size); must equal the ``world_size``
            given to ``init_process_group`` (``None``: that world size).
        active_ranks: the seats that found the group (the default group only; default:
            every seat, or ``MOONCAKE_ACTIVE_RANKS``). The other seats are extension seats:
            inactive until a process started with ``is_recovery=True`` fills them through
            ``join_group`` and the members' ``recover_ranks``. Founders do not wait for
            them, so rendezvous must not either: use ``mooncake-run``, ``file://`` or an
            external store (a ``tcp://`` store hosted by rank 0 waits for every seat).
            Must agree across founders.
        on_failure: ``"raise"`` / ``"mask"`` / ``"manual"`` (see docs/fault-tolerance.md);
            must agree across ranks (``init_process_group`` raises ``ValueError`` on every
            rank otherwise).
        is_recovery: this process replaces a dead rank (or fills an extension seat) and
            will call ``join_group`` (default: ``MOONCAKE_IS_RECOVERY``, set by
            ``mooncake-run`` on a respawned rank). Subgroups created while the default
            group is still joining are joined the same way; later ones are set up normally.
        host_ip: address (a string) the TCP data plane listens on (default: the interface
            routed to the rendezvous host, or ``MOONCAKE_SOCKET_IFNAME``).
        shm_slot_bytes: bytes per rank per pipeline stage of the shared-memory engine
            (``MOONCAKE_SHM_SLOT_BYTES``), at least 4096; must agree across ranks.
        debug: keep a trace of recent ops and dump it on timeout (``MOONCAKE_DEBUG``).
        cuda_ipc: CUDA builds: ``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and
            ``reduce_scatter_tensor`` of CUDA tensors through CUDA IPC when every rank is on
            this host (default: ``MOONCAKE_CUDA_IPC``, on); ``False`` stages them through
            pinned host memory. Must agree across ranks (else the first such op raises
            ``ValueError`` on every rank).
        hierarchical: in groups that span hosts with the same number of ranks on each, run
            all_reduce, reduce, reduce_scatter, all_gather and broadcast in two levels (inside
            each host, then between hosts; docs/process-group.md "Across hosts") so that each
            host's link carries one copy per remote host, not per remote rank (default:
            ``MOONCAKE_HIERARCHICAL``, on). Must agree across ranks.
    """

    timeout: float | timedelta = 30.0
    transport: str | None = None
    max_group_size: int | None = None
    active_ranks: Sequence[int] | None = None
    on_failure: str = "raise"
    is_recovery: bool | None = None
    host_ip: str | None = None
    shm_slot_bytes: int | None = None
    debug: bool | None = None
    cuda_ipc: bool | None = None
    hierarchical: bool | None = None

    def __post_init__(self):
        if isinstance(self.timeout, timedelta):
            self.timeout = self.timeout.total_seconds()
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real):
            raise ValueError(
                "MooncakeOptions: timeout must be seconds (a number) or a timedelta, "
                f"got {self.timeout!r}"
            )
        for name in ("max_group_size", "shm_slot_bytes"):
            setattr(self, name, _opt_int(getattr(self, name), name))
        for name in ("is_recovery", "debug", "cuda_ipc", "hierarchical"):
            setattr(self, name, _opt_bool(getattr(self, name), name))
        # written so that NaN fails too
        if not (MIN_TIMEOUT_S <= float(self.timeout) <= MAX_TIMEOUT_S):
            raise ValueError(
                f"MooncakeOptions: timeout must be at least {MIN_TIMEOUT_S} s (and at most "
                f"{MAX_TIMEOUT_S:g} s), got {self.timeout!r}"
            )
        if self.host_ip is not None and not isinstance(self.host_ip, str):
            raise ValueError(
                "MooncakeOptions: host_ip must be an address string (e.g. '10.0.0.5') or None, "
                f"got {self.host_ip!r}"
            )
        if self.transport is not None and self.transport not in _TRANSPORTS:
            raise ValueError(
                f"MooncakeOptions: transport must be one of {_TRANSPORTS}, got {self.transport!r}"
            )
        if self.on_failure not in _POLICIES:
            raise ValueError(
                f"MooncakeOptions: on_failure must be one of {_POLICIES}, got {self.on_failure!r}"
            )
        if self.max_group_size is not None and self.max_group_size < 1:
            raise ValueError(
                f"MooncakeOptions: max_group_size must be >= 1, got {self.max_group_size}"
            )
        if self.active_ranks is not None:
            try:
                if isinstance(self.active_ranks, (str, bytes)):
                    raise TypeError
                ranks = [operator.index(r) for r in self.active_ranks]
            except TypeError:
                raise ValueError(
                    "MooncakeOptions: active_ranks must be a sequence of int seat numbers, "
                    f"got {self.active_ranks!r}"
                ) from None
            if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
                raise ValueError(
                    "MooncakeOptions: active_ranks must be distinct non-negative seat "
                    f"numbers (at least one), got {list(self.active_ranks)}"
                )
            if self.max_group_size is not None and max(ranks) >= self.max_group_size:
                raise ValueError(
                    f"MooncakeOptions: active_ranks {ranks} must lie in [0, max_group_size="
                    f"{self.max_group_size})"
                )
            self.active_ranks = sorted(ranks)
        if self.shm_slot_bytes is not None and self.shm_slot_bytes < MIN_SHM_SLOT_BYTES:
            raise ValueError(
                f"MooncakeOptions: shm_slot_bytes must be >= {MIN_SHM_SLOT_BYTES}, "
                f"got {self.shm_slot_bytes}"
            )


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _int_env(env, name: str, default: int, what: str = "bytes", minimum: int | None = None) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer ({what}), got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum} ({what}), got {raw!r}")
    return value


def _opt_bool(value, name: str) -> bool | None:
    """An explicit boolean option: None (unset), a bool, or 0/1.

    Strings such as "0" (which bool() would turn into True) raise.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"MooncakeOptions.{name} must be True or False, got {value!r}")


def _opt_int(value, name: str) -> int | None:
    """An explicit integer option: None (unset) or an int (not a bool, not a string)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"MooncakeOptions: {name} must be an int, got {value!r}") from None


def _ranks_env(env, name: str):
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        ranks = sorted(int(tok) for tok in raw.split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated seat numbers, got {raw!r}") from None
    if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"{name} must be distinct non-negative seat numbers, got {raw!r}")
    return ranks


def bool_env(env, name: str, default: bool) -> bool:
    """A boolean ``MOONCAKE_*`` variable, or ``default`` when it is unset or empty.

    ``1/true/yes/on`` and ``0/false/no/off`` in any case; anything else raises ``ValueError`` naming
    the variable.
    """
    raw = (env.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{name} must be 0 or 1, got {env.get(name)!r} (also taken: true/false, yes/no, on/off)"
    )


# setting -> how it is read from the environment (each variable in one place)
_FROM_ENV = {
    "transport": lambda env: env.get("MOONCAKE_TRANSPORT", "auto") or "auto",
    "host_id": lambda env: env.get("MOONCAKE_HOST_ID") or f"{socket.gethostname()}/{_boot_id()}",
    "socket_ifname": lambda env: env.get("MOONCAKE_SOCKET_IFNAME") or None,
    "debug": lambda env: bool_env(env, "MOONCAKE_DEBUG", False),
    "shm_slot_bytes": lambda env: _int_env(
        env, "MOONCAKE_SHM_SLOT_BYTES", 1 << 20, minimum=MIN_SHM_SLOT_BYTES
    ),
    "fault_inject": lambda env: env.get("MOONCAKE_FAULT_INJECT") or None,
    "fault_delay": lambda env: env.get("MOONCAKE_FAULT_DELAY") or None,
    "active_ranks": lambda env: _ranks_env(env, "MOONCAKE_ACTIVE_RANKS"),
    "is_recovery": lambda env: bool_env(env, "MOONCAKE_IS_RECOVERY", False),
    "rdma_device": lambda env: env.get("MOONCAKE_RDMA_DEVICE") or "",
    "rdma_gid_index": lambda env: _int_env(env, "MOONCAKE_RDMA_GID_INDEX", -1, "a GID index"),
    "cuda_ipc": lambda env: bool_env(env, "MOONCAKE_CUDA_IPC", True),
    "hierarchical": lambda env: bool_env(env, "MOONCAKE_HIERARCHICAL", True),
}


class LazyEnv(dict):
    """Settings read from the environment when first looked up.

    A resolver that looks up only the settings whose option is not given never reads (nor
    rejects) the others' variables, so an explicit argument wins, also over a malformed one.
    """

    def __init__(self, readers: dict):
        super().__init__()
        self._readers = readers

    def __missing__(self, key: str):
        value = self[key] = self._readers[key](os.environ)
        return value


def env_defaults() -> dict[str, Any]:
    """The process group's settings from ``MOONCAKE_*`` variables (the only place they are read).

    Raises ``ValueError`` naming a malformed variable.
    """
    return {k: read(os.environ) for k, read in _FROM_ENV.items()}


def resolve(opts: MooncakeOptions | None) -> dict:
    """Merge explicit options over the environment; returns plain values."""
    opts = opts or MooncakeOptions()
    env = LazyEnv(_FROM_ENV)
    transport = opts.transport or env["transport"]
    if transport not in _TRANSPORTS:
        raise ValueError(f"MOONCAKE_TRANSPORT must be one of {_TRANSPORTS}, got {transport!r}")
    return {
        "timeout": float(opts.timeout),
        "transport": transport,
        "host_id": env["host_id"],
        "host_ip": opts.host_ip,
        "socket_ifname": env["socket_ifname"],
        "debug": env["debug"] if opts.debug is None else _opt_bool(opts.debug, "debug"),
        "shm_slot_bytes": opts.shm_slot_bytes or env["shm_slot_bytes"],
        "on_failure": opts.on_failure,
        "max_group_size": opts.max_group_size,
        "active_ranks": env["active_ranks"]
        if opts.active_ranks is None
        else list(opts.active_ranks),
        "is_recovery": env["is_recovery"]
        if opts.is_recovery is None
        else _opt_bool(opts.is_recovery, "is_recovery"),
        "fault_inject": env["fault_inject"],
        "fault_delay": env["fault_delay"],
        "rdma_device": env["rdma_device"],
        "rdma_gid_index": env["rdma_gid_index"],
        "cuda_ipc": env["cuda_ipc"]
        if opts.cuda_ipc is None
        else _opt_bool(opts.cuda_ipc, "cuda_ipc"),
        "hierarchical": env["hierarchical"]
        if opts.hierarchical is None
        else _opt_bool(opts.hierarchical, "hierarchical"),
    }
