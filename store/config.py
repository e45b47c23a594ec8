"""Configuration of ``mooncake_store``: one keyword-only dataclass per part.

Every ``MOONCAKE_*`` environment variable the store reads is read here, in
:func:`env_defaults`; explicit arguments always win over the environment.

| variable | meaning | default |
|---|---|---|
| ``MOONCAKE_STORE_MASTER`` | ``HOST:PORT`` of the master a client uses | embedded master |
| ``MOONCAKE_STORE_ETCD`` | ``HOST:PORT`` of etcd: clients find the leader there, masters elect one | off |
| ``MOONCAKE_STORE_ETCD_PREFIX`` | key prefix of one store cluster in etcd | ``/mooncake_store/default`` |
| ``MOONCAKE_STORE_SECRET`` | shared secret clients must prove (HMAC) to the master and to transfer engines | none |
| ``MOONCAKE_STORE_SEGMENT_SIZE`` | bytes of shared memory a client contributes (0: none) | 256 MiB |
| ``MOONCAKE_STORE_SSD_DIR`` | directory a client contributes as SSD tier | none |
| ``MOONCAKE_STORE_SSD_MAX_BYTES`` | bytes of object data a client's SSD directory may hold | unlimited |
| ``MOONCAKE_STORE_PUT_RESERVATION_BYTES`` | bytes a client asks to reserve for one-round-trip puts (0: off) | 64 MiB |
| ``MOONCAKE_STORE_RPC_BUSY_POLL_US`` | microseconds a client checks for a metadata reply without sleeping (0: always sleeps) | 200 |
| ``MOONCAKE_STORE_TUNE_MALLOC`` | ``0``: a client leaves glibc malloc's thresholds alone (``StoreConfig.tune_malloc``) | ``1`` |
| ``MOONCAKE_STORE_TRANSFER`` | ``auto`` (map same-host segments, TCP otherwise) or ``tcp`` (always TCP) | ``auto`` |
| ``MOONCAKE_HOST_ID`` | processes with equal ids count as one host and map each other's segments | hostname + boot id |
| ``MOONCAKE_SOCKET_IFNAME`` | interface the transfer engine listens on | interface routed to the master |
| ``MOONCAKE_STORE_NO_UVLOOP`` | ``1``: the master uses asyncio's own event loop even when uvloop is installed | off |
| ``MOONCAKE_STORE_TEST_PAUSE`` | tests only: ``put:SECONDS`` / ``get:SECONDS`` pauses after the master answered put-start / get, before any byte moves | off |
"""

from __future__ import annotations

import dataclasses
import os
import socket

