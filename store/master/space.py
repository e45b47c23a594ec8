"""Placement and eviction in the master's metadata core: where a put's replicas go, which
objects are evicted (least recently used first, never leased, pinned or being written)
to make room, and how an eviction offloads to SSD first when the owner has a directory.

Mixed into :class:`~mooncake_store.core.Core`, whose ``__init__`` sets the state these
methods use (``objects``, ``pending``, ``lru``, ``clients``, ``segments``, ``used``, ...).
"""

from __future__ import annotations

from ..common.errors import (
    NoSpaceError,
    ReplicaShortfallError,
)
from ..common.layout import ALIGN, aligned
from .records import Obj, Segment


class _SpaceMixin:
    """Placement of replicas, and eviction."""

    def _place(
        self, key, size, r, pref, require_all, avoid: set = frozenset(), only_pref: bool = False
    ) -> list:
        """Allocates up to ``r`` replicas in distinct segments (not those in ``avoid``:
        segments a writer could not reach; ``only_pref``: in segment ``pref`` alone),
        evicting as needed."""
        n = aligned(size) if size else 0
        if n == 0:
            # nothing to store: an empty object lives in the master alone (its metadata is
            # its value), so it outlives every segment (and needs none); WeightSync keeps
            # its version records so, which a restarted trainer must see even when its
            # segment held them
            return []
        live = [
            s
            for s in self.segments.values()
            if s.alloc.size >= n and s.name not in avoid and (not only_pref or s.name == pref)
        ]
        if not live:
            if not self.segments:
                raise NoSpaceError("no segment is registered (no client contributes memory)")
            if all(s.name in avoid for s in self.segments.values()):
                raise NoSpaceError(
                    f"no reachable segment for {size} bytes: the writer could not reach "
                    f"{sorted(avoid)} (owners gone?)"
                )
            raise NoSpaceError(
                f"object of {size} bytes ({n} with the {ALIGN}-byte rounding of allocations) is "
                f"larger than every segment's usable size"
            )
        live.sort(key=lambda s: (s.name != pref, -(s.alloc.size - s.alloc.used)))
        target = min(r, len(live))
        if require_all and target < r:
            raise ReplicaShortfallError(
                f"{r} replicas requested but only {len(live)} segment(s) can hold {size} bytes; nothing stored"
            )
        got: list = []
        used_names: set = set()

        def try_alloc():
            for s in live:
                if len(got) >= target:
                    return
                if s.name in used_names:
                    continue
                off = s.alloc.alloc(n)
                if off is not None:
                    self.used += n
                    got.append([s.name, off, n])
                    used_names.add(s.name)

        try_alloc()
        if len(got) < target and self._reclaim([s.name for s in live if s.name not in used_names]):
            # space handed out for other puts comes back first: nothing is evicted for it
            for s_, off, nn in got:
                self.segments[s_].alloc.free(off, nn)
                self.used -= nn
            e = NoSpaceError(
                f"no space for {size} bytes yet: put reservations are being given back"
            )
            e.code = "NoSpaceRetry"
            raise e
        if len(got) < target:
            self._evict_for(n, target - len(got), used_names, live, keep=key)
            try_alloc()
        if len(got) < target or (require_all and len(got) < r):
            if require_all and got:
                for s, off, nn in got:
                    self.segments[s].alloc.free(off, nn)
                    self.used -= nn
                raise ReplicaShortfallError(
                    f"only {len(got)} of {r} replicas of {size} bytes fit; nothing stored"
                )
            if not got:
                if self.clock() < self.no_evict_until:
                    # read leases of the previous leader are not known here: nothing is
                    # evicted until they have surely ended (the message said "leased,
                    # pinned or being written", and the put failed at once)
                    e = NoSpaceError(
                        f"no space for {size} bytes yet: a new leader evicts nothing for "
                        f"{self.no_evict_until - self.clock():.1f} s more (the old leader's read leases)"
                    )
                    e.code = "NoSpaceRetry"
                    raise e
                offl = any(o.offloading for o in self.objects.values())
                msg = f"no space for {size} bytes: every segment is full and nothing can be evicted (leased, pinned or being written)"
                if offl:
                    e = NoSpaceError(msg + "; offload to SSD in progress")
                    e.code = "NoSpaceRetry"
                    raise e
                raise NoSpaceError(msg)
        return got

    def _evictable(self, obj: Obj, now: float) -> bool:
        return (
            not obj.pin
            and not obj.offloading
            and obj.lease_until <= now
            and bool(obj.repl)
            and now >= self.no_evict_until
        )

    def _evict_for(self, n: int, need: int, exclude: set, live: list, keep: str | None = None):
        """Evicts LRU objects with a replica in a segment not in ``exclude`` until ``need``
        of those segments have ``n`` contiguous free bytes (or nothing is left to evict).
        Evicts nothing when even evicting every candidate could not free ``n`` bytes in
        ``need`` segments (a put that cannot fit must not cost other objects), and never
        ``keep`` (the key being upserted: its old value stays until the new one is in)."""
        now = self.clock()
        wanted = {s.name for s in live if s.name not in exclude}
        possible = 0
        for name in wanted:  # stops as soon as enough is found
            if possible >= need:
                break
            possible += self._could_fit(self.segments[name], n, keep, now)
        if possible < need:
            return
        self.ssd_waiting.clear()
        for key in list(self.lru):
            if key == keep:
                continue
            fits = sum(1 for name in wanted if self.segments[name].alloc.largest_free() >= n)
            if fits >= need:
                return
            obj = self.objects.get(key)
            if (
                obj is None
                or not self._evictable(obj, now)
                or not any(r[0] in wanted for r in obj.repl)
            ):
                continue
            self._evict(obj, now)

    def _could_fit(self, seg: Segment, n: int, keep: str | None, now: float) -> bool:
        """Whether ``seg`` would have ``n`` contiguous free bytes if every object that may be
        evicted (not ``keep``) were: free blocks and those objects' ranges, merged where
        they touch (a leased, pinned or reserved range between them splits the run)."""
        if seg.alloc.largest_free() >= n:
            return True
        spans = seg.alloc.free_spans()
        for k in seg.keys:
            o = self.objects.get(k)
            if o is not None and k != keep and self._evictable(o, now):
                spans += [(r[1], aligned(r[2])) for r in o.repl if r[0] == seg.name and r[2] > 0]
        spans.sort()
        start = end = -1
        for off, size in spans:
            if off == end:
                end += size
            else:
                start, end = off, off + size
            if end - start >= n:
                return True
        return False

    def _evict(self, obj: Obj, now: float, to_ssd: bool = True) -> bool:
        """Drops ``obj``'s memory replicas; to SSD first when an owner has a directory
        with room (then asynchronously: the object stays until the owner reports). True
        if freed now."""
        if not obj.ssd and to_ssd:
            for seg_name, off, _n in obj.repl:
                seg = self.segments.get(seg_name)
                if seg is None or not seg.client.ssd_dir:
                    continue
                c = seg.client
                if c.id in self.ssd_waiting:  # this eviction pass found its directory busy already
                    return False
                room = self._ssd_room(c, obj.size, now)
                if room is None:
                    # a burst of evictions faster than the disk: the object waits in memory
                    # (puts meanwhile get NoSpaceRetry) rather than skipping the SSD, which
                    # kept older objects there and lost newer ones (found by a trial)
                    self.ssd_waiting.add(c.id)
                    return False
                if room:
                    c.ssd_bytes += obj.size  # reserved until the owner reports
                    c.ssd_inflight += obj.size
                    obj.offloading = c.id
                    self._queue(c, ["offload", obj.key, obj.version, off, obj.size, obj.meta])
                    return False
        self.counters.evictions += 1
        for seg_name, off, n in obj.repl:
            self._free_replica(seg_name, off, n, obj.key, 0.0)
        obj.repl = []
        if not obj.ssd:
            self.objects.pop(obj.key, None)
            self.lru.pop(obj.key, None)
        self._dirty(obj.key)
        return True
