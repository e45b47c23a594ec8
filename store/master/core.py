"""The master's metadata state machine (no I/O, no threads: the server calls it).

Objects: ``key -> Obj`` for committed versions, ``key -> Obj`` in ``pending`` for puts in
progress (a put on an existing key with ``upsert`` keeps the old version readable until
the new one commits). Replicas live in client segments (``[segment, offset, bytes]``) or
in a client's SSD directory (``[client, path]``). Space is allocated by the master and
written by the client; the master never touches data.

``Core`` holds the state, clients, reads, the tick and stats; its parts are mixed in:
``puts.py`` (puts, put reservations), ``space.py`` (placement, eviction) and
``ssd.py`` (the SSD tier); the records live in ``records.py``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from ..common.errors import (
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ProtocolError,
    UnknownClientError,
)
from ..common.layout import aligned
from .config import MasterConfig
from .puts import _PutMixin
from .records import Client, Counters, Obj, Segment
from .space import _SpaceMixin
from .ssd import LOAD_ORPHAN_S, _SsdMixin

# seconds between two ticks (Master's ticker); a gap longer than STALL_S is a stall of the
# master itself, and all of it but one tick period is credited to clients and puts
TICK_S = 0.1
STALL_S = 1.0


class Core(_PutMixin, _SpaceMixin, _SsdMixin):
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

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
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


def load_into(core: Core, clients: list, objs: list) -> None:
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
