"""Options of :class:`~mooncake_store.WeightSync` (:class:`WeightSyncConfig`)."""

from __future__ import annotations

import dataclasses

from ..common.config import MiB


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
            pull or ``release()``. The rest is copied. ``"swap"``: as ``"copy"``, but a
            staged tensor with the target's dtype, shape, strides and device becomes the
            target's storage (``param.data = staged``: no copy at install) and the target's
            old storage stages the next pull; for readers that keep no other reference to
            their tensors' storage (a view of a target, or a flat buffer the targets view,
            no longer sees the new version).
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
        if self.install not in ("copy", "view", "swap"):
            raise ValueError(
                f"WeightSyncConfig: install must be 'copy', 'view' or 'swap', got {self.install!r}"
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
