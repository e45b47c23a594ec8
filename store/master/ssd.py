"""SSD bookkeeping in the master's metadata core: SSD files clients report (``adopt_ssd``),
room in each client's SSD directory, offloads (``offload_done``), loads into memory for
readers on other hosts (``_promote``, ``load_done``) and corrupt files (``ssd_bad``).

Mixed into :class:`~mooncake_store.core.Core`, whose ``__init__`` sets the state these
methods use (``objects``, ``pending``, ``lru``, ``clients``, ``segments``, ``used``, ...).
"""

from __future__ import annotations

from ..common.errors import ProtocolError
from ..common.layout import aligned
from .records import Client, Obj, Segment

# seconds a client's SSD directory gets no offloads after a write to it failed (a full disk)
SSD_RETRY_S = 10.0
# a load from SSD whose object went away meanwhile (removed, overwritten, dropped) may
# still be writing into its slot: the slot is reused only this long after, or after its
# load_done, whichever comes first
LOAD_ORPHAN_S = 120.0


class _SsdMixin:
    """SSD replicas: adoption, room, offloads, loads, corrupt files."""

    def _adopt_ssd(self, c: Client, e):
        if not (
            isinstance(e, list)
            and len(e) == 5
            and isinstance(e[0], str)
            and isinstance(e[1], int)
            and isinstance(e[2], int)
            and e[2] >= 0
            and isinstance(e[3], bytes)
            and isinstance(e[4], str)
            and e[0]
        ):
            return
        key, version, size, meta, path = e
        cur = self.objects.get(key)
        if cur is not None and cur.version >= version:
            mine = [e for e in cur.ssd if e[1] == path]
            if not mine:
                self._queue(c, ["delete", path])
            elif cur.version == version and mine[0][0] != c.id:
                # the same file, registered by a new client on that directory (the owner
                # restarted before its old incarnation's TTL ran out): the new one owns it
                # now, or the old one's death would drop the object (found by a trial)
                old = self.clients.get(mine[0][0])
                if old is not None:
                    self._ssd_forget(old, cur)
                mine[0][0] = c.id
                c.ssd_keys.add(key)
                c.ssd_bytes += size
                self._dirty(key)
            return
        if cur is not None:
            self._drop_committed(key)
        obj = Obj(key, size, version, meta, False)
        obj.ssd.append([c.id, path])
        c.ssd_keys.add(key)
        c.ssd_bytes += size
        self.objects[key] = obj
        self.lru[key] = None
        self._version = max(self._version, version)
        self._dirty(key)

    def adopt_ssd(self, a: dict) -> dict:
        """A registered client reports SSD files it found (in chunks, after ``register``)."""
        c = self._client(a.get("client"))
        entries = a.get("entries")
        if not isinstance(entries, list) or len(entries) > 100_000:
            raise ProtocolError(
                "adopt_ssd: entries must be a list of at most 100000 [key, version, size, meta, path]"
            )
        for e in entries:
            self._adopt_ssd(c, e)
        return {}

    def _ssd_room(self, c: Client, size: int, now: float) -> bool | None:
        """Whether ``c``'s SSD directory can take ``size`` more bytes, after dropping the
        least recently used objects that live only there (not leased, not being loaded).
        None: not now, but once the offloads in flight to it are done (they then become
        such objects): the caller keeps the object in memory for now."""
        if now - c.ssd_failed_at < SSD_RETRY_S:
            return False
        if c.ssd_max is None:
            return True
        if size > c.ssd_max:
            return False
        if c.ssd_bytes + size <= c.ssd_max:
            return True
        for key in list(self.lru):
            if c.ssd_bytes + size <= c.ssd_max:
                break
            o = self.objects.get(key)
            if (
                o is None
                or key not in c.ssd_keys
                or o.repl
                or o.loading is not None
                or o.lease_until > now
                or o.offloading
            ):
                continue
            self._drop_committed(key)
            self.counters.ssd_drops += 1
        if c.ssd_bytes + size <= c.ssd_max:
            return True
        return None if c.ssd_inflight else False

    def _ssd_forget(self, c: Client, obj: Obj):
        if obj.key in c.ssd_keys:
            c.ssd_keys.discard(obj.key)
            c.ssd_bytes -= obj.size

    def _promote(self, obj: Obj) -> bool:
        """Asks the owner of an SSD replica to load ``obj`` into its segment (for readers
        on other hosts). True while that load is in progress (the reader asks again)."""
        if obj.loading is not None:
            return True
        n = aligned(obj.size) if obj.size else 0
        for cid, path in obj.ssd:
            c = self.clients.get(cid)
            if c is None:
                continue
            for seg in c.segments:
                off = seg.alloc.alloc(n) if n else 0
                if off is None:
                    self._evict_for(n, 1, set(), [seg])
                    off = seg.alloc.alloc(n)
                if off is None:
                    if self._space_coming(seg):
                        return True
                    continue
                self.used += n
                seg.add_key(obj.key)
                obj.loading = [seg.name, off, n]
                self._queue(c, ["load", obj.key, obj.version, path, off, obj.size])
                return True
        return False

    def _space_coming(self, seg: Segment) -> bool:
        """Whether space in ``seg`` frees up by itself soon: offloads to SSD, leases or
        deferred frees that end, puts that finish or are aborted, loads from SSD that
        finish (and whose lease then ends)."""
        now = self.clock()
        if any(d[1] == seg.name for d in self.deferred) or self._reclaim([seg.name]):
            return True
        for k in seg.keys:
            if k in self.pending:
                return True
            o = self.objects.get(k)
            if o is not None and (
                o.offloading
                or (o.lease_until > now and not o.pin)
                or (o.loading is not None and o.loading[0] == seg.name)
            ):
                return True  # a load in progress becomes evictable once its reader is done
        return False

    def load_done(self, a: dict) -> dict:
        self._client(a.get("client"))
        key, version, ok = a.get("key"), a.get("version"), a.get("ok")
        if not (isinstance(key, str) and isinstance(version, int)):
            raise ProtocolError("load_done: bad arguments")
        obj = self.objects.get(key)
        if obj is None or obj.version != version or obj.loading is None:
            self._end_orphan_load(key, version)
            return {}
        seg_name, off, n = obj.loading
        obj.loading = None
        if ok and seg_name in self.segments:
            obj.repl.append([seg_name, off, n])
            self._dirty(key)
        else:
            self._free_replica(seg_name, off, n, key, 0.0)
        return {}

    def _end_orphan_load(self, key: str, version: int):
        """The load of an object released meanwhile is over: its slot is free now."""
        slot = self.orphan_loads.pop((key, version), None)
        if slot is None:
            return
        for i, d in enumerate(self.deferred):
            if d[1] == slot[0] and d[2] == slot[1]:
                del self.deferred[i]
                self._free_replica(d[1], d[2], d[3], key, 0.0)
                break

    def ssd_bad(self, a: dict) -> dict:
        """A client found an SSD file of ``key`` (at ``version``) missing or corrupt
        (``ssd.CorruptError``): that replica is dropped and its file deleted; an object
        with no replica left is gone (its gets miss, not fail forever)."""
        self._client(a.get("client"))
        key, version, path = a.get("key"), a.get("version"), a.get("path")
        if not (isinstance(key, str) and isinstance(version, int) and isinstance(path, str)):
            raise ProtocolError("ssd_bad: bad arguments")
        obj = self.objects.get(key)
        if obj is None or obj.version != version:
            return {}
        for i, (cid, p) in enumerate(obj.ssd):
            if p != path:
                continue
            del obj.ssd[i]
            self.counters.ssd_corrupt += 1
            c = self.clients.get(cid)
            if c is not None:
                self._ssd_forget(c, obj)
                self._queue(c, ["delete", path])
            if not obj.repl and not obj.ssd:
                self._drop_committed(key)  # an object with no replica left is gone
            else:
                self._dirty(key)
            break
        return {}

    def offload_done(self, a: dict) -> dict:
        c = self._client(a.get("client"))
        key, version, path, ok = a.get("key"), a.get("version"), a.get("path"), a.get("ok")
        if not (isinstance(key, str) and isinstance(version, int) and isinstance(path, str)):
            raise ProtocolError("offload_done: bad arguments")
        obj = self.objects.get(key)
        if obj is None or obj.version != version or obj.offloading != c.id:
            # the object changed meanwhile; its reservation went with it (see _release)
            if ok:
                self._queue(c, ["delete", path])
            return {}
        obj.offloading = False
        c.ssd_inflight -= obj.size
        if ok:
            self.counters.offloads += 1
            obj.ssd.append([c.id, path])
            c.ssd_keys.add(key)
            for seg_name, off, n in obj.repl:
                self._free_replica(seg_name, off, n, key, obj.lease_until)
            obj.repl = []
            self.counters.evictions += 1
            self._dirty(key)
        else:
            # the write failed (a full disk, say): evicted without an SSD copy, like a store
            # without an SSD tier, and no offloads to that directory for SSD_RETRY_S
            now = self.clock()
            c.ssd_bytes -= obj.size
            c.ssd_failed_at = now
            if self._evictable(obj, now):
                self._evict(obj, now, to_ssd=False)
        return {}
