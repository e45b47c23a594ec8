"""The master's metadata state machine (no I/O, no threads: the server calls it).

Objects: ``key -> Obj`` for committed versions, ``key -> Obj`` in ``pending`` for puts in
progress (a put on an existing key with ``upsert`` keeps the old version readable until
the new one commits). Replicas live in client segments (``[segment, offset, bytes]``) or
in a client's SSD directory (``[client, path]``). Space is allocated by the master and
written by the client; the master never touches data.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from .alloc import ALIGN, Allocator, aligned
from .config import MasterConfig
from .errors import (
    NoSpaceError,
    ObjectExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ProtocolError,
    PutLostError,
    ReplicaShortfallError,
    StoreError,
    UnknownClientError,
)

SEG_HEADER = 4096  # bytes at the start of every segment kept for its header (magic + token)


# seconds a client's SSD directory gets no offloads after a write to it failed (a full disk)
SSD_RETRY_S = 10.0
# a load from SSD whose object went away meanwhile (removed, overwritten, dropped) may
# still be writing into its slot: the slot is reused only this long after, or after its
# load_done, whichever comes first
LOAD_ORPHAN_S = 120.0
# seconds between two ticks (Master's ticker); a gap longer than STALL_S is a stall of the
# master itself, and all of it but one tick period is credited to clients and puts
TICK_S = 0.1
STALL_S = 1.0


class Segment:
    __slots__ = ("alloc", "client", "desc", "keys", "name", "size")

    def __init__(self, name: str, client: Client, size: int, desc: dict):
        self.name = name
        self.client = client
        self.size = size
        self.alloc = (
            Allocator(size - SEG_HEADER, base=SEG_HEADER)
            if size > SEG_HEADER
            else Allocator(0, SEG_HEADER)
        )
        self.desc = desc
        # key -> replicas here (committed or pending): an upsert's new replica may share the
        # segment with the old one, and freeing the old must not forget the new
        self.keys: dict = {}

    def add_key(self, key: str):
        self.keys[key] = self.keys.get(key, 0) + 1

    def drop_key(self, key: str):
        n = self.keys.get(key, 0) - 1
        if n > 0:
            self.keys[key] = n
        else:
            self.keys.pop(key, None)


class Client:
    __slots__ = (
        "event",
        "host",
        "id",
        "last_put",
        "last_seen",
        "name",
        "pid",
        "reclaim_at",
        "reserved",
        "segments",
        "ssd_bytes",
        "ssd_dir",
        "ssd_failed_at",
        "ssd_inflight",
        "ssd_keys",
        "ssd_max",
        "tasks",
        "writing",
    )

    def __init__(
        self,
        cid: str,
        name: str,
        host: str,
        pid: int,
        ssd_dir: str | None,
        now: float,
        ssd_max: int | None = None,
    ):
        self.id = cid
        self.name = name
        self.host = host
        self.pid = pid
        self.ssd_dir = ssd_dir
        self.last_seen = now
        self.segments: list[Segment] = []
        self.tasks: list = []
        self.event = None  # asyncio.Event, set by the server
        self.writing: set = set()  # keys of pending puts this client writes
        self.ssd_keys: set = set()  # keys with an SSD replica in this client's directory
        self.ssd_max = ssd_max  # object bytes the directory may hold (None: no limit)
        self.ssd_bytes = 0  # object bytes on it, offloads in flight included
        self.ssd_inflight = 0  # of which offloads in flight (written, not yet reported)
        self.ssd_failed_at = (
            -1e18
        )  # when a write to it last failed (full disk: no offloads for a while)
        # put reservations: segment name -> [offset of the next byte, bytes left] (see Core.reserve)
        self.reserved: dict = {}
        self.reclaim_at = -1e18  # when it was last asked to give its reservations back
        self.last_put = None  # [request id, reply] of its last one-round-trip put (a resent request gets it again)


class Obj:
    __slots__ = (
        "deadline",
        "key",
        "lease_until",
        "loading",
        "meta",
        "offloading",
        "pin",
        "repl",
        "size",
        "ssd",
        "version",
        "want",
        "writer",
    )

    def __init__(self, key, size, version, meta, pin):
        self.key = key
        self.size = size
        self.version = version
        self.meta = meta
        self.repl: list = []  # [segment name, offset, allocated bytes]
        self.want = (
            1  # replicas a put asked for and could have (what a put of an empty object reports)
        )
        self.ssd: list = []  # [client id, path]
        self.pin = pin
        self.lease_until = 0.0
        self.writer = None
        self.deadline = 0.0
        self.offloading = False  # or the id of the client writing it to its SSD
        self.loading = None  # [segment, offset, bytes] being filled from SSD for remote readers


class Counters:
    def __init__(self):
        self.puts = self.gets = self.hits = self.misses = self.evictions = 0
        self.offloads = self.removes = self.put_aborts = self.clients_lost = self.ssd_drops = 0
        self.ssd_corrupt = 0


class Core:
    """Metadata of one store master. Every public method may raise a ``StoreError``;
    arguments are validated before anything changes."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = config
        self.clock = clock
        self.objects: dict[str, Obj] = {}
        self.pending: dict[str, Obj] = {}
        self.lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.clients: dict[str, Client] = {}
        self.segments: dict[str, Segment] = {}
        self.deferred: list = []  # [until, segment name, offset, bytes]
        self.ssd_waiting: set = (
            set()
        )  # clients whose SSD directory is busy, during one eviction pass
        self.orphan_loads: dict = {}  # (key, version) -> (segment name, offset) of a deferred load slot
        self.counters = Counters()
        self.capacity = 0
        self.used = 0  # allocated bytes, reservations included
        self.reserved_bytes = 0  # bytes of all put reservations (part of used)
        self.seg_epoch = 0
        self._version = int(time.time() * 1e6)
        self.no_evict_until = 0.0
        self.last_tick = clock()
        # persistence hooks (etcd): keys/segments/clients changed since the last flush
        self.dirty_objs: set = set()
        self.dirty_clients: set = set()
        self.track_dirty = False
        self.notify: Callable[[Client], None] = lambda c: None

    # ------------------------------------------------------------------ helpers
    def _next_version(self) -> int:
        self._version = max(self._version + 1, int(time.time() * 1e6))
        return self._version

    def _client(self, cid) -> Client:
        c = self.clients.get(cid) if isinstance(cid, str) else None
        if c is None:
            raise UnknownClientError(
                f"unknown client {cid!r} (the master restarted or declared it dead); register again"
            )
        c.last_seen = self.clock()
        return c

    def _dirty(self, key):
        if self.track_dirty:
            self.dirty_objs.add(key)

    def _queue(self, client: Client, task: list):
        client.tasks.append(task)
        self.notify(client)

    def _check_key(self, key) -> str:
        if not isinstance(key, str) or not key:
            raise ProtocolError(f"a key must be a non-empty str, got {type(key).__name__}")
        if len(key) > self.cfg.max_key_bytes // 4 and len(key.encode()) > self.cfg.max_key_bytes:
            raise ProtocolError(
                f"key of {len(key.encode())} bytes exceeds {self.cfg.max_key_bytes}"
            )
        return key

    def _keys(self, keys) -> list:
        if not isinstance(keys, list):
            raise ProtocolError("keys must be a list")
        if len(keys) > self.cfg.max_keys_per_call:
            raise ProtocolError(f"{len(keys)} keys in one call exceed {self.cfg.max_keys_per_call}")
        return [self._check_key(k) for k in keys]

    def _free_replica(self, seg_name: str, off: int, n: int, key: str, until: float):
        seg = self.segments.get(seg_name)
        if seg is None:
            return
        seg.drop_key(key)
        if n <= 0:
            return
        if until > self.clock():
            self.deferred.append([until, seg_name, off, n])
            return
        seg.alloc.free(off, n)
        self.used -= aligned(n)

    def _release(self, obj: Obj, *, delete_ssd=True):
        """Frees everything of ``obj`` (deferred while a lease protects a reader)."""
        if obj.offloading:  # the SSD space reserved for its write goes too
            c = self.clients.get(obj.offloading)
            if c is not None:
                c.ssd_bytes -= obj.size
                c.ssd_inflight -= obj.size
            obj.offloading = False
        if obj.loading is not None:  # its owner may still be writing into the slot
            seg_name, off, n = obj.loading
            obj.loading = None
            self.orphan_loads[(obj.key, obj.version)] = (seg_name, off)
            self._free_replica(seg_name, off, n, obj.key, self.clock() + LOAD_ORPHAN_S)
        for seg_name, off, n in obj.repl:
            self._free_replica(seg_name, off, n, obj.key, obj.lease_until)
        obj.repl = []
        for cid, path in obj.ssd:
            c = self.clients.get(cid)
            if c is not None:
                self._ssd_forget(c, obj)
                if delete_ssd:
                    self._queue(c, ["delete", path])
        obj.ssd = []

    def _drop_committed(self, key: str):
        obj = self.objects.pop(key, None)
        if obj is not None:
            self.lru.pop(key, None)
            self._release(obj)
            self._dirty(key)

    def _abort_pending(self, key: str):
        obj = self.pending.pop(key, None)
        if obj is None:
            return
        w = self.clients.get(obj.writer)
        if w is not None:
            w.writing.discard(key)
        self._release(obj)
        self.counters.put_aborts += 1

    # ------------------------------------------------------------------ clients
    def register(self, a: dict) -> dict:
        cid, name, host, pid = a.get("client"), a.get("name"), a.get("host"), a.get("pid")
        segs, ssd_dir, ssd = a.get("segs", []), a.get("ssd_dir"), a.get("ssd", [])
        ssd_max = a.get("ssd_max")
        if not (
            isinstance(cid, str)
            and isinstance(name, str)
            and name
            and isinstance(host, str)
            and isinstance(pid, int)
            and isinstance(segs, list)
            and isinstance(ssd, list)
            and (ssd_dir is None or isinstance(ssd_dir, str))
            and (
                ssd_max is None
                or (isinstance(ssd_max, int) and not isinstance(ssd_max, bool) and ssd_max >= 0)
            )
        ):
            raise ProtocolError("register: bad arguments")
        if len(segs) > 1:
            raise ProtocolError("register: a client contributes at most one segment")
        for d in segs:
            if not (
                isinstance(d, dict) and isinstance(d.get("size"), int) and 0 <= d["size"] < 1 << 50
            ):
                raise ProtocolError("register: bad segment descriptor")
        if len(ssd) > 10_000_000:
            raise ProtocolError("register: too many SSD entries")
        now = self.clock()
        old = self.clients.get(cid)
        if old is not None:
            self._kill_client(old, reason="registered again")
        for seg in self.segments.values():
            if seg.name == name and seg.client.id != cid:
                raise ProtocolError(f"register: segment name {name!r} is taken by a live client")
        c = Client(cid, name, host, pid, ssd_dir, now, ssd_max)
        self.clients[cid] = c
        for d in segs:
            d = dict(d)
            d["name"] = name
            seg = Segment(name, c, d["size"], d)
            self.segments[name] = seg
            c.segments.append(seg)
            self.capacity += seg.alloc.size
        self.seg_epoch += 1
        if self.track_dirty:
            self.dirty_clients.add(cid)
        for e in ssd:
            self._adopt_ssd(c, e)
        return {
            "ttl_ms": int(self.cfg.lease_ttl_s * 1000),
            "client_ttl_ms": int(self.cfg.client_ttl_s * 1000),
        }

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

    def unregister(self, a: dict) -> dict:
        c = self._client(a.get("client"))
        self._kill_client(c, reason="unregistered")
        return {}

    def poll(self, a: dict) -> dict:
        """Heartbeat; returns queued tasks and (when changed) the live segment names."""
        c = self._client(a.get("client"))
        tasks, c.tasks = c.tasks, []
        out = {"tasks": tasks, "epoch": self.seg_epoch}
        if a.get("epoch") != self.seg_epoch:
            out["segs"] = list(self.segments)
        return out

    def _kill_client(self, c: Client, reason: str):
        self.clients.pop(c.id, None)
        dead = {s.name for s in c.segments}
        for seg_name in list(c.reserved):
            self._unreserve(c, seg_name)
        for other in self.clients.values():
            for seg_name in [n for n in other.reserved if n in dead]:
                self._unreserve(other, seg_name)
        for key in list(c.writing):
            self._abort_pending(key)
        for seg in c.segments:
            for key in list(seg.keys):
                p = self.pending.get(key)
                if p is not None and any(r[0] in dead for r in p.repl):
                    self._abort_pending(key)
                obj = self.objects.get(key)
                if obj is not None:
                    obj.repl = [r for r in obj.repl if r[0] not in dead]
                    if obj.loading is not None and obj.loading[0] in dead:
                        obj.loading = None
                    if (
                        obj.offloading == c.id
                    ):  # its writer is gone (it stayed unevictable for good)
                        obj.offloading = False
                    self._dirty(key)
                    if not obj.repl and not obj.ssd:
                        self.objects.pop(key, None)
                        self.lru.pop(key, None)
        for key in list(c.ssd_keys):
            obj = self.objects.get(key)
            if obj is not None:
                obj.ssd = [s for s in obj.ssd if s[0] != c.id]
                self._dirty(key)
                if not obj.repl and not obj.ssd:
                    self.objects.pop(key, None)
                    self.lru.pop(key, None)
        self.deferred = [d for d in self.deferred if d[1] not in dead]
        for seg in c.segments:
            self.segments.pop(seg.name, None)
            self.capacity -= seg.alloc.size
            self.used -= seg.alloc.used
        self.seg_epoch += 1
        if self.track_dirty:
            self.dirty_clients.add(c.id)

    # ------------------------------------------------------------------ puts
    def _put_items(self, items: list, op: str) -> list:
        """``[(key, size, meta)]`` of a put request's items; ``ProtocolError`` for a
        malformed item or a key repeated in one batch."""
        checked = []
        for it in items:
            if not (
                isinstance(it, list)
                and len(it) == 3
                and isinstance(it[1], int)
                and it[1] >= 0
                and isinstance(it[2], bytes)
                and len(it[2]) <= self.cfg.max_meta_bytes
            ):
                raise ProtocolError(f"{op}: each item must be [key, size >= 0, meta bytes]")
            checked.append((self._check_key(it[0]), it[1], it[2]))
        if len({k for k, _, _ in checked}) != len(checked):
            raise ProtocolError(f"{op}: duplicate keys in one batch")
        return checked

    def _check_new(self, key: str, upsert: bool):
        """``ObjectExistsError`` unless a put of ``key`` may start now."""
        if key in self.pending:
            raise ObjectExistsError(f"key {key!r} is being written by another put")
        if key in self.objects and not upsert:
            raise ObjectExistsError(f"key {key!r} exists (use upsert to overwrite)")

    # ------------------------------------------------------------------ puts
    def put_start(self, a: dict) -> dict:
        c = self._client(a.get("client"))
        items = a.get("items")
        r, pref, pin = a.get("r", 1), a.get("pref"), bool(a.get("pin", False))
        require_all, upsert = bool(a.get("all", False)), bool(a.get("upsert", False))
        if not isinstance(items, list) or len(items) > self.cfg.max_keys_per_call:
            raise ProtocolError(
                "put_start: items must be a list of at most max_keys_per_call [key, size, meta]"
            )
        if not (isinstance(r, int) and 1 <= r <= 64) or not (pref is None or isinstance(pref, str)):
            raise ProtocolError("put_start: bad replica options")
        avoid = a.get("x", [])
        if not (
            isinstance(avoid, list) and len(avoid) <= 64 and all(isinstance(x, str) for x in avoid)
        ):
            raise ProtocolError("put_start: x must be a list of at most 64 segment names")
        checked = self._put_items(items, "put_start")
        out, segs = [], {}
        now = self.clock()
        for key, size, meta in checked:
            try:
                self._check_new(key, upsert)
                repl = self._place(key, size, r, pref, require_all, set(avoid))
                obj = Obj(key, size, self._next_version(), meta, pin)
                obj.repl = repl
                obj.want = len(repl) if size else max(1, min(r, len(self.segments)))
                obj.writer = c.id
                obj.deadline = now + self.cfg.put_ttl_s
                self.pending[key] = obj
                c.writing.add(key)
                for s, _, _ in repl:
                    self.segments[s].add_key(key)
                    segs[s] = self.segments[s].desc
                out.append([0, obj.version, [[s, off] for s, off, _ in repl], r])
            except StoreError as e:
                out.append([1, e.code, str(e)])
        return {"items": out, "segs": segs}

    def _place(self, key, size, r, pref, require_all, avoid: set = frozenset()) -> list:
        """Allocates up to ``r`` replicas in distinct segments (not those in ``avoid``:
        segments a writer could not reach), evicting as needed."""
        n = aligned(size) if size else 0
        if n == 0:
            # nothing to store: an empty object lives in the master alone (its metadata is
            # its value), so it outlives every segment (and needs none); WeightSync keeps
            # its version records so, which a restarted trainer must see even when its
            # segment held them
            return []
        live = [s for s in self.segments.values() if s.alloc.size >= n and s.name not in avoid]
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

    def put_end(self, a: dict) -> dict:
        c = self._client(a.get("client"))
        items = a.get("items")
        if not isinstance(items, list):
            raise ProtocolError("put_end: items must be a list of [key, version]")
        out = []
        for it in items:
            if not (isinstance(it, list) and len(it) == 2 and isinstance(it[1], int)):
                raise ProtocolError("put_end: each item must be [key, version]")
        for key, version in items:
            p = self.pending.get(key) if isinstance(key, str) else None
            if p is None or p.version != version or p.writer != c.id:
                cur = self.objects.get(key) if isinstance(key, str) else None
                if cur is not None and cur.version == version:
                    out.append(
                        [0, len(cur.repl) if cur.size else cur.want]
                    )  # already committed (a retried request)
                else:
                    out.append(
                        [
                            1,
                            PutLostError.code,
                            f"put of {key!r} is unknown to the master (aborted after its lease, or lost in a leader change)",
                        ]
                    )
                continue
            del self.pending[key]
            c.writing.discard(key)
            live = [r for r in p.repl if r[0] in self.segments]
            if not live and p.size > 0:
                out.append([1, PutLostError.code, f"every segment of {key!r} died during the put"])
                continue
            p.repl = live
            p.writer = None
            self._install(p)
            out.append([0, len(live) if p.size else p.want])
        return {"items": out}

    def _install(self, obj: Obj):
        """Makes ``obj`` the committed version of its key (the old one is released)."""
        old = self.objects.get(obj.key)
        if old is not None:
            self.lru.pop(obj.key, None)
            self._release(old)
        self.objects[obj.key] = obj
        self.lru[obj.key] = None
        self.counters.puts += 1
        self._dirty(obj.key)

    def put_revoke(self, a: dict) -> dict:
        c = self._client(a.get("client"))
        items = a.get("items")
        if not isinstance(items, list):
            raise ProtocolError("put_revoke: items must be a list of [key, version]")
        self.abort_puts(c.id, items)
        return {}

    def abort_puts(self, cid: str, items: list, grace_s: float = 0.0):
        """Aborts the puts ``[key, version]`` that client ``cid`` started and has not ended
        (others are ignored); unlike a request, this does not count as its heartbeat. Their
        space is freed after ``grace_s`` seconds (a writer that may still be copying into
        it must not land in the next object placed there)."""
        for it in items:
            if isinstance(it, list) and len(it) == 2:
                p = self.pending.get(it[0]) if isinstance(it[0], str) else None
                if p is not None and p.version == it[1] and p.writer == cid:
                    p.lease_until = max(p.lease_until, self.clock() + grace_s)
                    self._abort_pending(it[0])

    # ------------------------------------------------------------------ one-round-trip puts
    # A client may hold one reservation per segment: a range the master allocated to it
    # (counted as used), which it fills from the front with the bytes of its next puts and
    # then commits with one request (``put``) instead of two (``put_start``, ``put_end``).
    # Only that client writes into its reservation, so no other put can be handed its
    # bytes. The master frees what is left when the client gives it back (``reserve`` with
    # ``ret``), dies or unregisters; when space runs short it asks holders to give theirs
    # back (an ``unreserve`` task) before anything is evicted. Reservations are not written
    # to etcd: a new leader treats their space as free, and clients drop theirs when their
    # connection to the master changes.
    def _unreserve(self, c: Client, seg_name: str):
        off, n = c.reserved.pop(seg_name)
        self.reserved_bytes -= n
        seg = self.segments.get(seg_name)
        if seg is not None and n > 0:
            seg.alloc.free(off, n)
            self.used -= n

    def _reclaim(self, seg_names) -> bool:
        """Asks every holder of a reservation in ``seg_names`` to give it back (at most
        every 0.2 s per holder). True if there was any."""
        now = self.clock()
        found = False
        for c in self.clients.values():
            if any(n in c.reserved for n in seg_names):
                found = True
                if now - c.reclaim_at > 0.2:
                    c.reclaim_at = now
                    self._queue(c, ["unreserve"])
        return found

    def reserve(self, a: dict) -> dict:
        """Gives back the reservations in ``ret`` ([segment, offset, bytes] as last known to
        the client, others are ignored; offset -1: whatever it holds in that segment) and, with ``bytes`` > 0, reserves up to that many
        bytes in ``pref`` (or the segment with the most free space not in ``x``). Grants
        only what fits without eviction while the store stays below its low watermark, at
        most 1/16 of the segment, and nothing if that is less than ``min`` bytes. Returns ``{"resv": [segment, offset, bytes] or None,
        "segs": {name: descriptor}}``."""
        c = self._client(a.get("client"))
        ret, want, pref, avoid = a.get("ret", []), a.get("bytes", 0), a.get("pref"), a.get("x", [])
        least = a.get("min", 0)
        if not (
            isinstance(ret, list)
            and len(ret) <= 64
            and isinstance(want, int)
            and not isinstance(want, bool)
            and 0 <= want < 1 << 50
            and (pref is None or isinstance(pref, str))
            and isinstance(least, int)
            and not isinstance(least, bool)
            and isinstance(avoid, list)
            and len(avoid) <= 64
            and all(isinstance(x, str) for x in avoid)
        ):
            raise ProtocolError("reserve: bad arguments")
        for r in ret:
            if not (
                isinstance(r, list)
                and len(r) == 3
                and isinstance(r[0], str)
                and isinstance(r[1], int)
                and isinstance(r[2], int)
            ):
                raise ProtocolError(
                    "reserve: each returned reservation must be [segment, offset, bytes]"
                )
        for seg_name, off, n in ret:
            # offset -1: whatever this client holds there (it lost track of the extent)
            if c.reserved.get(seg_name) == [off, n] or (off == -1 and seg_name in c.reserved):
                self._unreserve(c, seg_name)
        if want <= 0:
            return {"resv": None, "segs": {}}
        cands = [
            s
            for s in self.segments.values()
            if s.name not in avoid and s.name not in c.reserved and (pref is None or s.name == pref)
        ]
        cands.sort(key=lambda s: -(s.alloc.size - s.alloc.used))
        for seg in cands[:1]:
            n = aligned(min(want, seg.alloc.size // 16))
            if (
                n < max(4096, least)
                or self.used + n > self.cfg.low_watermark * self.capacity
                or seg.alloc.largest_free() < 4 * n
            ):
                break
            off = seg.alloc.alloc(n)
            if off is None:
                break
            self.used += n
            self.reserved_bytes += n
            c.reserved[seg.name] = [off, n]
            return {"resv": [seg.name, off, n], "segs": {seg.name: seg.desc}}
        return {"resv": None, "segs": {}}

    def put(self, a: dict) -> dict:
        """Commits objects the client already wrote into its reservation in ``seg``: items
        ``[key, size, meta]`` lie back to back (each at an ``aligned`` size) from the
        reservation's front, whose offset the client names (``off``). Per item the same
        checks and results as ``put_start`` + ``put_end``; a refused item's bytes go back to
        the free space. Returns ``{"items": [...], "resv": [offset, bytes] left}``, or
        ``{"lost": True}`` (nothing done) when the master holds no such reservation: the
        client then puts the same objects the two-request way."""
        c = self._client(a.get("client"))
        rid = a.get("rid")
        if c.last_put is not None and c.last_put[0] == rid:
            return c.last_put[1]  # the same request again (the reply was lost): same answer
        items, seg_name, off0 = a.get("items"), a.get("seg"), a.get("off")
        pin, upsert = bool(a.get("pin", False)), bool(a.get("upsert", False))
        if not (
            isinstance(items, list)
            and 0 < len(items) <= self.cfg.max_keys_per_call
            and isinstance(seg_name, str)
            and isinstance(off0, int)
        ):
            raise ProtocolError("put: bad arguments (items, seg, off)")
        checked = self._put_items(items, "put")
        resv = c.reserved.get(seg_name)
        total = sum(aligned(n) for _, n, _ in checked)
        if resv is None or resv[0] != off0 or total > resv[1] or seg_name not in self.segments:
            done = self._put_done_before(checked, seg_name, off0)
            return {"lost": True} if done is None else {"items": done, "resv": None}
        seg = self.segments[seg_name]
        resv[0] += total
        resv[1] -= total
        self.reserved_bytes -= total
        out, off = [], off0
        for key, size, meta in checked:
            n = aligned(size)
            try:
                self._check_new(key, upsert)
                obj = Obj(key, size, self._next_version(), meta, pin)
                if n:  # an empty object lives in the master alone (see _place)
                    obj.repl = [[seg_name, off, n]]
                    seg.add_key(key)
                self._install(obj)
                out.append([0, 1])
            except StoreError as e:
                if n:
                    seg.alloc.free(off, n)
                    self.used -= n
                out.append([1, e.code, str(e)])
            off += n
        reply = {"items": out, "resv": list(resv)}
        if isinstance(rid, int):
            c.last_put = [rid, reply]
        return reply

    def _put_done_before(self, checked: list, seg_name: str, off0: int) -> list | None:
        """A ``put`` whose reservation this master does not hold may be a request resent
        after a leader change whose first sending the old leader committed (and wrote to
        etcd): then its objects are here, each at exactly the range the client wrote. Per
        item success for those, ``PutLostError`` for the others (the client puts them
        again the two-request way); None if no object is found so (nothing was committed)."""
        out, off, found = [], off0, False
        for key, size, _ in checked:
            n = aligned(size)
            o = self.objects.get(key)
            if n and o is not None and o.size == size and o.repl[:1] == [[seg_name, off, n]]:
                out.append([0, len(o.repl)])
                found = True
            else:
                out.append([1, PutLostError.code, f"put of {key!r} was lost in a leader change"])
            off += n
        return out if found else None

    # ------------------------------------------------------------------ reads
    def get(self, a: dict) -> dict:
        reader = self._client(a.get("client"))
        keys = self._keys(a.get("keys"))
        now = self.clock()
        until = now + self.cfg.lease_ttl_s
        out, segs = [], {}
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                self.counters.misses += 1
                out.append(None)
                continue
            if obj.lease_until < until:
                obj.lease_until = until
            self.lru.move_to_end(key)
            reps = []
            for s, off, _ in obj.repl:
                seg = self.segments.get(s)
                if seg is not None:
                    reps.append(["m", s, off])
                    segs[s] = seg.desc
            for cid, path in obj.ssd:
                cl = self.clients.get(cid)
                if cl is not None:
                    reps.append(["s", cl.host, path])
            retry = False
            if (
                not obj.repl
                and obj.ssd
                and reader.host
                not in {self.clients[c].host for c, _ in obj.ssd if c in self.clients}
            ):
                retry = self._promote(
                    obj
                )  # only on disks of other hosts: load it into memory first
            if not retry:  # a reader asks again while a load runs: that is one get, not many
                self.counters.hits += 1
                self.counters.gets += 1
            out.append([obj.size, obj.version, obj.meta, reps, retry])
        return {"objs": out, "segs": segs, "ttl_ms": int(self.cfg.lease_ttl_s * 1000)}

    def where(self, a: dict) -> dict:
        """Introspection: the segment names (memory) and SSD client names holding each key."""
        keys = self._keys(a.get("keys"))
        out = []
        for k in keys:
            o = self.objects.get(k)
            if o is None:
                out.append(None)
                continue
            out.append(
                {
                    "memory": [r[0] for r in o.repl],
                    "ssd": [self.clients[c].name for c, _ in o.ssd if c in self.clients],
                }
            )
        return {"where": out}

    def exists(self, a: dict) -> dict:
        """Which keys have a committed version; with ``meta``, also each one's metadata
        bytes (None if missing): no lease, no LRU touch, nothing loaded from SSD."""
        keys = self._keys(a.get("keys"))
        if a.get("meta") is True:
            objs = [self.objects.get(k) for k in keys]
            return {
                "exists": [o is not None for o in objs],
                "meta": [None if o is None else o.meta for o in objs],
            }
        return {"exists": [k in self.objects for k in keys]}

    def remove(self, a: dict) -> dict:
        self._client(a.get("client"))
        keys = self._keys(a.get("keys"))
        force = bool(a.get("force", False))
        now = self.clock()
        out = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None:
                out.append([1, ObjectNotFoundError.code, f"key {key!r} not found"])
                continue
            if obj.lease_until > now and not force:
                out.append(
                    [
                        1,
                        ObjectHasLeaseError.code,
                        f"key {key!r} is leased by a reader for {obj.lease_until - now:.3f} s more (force=True removes it anyway)",
                    ]
                )
                continue
            self._drop_committed(key)
            self.counters.removes += 1
            out.append([0, 0])
        return {"items": out}

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

    # ------------------------------------------------------------------ time
    def tick(self):
        """Declares silent clients dead, aborts overdue puts, frees expired deferred
        space and evicts down to the low watermark when above the high one."""
        now = self.clock()
        gap = now - self.last_tick
        self.last_tick = now
        if gap > STALL_S:
            # (all of the gap: a client whose heartbeat the master was holding when it stopped
            # was last seen before the stall, and the tick can run before that heartbeat's
            # answer; crediting only the part above STALL_S declared it dead now and then)
            stall = gap - TICK_S
            # this master did not run for a while (stopped, swapped out, starved): the
            # clients' heartbeats could not be served, so the stall does not count against
            # them, nor against puts in progress
            for c in self.clients.values():
                c.last_seen += stall
            for p in self.pending.values():
                p.deadline += stall
        for c in [c for c in self.clients.values() if now - c.last_seen > self.cfg.client_ttl_s]:
            self.counters.clients_lost += 1
            self._kill_client(c, reason="heartbeat")
        for key in [k for k, p in self.pending.items() if p.deadline < now]:
            self._abort_pending(key)
        if self.deferred:
            keep = []
            for d in self.deferred:
                if d[0] <= now:
                    seg = self.segments.get(d[1])
                    if seg is not None:
                        seg.alloc.free(d[2], d[3])
                        self.used -= aligned(d[3])
                else:
                    keep.append(d)
            self.deferred = keep
        if self.orphan_loads:
            live = {(d[1], d[2]) for d in self.deferred}
            self.orphan_loads = {k: v for k, v in self.orphan_loads.items() if v in live}
        if (
            self.capacity
            and self.used > self.cfg.high_watermark * self.capacity
            and self.reserved_bytes
        ):
            self._reclaim(list(self.segments))  # reserved space counts as free below
        if (
            self.capacity
            and self.used - self.reserved_bytes > self.cfg.high_watermark * self.capacity
        ):
            goal = self.cfg.low_watermark * self.capacity
            projected = self.used - self.reserved_bytes
            self.ssd_waiting.clear()
            for key in list(self.lru):
                if projected <= goal:
                    break
                obj = self.objects.get(key)
                if obj is None or not self._evictable(obj, now):
                    continue
                freed = sum(aligned(r[2]) for r in obj.repl)
                self._evict(obj, now)
                projected -= freed

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        return {
            "objects": len(self.objects),
            "pending": len(self.pending),
            "used_bytes": self.used,
            "reserved_bytes": self.reserved_bytes,
            "capacity_bytes": self.capacity,
            "clients": len(self.clients),
            "segments": len(self.segments),
            "deferred": len(self.deferred),
            "ssd_objects": sum(1 for o in self.objects.values() if o.ssd),
            **vars(self.counters),
        }

    def metrics_text(self, leader: bool = True) -> str:
        s = self.stats()
        lines = []

        def m(name, kind, help_, value):
            lines.append(f"# HELP mooncake_store_{name} {help_}")
            lines.append(f"# TYPE mooncake_store_{name} {kind}")
            lines.append(f"mooncake_store_{name} {value}")

        m("objects", "gauge", "Committed objects.", s["objects"])
        m("objects_on_ssd", "gauge", "Committed objects with an SSD replica.", s["ssd_objects"])
        m("pending_puts", "gauge", "Puts in progress.", s["pending"])
        m(
            "used_bytes",
            "gauge",
            "Bytes allocated in segments (put reservations included).",
            s["used_bytes"],
        )
        m(
            "reserved_bytes",
            "gauge",
            "Bytes of segments reserved for clients' next puts.",
            s["reserved_bytes"],
        )
        m("capacity_bytes", "gauge", "Bytes of all registered segments.", s["capacity_bytes"])
        m("clients", "gauge", "Live clients.", s["clients"])
        m("segments", "gauge", "Registered segments.", s["segments"])
        m("puts_total", "counter", "Committed puts.", s["puts"])
        m("hits_total", "counter", "Gets of existing keys.", s["hits"])
        m("misses_total", "counter", "Gets of missing keys.", s["misses"])
        m(
            "evictions_total",
            "counter",
            "Objects whose memory replicas were evicted.",
            s["evictions"],
        )
        m("offloads_total", "counter", "Objects written to an SSD directory.", s["offloads"])
        m(
            "ssd_drops_total",
            "counter",
            "Objects dropped from an SSD directory to make room (ssd_max_bytes).",
            s["ssd_drops"],
        )
        m(
            "ssd_corrupt_total",
            "counter",
            "SSD replicas dropped because their file was missing or corrupt.",
            s["ssd_corrupt"],
        )
        m("removes_total", "counter", "Removed objects.", s["removes"])
        m(
            "put_aborts_total",
            "counter",
            "Puts aborted (writer died, timed out or revoked).",
            s["put_aborts"],
        )
        m(
            "clients_lost_total",
            "counter",
            "Clients declared dead after missing heartbeats.",
            s["clients_lost"],
        )
        m("leader", "gauge", "1 if this master serves requests.", 1 if leader else 0)
        return "\n".join(lines) + "\n"


def load_into(core: Core, clients: list, objs: list):
    """Fills an empty ``core`` from the etcd record (a new leader). Every client gets a
    full ``client_ttl_s`` to send its next heartbeat; nothing is evicted for one lease TTL
    (readers' leases were not recorded)."""
    from .ha import decode_obj

    now = core.clock()
    for rec in clients:
        try:
            ssd_max = rec.get("ssd_max")
            c = Client(
                rec["id"],
                rec["name"],
                rec["host"],
                int(rec["pid"]),
                rec.get("ssd_dir"),
                now,
                None if ssd_max is None else int(ssd_max),
            )
            for d in rec["segs"]:
                seg = Segment(d["name"], c, int(d["size"]), d)
                core.segments[seg.name] = seg
                c.segments.append(seg)
                core.capacity += seg.alloc.size
            core.clients[c.id] = c
        except (KeyError, TypeError, ValueError):
            continue
    used: dict = {}
    for rec in objs:
        try:
            key, size, version, meta, repl, ssd, pin = decode_obj(rec)
        except (KeyError, TypeError, ValueError):
            continue
        obj = Obj(key, size, version, meta, pin)
        obj.repl = [[s, int(off), int(n)] for s, off, n in repl if s in core.segments]
        obj.ssd = [[cid, p] for cid, p in ssd if cid in core.clients]
        if not obj.repl and not obj.ssd and size:  # empty objects need no replica
            continue
        for s, off, n in obj.repl:
            core.segments[s].add_key(key)
            used.setdefault(s, []).append((off, n))
        for cid, _ in obj.ssd:
            core.clients[cid].ssd_keys.add(key)
            core.clients[cid].ssd_bytes += size
        core.objects[key] = obj
        core.lru[key] = None
        core._version = max(core._version, version)
    for name, ranges in used.items():
        seg = core.segments[name]
        seg.alloc.rebuild(ranges)
        core.used += seg.alloc.used
    core.seg_epoch += 1
    core.no_evict_until = now + core.cfg.lease_ttl_s