from ._args import _short
from .segment import SEG_HEADER

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def _parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) < 65536):
        raise ValueError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def default_host_id() -> str:
    """Hostname plus boot id: equal on every process of one boot of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


# variable -> StoreConfig field, taken as a string / as a whole number (and what it counts)
_ENV_STR = {
    "MOONCAKE_STORE_MASTER": "master",
    "MOONCAKE_STORE_ETCD": "etcd",
    "MOONCAKE_STORE_ETCD_PREFIX": "etcd_prefix",
    "MOONCAKE_STORE_SECRET": "secret",
    "MOONCAKE_STORE_SSD_DIR": "ssd_dir",
    "MOONCAKE_STORE_TRANSFER": "transfer",
    "MOONCAKE_HOST_ID": "host_id",
    "MOONCAKE_SOCKET_IFNAME": "ifname",
}
_ENV_INT = {
    "MOONCAKE_STORE_SEGMENT_SIZE": ("segment_size", "a byte count"),
    "MOONCAKE_STORE_SSD_MAX_BYTES": ("ssd_max_bytes", "a byte count"),
    "MOONCAKE_STORE_PUT_RESERVATION_BYTES": ("put_reservation_bytes", "a byte count"),
    "MOONCAKE_STORE_RPC_BUSY_POLL_US": ("rpc_busy_poll_us", "a whole number of microseconds"),
}


def env_defaults() -> dict:
    """The store's ``MOONCAKE_*`` environment variables, parsed (absent ones omitted).

    Raises ``ValueError`` for a malformed value, naming the variable."""
    env = os.environ
    out: dict = {}
    for var, field in _ENV_STR.items():
        if env.get(var):
            out[field] = env[var]
    for var, (field, what) in _ENV_INT.items():
        if env.get(var):
            if not (env[var].isascii() and env[var].isdigit()):
                raise ValueError(f"{var} must be {what}, got {env[var]!r}")
            out[field] = int(env[var])
    for var, field in (
        ("MOONCAKE_STORE_TUNE_MALLOC", "tune_malloc"),
        ("MOONCAKE_STORE_NO_UVLOOP", "no_uvloop"),
    ):
        if env.get(var):
            if env[var] not in ("0", "1"):
                raise ValueError(f"{var} must be 0 or 1, got {env[var]!r}")
            out[field] = env[var] == "1"
    if env.get("MOONCAKE_STORE_TEST_PAUSE"):
        v = env["MOONCAKE_STORE_TEST_PAUSE"]
        what, _, secs = v.partition(":")
        try:
            out["test_pause"] = (what, float(secs))
        except ValueError:
            raise ValueError(
                f"MOONCAKE_STORE_TEST_PAUSE must be put:SECONDS or get:SECONDS, got {v!r}"
            ) from None
        if what not in ("put", "get"):
            raise ValueError(
                f"MOONCAKE_STORE_TEST_PAUSE must be put:SECONDS or get:SECONDS, got {v!r}"
            )
    return out


@dataclasses.dataclass(kw_only=True)
class MasterConfig:
    """Options of a store master (``mooncake-store-master`` flags have the same names).

    Attributes:
        host: address the metadata RPC listens on (default 127.0.0.1; ``0.0.0.0`` for
            every interface).
        port: TCP port (0: an ephemeral port, reported by ``Master.address``).
        secret: shared secret clients must prove (HMAC-SHA256 over a per-connection
            nonce); ``None``: no authentication (``MOONCAKE_STORE_SECRET``).
        client_ttl_s: seconds without a heartbeat after which a client is declared dead:
            its segments are dropped (objects with a replica elsewhere survive), its
            unfinished puts are aborted and their space and keys freed.
        put_ttl_s: seconds a put may stay unfinished by a live writer before it is aborted.
        lease_ttl_s: seconds a read lease lasts (every get takes one); a leased object is
            neither evicted nor removed without ``force``. The three TTLs must be at least
            0.1 s and below 1e6 s (``ValueError``).
        high_watermark / low_watermark: fractions of total segment capacity; above the
            high one, objects are evicted (approximate LRU; leased, pinned and unfinished
            ones skipped; to the owner's SSD directory where it has one) down to the low one.
        max_frame_bytes: largest RPC frame accepted (bytes); larger ones get an error
            reply and the connection is closed.
        max_keys_per_call: most keys in one batch request.
        max_key_bytes / max_meta_bytes: longest key (UTF-8 bytes) / per-object metadata.
        metrics_port: serve Prometheus text metrics over HTTP at ``host:metrics_port``
            (``/metrics``); ``None``: only through the ``metrics`` RPC.
        etcd: ``HOST:PORT`` of etcd for high availability (leader election with an etcd
            lease; object metadata kept in etcd). ``None``: a single master.
        etcd_prefix: key prefix of this store cluster in etcd.
        leader_ttl_s: TTL of the leader's etcd lease, whole seconds >= 2 (a standby takes
            over at most about this long after the leader dies).
        advertise: ``HOST:PORT`` clients are told to use for this master (default: host:port;
            required with ``etcd`` when ``host`` is a wildcard such as ``0.0.0.0``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    secret: str | None = None
    client_ttl_s: float = 5.0
    put_ttl_s: float = 60.0
    lease_ttl_s: float = 5.0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    max_frame_bytes: int = 4 * MiB
    max_keys_per_call: int = 4096
    max_key_bytes: int = 4096
    max_meta_bytes: int = 4096
    metrics_port: int | None = None
    etcd: str | None = None
    etcd_prefix: str = "/mooncake_store/default"
    leader_ttl_s: int = 2
    advertise: str | None = None

    def __post_init__(self):
        for name in ("client_ttl_s", "put_ttl_s", "lease_ttl_s"):
            v = float(getattr(self, name))
            # inf overflowed when the master converted it to milliseconds; 1e-9 expired
            # every lease before its reader could use it
            if not (0.1 <= v < 1e6):
                raise ValueError(
                    f"MasterConfig: {name} must be >= 0.1 and < 1e6 seconds, got {getattr(self, name)!r}"
                )
        if not (0 < self.low_watermark <= self.high_watermark <= 1):
            raise ValueError(
                "MasterConfig: need 0 < low_watermark <= high_watermark <= 1, got "
                f"{self.low_watermark} and {self.high_watermark}"
            )
        if not (0 <= int(self.port) < 65536):
            raise ValueError(f"MasterConfig: port must be 0..65535, got {self.port}")
        if self.metrics_port is not None and not (
            0 <= int(self.metrics_port) < 65536
        ):  # 70000 wrapped to 4464
            raise ValueError(
                f"MasterConfig: metrics_port must be 0..65535, got {self.metrics_port}"
            )
        if self.max_frame_bytes < 4096:
            raise ValueError(
                f"MasterConfig: max_frame_bytes must be >= 4096, got {self.max_frame_bytes}"
            )
        if self.etcd is not None:
            _parse_hostport(self.etcd, "MasterConfig.etcd")
            if int(self.leader_ttl_s) < 2:
                raise ValueError(
                    f"MasterConfig: leader_ttl_s must be >= 2 s (etcd's minimum), got {self.leader_ttl_s}"
                )
        if self.advertise is not None:
            _parse_hostport(self.advertise, "MasterConfig.advertise")
        elif self.etcd is not None and self.host in ("0.0.0.0", "::", ""):
            # the leader publishes its address in etcd: 0.0.0.0 there sent clients to themselves
            raise ValueError(
                f"MasterConfig: host {self.host!r} listens on every interface; with etcd, give "
                "advertise (HOST:PORT clients reach this master at)"
            )


_TRANSFERS = ("auto", "tcp")


@dataclasses.dataclass(kw_only=True)
class StoreConfig:
    """Options of a :class:`~mooncake_store.MooncakeStore` client. ``None`` fields take
    the environment's value (see the module docstring), then the default.

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
            sleeping before it waits in ``poll()`` (default 200; 0: always sleeps). On VMs
            waking a sleeping vCPU costs about as much as the master's answer (the 2-core
            CI VM: a loopback ping-pong 70-80 us when the caller sleeps, 21-22 us when it
            spins; see ``protocol.Connection``); the spin is bounded, so at most this much
            CPU per request (``MOONCAKE_STORE_RPC_BUSY_POLL_US``).
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
            (``store/segment.py`` ``_map`` has the measurements).
        tune_malloc: set glibc malloc's mmap threshold to 32 MiB and its trim threshold
            to 64 MiB in this process (once, unless the user set them through the
            environment), so that the ``bytes`` of gets reuse freed heap instead of taking
            fresh pages from the kernel: batch gets of 1 MiB values went from 3.86 to
            7.12 GiB/s on the CI VM (``store/segment.py`` ``tune_malloc``). The process keeps
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
    master_config: MasterConfig | None = None
    test_pause: tuple | None = None

    def resolved(self) -> StoreConfig:
        """A copy with environment values and defaults filled in; raises ``ValueError``."""
        env = env_defaults()
        vals = dataclasses.asdict(self)
        vals["master_config"] = self.master_config
        for k, v in env.items():
            if k in vals and vals[k] is None:
                vals[k] = v
        out = StoreConfig(**vals)
        from_env = {f: var for var, f in _ENV_STR.items() if f in env and getattr(self, f) is None}
        from_env.update(
            {f: var for var, (f, _) in _ENV_INT.items() if f in env and getattr(self, f) is None}
        )
        if out.etcd_prefix is None:
            out.etcd_prefix = "/mooncake_store/default"
        if out.segment_size is None:
            out.segment_size = 256 * MiB
        if out.put_reservation_bytes is None:
            out.put_reservation_bytes = 64 * MiB
        if out.rpc_busy_poll_us is None:
            out.rpc_busy_poll_us = 200
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

    def validate(self) -> None:
        if self.master is not None:
            _parse_hostport(self.master, "StoreConfig.master")
        if self.etcd is not None:
            _parse_hostport(self.etcd, "StoreConfig.etcd")
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
        for n in ("serve_tcp", "prefault", "huge_pages", "tune_malloc"):
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


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """Options of :class:`~mooncake_store.weight_sync.WeightSync`.

    Attributes:
        bucket_bytes: tensors are packed into buckets of about this size (one store object
            each; a tensor larger than this is its own bucket, written without a copy).
        checksums: store a digest per tensor piece (XXH3-128 from ``xxhash``, or BLAKE2b-128
            from hashlib when xxhash is not installed); readers verify every piece before
            installing anything.
        keep_versions: committed versions kept besides the newest (older ones are dropped
            once no reader holds them). A publish needs room for ``keep_versions + 2``
            versions at once (those kept, the newest, and the one being written, all
            pinned), below the master's high watermark, or it fails with ``NoSpaceError``
            (and removes what it wrote).
        commit_timeout_s: how long the committing shard waits for the other shards'
            manifests.
        hold_ttl_s: a reader's hold on a version counts for this long after it was taken
            (a reader that died does not keep old versions forever).
        max_readers: reader slots per model (a reader takes one at its first pull).
        pin: store weight objects pinned (never evicted to make room).
        install: how ``pull`` installs a version. ``"copy"``: copies into the reader's
            tensors (staged first, all or nothing). ``"view"``: tensors published whole
            that lie in memory on the reader's host become read-only views of that memory
            (``param.data = view``; no copy, one copy of the weights per host however many
            readers; needs ``pin=True`` and ``into`` an ``nn.Module`` or ``None``); the
            reader holds the version (refreshed every ``hold_ttl_s / 4``) until its next
            pull or ``release()``. The rest is copied.
        relay: readers on a host other than the one holding a version's pieces share one
            pull per host, and the hosts pass the pieces on to each other in a chain,
            bucket by bucket, so the publisher host's link carries each byte about once
            however many hosts read (``docs/weight-sync.md`` "Across hosts"). The first
            reader of a version on a host is its relay: it reads each bucket from the host
            before it in the chain (the publisher's for the first) and keeps a copy in its
            own segment, which the other readers of its host map and the next host reads
            (``StoreConfig.segment_size``: one version per version published within the
            master's ``lease_ttl_s``, plus one; it frees its copies of a version when it
            starts its next pull; a smaller segment only relays less). A relay that dies or stalls costs the
            readers after it a wait (up to ``relay_wait_s``) and a read from the next
            source up the chain; every reader still checks the whole version before it
            installs anything. ``False``: every reader reads every bucket from where it
            was published.
        relay_wait_s: seconds a reader waits for the host before it in the chain to have
            a part of a bucket before it reads that part (and the rest) from the next
            source up, and a follower for its host's relay to take a chain position (it
            then reads from the relays there are).
        relay_part_bytes: bytes a relay passes on at a time: the next host reads a part
            of a bucket as soon as it is in, so each hop down the chain adds one part's
            transfer to a pull (17 ms for 4 MiB at 2 Gbit/s), not one bucket's; smaller
            parts cost more requests to the master (at least 64 KiB). The publisher's
            value holds for its version (it is recorded with the version's commit).
    """

    bucket_bytes: int = 64 * MiB
    checksums: bool = True
    keep_versions: int = 1
    commit_timeout_s: float = 120.0
    hold_ttl_s: float = 600.0
    max_readers: int = 64
    pin: bool = True
    install: str = "copy"
    relay: bool = True
    relay_wait_s: float = 10.0
    relay_part_bytes: int = 4 * MiB

    def __post_init__(self):
        if self.install not in ("copy", "view"):
            raise ValueError(
                f"WeightSyncConfig: install must be 'copy' or 'view', got {self.install!r}"
            )
        if self.install == "view" and not self.pin:
            raise ValueError(
                "WeightSyncConfig: install='view' needs pin=True (an evicted object's memory is reused)"
            )
        # below 2**63: sizes go into the version's records (msgpack integers); parts of at
        # least 64 KiB: each is a store object of every relay, with its requests to the master
        for f, low in (("bucket_bytes", 1), ("relay_part_bytes", 64 * 1024)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 1 << 63:
                raise ValueError(
                    f"WeightSyncConfig: {f} must be an int in [{low}, 2**63), got {v!r}"
                )
        if not isinstance(self.keep_versions, int) or self.keep_versions < 0:
            raise ValueError(
                f"WeightSyncConfig: keep_versions must be an int >= 0, got {self.keep_versions!r}"
            )
        if not isinstance(self.max_readers, int) or self.max_readers < 1:
            raise ValueError(
                f"WeightSyncConfig: max_readers must be an int >= 1, got {self.max_readers!r}"
            )
        for f in ("relay", "checksums", "pin"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"WeightSyncConfig: {f} must be a bool, got {getattr(self, f)!r}")
        for f in ("commit_timeout_s", "hold_ttl_s", "relay_wait_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"WeightSyncConfig: {f} must be a positive number, got {v!r}")


@dataclasses.dataclass(kw_only=True)
class KVCacheConfig:
    """Options of :class:`~mooncake_store.kvcache.KVCacheStore`.

    Attributes:
        chunk_tokens: tokens per chunk; only whole chunks are stored and matched.
        model: name of the model whose K/V these are (part of every key: K/V of
            different models never mix).
        pin: store chunks pinned (default False: chunks are a cache, evicted in LRU order
            and, with an SSD tier, dropped to SSD).
    """

    chunk_tokens: int = 256
    model: str = "default"
    pin: bool = False

    def __post_init__(self):
        if (
            not isinstance(self.chunk_tokens, int)
            or isinstance(self.chunk_tokens, bool)
            or self.chunk_tokens < 1
        ):
            raise ValueError(
                f"KVCacheConfig: chunk_tokens must be an int >= 1, got {self.chunk_tokens!r}"
            )
        if (
            not isinstance(self.model, str)
            or not self.model
            or "/" in self.model
            or len(self.model) > 200
        ):
            raise ValueError(
                "KVCacheConfig: model must be a non-empty str without '/' (at most 200 chars), "
                f"got {_short(self.model) if isinstance(self.model, str) else repr(self.model)}"
            )
