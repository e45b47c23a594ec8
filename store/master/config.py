"""Options of a store master (:class:`MasterConfig`)."""

from __future__ import annotations

import dataclasses

from ..common.config import MiB, parse_hostport
from .eviction import POLICIES


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
        high_watermark: fraction of total segment capacity above which objects are evicted
            (approximate LRU; leased, pinned and unfinished ones skipped; to the owner's SSD
            directory where it has one) down to ``low_watermark``.
        low_watermark: fraction of total segment capacity that eviction brings use down to.
        max_frame_bytes: largest RPC frame accepted (bytes); larger ones get an error
            reply and the connection is closed.
        max_keys_per_call: most keys in one batch request.
        max_key_bytes: longest key (UTF-8 bytes).
        max_meta_bytes: longest per-object metadata (bytes).
        metrics_port: serve Prometheus text metrics over HTTP at ``host:metrics_port``
            (``/metrics``); ``None``: only through the ``metrics`` RPC.
        etcd: ``HOST:PORT`` of etcd for high availability (leader election with an etcd
            lease; object metadata kept in etcd). ``None``: a single master.
        etcd_prefix: key prefix of this store cluster in etcd.
        leader_ttl_s: TTL of the leader's etcd lease, whole seconds >= 2 (a standby takes
            over at most about this long after the leader dies).
        advertise: ``HOST:PORT`` clients are told to use for this master (default: host:port;
            required with ``etcd`` when ``host`` is a wildcard such as ``0.0.0.0``).
        history_entries: dropped keys whose cause the master remembers (the ``history``
            request); the oldest drop is forgotten first; 0: none.
        orphan_grace_s: seconds an object found on SSD at a restart may wait for its
            ``parent`` (from another client's directory) before it is dropped.
        eviction_policy: which objects memory eviction takes first: ``"lru"`` (least
            recently used) or ``"lfu"`` (least frequently used, with dynamic aging: a use
            long ago counts less than one now). Under both an object's ancestors go after
            it, and one that is dropped takes its descendants with it. Objects that live
            only on SSD are dropped from there in LRU order whatever the policy.
        busy_poll_us: microseconds the master keeps polling its connections without
            sleeping after a request (0: it sleeps as soon as it has nothing to do). A
            client's next request then costs no wake-up of the master (tens of
            microseconds on a VM, as much as the answer); the price is at most this much
            CPU after the last request of a burst. 0..1000000 (``ValueError``).
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
    history_entries: int = 100_000
    orphan_grace_s: float = 30.0
    eviction_policy: str = "lru"
    busy_poll_us: int = 60

    def __post_init__(self):
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"MasterConfig: eviction_policy must be one of {', '.join(POLICIES)}, got "
                f"{self.eviction_policy!r}"
            )
        for name in ("client_ttl_s", "put_ttl_s", "lease_ttl_s"):
            v = float(getattr(self, name))
            # inf overflowed when the master converted it to milliseconds; 1e-9 expired
            # every lease before its reader could use it
            if not (0.1 <= v < 1e6):
                raise ValueError(
                    f"MasterConfig: {name} must be >= 0.1 and < 1e6 seconds, got {getattr(self, name)!r}"
                )
        if not (
            isinstance(self.busy_poll_us, int)
            and not isinstance(self.busy_poll_us, bool)
            and 0 <= self.busy_poll_us <= 1_000_000
        ):
            raise ValueError(
                f"MasterConfig: busy_poll_us must be microseconds in 0..1000000, got {self.busy_poll_us!r}"
            )
        if not (isinstance(self.history_entries, int) and self.history_entries >= 0):
            raise ValueError(
                f"MasterConfig: history_entries must be an int >= 0, got {self.history_entries!r}"
            )
        if not (0 <= float(self.orphan_grace_s) < 1e6):
            raise ValueError(
                f"MasterConfig: orphan_grace_s must be >= 0 and < 1e6 seconds, got {self.orphan_grace_s!r}"
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
            parse_hostport(self.etcd, "MasterConfig.etcd")
            if int(self.leader_ttl_s) < 2:
                raise ValueError(
                    f"MasterConfig: leader_ttl_s must be >= 2 s (etcd's minimum), got {self.leader_ttl_s}"
                )
        if self.advertise is not None:
            parse_hostport(self.advertise, "MasterConfig.advertise")
        elif self.etcd is not None and self.host in ("0.0.0.0", "::", ""):
            # the leader publishes its address in etcd: 0.0.0.0 there sent clients to themselves
            raise ValueError(
                f"MasterConfig: host {self.host!r} listens on every interface; with etcd, give "
                "advertise (HOST:PORT clients reach this master at)"
            )
