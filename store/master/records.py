"""The records the master's metadata core keeps.

A registered segment, a client, an
object (a committed version or a put in progress), the counters of ``stats``, and
:class:`Records`, which holds them all with the changes every part of the core makes
(install a version, release an object's space, abort a put, drop an object with its
descendants and remember why).
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable, Iterable

from ..common.errors import ProtocolError, UnknownClientError
from ..common.layout import ALIGN, SEG_HEADER, aligned
from .alloc import Allocator
from .config import MasterConfig
from .eviction import LfuOrder

# a load from SSD whose object went away meanwhile (removed, overwritten, dropped) may
# still be writing into its slot: the slot is reused only this long after, or after its
# load_done, whichever comes first
LOAD_ORPHAN_S = 120.0


class Segment:
    """A registered segment: name, owner, size, descriptor, allocator and the keys placed in it."""

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

    def add_key(self, key: str) -> None:
        """Counts one more replica of ``key`` in this segment (committed or pending)."""
        self.keys[key] = self.keys.get(key, 0) + 1

    def drop_key(self, key: str) -> None:
        """Counts one replica of ``key`` fewer in this segment; forgets the key at zero."""
        n = self.keys.get(key, 0) - 1
        if n > 0:
            self.keys[key] = n
        else:
            self.keys.pop(key, None)


class Client:
    """A registered client: its identity, segments, SSD directory, tasks and put reservations."""

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
    """An object: a committed version or a put in progress, with its replicas and leases."""

    __slots__ = (
        "deadline",
        "group",
        "key",
        "lease_gen",
        "lease_until",
        "loading",
        "meta",
        "offloading",
        "parent",
        "pin",
        "readers",
        "repl",
        "serial",
        "size",
        "ssd",
        "tags",
        "version",
        "want",
        "writer",
    )

    def __init__(self, key, size, version, meta, pin, parent=None, tags=None, group=None):
        self.key = key
        self.serial = 0  # Records.invalidations_done when its put started
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
        # reads under the current lease not yet reported done; the lease ends early when the
        # last one is (a generation tells one lease from the next)
        self.readers = 0
        self.lease_gen = 0
        self.writer = None
        self.deadline = 0.0
        self.offloading = False  # or the id of the client writing it to its SSD
        self.loading = None  # [segment, offset, bytes] being filled from SSD for remote readers
        self.parent = parent  # key this object hangs off: dropping that drops this one too
        self.tags = tags  # tuple of tags (``invalidate`` drops it by any of them), or None
        self.group = group  # quota group whose bytes it counts in, or None


# why an object was dropped (``Records.drop``; the ``history`` request and the
# ``mooncake_store_drops_total`` metric name them)
CAUSES = ("evicted", "invalidated", "holder_lost", "removed", "corrupt", "orphaned")


class Counters:
    """The counters of ``stats``, since the master started."""

    def __init__(self):
        self.puts = self.gets = self.hits = self.misses = self.evictions = 0
        self.offloads = self.removes = self.put_aborts = self.clients_lost = self.ssd_drops = 0
        self.ssd_corrupt = 0
        self.invalidations = self.holds = self.promotes = 0
        self.drops = dict.fromkeys(CAUSES, 0)  # objects dropped, by cause (descendants included)
        self.group_drops: dict = {}  # quota group -> cause -> objects of the group dropped


class Records:
    """Everything one master knows (no I/O, no threads), shared by the parts of the core.

    The parts of :class:`~mooncake_store.master.core.Core` read these fields and change them through
    the methods below or their own.

    Attributes:
        objects: key -> committed version.
        pending: key -> put in progress (an upsert keeps the old version readable until the new one
            commits).
        lru: keys of committed objects with a memory replica (or none at all: empty objects,
            loads in flight), least recently used first: the order of memory eviction.
        ssd_lru: keys of committed objects that lie on SSD only, least recently used first:
            the order in which an SSD directory over its bound drops them. Apart, so that
            memory eviction does not walk past every object on SSD.
        lfu: the eviction order of ``eviction_policy="lfu"`` (None under LRU).
        clients: live clients by id.
        segments: their segments by name.
        deferred: ``[until, segment, offset, bytes]`` frees waiting for a read lease (or a load from
            SSD) to end.
        orphan_loads: ``(key, version) -> (segment, offset)`` of a load slot whose object went away
            while its owner loaded it.
        retired: ``(key, version) -> [lease generation, readers, until, [(segment, offset)]]``
            of an object released (replaced, removed) while readers held its lease: its
            replicas wait in ``deferred``, and once its last reader says it is done
            (``Core.reads_done``) they are freed at once (``end_retired_read``).
        capacity: bytes of all segments.
        used: bytes allocated (put reservations included).
        reserved_bytes: bytes of put reservations.
        seg_epoch: counts changes of the set of segments (clients unmap dead ones).
        no_evict_until: a new leader evicts nothing before this (the old leader's read leases are
            unknown).
        track_dirty: record which keys and clients changed (``take_dirty``), for etcd.
        notify: called with a client that has a new task (wakes its long poll).
        children: key -> keys of the committed objects whose ``parent`` it is (kept by key,
            so an upsert of the parent keeps them).
        tag_keys: tag -> keys of the committed objects carrying it.
        group_bytes / group_pending / group_lru / group_quota: per quota group, the bytes
            of its committed objects (value sizes, one count per object wherever it
            lies) / of its puts in progress / its keys least recently used first / its
            quota (the last one a put named).
        history: key -> ``(cause, tier, unix_s, detail)`` of its last drop, at most
            ``history_entries``, the oldest drop forgotten first.
        held: key -> number of holds on it (``holds.py``): not evicted while held.
        orphans: key -> clock time after which an object adopted from SSD whose parent
            is still not stored is dropped (its parent may still come from another
            client's directory).
    """

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = config
        self.clock = clock
        self.objects: dict[str, Obj] = {}
        self.pending: dict[str, Obj] = {}
        self.lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.ssd_lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lfu = LfuOrder() if config.eviction_policy == "lfu" else None
        self.clients: dict[str, Client] = {}
        self.segments: dict[str, Segment] = {}
        self.deferred: list = []
        self.orphan_loads: dict = {}
        self.retired: dict = {}
        self.counters = Counters()
        self.capacity = 0
        self.used = 0
        self.reserved_bytes = 0
        self.seg_epoch = 0
        self.no_evict_until = 0.0
        self.track_dirty = False
        self.dirty_objs: set = set()
        self.dirty_clients: set = set()
        self.notify: Callable[[Client], None] = lambda c: None
        self._version = int(time.time() * 1e6)
        self.children: dict[str, set] = {}
        self.tag_keys: dict[str, set] = {}
        # invalidate requests served, and per tag the count when it was last invalidated (the
        # latest 65536 tags): a put of a tagged object that started before commits nothing
        self.invalidations_done = 0
        self.tag_invalidated: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.group_bytes: dict[str, int] = {}
        self.group_pending: dict[str, int] = {}
        self.group_lru: dict[str, collections.OrderedDict] = {}
        self.group_quota: dict[str, int] = {}
        self.history: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.held: dict[str, int] = {}
        self.orphans: dict[str, float] = {}

    # ------------------------------------------------------------------ lookups
    def next_version(self) -> int:
        """A version number above every one handed out or seen.

        Microseconds of the wall clock, so a restarted master without etcd still counts upwards.
        """
        self._version = max(self._version + 1, int(time.time() * 1e6))
        return self._version

    def see_version(self, version: int) -> None:
        """Versions handed out from now on are above ``version`` (one found on SSD or in etcd)."""
        self._version = max(self._version, version)

    def client(self, cid) -> Client:
        """The live client ``cid``; a request from it counts as its heartbeat.

        Raises ``UnknownClientError`` (it registers again).
        """
        c = self.clients.get(cid) if isinstance(cid, str) else None
        if c is None:
            raise UnknownClientError(
                f"unknown client {cid!r} (the master restarted or declared it dead); register again"
            )
        c.last_seen = self.clock()
        return c

    def check_key(self, key) -> str:
        """``key`` if it is a non-empty str within ``max_key_bytes``; ``ProtocolError``."""
        if not isinstance(key, str) or not key:
            raise ProtocolError(f"a key must be a non-empty str, got {type(key).__name__}")
        if len(key) > self.cfg.max_key_bytes // 4 and len(key.encode()) > self.cfg.max_key_bytes:
            raise ProtocolError(
                f"key of {len(key.encode())} bytes exceeds {self.cfg.max_key_bytes}"
            )
        return key

    def check_keys(self, keys) -> list:
        """A request's ``keys``: a list of at most ``max_keys_per_call`` valid keys."""
        if not isinstance(keys, list):
            raise ProtocolError("keys must be a list")
        if len(keys) > self.cfg.max_keys_per_call:
            raise ProtocolError(f"{len(keys)} keys in one call exceed {self.cfg.max_keys_per_call}")
        return [self.check_key(k) for k in keys]

    # ------------------------------------------------------------------ etcd and tasks
    def dirty(self, key: str) -> None:
        """Marks ``key``'s record as changed (written to etcd after this request)."""
        if self.track_dirty:
            self.dirty_objs.add(key)

    def dirty_client(self, cid: str) -> None:
        """Marks client ``cid``'s record as changed (written to etcd after this request)."""
        if self.track_dirty:
            self.dirty_clients.add(cid)

    def take_dirty(self) -> tuple[dict, dict]:
        """``(objects, clients)`` changed since the last call.

        key -> ``Obj`` (None: gone) and client id -> ``Client`` (None: gone).
        """
        objs = {k: self.objects.get(k) for k in self.dirty_objs}
        clients = {c: self.clients.get(c) for c in self.dirty_clients}
        self.dirty_objs, self.dirty_clients = set(), set()
        return objs, clients

    def queue(self, client: Client, task: list) -> None:
        """Hands ``task`` to ``client`` with its next heartbeat's answer."""
        client.tasks.append(task)
        self.notify(client)

    # ------------------------------------------------------------------ changes
    def free_replica(self, seg_name: str, off: int, n: int, key: str, until: float) -> None:
        """Gives ``[off, off + n)`` of ``seg_name`` back.

        While a lease protects a reader (``until`` in the future), later, through ``deferred``.
        """
        seg = self.segments.get(seg_name)
        if seg is None:
            return
        # Segment.drop_key, inline: a remove's one replica is on every remove's path
        keys = seg.keys
        left = keys.get(key, 0) - 1
        if left > 0:
            keys[key] = left
        else:
            keys.pop(key, None)
        if n <= 0:
            return
        if until > self.clock():
            self.deferred.append([until, seg_name, off, n])
            return
        seg.alloc.free(off, n)
        self.used -= (n + ALIGN - 1) & ~(ALIGN - 1)

    def end_retired_read(self, key: str, version: int, lease_gen: int) -> None:
        """A reader of the retired ``(key, version)`` is done.

        After the last one, its replicas' deferred space is freed now rather than at the
        lease's end.
        """
        r = self.retired.get((key, version))
        if r is None or r[0] != lease_gen or r[1] <= 0:
            return
        r[1] -= 1
        if r[1] > 0:
            return
        del self.retired[(key, version)]
        slots = set(r[3])
        for d in self.deferred:
            if (d[1], d[2]) in slots:
                d[0] = 0.0  # due now: free_deferred gives it back
        self.free_deferred(self.clock())

    def free_deferred(self, now: float) -> None:
        """Frees the deferred ranges whose time has come."""
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
        if self.retired:
            self.retired = {k: r for k, r in self.retired.items() if r[2] > now}
        if self.orphan_loads:
            live = {(d[1], d[2]) for d in self.deferred}
            self.orphan_loads = {k: v for k, v in self.orphan_loads.items() if v in live}

    def forget_ssd(self, c: Client, obj: Obj) -> None:
        """``obj`` no longer counts against ``c``'s SSD directory."""
        if obj.key in c.ssd_keys:
            c.ssd_keys.discard(obj.key)
            c.ssd_bytes -= obj.size

    def release(self, obj: Obj, *, delete_ssd: bool = True) -> None:
        """Frees everything of ``obj`` (deferred while a lease protects a reader).

        Its SSD files are deleted unless ``delete_ssd`` is False.
        """
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
            self.free_replica(seg_name, off, n, obj.key, self.clock() + LOAD_ORPHAN_S)
        if obj.repl and obj.readers > 0 and obj.lease_until > self.clock():
            self.retired[(obj.key, obj.version)] = [
                obj.lease_gen,
                obj.readers,
                obj.lease_until,
                [(seg_name, off) for seg_name, off, _ in obj.repl],
            ]
        for seg_name, off, n in obj.repl:
            self.free_replica(seg_name, off, n, obj.key, obj.lease_until)
        obj.repl = []
        for cid, path in obj.ssd:
            c = self.clients.get(cid)
            if c is not None:
                self.forget_ssd(c, obj)
                if delete_ssd:
                    self.queue(c, ["delete", path])
        obj.ssd = []

    def install(self, obj: Obj, *, count: bool = True) -> None:
        """Makes ``obj`` the committed version of its key.

        The old one is released; the key's children stay. ``count``: a put (not an object
        found on SSD).
        """
        old = self.objects.get(obj.key)
        if old is not None:
            self.unlink(old)
            self.release(old)
        self.objects[obj.key] = obj
        self.link(obj)
        if count:
            self.counters.puts += 1
        self.dirty(obj.key)

    def link(self, obj: Obj) -> None:
        """Enters the committed ``obj`` in the LRU order and the indexes.

        The parent's children, the tags' keys and the group's bytes and LRU order; its key
        leaves the drop history (it is stored again).
        """
        key = obj.key
        if obj.ssd and not obj.repl and obj.loading is None:
            self.ssd_lru[key] = None
        else:
            self.lru[key] = None
        if self.lfu is not None:
            self.lfu.add(key)
        if self.history:
            self.history.pop(key, None)
        if obj.parent is not None:
            kids = self.children.get(obj.parent)
            if kids is None:
                self.children[obj.parent] = {key}
            else:
                kids.add(key)
        if obj.tags:
            for t in obj.tags:
                keys = self.tag_keys.get(t)
                if keys is None:
                    self.tag_keys[t] = {key}
                else:
                    keys.add(key)
        g = obj.group
        if g is not None:
            self.group_bytes[g] = self.group_bytes.get(g, 0) + obj.size
            lru = self.group_lru.get(g)
            if lru is None:
                lru = self.group_lru[g] = collections.OrderedDict()
            lru[key] = None

    def add_tags(self, obj: Obj, tags: tuple) -> bool:
        """Adds ``tags`` to the committed ``obj`` (and the tag index); True if any was new."""
        new = tuple(t for t in dict.fromkeys(tags) if not obj.tags or t not in obj.tags)
        if not new:
            return False
        obj.tags = (obj.tags or ()) + new
        for t in new:
            keys = self.tag_keys.get(t)
            if keys is None:
                self.tag_keys[t] = {obj.key}
            else:
                keys.add(obj.key)
        self.dirty(obj.key)
        return True

    def invalidated_since(self, obj: Obj) -> str | None:
        """A tag of ``obj`` that ``invalidate`` dropped after ``obj``'s put started, or None."""
        for t in obj.tags or ():
            if self.tag_invalidated.get(t, -1) >= obj.serial:
                return t
        return None

    def unlink(self, obj: Obj) -> None:
        """Takes the committed ``obj`` out of what :meth:`link` entered it in.

        Not its children: they hang off its key.
        """
        key = obj.key
        self.lru.pop(key, None)
        self.ssd_lru.pop(key, None)
        if self.lfu is not None:
            self.lfu.remove(key)
        if obj.parent is not None:
            kids = self.children.get(obj.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.children[obj.parent]
        if obj.tags:
            for t in obj.tags:
                keys = self.tag_keys.get(t)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self.tag_keys[t]
        g = obj.group
        if g is not None:
            left = self.group_bytes.get(g, 0) - obj.size
            lru = self.group_lru.get(g)
            if lru is not None:
                lru.pop(key, None)
            if lru:
                self.group_bytes[g] = left
            else:  # the group's last object: forget the group
                self.group_bytes.pop(g, None)
                self.group_lru.pop(g, None)
                if not self.group_pending.get(g):
                    self.group_quota.pop(g, None)

    def to_ssd_only(self, key: str) -> None:
        """``key``'s object lost its last memory replica and lives on SSD: it leaves memory's order.

        It is the most recently used object on SSD (the others went there before it), and its
        ancestors that lie on SSD only go after it, nearest first: an SSD directory over its
        bound then drops the leaves of a chain first, not a parent whose drop would take the
        newer objects below it along.
        """
        if self.lru.pop(key, 0) is None:
            ssd_lru = self.ssd_lru
            ssd_lru[key] = None
            o = self.objects.get(key)
            seen = {key}
            while o is not None and o.parent is not None and o.parent not in seen:
                p = o.parent
                if p not in ssd_lru:
                    break
                seen.add(p)
                ssd_lru.move_to_end(p)
                o = self.objects.get(p)

    def to_memory(self, key: str) -> None:
        """``key``'s object, on SSD only, has a memory replica again (loaded): most recently used."""
        if self.ssd_lru.pop(key, 0) is None:
            self.lru[key] = None

    def bump(self, key: str) -> None:
        """Moves the committed ``key`` to the most recently used end of its order."""
        if key in self.lru:
            self.lru.move_to_end(key)
        elif key in self.ssd_lru:
            self.ssd_lru.move_to_end(key)

    def touch(self, keys: Iterable[str], *, use: bool = True) -> None:
        """Marks the committed ``keys`` as just used (LRU order, their groups' too).

        Their ancestors (``parent`` links) become more recently used than their descendants,
        so eviction takes the leaves of a chain first and not its root, whose drop would take
        the whole chain with it. ``use``: under LFU, a use to count (a read); False: the
        priority is brought to the current level without counting a use (a put, a lookup
        before a read).
        """
        objects, lfu, bump = self.objects, self.lfu, self.bump
        linked = []
        for k in keys:
            o = objects.get(k)
            if o is None:
                continue
            bump(k)
            if o.group is not None:
                self.group_lru[o.group].move_to_end(k)
            if lfu is not None:
                lfu.use(k, use)
                if o.parent is None:
                    lfu.push(k)
            if o.parent is not None:
                linked.append(k)
        if not linked:
            return
        # depth of each key and ancestor (0: the topmost stored one), each walked once
        depth: dict = {}
        for k in linked:
            path, seen, x, d = [], set(), k, -1
            while True:
                if x in depth:
                    d = depth[x]
                    break
                o = objects.get(x)
                if o is None or x in seen:  # a missing ancestor, or a cycle of upserts
                    break
                path.append(x)
                seen.add(x)
                if o.parent is None:
                    break
                x = o.parent
            for x in reversed(path):
                d += 1
                depth[x] = d
        for k in sorted(depth, key=depth.__getitem__, reverse=True):
            bump(k)
            if lfu is not None:
                lfu.push(k)
            g = objects[k].group
            if g is not None:
                self.group_lru[g].move_to_end(k)

    def eviction_candidates(self) -> Iterable[str]:
        """Keys in the order memory eviction considers them (``MasterConfig.eviction_policy``)."""
        if self.lfu is not None:
            return self.lfu.candidates(self.objects)
        return self._lru_candidates()

    def _lru_candidates(self) -> Iterable[str]:
        # no copy of the whole order per eviction (0.5 ms with 8,000 objects, paid by every
        # put that evicts): an eviction changes the order, and the walk starts again from its
        # front, past the few objects that could not be evicted
        while True:
            try:
                yield from self.lru
                return
            except RuntimeError:  # the order changed under the walk: the caller evicted
                continue

    def descendants(self, key: str) -> list:
        """The committed objects that hang off ``key`` (children, their children, ...), each once."""
        out, seen, stack = [], {key}, [key]
        while stack:
            for c in self.children.get(stack.pop(), ()):
                if c not in seen:
                    seen.add(c)
                    o = self.objects.get(c)
                    if o is not None:
                        out.append(o)
                        stack.append(c)
        return out

    def descendants_evictable(self, key: str, now: float) -> int | None:
        """The bytes an eviction of ``key`` frees in memory with the objects that hang off it.

        Returns:
            The bytes of those objects' memory replicas, or None when one of them must not be
            evicted (pinned, held, leased).
        """
        n = 0
        for o in self.descendants(key):
            if o.pin or o.lease_until > now or o.key in self.held:
                return None
            n += sum(aligned(r[2]) for r in o.repl)
        return n

    @staticmethod
    def tier_of(obj: Obj) -> str:
        """Where ``obj`` lies.

        Returns:
            ``"memory"`` (a replica in a segment), ``"ssd"`` (only on SSD) or ``"master"`` (an
            empty object, which lives in the master alone).
        """
        if obj.repl or obj.loading is not None:
            return "memory"
        return "ssd" if obj.ssd else "master"

    def drop(self, key: str, cause: str, detail: str = "", *, tier: str | None = None) -> int:
        """Drops the committed object of ``key`` and every object that hangs off it.

        Iteratively, so a chain of any length; their space is freed (after the leases of
        readers) and each drop is recorded in :attr:`history`.

        Args:
            key: the key whose committed object is dropped.
            cause: one of :data:`CAUSES`, for the history and the metrics.
            detail: what the cause is about (a tag, a client's name); descendants get
                ``"with parent <key>: <detail>"`` (``"with parent <key>"`` without one).
            tier: where the object was dropped from (default: where it lies now).

        Returns:
            How many objects were dropped.
        """
        obj = self.objects.get(key)
        if obj is None:
            return 0
        now_s = time.time()
        remember = self.cfg.history_entries > 0
        inherited = None
        stack, n = [key], 0
        while stack:
            k = stack.pop()
            o = self.objects.pop(k, None)
            if o is None:
                continue
            kids = self.children.pop(k, None)
            if kids:
                stack.extend(kids)
            if o.group is not None:
                per = self.counters.group_drops.setdefault(o.group, {})
                per[cause] = per.get(cause, 0) + 1
            if remember:
                t = tier if k == key and tier is not None else self.tier_of(o)
            self.unlink(o)
            self.release(o)
            if self.orphans:
                self.orphans.pop(k, None)
            if remember:
                if k == key:
                    self.remember(k, cause, t, now_s, detail)
                else:
                    if inherited is None:  # one string for the whole cascade
                        inherited = sys.intern(
                            f"with parent {key}: {detail}" if detail else f"with parent {key}"
                        )
                    self.remember(k, cause, t, now_s, inherited)
            if self.track_dirty:
                self.dirty_objs.add(k)
            n += 1
        self.counters.drops[cause] = self.counters.drops.get(cause, 0) + n
        return n

    def remember(self, key: str, cause: str, tier: str, unix_s: float, detail: str) -> None:
        """Records the drop of ``key`` in :attr:`history` (past ``history_entries``, the oldest goes)."""
        limit = self.cfg.history_entries
        if limit <= 0:
            return
        h = self.history
        if key in h:
            del h[key]
        h[key] = (cause, tier, unix_s, detail)
        if len(h) > limit:
            h.popitem(last=False)

    def abort_pending(self, key: str) -> None:
        """Aborts the put in progress of ``key`` and frees its space."""
        obj = self.pending.pop(key, None)
        if obj is None:
            return
        w = self.clients.get(obj.writer)
        if w is not None:
            w.writing.discard(key)
        if obj.group is not None:
            self.unpend_group(obj)
        self.release(obj)
        self.counters.put_aborts += 1

    def unpend_group(self, obj: Obj) -> None:
        """Takes a put in progress of ``obj`` out of its group's count (committed or given up)."""
        g = obj.group
        if g is not None:
            left = self.group_pending.get(g, 0) - obj.size
            if left > 0:
                self.group_pending[g] = left
            else:
                self.group_pending.pop(g, None)
                if g not in self.group_lru:
                    self.group_quota.pop(g, None)
