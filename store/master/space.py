"""Placement and eviction in the master's metadata core.

Where a put's replicas go, which
objects are evicted (least recently used first, never leased, pinned, held or being
written) to make room, whether an eviction offloads to the owner's SSD directory first
(and which objects that live only there are dropped to make room on it), and which
objects of a quota group are dropped to keep it within its quota.

An eviction that drops an object (no SSD copy left) drops the objects that hang off it
too (``Records.drop``), so it counts their bytes, and it does not happen while one of
them must not be evicted.
"""

from __future__ import annotations

from ..common.errors import (
    NoSpaceError,
    ReplicaShortfallError,
)
from ..common.layout import ALIGN, aligned
from .records import Client, Obj, Records, Segment
from .reservations import Reservations

# seconds a client's SSD directory gets no offloads after a write to it failed (a full disk)
SSD_RETRY_S = 10.0


class Space:
    """Placement of replicas, and eviction."""

    def __init__(self, records: Records, reservations: Reservations):
        self.records = records
        self.reservations = reservations
        # clients whose SSD directory is busy, during one eviction pass
        self._ssd_waiting: set = set()

    def place(
        self, key, size, r, pref, require_all, avoid: set = frozenset(), only_pref: bool = False
    ) -> list:
        """Allocates up to ``r`` replicas in distinct segments, evicting as needed.

        Replicas go to segments on distinct hosts (``StoreConfig.host_id``) first, then to
        distinct segments of hosts already used.

        Not in segments in ``avoid`` (segments a writer could not reach); ``only_pref``: in segment
        ``pref`` alone.
        """
        rec = self.records
        n = aligned(size) if size else 0
        if n == 0:
            # nothing to store: an empty object lives in the master alone (its metadata is
            # its value), so it outlives every segment (and needs none); WeightSync keeps
            # its version records so, which a restarted trainer must see even when its
            # segment held them
            return []
        live = [
            s
            for s in rec.segments.values()
            if s.alloc.size >= n and s.name not in avoid and (not only_pref or s.name == pref)
        ]
        if not live:
            if not rec.segments:
                raise NoSpaceError("no segment is registered (no client contributes memory)")
            if all(s.name in avoid for s in rec.segments.values()):
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
        used_hosts: set = set()

        def try_alloc():
            # distinct hosts first, so that one dead host (or process) leaves a replica; then
            # distinct segments on hosts already used, where there are fewer hosts than replicas
            for spread in (True, False):
                for s in live:
                    if len(got) >= target:
                        return
                    if s.name in used_names or (spread and seg_host(s) in used_hosts):
                        continue
                    off = s.alloc.alloc(n)
                    if off is not None:
                        rec.used += n
                        got.append([s.name, off, n])
                        used_names.add(s.name)
                        used_hosts.add(seg_host(s))

        try_alloc()
        if len(got) < target and self.reservations.reclaim(
            [s.name for s in live if s.name not in used_names]
        ):
            # space handed out for other puts comes back first: nothing is evicted for it
            for s_, off, nn in got:
                rec.segments[s_].alloc.free(off, nn)
                rec.used -= nn
            e = NoSpaceError(
                f"no space for {size} bytes yet: put reservations are being given back"
            )
            e.code = "NoSpaceRetry"
            raise e
        if len(got) < target:
            self.evict_for(n, target - len(got), used_names, live, keep=key)
            try_alloc()
        if len(got) < target or (require_all and len(got) < r):
            if require_all and got:
                for s, off, nn in got:
                    rec.segments[s].alloc.free(off, nn)
                    rec.used -= nn
                raise ReplicaShortfallError(
                    f"only {len(got)} of {r} replicas of {size} bytes fit; nothing stored"
                )
            if not got:
                if rec.clock() < rec.no_evict_until:
                    # read leases of the previous leader are not known here: nothing is
                    # evicted until they have surely ended (the message said "leased,
                    # pinned or being written", and the put failed at once)
                    e = NoSpaceError(
                        f"no space for {size} bytes yet: a new leader evicts nothing for "
                        f"{rec.no_evict_until - rec.clock():.1f} s more (the old leader's read leases)"
                    )
                    e.code = "NoSpaceRetry"
                    raise e
                # offloads in flight, by the clients' counts (a walk over every object cost
                # milliseconds per refused put with 30,000 objects on SSD)
                offl = any(c.ssd_inflight > 0 for c in rec.clients.values())
                msg = f"no space for {size} bytes: every segment is full and nothing can be evicted (leased, pinned or being written)"
                if offl:
                    e = NoSpaceError(msg + "; offload to SSD in progress")
                    e.code = "NoSpaceRetry"
                    raise e
                raise NoSpaceError(msg)
        return got

    def evictable(self, obj: Obj, now: float) -> bool:
        """Whether ``obj``'s memory replicas may be evicted now."""
        return (
            not obj.pin
            and not obj.offloading
            and obj.lease_until <= now
            and bool(obj.repl)
            and now >= self.records.no_evict_until
            and obj.key not in self.records.held
        )

    def evict_for(self, n: int, need: int, exclude: set, live: list, keep: str | None = None):
        """Evicts LRU objects with a replica in a segment not in ``exclude`` to make room.

        It evicts until ``need`` of those segments have ``n`` contiguous free bytes (or nothing is
        left to evict). Evicts nothing when even evicting every candidate could not free ``n`` bytes
        in ``need`` segments (a put that cannot fit must not cost other objects), and never ``keep``
        (the key being upserted: its old value stays until the new one is in).
        """
        rec = self.records
        now = rec.clock()
        wanted = {s.name for s in live if s.name not in exclude}
        possible = 0
        for name in wanted:  # stops as soon as enough is found
            if possible >= need:
                break
            possible += self._could_fit(rec.segments[name], n, keep, now)
        if possible < need:
            return
        self._ssd_waiting.clear()
        for key in rec.eviction_candidates():
            if key == keep:
                continue
            fits = sum(1 for name in wanted if rec.segments[name].alloc.largest_free() >= n)
            if fits >= need:
                return
            obj = rec.objects.get(key)
            if (
                obj is None
                or not self.evictable(obj, now)
                or not any(r[0] in wanted for r in obj.repl)
            ):
                continue
            self.evict(obj, now)

    def _could_fit(self, seg: Segment, n: int, keep: str | None, now: float) -> bool:
        """Whether ``seg`` would have ``n`` contiguous free bytes if all it may evict were evicted.

        That is, if every object that may be evicted (not ``keep``) were. Counted: free blocks and
        those objects' ranges, merged where they touch (a leased, pinned or reserved range between
        them splits the run).
        """
        if seg.alloc.largest_free() >= n:
            return True
        spans = seg.alloc.free_spans()
        for k in seg.keys:
            o = self.records.objects.get(k)
            if o is not None and k != keep and self.evictable(o, now):
                mine = [(r[1], aligned(r[2])) for r in o.repl if r[0] == seg.name and r[2] > 0]
                if any(size >= n for _off, size in mine):
                    # evicting this one object is enough: a cache of equal chunks stops at
                    # the first evictable key instead of walking the whole segment per put
                    return True
                spans += mine
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

    def evict_to_low_watermark(self, now: float) -> None:
        """Above the high watermark, evicts least recently used objects down to the low one.

        Put reservations are counted as free; eviction goes on until the projected use is down to
        the low watermark.
        """
        rec = self.records
        cfg = rec.cfg
        # memory being offloaded to SSD is as good as free: counted as used, every tick would
        # evict that much again while the disk writes, and the offloads queued would grow
        offloading = sum(c.ssd_inflight for c in rec.clients.values())
        projected = rec.used - rec.reserved_bytes - offloading
        if not rec.capacity or projected <= cfg.high_watermark * rec.capacity:
            return
        goal = cfg.low_watermark * rec.capacity
        self._ssd_waiting.clear()
        for key in rec.eviction_candidates():
            if projected <= goal:
                break
            obj = rec.objects.get(key)
            if obj is None or not self.evictable(obj, now):
                continue
            projected -= self.evict(obj, now)

    def evict(self, obj: Obj, now: float, to_ssd: bool = True) -> int:
        """Drops ``obj``'s memory replicas; to SSD first when an owner has a directory with room.

        The move to SSD is asynchronous: the object stays until the owner reports. An
        object left without any replica is dropped with the objects that hang off it,
        unless one of those must not be evicted (then nothing happens).

        Returns:
            The bytes of memory this frees (its replicas, and its descendants' when they
            go too), or will free once an offload in flight or waiting is done; 0 when
            nothing is evicted.
        """
        rec = self.records
        mem = sum(aligned(r[2]) for r in obj.repl)
        if rec.lfu is not None:
            rec.lfu.evicted(obj.key)
        if not obj.ssd and to_ssd:
            for seg_name, off, _n in obj.repl:
                seg = rec.segments.get(seg_name)
                if seg is None or not seg.client.ssd_dir:
                    continue
                c = seg.client
                if c.id in self._ssd_waiting:  # this eviction pass found its directory busy already
                    return mem
                room = self._ssd_room(c, obj.size, now)
                if room is None:
                    # a burst of evictions faster than the disk: the object waits in memory
                    # (puts meanwhile get NoSpaceRetry) rather than skipping the SSD, which
                    # would keep older objects there and lose newer ones
                    self._ssd_waiting.add(c.id)
                    return mem
                if room:
                    c.ssd_bytes += obj.size  # reserved until the owner reports
                    c.ssd_inflight += obj.size
                    obj.offloading = c.id
                    rec.queue(
                        c,
                        ["offload", obj.key, obj.version, off, obj.size, obj.meta, ssd_links(obj)],
                    )
                    return mem
        if not obj.ssd and obj.key in rec.children:
            extra = rec.descendants_evictable(obj.key, now)
            if extra is None:
                return 0
            mem += extra
        rec.counters.evictions += 1
        for seg_name, off, n in obj.repl:
            rec.free_replica(seg_name, off, n, obj.key, 0.0)
        obj.repl = []
        if obj.ssd:
            rec.to_ssd_only(obj.key)
            rec.dirty(obj.key)
        else:
            rec.drop(obj.key, "evicted", tier="memory")
        return mem

    def _ssd_room(self, c: Client, size: int, now: float) -> bool | None:
        """Whether ``c``'s SSD directory can take ``size`` more bytes.

        After dropping the least recently used objects that live only there (not leased, not being
        loaded). None: not now, but once the offloads in flight to it are done (they then become
        such objects): the caller keeps the object in memory for now.
        """
        if now - c.ssd_failed_at < SSD_RETRY_S:
            return False
        if c.ssd_max is None:
            return True
        if size > c.ssd_max:
            return False
        if c.ssd_bytes + size <= c.ssd_max:
            return True
        rec = self.records
        # the victims first, then their drops (which change the order): the walk stops as soon
        # as enough is found instead of copying the whole order at every offload
        over = c.ssd_bytes + size - c.ssd_max
        victims, found = [], 0
        for key in rec.ssd_lru:
            if found >= over:
                break
            o = rec.objects.get(key)
            if (
                o is None
                or key not in c.ssd_keys
                or o.repl
                or o.loading is not None
                or o.lease_until > now
                or o.offloading
                or key in rec.held
                or (key in rec.children and rec.descendants_evictable(key, now) is None)
            ):
                continue
            victims.append(key)
            found += o.size
        for key in victims:
            if c.ssd_bytes + size <= c.ssd_max:
                break
            if key in rec.objects:  # not dropped with an earlier victim
                rec.drop(key, "evicted", f"ssd_max_bytes of {c.name}", tier="ssd")
                rec.counters.ssd_drops += 1
        if c.ssd_bytes + size <= c.ssd_max:
            return True
        return None if c.ssd_inflight else False

    def fit_group(
        self, key: str, size: int, group: str, quota: int | None, parent: str | None = None
    ) -> None:
        """Makes room for a put of ``size`` bytes under ``key`` within quota group ``group``.

        When the group's committed bytes, those of its puts in progress and ``size`` (less the
        value of ``key`` it replaces) exceed its quota (``quota``, or the last one a put named),
        drops the group's least recently used objects that may be evicted (not pinned, leased
        or held, nor with such a descendant), with what hangs off them, never ``parent`` or
        its ancestors (the put would hang off a dropped object). A drop does not offload to
        SSD: the group's bytes count wherever its objects lie.

        Raises:
            NoSpaceError: even dropping all of those would not be enough (nothing is dropped
                then), naming the group and its quota; code ``NoSpaceRetry`` while a new leader
                evicts nothing.
        """
        rec = self.records
        if quota is None:
            quota = rec.group_quota.get(group)
            if quota is None:
                return
        else:
            rec.group_quota[group] = quota
        old = rec.objects.get(key)
        replaced = old.size if old is not None and old.group == group else 0
        have = rec.group_bytes.get(group, 0) + rec.group_pending.get(group, 0)
        over = have - replaced + size - quota
        if over <= 0:
            return
        now = rec.clock()
        # the put's parent chain stays: its ancestors are what makes it reachable
        keep = {key}
        x = parent
        while x is not None and x not in keep:
            keep.add(x)
            o = rec.objects.get(x)
            x = o.parent if o is not None else None
        picked, taken, freed = [], set(keep), 0
        if size <= quota and now >= rec.no_evict_until:
            for k in rec.group_lru.get(group, ()):
                if freed >= over:
                    break
                o = rec.objects[k]
                if k in taken or o.pin or o.lease_until > now or k in rec.held:
                    continue
                sub = rec.descendants(k) if k in rec.children else []
                if any(
                    d.key in keep or d.pin or d.lease_until > now or d.key in rec.held for d in sub
                ):
                    continue
                # descendants already picked (a chain's leaves come first in LRU order) are
                # counted once
                new = [d for d in sub if d.key not in taken]
                taken.add(k)
                taken.update(d.key for d in new)
                picked.append(k)
                freed += o.size + sum(d.size for d in new if d.group == group)
        if size > quota:
            raise NoSpaceError(
                f"no space for {size} bytes in group {group!r}: larger than its quota of {quota} bytes"
            )
        if freed < over and now < rec.no_evict_until:
            # the old leader's read leases are not known here (see place)
            e = NoSpaceError(
                f"no space for {size} bytes in group {group!r} yet: a new leader evicts nothing "
                f"for {rec.no_evict_until - now:.1f} s more (the old leader's read leases)"
            )
            e.code = "NoSpaceRetry"
            raise e
        if freed < over:
            raise NoSpaceError(
                f"no space for {size} bytes in group {group!r}: it holds {have} of its quota of "
                f"{quota} bytes, and only {freed} bytes of it can be evicted now (the rest is "
                "leased, pinned, held or being written)"
            )
        why = f"group {group!r} over its quota of {quota} bytes"
        for k in picked:
            if k in rec.objects:  # not dropped with an ancestor picked after it
                rec.drop(k, "evicted", why)


def seg_host(seg) -> str:
    """The host a segment lives on (its owner's ``host_id``); its own name where unknown."""
    return seg.desc.get("host") or seg.name


def ssd_links(obj: Obj) -> dict:
    """What an SSD file's header keeps of ``obj`` besides key, version and metadata.

    Its parent, tags and group, so that a restart from SSD keeps them.
    """
    out: dict = {}
    if obj.parent is not None:
        out["p"] = obj.parent
    if obj.tags:
        out["t"] = list(obj.tags)
    if obj.group is not None:
        out["g"] = obj.group
    return out
