"""The master's metadata core: one method per request of the metadata RPC.

No I/O, no threads: the service calls it, and its methods run on the service's event loop.

Objects: ``key -> Obj`` for committed versions, ``key -> Obj`` in ``pending`` for puts in
progress (a put on an existing key with ``upsert`` keeps the old version readable until
the new one commits). Replicas live in client segments (``[segment, offset, bytes]``) or
in a client's SSD directory (``[client, path]``). Space is allocated by the master and
written by the client; the master never touches data.

:class:`Core` handles clients, reads, the tick and stats itself, and hands the other
requests to its parts, composed over one :class:`~mooncake_store.master.records.Records`
(``records.py``): ``reservations.py`` (put reservations), ``space.py`` (placement and
eviction), ``puts.py`` (puts), ``ssd.py`` (the SSD tier), ``holds.py`` (holds) and
``keyspace.py`` (tags, prefixes, the drop history).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..common.errors import (
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ProtocolError,
)
from .config import MasterConfig
from .holds import Holds
from .keyspace import Keyspace
from .puts import Puts
from .records import Client, Records, Segment
from .reservations import Reservations
from .space import Space
from .ssd import SsdTier

# seconds between two ticks (Master's ticker); a gap longer than STALL_S is a stall of the
# master itself, and all of it but one tick period is credited to clients and puts
TICK_S = 0.1
STALL_S = 1.0


class Core:
    """Metadata of one store master.

    Every request method may raise a ``StoreError``; arguments are validated before anything
    changes.

    Attributes:
        records: what the master knows (:class:`~mooncake_store.master.records.Records`),
            shared by the parts below.
        reservations: put reservations (:class:`~mooncake_store.master.reservations.Reservations`).
        space: placement and eviction (:class:`~mooncake_store.master.space.Space`).
        puts: puts (:class:`~mooncake_store.master.puts.Puts`).
        ssd: the SSD tier (:class:`~mooncake_store.master.ssd.SsdTier`).
        holds: holds (:class:`~mooncake_store.master.holds.Holds`).
        keyspace: tags, prefixes, the drop history
            (:class:`~mooncake_store.master.keyspace.Keyspace`).
    """

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = config
        self.records = Records(config, clock)
        self.reservations = Reservations(self.records)
        self.space = Space(self.records, self.reservations)
        self.puts = Puts(self.records, self.space, self.reservations)
        self.ssd = SsdTier(self.records, self.space, self.reservations)
        self.holds = Holds(self.records)
        self.keyspace = Keyspace(self.records)
        self.last_tick = clock()

    # ------------------------------------------------------------------ clients
    def register(self, a: dict) -> dict:
        """A client joins with its segment (at most one) and the SSD files it found.

        One already registered under that id is dropped first (it restarted).
        """
        rec = self.records
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
        now = rec.clock()
        old = rec.clients.get(cid)
        if old is not None:
            self._kill_client(old, reason="registered again")
        for seg in rec.segments.values():
            if seg.name == name and seg.client.id != cid:
                raise ProtocolError(f"register: segment name {name!r} is taken by a live client")
        c = Client(cid, name, host, pid, ssd_dir, now, ssd_max)
        rec.clients[cid] = c
        for d in segs:
            d = dict(d)
            d["name"] = name
            seg = Segment(name, c, d["size"], d)
            rec.segments[name] = seg
            c.segments.append(seg)
            rec.capacity += seg.alloc.size
        rec.seg_epoch += 1
        rec.dirty_client(cid)
        for e in ssd:
            self.ssd.adopt(c, e)
        return {
            "ttl_ms": int(rec.cfg.lease_ttl_s * 1000),
            "client_ttl_ms": int(rec.cfg.client_ttl_s * 1000),
        }

    def unregister(self, a: dict) -> dict:
        """A client leaves: it is dropped with its segments and reservations.

        See ``_kill_client``.
        """
        c = self.records.client(a.get("client"))
        self._kill_client(c, reason="unregistered")
        return {}

    def poll(self, a: dict) -> dict:
        """Heartbeat; returns queued tasks and (when changed) the live segment names."""
        rec = self.records
        c = rec.client(a.get("client"))
        tasks, c.tasks = c.tasks, []
        out = {"tasks": tasks, "epoch": rec.seg_epoch}
        if a.get("epoch") != rec.seg_epoch:
            out["segs"] = list(rec.segments)
        return out

    def _kill_client(self, c: Client, reason: str):
        """Drops ``c`` with its segments and reservations.

        ``reason``: why, for the reader of a trace. Objects with a replica elsewhere survive, its
        puts are aborted.
        """
        rec = self.records
        rec.clients.pop(c.id, None)
        dead = {s.name for s in c.segments}
        for seg_name in list(c.reserved):
            self.reservations.unreserve(c, seg_name)
        for other in rec.clients.values():
            for seg_name in [n for n in other.reserved if n in dead]:
                self.reservations.unreserve(other, seg_name)
        for key in list(c.writing):
            rec.abort_pending(key)
        self.holds.drop_client(c)
        for seg in c.segments:
            for key in list(seg.keys):
                p = rec.pending.get(key)
                if p is not None and any(r[0] in dead for r in p.repl):
                    rec.abort_pending(key)
                obj = rec.objects.get(key)
                if obj is not None:
                    obj.repl = [r for r in obj.repl if r[0] not in dead]
                    if obj.loading is not None and obj.loading[0] in dead:
                        obj.loading = None
                    if (
                        obj.offloading == c.id
                    ):  # its writer is gone (it stayed unevictable for good)
                        obj.offloading = False
                    rec.dirty(key)
                    if not obj.repl and not obj.ssd:
                        rec.drop(key, "holder_lost", c.name, tier="memory")
                    elif not obj.repl and obj.loading is None:
                        rec.to_ssd_only(key)
        for key in list(c.ssd_keys):
            obj = rec.objects.get(key)
            if obj is not None:
                obj.ssd = [s for s in obj.ssd if s[0] != c.id]
                rec.dirty(key)
                if not obj.repl and not obj.ssd:
                    rec.drop(key, "holder_lost", c.name, tier="ssd")
        rec.deferred = [d for d in rec.deferred if d[1] not in dead]
        for seg in c.segments:
            rec.segments.pop(seg.name, None)
            rec.capacity -= seg.alloc.size
            rec.used -= seg.alloc.used
        rec.seg_epoch += 1
        rec.dirty_client(c.id)

    # ------------------------------------------------------------------ reads
    def get(self, a: dict) -> dict:
        """Where each key's replicas are, with a read lease of ``lease_ttl_s`` on each.

        An object only on another host's SSD is loaded into memory first (``retry``: the reader asks
        again).
        """
        rec = self.records
        reader = rec.client(a.get("client"))
        keys = rec.check_keys(a.get("keys"))
        self.reads_done(a.get("done"))
        now = rec.clock()
        until = now + rec.cfg.lease_ttl_s
        out, segs, touch = [], {}, None
        for key in keys:
            obj = rec.objects.get(key)
            if obj is None:
                rec.counters.misses += 1
                out.append(None)
                continue
            if obj.lease_until <= now:  # a new lease: readers of the last one are over
                obj.readers = 0
                obj.lease_gen += 1
            if obj.lease_until < until:
                obj.lease_until = until
            if obj.parent is None and obj.group is None and rec.lfu is None:
                rec.bump(key)
            elif touch is None:
                touch = [key]
            else:
                touch.append(key)
            reps = []
            for s, off, _ in obj.repl:
                seg = rec.segments.get(s)
                if seg is not None:
                    reps.append(["m", s, off])
                    segs[s] = seg.desc
            for cid, path in obj.ssd:
                cl = rec.clients.get(cid)
                if cl is not None:
                    reps.append(["s", cl.host, path])
            retry = False
            if (
                not obj.repl
                and obj.ssd
                and reader.host not in {rec.clients[c].host for c, _ in obj.ssd if c in rec.clients}
            ):
                retry = self.ssd.promote(
                    obj
                )  # only on disks of other hosts: load it into memory first
            if not retry:  # a reader asks again while a load runs: that is one get, not many
                rec.counters.hits += 1
                rec.counters.gets += 1
                obj.readers += 1
            out.append([obj.size, obj.version, obj.meta, reps, retry, obj.lease_gen])
        if touch is not None:
            rec.touch(touch)
        return {"objs": out, "segs": segs, "ttl_ms": int(rec.cfg.lease_ttl_s * 1000)}

    def reads_done(self, done) -> None:
        """Ends the read leases whose readers all said they are done (``done`` of get, exists).

        ``done``: ``[key, version, lease generation]`` per read finished within its lease. When
        the last reader of a lease is done, the object may be evicted (and its space reused) at
        once instead of at the lease's end: a replay faster than real time would otherwise keep
        every object read in the last ``lease_ttl_s`` from eviction. Malformed entries and
        notes of another lease are ignored; a note of a version replaced or removed while
        read ends that version's deferred frees once its last reader is done.
        """
        if not isinstance(done, list):
            return
        rec = self.records
        for e in done[: rec.cfg.max_keys_per_call]:
            if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)):
                continue
            o = rec.objects.get(e[0])
            if o is None or o.version != e[1]:
                if rec.retired:  # replaced or removed while read: its space may go now
                    rec.end_retired_read(e[0], e[1], e[2])
                continue
            if o.lease_gen != e[2] or o.readers <= 0:
                continue
            o.readers -= 1
            if o.readers == 0:
                o.lease_until = 0.0

    def where(self, a: dict) -> dict:
        """Introspection: the segment names (memory) and SSD client names holding each key."""
        rec = self.records
        keys = rec.check_keys(a.get("keys"))
        out = []
        for k in keys:
            o = rec.objects.get(k)
            if o is None:
                out.append(None)
                continue
            out.append(
                {
                    "memory": [r[0] for r in o.repl],
                    "ssd": [rec.clients[c].name for c, _ in o.ssd if c in rec.clients],
                }
            )
        return {"where": out}

    def exists(self, a: dict) -> dict:
        """Which keys have a committed version; with ``meta``, also each one's metadata bytes.

        Metadata is None if missing. No lease, nothing loaded from SSD; with ``touch``, the
        keys found count as used (eviction order), else no LRU touch.
        """
        rec = self.records
        keys = rec.check_keys(a.get("keys"))
        self.reads_done(a.get("done"))
        if a.get("meta") is True:
            objs = [rec.objects.get(k) for k in keys]
            if a.get("touch") is True:
                rec.touch([k for k, o in zip(keys, objs) if o is not None], use=False)
            return {
                "exists": [o is not None for o in objs],
                "meta": [None if o is None else o.meta for o in objs],
            }
        return {"exists": [k in rec.objects for k in keys]}

    def remove(self, a: dict) -> dict:
        """Removes committed objects (a leased one only with ``force``)."""
        rec = self.records
        rec.client(a.get("client"))
        keys = rec.check_keys(a.get("keys"))
        force = bool(a.get("force", False))
        now = rec.clock()
        out = []
        for key in keys:
            obj = rec.objects.get(key)
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
            rec.drop(key, "removed")
            rec.counters.removes += 1
            out.append([0, 0])
        return {"items": out}

    # ------------------------------------------------------------------ keys (keyspace.py, holds.py)
    def invalidate(self, a: dict) -> dict:
        """The ``invalidate`` request: ``Keyspace.invalidate``."""
        return self.keyspace.invalidate(a)

    def tag(self, a: dict) -> dict:
        """The ``tag`` request: ``Keyspace.tag``."""
        return self.keyspace.tag(a)

    def history(self, a: dict) -> dict:
        """The ``history`` request: ``Keyspace.history``."""
        return self.keyspace.history(a)

    def list_prefixes(self, a: dict) -> dict:
        """The ``list_prefixes`` request: ``Keyspace.list_prefixes``."""
        return self.keyspace.list_prefixes(a)

    def remove_prefix(self, a: dict) -> dict:
        """The ``remove_prefix`` request: ``Keyspace.remove_prefix``."""
        return self.keyspace.remove_prefix(a)

    def hold(self, a: dict) -> dict:
        """The ``hold`` request: ``Holds.hold``."""
        return self.holds.hold(a)

    def release(self, a: dict) -> dict:
        """The ``release`` request: ``Holds.release``."""
        return self.holds.release(a)

    # ------------------------------------------------------------------ puts (puts.py, reservations.py)
    def put_start(self, a: dict) -> dict:
        """The ``put_start`` request: ``Puts.start``."""
        return self.puts.start(a)

    def put_end(self, a: dict) -> dict:
        """The ``put_end`` request: ``Puts.end``."""
        return self.puts.end(a)

    def put_revoke(self, a: dict) -> dict:
        """The ``put_revoke`` request: ``Puts.revoke``."""
        return self.puts.revoke(a)

    def abort_puts(self, cid: str, items: list, grace_s: float = 0.0) -> None:
        """Aborts puts client ``cid`` started on a connection that closed.

        See :meth:`Puts.abort <mooncake_store.master.puts.Puts.abort>`.
        """
        self.puts.abort(cid, items, grace_s)

    def reserve(self, a: dict) -> dict:
        """The ``reserve`` request: ``Reservations.reserve``."""
        return self.reservations.reserve(a)

    def put(self, a: dict) -> dict:
        """The ``put`` request: ``Puts.commit_reserved``."""
        return self.puts.commit_reserved(a)

    # ------------------------------------------------------------------ SSD tier (ssd.py)
    def adopt_ssd(self, a: dict) -> dict:
        """The ``adopt_ssd`` request: ``SsdTier.adopt_ssd``."""
        return self.ssd.adopt_ssd(a)

    def offload_done(self, a: dict) -> dict:
        """The ``offload_done`` request: ``SsdTier.offload_done``."""
        return self.ssd.offload_done(a)

    def load_done(self, a: dict) -> dict:
        """The ``load_done`` request: ``SsdTier.load_done``."""
        return self.ssd.load_done(a)

    def ssd_bad(self, a: dict) -> dict:
        """The ``ssd_bad`` request: ``SsdTier.ssd_bad``."""
        return self.ssd.ssd_bad(a)

    def promote(self, a: dict) -> dict:
        """The ``promote`` request: ``SsdTier.promote_keys``."""
        return self.ssd.promote_keys(a)

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
        """Declares silent clients dead, aborts overdue puts, frees expired deferred space, evicts.

        It evicts down to the low watermark when above the high one.
        """
        rec = self.records
        now = rec.clock()
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
            for c in rec.clients.values():
                c.last_seen += stall
            for p in rec.pending.values():
                p.deadline += stall
        for c in [c for c in rec.clients.values() if now - c.last_seen > rec.cfg.client_ttl_s]:
            rec.counters.clients_lost += 1
            self._kill_client(c, reason="heartbeat")
        for key in [k for k, p in rec.pending.items() if p.deadline < now]:
            rec.abort_pending(key)
        self.holds.expire(now)
        if self.ssd.waiting:
            self.ssd.retry_promotes(now)
        if rec.orphans:
            self._drop_orphans(now)
        rec.free_deferred(now)
        if rec.capacity and rec.used > rec.cfg.high_watermark * rec.capacity and rec.reserved_bytes:
            self.reservations.reclaim(list(rec.segments))  # reserved space counts as free below
        self.space.evict_to_low_watermark(now)

    def _drop_orphans(self, now: float) -> None:
        """Drops the objects adopted from SSD whose parent has not come by their deadline."""
        rec = self.records
        due = []
        for k, t in rec.orphans.items():  # in order of adoption, so of deadline
            if t > now:
                break
            due.append(k)
        for key in due:
            del rec.orphans[key]
            obj = rec.objects.get(key)
            if obj is not None and obj.parent is not None and obj.parent not in rec.objects:
                rec.drop(key, "orphaned", f"parent {obj.parent} not stored")

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """The ``stats`` request: figures now and counters since the master started."""
        rec = self.records
        return {
            "objects": len(rec.objects),
            "pending": len(rec.pending),
            "used_bytes": rec.used,
            "reserved_bytes": rec.reserved_bytes,
            "capacity_bytes": rec.capacity,
            "clients": len(rec.clients),
            "segments": len(rec.segments),
            "deferred": len(rec.deferred),
            "ssd_objects": sum(1 for o in rec.objects.values() if o.ssd),
            "held_keys": len(rec.held),
            "active_holds": len(self.holds),
            "history_entries": len(rec.history),
            "group_bytes": dict(rec.group_bytes),
            **vars(rec.counters),
            "drops": dict(rec.counters.drops),
            "group_drops": {g: dict(c) for g, c in rec.counters.group_drops.items()},
        }
