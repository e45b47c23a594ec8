"""Options of a store client: :class:`StoreConfig` and :class:`ReplicateConfig`.

:class:`StoreConfig` configures a :class:`~mooncake_store.MooncakeStore`; :class:`ReplicateConfig`
says how one put places its object.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from ..common.config import ENV_INT, ENV_STR, MiB, default_host_id, env_defaults, parse_hostport
from ..common.layout import SEG_HEADER
from ..master import MasterConfig

_TRANSFERS = ("auto", "tcp")


@dataclasses.dataclass(kw_only=True)
class StoreConfig:
    """Options of a :class:`~mooncake_store.MooncakeStore` client.

    ``None`` fields take the environment's value (the table in ``common/config.py``), then the
    default.

    Attributes:
        master: ``HOST:PORT`` of the master; ``None`` and no ``etcd``: an embedded master
            runs in this process (on 127.0.0.1, an ephemeral port: ``store.master_address``),
            configured by ``master_config``.
        etcd: ``HOST:PORT`` of etcd: the client asks it who leads and follows leader changes.
        etcd_prefix: key prefix of the store cluster in etcd.
        secret: shared secret (must match the master's).
        name: this client's name, which is also its segment's name (what
            ``ReplicateConfig.preferred_segment`` names); default ``host-pid-random``.
        segment_size: bytes of shared memory this client contributes, more than 4096 (the
            segment's header), or 0: none (it then only reads and writes other clients'
            segments). Default 256 MiB.
        ssd_dir: directory this client contributes as SSD tier (created if missing);
            entries found there at start are registered again (persistence). Needs
            ``segment_size > 0``; one client per directory (a lock file ``.lock`` in it;
            ``StoreError`` while another live process holds it).
        ssd_max_bytes: object bytes ``ssd_dir`` may hold (``None``: no limit). When an
            eviction would go past it, the master first drops the least recently used
            objects that live only on that SSD; an object that still does not fit (or whose
            write fails, e.g. a full disk) is evicted without an SSD copy.
        transfer: ``"auto"``: segments of processes with the same ``host_id`` are mapped
            and copied directly, others are reached through the TCP transfer engine;
            ``"tcp"``: always the transfer engine.
        host_id: which processes count as one host (default: hostname + boot id).
        listen_host: address the transfer engine listens on (default: the interface that
            routes to the master, or ``ifname``).
        ifname: network interface for ``listen_host``.
        rpc_timeout_s: seconds one metadata request may take.
        rpc_busy_poll_us: microseconds a client checks for the master's reply without
            sleeping before it waits in ``poll()`` (0: always sleeps). Default 200 with the
            embedded master, 0 with a master process, which busy-polls itself
            (``MasterConfig.busy_poll_us``): measured in docs/store.md, "Metadata RPC". The
            spin is bounded, so at most this much CPU per request
            (``MOONCAKE_STORE_RPC_BUSY_POLL_US``).
        failover_timeout_s: seconds a request keeps retrying, from its first failure, while no
            leader answers (the first failure may itself take ``rpc_timeout_s``: a stopped
            leader that accepts connections but never answers), each retry cut to what is
            left: a request with no master to answer raises ``StoreError`` after at most
            ``rpc_timeout_s + failover_timeout_s``.
        heartbeat_interval_s: seconds between heartbeats (must be well below the master's
            ``client_ttl_s``).
        serve_tcp: start the transfer engine so that clients on other hosts (or with
            ``transfer="tcp"``) reach this client's segment; imports torch and the C++
            extension. ``False``: same-host clients only, no torch import.
        prefault: map segments with every page allocated and mapped up front
            (``MADV_POPULATE_WRITE``; ``MADV_POPULATE_READ`` for read-only mappings): the first
            copies into a segment then take no page faults, at the cost of committing
            ``segment_size`` bytes at start and a one-time cost per mapped peer segment.
        huge_pages: with ``prefault``, back this client's segment with 2 MiB pages
            (``MADV_COLLAPSE``, Linux 6.1+; 4 KiB pages where the kernel refuses). On VMs
            a 4 KiB page nobody touched for about a second costs 0.5 to several us at its
            next access, which the store's copies into idle space would otherwise pay
            (``client/segment.py`` ``_map`` has the measurements).
        tune_malloc: set glibc malloc's mmap threshold to 32 MiB and its trim threshold
            to 64 MiB in this process (once, unless the user set them through the
            environment), so that the ``bytes`` of gets reuse freed heap instead of taking
            fresh pages from the kernel: batch gets of 1 MiB values went from 3.86 to
            7.12 GiB/s on the CI VM (``client/segment.py`` ``tune_malloc``). The process keeps
            up to 64 MiB of freed heap. Default True (``MOONCAKE_STORE_TUNE_MALLOC``).
        put_reservation_bytes: bytes of segment space this client asks the master to
            reserve for its next puts (default 64 MiB; the master grants at most 1/16 of a
            segment, and none once the store is above its low watermark). A put of
            ``replica_num=1``, not pinned, whose objects fit in a quarter of it is written
            into that space and committed with one metadata round trip instead of two
            (pinned objects are placed by the master, so that they cannot end up scattered
            over the segment, splitting its free space for good); the master
            takes reserved space back (the client gives it up) before it evicts anything,
            and the client gives it back after a few idle seconds. 0: every put takes two
            round trips (``MOONCAKE_STORE_PUT_RESERVATION_BYTES``).
        release_leases: tell the master when reads are done (with the next get or exists
            request) so that their read leases end before ``lease_ttl_s`` once every reader
            is done (default True); False: every read lease this client takes runs its full
            TTL, as in Mooncake.
        master_config: options of the embedded master.
        test_pause: tests only: ``("put", s)`` / ``("get", s)`` sleeps ``s`` seconds after the
            master answered put-start / get, before any byte moves (``MOONCAKE_STORE_TEST_PAUSE``).
    """

    master: str | None = None
    etcd: str | None = None
    etcd_prefix: str | None = None
    secret: str | None = None
    name: str | None = None
    segment_size: int | None = None
    ssd_dir: str | None = None
    ssd_max_bytes: int | None = None
    transfer: str | None = None
    host_id: str | None = None
    listen_host: str | None = None
    ifname: str | None = None
    rpc_timeout_s: float = 10.0
    rpc_busy_poll_us: int | None = None
    failover_timeout_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    serve_tcp: bool = True
    prefault: bool = True
    huge_pages: bool = True
    tune_malloc: bool | None = None
    put_reservation_bytes: int | None = None
    release_leases: bool = True
    master_config: MasterConfig | None = None
    test_pause: tuple | None = None

    def resolved(self) -> StoreConfig:
        """A copy with environment values and defaults filled in; raises ``ValueError``."""
        vals = dataclasses.asdict(self)
        vals["master_config"] = self.master_config
        env = env_defaults(frozenset(k for k, v in vals.items() if v is not None))
        for k, v in env.items():
            if k in vals and vals[k] is None:
                vals[k] = v
        out = StoreConfig(**vals)
        from_env = {f: var for var, f in ENV_STR.items() if f in env and getattr(self, f) is None}
        from_env.update(
            {f: var for var, (f, _) in ENV_INT.items() if f in env and getattr(self, f) is None}
        )
        if out.etcd_prefix is None:
            out.etcd_prefix = "/mooncake_store/default"
        if out.segment_size is None:
            out.segment_size = 256 * MiB
        if out.put_reservation_bytes is None:
            out.put_reservation_bytes = 64 * MiB
        if out.rpc_busy_poll_us is None:
            # an embedded master (no address, no etcd) does not busy-poll; a master process
            # does, and against it a client that sleeps is the faster one (docs/store.md)
            out.rpc_busy_poll_us = 200 if out.embedded_master else 0
        if out.tune_malloc is None:
            out.tune_malloc = True
        if out.transfer is None:
            out.transfer = "auto"
        if out.host_id is None:
            out.host_id = default_host_id()
        if out.name is None:
            out.name = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        try:
            out.validate()
        except ValueError as e:  # a value from the environment: name the variable too
            var = next((v for f, v in from_env.items() if f in str(e)), None)
            if var is None:
                raise
            raise ValueError(f"{e} (from {var})") from None
        return out

    @property
    def embedded_master(self) -> bool:
        """Whether this client starts a master of its own (neither ``master`` nor ``etcd``)."""
        return self.master is None and self.etcd is None

    def validate(self) -> None:
        """Checks every field; raises ``ValueError`` naming the field that is invalid.

        Also raised for ``master`` and ``etcd`` given together.
        """
        if self.master is not None:
            parse_hostport(self.master, "StoreConfig.master")
        if self.etcd is not None:
            parse_hostport(self.etcd, "StoreConfig.etcd")
            if self.master is not None:  # master= was ignored
                raise ValueError(
                    "StoreConfig: give master (one master) or etcd (follow the leader), not both"
                )
        if self.segment_size is not None and (
            not isinstance(self.segment_size, int)
            or isinstance(self.segment_size, bool)
            or self.segment_size < 0
        ):
            raise ValueError(
                f"StoreConfig: segment_size must be a byte count >= 0, got {self.segment_size!r}"
            )
        if self.segment_size and self.segment_size <= SEG_HEADER:
            raise ValueError(
                f"StoreConfig: segment_size must be 0 (no segment) or more than {SEG_HEADER} "
                f"bytes (the segment's header), got {self.segment_size}"
            )
        for n in ("serve_tcp", "prefault", "huge_pages", "tune_malloc", "release_leases"):
            if not isinstance(getattr(self, n), bool) and not (
                n == "tune_malloc" and self.tune_malloc is None
            ):
                raise ValueError(
                    f"StoreConfig: {n} must be True or False, got {getattr(self, n)!r}"
                )
        for n in ("host_id", "listen_host", "ifname", "secret", "etcd_prefix"):
            v = getattr(self, n)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"StoreConfig: {n} must be a str, got {v!r}")
        if self.ssd_dir is not None and not isinstance(self.ssd_dir, (str, os.PathLike)):
            raise ValueError(f"StoreConfig: ssd_dir must be a path, got {self.ssd_dir!r}")
        if self.ssd_max_bytes is not None and (
            not isinstance(self.ssd_max_bytes, int)
            or isinstance(self.ssd_max_bytes, bool)
            or self.ssd_max_bytes < 0
        ):
            raise ValueError(
                f"StoreConfig: ssd_max_bytes must be a byte count >= 0 or None, got {self.ssd_max_bytes!r}"
            )
        if self.ssd_max_bytes is not None and self.ssd_dir is None:  # it was ignored
            raise ValueError("StoreConfig: ssd_max_bytes needs ssd_dir")
        if self.ssd_dir is not None and self.segment_size == 0:
            # objects reach the SSD tier only by eviction from this client's own segment
            raise ValueError(
                "StoreConfig: ssd_dir needs segment_size > 0 (objects are offloaded from this "
                "client's segment)"
            )
        if self.put_reservation_bytes is not None and (
            not isinstance(self.put_reservation_bytes, int)
            or isinstance(self.put_reservation_bytes, bool)
            or not 0 <= self.put_reservation_bytes < 1 << 50
        ):
            raise ValueError(
                "StoreConfig: put_reservation_bytes must be a byte count >= 0 and < 2**50, got "
                f"{self.put_reservation_bytes!r}"
            )
        if self.rpc_busy_poll_us is not None and (
            not isinstance(self.rpc_busy_poll_us, int)
            or isinstance(self.rpc_busy_poll_us, bool)
            or not 0 <= self.rpc_busy_poll_us <= 1_000_000
        ):
            raise ValueError(
                "StoreConfig: rpc_busy_poll_us must be microseconds in 0..1000000, got "
                f"{self.rpc_busy_poll_us!r}"
            )
        if self.transfer is not None and self.transfer not in _TRANSFERS:
            raise ValueError(
                f"StoreConfig: transfer must be one of {_TRANSFERS}, got {self.transfer!r}"
            )
        if self.name is not None and (not self.name or len(self.name) > 200 or "/" in self.name):
            raise ValueError(
                f"StoreConfig: name must be 1..200 characters without '/', got {self.name!r}"
            )
        for n in ("rpc_timeout_s", "failover_timeout_s", "heartbeat_interval_s"):
            if not (float(getattr(self, n)) > 0):
                raise ValueError(f"StoreConfig: {n} must be > 0 seconds")


@dataclasses.dataclass(kw_only=True)
class ReplicateConfig:
    """How a put places an object.

    Attributes:
        replica_num: copies to place, each in a different segment (>= 1).
        preferred_segment: name of the segment (client, ``StoreConfig.name``) to hold the
            first copy if it has room; ``None``: the master chooses (most free space
            first). Only a preference, as in Mooncake (the preferred segment is tried
            first, then the others): a name that is not registered (a typo, a client that
            left) is not an error and the copy goes where it would go without one;
            :meth:`MooncakeStore.where` tells where it went.
        pin: never evict this object (it still goes with its segment if the owner dies).
        require_all: raise :class:`ReplicaShortfallError` and store nothing if fewer than
            ``replica_num`` copies can be placed (default: place what fits and return the
            count).
    """

    replica_num: int = 1
    preferred_segment: str | None = None
    pin: bool = False
    require_all: bool = False

    def __post_init__(self):
        if (
            not isinstance(self.replica_num, int)
            or isinstance(self.replica_num, bool)
            or self.replica_num < 1
        ):
            raise ValueError(
                f"ReplicateConfig: replica_num must be an int >= 1, got {self.replica_num!r}"
            )
        if self.replica_num > 64:
            raise ValueError(f"ReplicateConfig: replica_num must be <= 64, got {self.replica_num}")
        if self.preferred_segment is not None and not isinstance(self.preferred_segment, str):
            raise ValueError(
                "ReplicateConfig: preferred_segment must be a segment name (str) or None"
            )
