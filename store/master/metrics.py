"""The master's Prometheus metrics.

A ``prometheus_client`` collector over the ``stats``
of the master's metadata core, read at each scrape, on a registry of its own (several
masters in one process, as in tests and embedded use, do not share the global one).
``Master`` serves its text through the ``metrics`` request and ``GET /metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# the text exposition format generate_latest writes, as Prometheus servers ask for it
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name after mooncake_store_, key in Core.stats(), help)
_GAUGES = (
    ("objects", "objects", "Committed objects."),
    ("objects_on_ssd", "ssd_objects", "Committed objects with an SSD replica."),
    ("pending_puts", "pending", "Puts in progress."),
    ("used_bytes", "used_bytes", "Bytes allocated in segments (put reservations included)."),
    ("reserved_bytes", "reserved_bytes", "Bytes of segments reserved for clients' next puts."),
    ("capacity_bytes", "capacity_bytes", "Bytes of all registered segments."),
    ("clients", "clients", "Live clients."),
    ("segments", "segments", "Registered segments."),
    ("holds", "active_holds", "Holds in force."),
    ("held_keys", "held_keys", "Keys under at least one hold."),
    ("history_entries", "history_entries", "Dropped keys whose cause the master remembers."),
)
# (name without _total, key in Core.stats(), help)
_COUNTERS = (
    ("puts", "puts", "Committed puts."),
    ("hits", "hits", "Gets of existing keys."),
    ("misses", "misses", "Gets of missing keys."),
    ("evictions", "evictions", "Objects whose memory replicas were evicted."),
    ("offloads", "offloads", "Objects written to an SSD directory."),
    (
        "ssd_drops",
        "ssd_drops",
        "Objects dropped from an SSD directory to make room (ssd_max_bytes).",
    ),
    (
        "ssd_corrupt",
        "ssd_corrupt",
        "SSD replicas dropped because their file was missing or corrupt.",
    ),
    ("removes", "removes", "Removed objects."),
    ("put_aborts", "put_aborts", "Puts aborted (writer died, timed out or revoked)."),
    ("clients_lost", "clients_lost", "Clients declared dead after missing heartbeats."),
    ("invalidations", "invalidations", "Invalidate requests."),
    ("holds_taken", "holds", "Holds taken."),
    ("promotes", "promotes", "Loads from SSD into memory scheduled by promote requests."),
)


class StoreCollector:
    """Yields the metrics of the master's stats.

    Args:
        source: returns ``(stats, leader)``: ``Core.stats()`` and whether this master serves
            requests.
    """

    def __init__(self, source: Callable[[], tuple[dict, bool]]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape, from the core's ``stats`` now."""
        stats, leader = self._source()
        for name, key, help_ in _GAUGES:
            yield GaugeMetricFamily(f"mooncake_store_{name}", help_, value=stats.get(key, 0))
        for name, key, help_ in _COUNTERS:
            yield CounterMetricFamily(f"mooncake_store_{name}", help_, value=stats.get(key, 0))
        drops = CounterMetricFamily(
            "mooncake_store_drops",
            "Objects dropped, by cause (objects dropped with an ancestor count under its cause).",
            labels=["cause"],
        )
        for cause, n in stats.get("drops", {}).items():
            drops.add_metric([cause], n)
        yield drops
        groups = GaugeMetricFamily(
            "mooncake_store_group_bytes",
            "Bytes of the committed objects of each quota group.",
            labels=["group"],
        )
        for group, n in stats.get("group_bytes", {}).items():
            groups.add_metric([group], n)
        yield groups
        group_drops = CounterMetricFamily(
            "mooncake_store_group_drops",
            "Objects of each quota group dropped, by cause (descendants included).",
            labels=["group", "cause"],
        )
        for group, causes in stats.get("group_drops", {}).items():
            for cause, n in causes.items():
                group_drops.add_metric([group, cause], n)
        yield group_drops
        yield GaugeMetricFamily(
            "mooncake_store_leader", "1 if this master serves requests.", value=1 if leader else 0
        )


class Metrics:
    """The registry of one master's metrics."""

    def __init__(self, source: Callable[[], tuple[dict, bool]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(source))

    def text(self) -> str:
        """The Prometheus text of every metric, read now."""
        return generate_latest(self.registry).decode()
