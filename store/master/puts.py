"""Puts in the master's metadata core: the two-request way (``put_start`` places the
replicas, ``put_end`` commits, ``put_revoke`` / ``abort_puts`` give the space back) and
the one-round-trip way (``reserve`` hands a client a put reservation, ``put`` commits what
it wrote there).

Mixed into :class:`~mooncake_store.core.Core`, whose ``__init__`` sets the state these
methods use (``objects``, ``pending``, ``lru``, ``clients``, ``segments``, ``used``, ...).
"""

from __future__ import annotations

from ..common.errors import (
    ObjectExistsError,
    ProtocolError,
    PutLostError,
    StoreError,
)
from ..common.layout import aligned
from .records import Client, Obj


class _PutMixin:
    """Puts: placement requests, commits, aborts, put reservations."""

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
                repl = self._place(
                    key, size, r, pref, require_all, set(avoid), only_pref=bool(a.get("only"))
                )
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

    def abort_puts(self, cid: str, items: list, grace_s: float = 0.0) -> None:
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
