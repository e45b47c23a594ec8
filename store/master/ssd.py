"""The SSD tier in the master's metadata core.

SSD files clients report (``adopt_ssd``),
offloads that finished (``offload_done``), loads into memory for readers on other hosts
or asked for ahead of reads (:meth:`SsdTier.promote`, ``promote``, ``load_done``) and
corrupt files (``ssd_bad``). Which objects go to SSD, and room there, is eviction's call
(``space.py``).
"""

from __future__ import annotations

import collections
import sys

from ..common.errors import ProtocolError
from ..common.layout import aligned
from .records import Client, Obj, Records, Segment
from .reservations import Reservations
from .space import Space

PROMOTE_WAIT_S = 30.0  # how long a promoted load may wait for room before it is dropped
MAX_PROMOTE_WAITING = 65536  # promoted loads waiting for room, at most (the oldest go)


class SsdTier:
    """SSD replicas: adoption, offloads, loads, corrupt files."""

    def __init__(self, records: Records, space: Space, reservations: Reservations):
        self.records = records
        self.space = space
        self.reservations = reservations
        # promoted keys whose load waits for room that frees up by itself (offloads, leases):
        # key -> when to give up (the clock's seconds); retried at every tick
        self.waiting: collections.OrderedDict[str, float] = collections.OrderedDict()

    def adopt(self, c: Client, e) -> None:
        """Registers one SSD file ``e`` that ``c`` found in its directory.

        ``e`` is ``[key, version, size, meta, path]``, and the links its header kept:
        ``{"p": parent, "t": [tags], "g": group}``; a malformed entry is ignored. An object
        whose parent is not stored waits ``orphan_grace_s`` for it (another client may
        bring it).
        """
        rec = self.records
        if not (
            isinstance(e, list)
            and len(e) in (5, 6)
            and isinstance(e[0], str)
            and isinstance(e[1], int)
            and isinstance(e[2], int)
            and e[2] >= 0
            and isinstance(e[3], bytes)
            and isinstance(e[4], str)
            and e[0]
        ):
            return
        key, version, size, meta, path = e[:5]
        parent, tags, group = _links(e[5] if len(e) == 6 else None, key)
        cur = rec.objects.get(key)
        if cur is not None and cur.version >= version:
            mine = [e for e in cur.ssd if e[1] == path]
            if not mine:
                rec.queue(c, ["delete", path])
            elif cur.version == version and mine[0][0] != c.id:
                # the same file, registered by a new client on that directory (the owner
                # restarted before its old incarnation's TTL ran out): the new one owns it
                # now, or the old one's death would drop the object
                old = rec.clients.get(mine[0][0])
                if old is not None:
                    rec.forget_ssd(old, cur)
                mine[0][0] = c.id
                c.ssd_keys.add(key)
                c.ssd_bytes += size
                rec.dirty(key)
            return
        obj = Obj(key, size, version, meta, False, parent, tags, group)
        obj.ssd.append([c.id, path])
        rec.install(obj, count=False)  # a newer version than the one stored replaces it
        c.ssd_keys.add(key)
        c.ssd_bytes += size
        rec.see_version(version)
        if parent is not None and parent not in rec.objects:
            rec.orphans[key] = rec.clock() + rec.cfg.orphan_grace_s

    def adopt_ssd(self, a: dict) -> dict:
        """A registered client reports SSD files it found (in chunks, after ``register``)."""
        rec = self.records
        c = rec.client(a.get("client"))
        entries = a.get("entries")
        if not isinstance(entries, list) or len(entries) > 100_000:
            raise ProtocolError(
                "adopt_ssd: entries must be a list of at most 100000 [key, version, size, meta, path]"
            )
        for e in entries:
            self.adopt(c, e)
        return {}

    def promote(self, obj: Obj) -> bool:
        """Asks the owner of an SSD replica to load ``obj`` into its segment.

        For readers on other hosts. True while that load is in progress (the reader asks
        again).
        """
        return self._load(obj) is not None

    def _load(self, obj: Obj) -> str | None:
        """Has the owner of an SSD replica of ``obj`` load it into its segment (evicting as needed).

        Returns:
            ``"scheduled"`` (asked now), ``"loading"`` (asked before), ``"wait"`` (no room yet,
            but space frees up by itself soon) or None (no owner can take it).
        """
        rec = self.records
        if obj.loading is not None:
            return "loading"
        n = aligned(obj.size) if obj.size else 0
        for cid, path in obj.ssd:
            c = rec.clients.get(cid)
            if c is None:
                continue
            for seg in c.segments:
                off = seg.alloc.alloc(n) if n else 0
                if off is None:
                    self.space.evict_for(n, 1, set(), [seg])
                    off = seg.alloc.alloc(n)
                if off is None:
                    if self._space_coming(seg):
                        return "wait"
                    continue
                rec.used += n
                seg.add_key(obj.key)
                obj.loading = [seg.name, off, n]
                rec.queue(c, ["load", obj.key, obj.version, path, off, obj.size])
                return "scheduled"
        return None

    def promote_keys(self, a: dict) -> dict:
        """The ``promote`` request: schedules loads into memory of the ``keys`` that lie only on SSD.

        No read lease is taken (a loaded copy is evicted as any other), and nothing waits for
        a load.

        Returns:
            ``{"scheduled": loads asked for now or waiting for room}``: a load that waits for
            room that frees up by itself (offloads and leases ending) is asked for again at
            every tick, for up to ``PROMOTE_WAIT_S``.
        """
        rec = self.records
        keys = rec.check_keys(a.get("keys"))
        n = 0
        until = rec.clock() + PROMOTE_WAIT_S
        for key in dict.fromkeys(keys):
            obj = rec.objects.get(key)
            if obj is not None and not obj.repl and obj.ssd and obj.size:
                got = self._load(obj)
                if got == "wait":  # no room yet: the ticks try again
                    self.waiting[key] = until
                    self.waiting.move_to_end(key)
                    while len(self.waiting) > MAX_PROMOTE_WAITING:
                        self.waiting.popitem(last=False)
                if got in ("scheduled", "wait"):
                    n += 1
        rec.counters.promotes += n
        return {"scheduled": n}

    def retry_promotes(self, now: float) -> None:
        """Asks again for the promoted loads that waited for room (at every tick)."""
        rec = self.records
        for key, until in list(self.waiting.items()):
            obj = rec.objects.get(key)
            if obj is None or obj.repl or not obj.ssd or until < now:
                del self.waiting[key]
                continue
            if self._load(obj) != "wait":
                del self.waiting[key]

    def _space_coming(self, seg: Segment) -> bool:
        """Whether space in ``seg`` frees up by itself soon.

        Offloads to SSD, leases or deferred frees that end, puts that finish or are aborted, loads
        from SSD that finish (and whose lease then ends).
        """
        rec = self.records
        now = rec.clock()
        if any(d[1] == seg.name for d in rec.deferred) or self.reservations.reclaim([seg.name]):
            return True
        for k in seg.keys:
            if k in rec.pending:
                return True
            o = rec.objects.get(k)
            if o is not None and (
                o.offloading
                or (o.lease_until > now and not o.pin)
                or (o.loading is not None and o.loading[0] == seg.name)
            ):
                return True  # a load in progress becomes evictable once its reader is done
        return False

    def load_done(self, a: dict) -> dict:
        """The owner of an SSD replica loaded ``key`` into its segment (``ok``) or could not."""
        rec = self.records
        rec.client(a.get("client"))
        key, version, ok = a.get("key"), a.get("version"), a.get("ok")
        if not (isinstance(key, str) and isinstance(version, int)):
            raise ProtocolError("load_done: bad arguments")
        obj = rec.objects.get(key)
        if obj is None or obj.version != version or obj.loading is None:
            self._end_orphan_load(key, version)
            return {}
        seg_name, off, n = obj.loading
        obj.loading = None
        if ok and seg_name in rec.segments:
            obj.repl.append([seg_name, off, n])
            rec.to_memory(key)
            if rec.lfu is not None:  # in memory again: back in the eviction order
                rec.lfu.push(key)
            rec.dirty(key)
        else:
            rec.free_replica(seg_name, off, n, key, 0.0)
        return {}

    def _end_orphan_load(self, key: str, version: int):
        """The load of an object released meanwhile is over: its slot is free now."""
        rec = self.records
        slot = rec.orphan_loads.pop((key, version), None)
        if slot is None:
            return
        for i, d in enumerate(rec.deferred):
            if d[1] == slot[0] and d[2] == slot[1]:
                del rec.deferred[i]
                rec.free_replica(d[1], d[2], d[3], key, 0.0)
                break

    def ssd_bad(self, a: dict) -> dict:
        """A client found an SSD file of ``key`` (at ``version``) missing or corrupt.

        See ``client/ssd.py`` ``CorruptError``. That replica is dropped and its file deleted; an
        object with no replica left is gone (its gets miss, not fail forever).
        """
        rec = self.records
        rec.client(a.get("client"))
        key, version, path = a.get("key"), a.get("version"), a.get("path")
        if not (isinstance(key, str) and isinstance(version, int) and isinstance(path, str)):
            raise ProtocolError("ssd_bad: bad arguments")
        obj = rec.objects.get(key)
        if obj is None or obj.version != version:
            return {}
        for i, (cid, p) in enumerate(obj.ssd):
            if p != path:
                continue
            del obj.ssd[i]
            rec.counters.ssd_corrupt += 1
            c = rec.clients.get(cid)
            if c is not None:
                rec.forget_ssd(c, obj)
                rec.queue(c, ["delete", path])
            if not obj.repl and not obj.ssd:  # an object with no replica left is gone
                rec.drop(key, "corrupt", path, tier="ssd")
            else:
                rec.dirty(key)
            break
        return {}

    def offload_done(self, a: dict) -> dict:
        """A client wrote ``key`` to its SSD directory (``ok``, at ``path``) or could not.

        Or, with ``items`` (``[key, version, path, ok]`` each, at most ``max_keys_per_call``),
        several offloads at once: a client that writes a burst of evictions reports them in
        one request.
        """
        rec = self.records
        c = rec.client(a.get("client"))
        items = a.get("items")
        if items is None:
            items = [[a.get("key"), a.get("version"), a.get("path"), a.get("ok")]]
        if not (isinstance(items, list) and len(items) <= rec.cfg.max_keys_per_call) or not all(
            isinstance(it, list)
            and len(it) == 4
            and isinstance(it[0], str)
            and isinstance(it[1], int)
            and isinstance(it[2], str)
            for it in items
        ):
            raise ProtocolError("offload_done: bad arguments")
        for key, version, path, ok in items:
            self._offload_done(c, key, version, path, ok)
        return {}

    def _offload_done(self, c: Client, key: str, version: int, path: str, ok) -> None:
        rec = self.records
        obj = rec.objects.get(key)
        if obj is None or obj.version != version or obj.offloading != c.id:
            # the object changed meanwhile; its reservation went with it (Records.release)
            if ok:
                rec.queue(c, ["delete", path])
            return
        obj.offloading = False
        c.ssd_inflight -= obj.size
        if ok:
            rec.counters.offloads += 1
            obj.ssd.append([c.id, path])
            c.ssd_keys.add(key)
            for seg_name, off, n in obj.repl:
                rec.free_replica(seg_name, off, n, key, obj.lease_until)
            obj.repl = []
            rec.to_ssd_only(key)
            rec.counters.evictions += 1
            rec.dirty(key)
        else:
            # the write failed (a full disk, say): evicted without an SSD copy, like a store
            # without an SSD tier, and no offloads to that directory for space.SSD_RETRY_S
            now = rec.clock()
            c.ssd_bytes -= obj.size
            c.ssd_failed_at = now
            if self.space.evictable(obj, now):
                self.space.evict(obj, now, to_ssd=False)


def _links(links, key: str) -> tuple:
    """The parent, tags and group of an SSD file's links (``{"p", "t", "g"}``).

    Whatever is malformed there is left out (a file is not refused for it).
    """
    if not isinstance(links, dict):
        return None, None, None
    parent, tags, group = links.get("p"), links.get("t"), links.get("g")
    if not (isinstance(parent, str) and parent and parent != key):
        parent = None
    if isinstance(tags, list) and all(isinstance(t, str) and t for t in tags):
        tags = tuple(sys.intern(t) for t in dict.fromkeys(tags)) or None
    else:
        tags = None
    group = sys.intern(group) if isinstance(group, str) and group else None
    return parent, tags, group
