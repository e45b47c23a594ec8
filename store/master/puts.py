"""Puts in the master's metadata core.

The two-request way (``put_start`` places the
replicas, ``put_end`` commits, ``put_revoke`` / :meth:`Puts.abort` give the space back)
and the one-round-trip way (``put`` commits what a client wrote into its put reservation,
``reservations.py``).

An item is ``[key, size, meta]`` or ``[key, size, meta, {"p": parent, "t": [tags]}]``; a
request may name a quota group (``g``) and its quota in bytes (``q``). A child commits
only while its parent is committed (``ParentMissingError`` otherwise; an earlier item of
the same request counts), and a put that would take its group above the quota first
drops the group's least recently used objects (``Space.fit_group``).
"""

from __future__ import annotations

import sys

from ..common.errors import (
    InvalidatedError,
    ObjectExistsError,
    ParentMissingError,
    ProtocolError,
    PutLostError,
    StoreError,
)
from ..common.layout import aligned
from .records import Obj, Records
from .reservations import Reservations
from .space import Space

MAX_TAGS = 16  # tags of one object
MAX_TAG_BYTES = 256  # UTF-8 bytes of one tag, or of a group's name


class Puts:
    """Placement requests, commits and aborts of puts."""

    def __init__(self, records: Records, space: Space, reservations: Reservations):
        self.records = records
        self.space = space
        self.reservations = reservations

    def _items(self, items: list, op: str) -> list:
        """The checked items of a put request.

        Returns:
            ``[(key, size, meta, parent, tags)]``.

        Raises:
            ProtocolError: a malformed item, or a key repeated in one batch.
        """
        checked = []
        for it in items:
            if not (
                isinstance(it, list)
                and len(it) in (3, 4)
                and isinstance(it[1], int)
                and it[1] >= 0
                and isinstance(it[2], bytes)
                and len(it[2]) <= self.records.cfg.max_meta_bytes
            ):
                raise ProtocolError(
                    f"{op}: each item must be [key, size >= 0, meta bytes] or [key, size, meta, links]"
                )
            key = self.records.check_key(it[0])
            parent, tags = self._links(it[3], key, op) if len(it) == 4 else (None, None)
            checked.append((key, it[1], it[2], parent, tags))
        if len({c[0] for c in checked}) != len(checked):
            raise ProtocolError(f"{op}: duplicate keys in one batch")
        return checked

    def _links(self, links, key: str, op: str) -> tuple:
        """The parent and tags of an item's links ``{"p": parent key, "t": [tags]}``.

        Either may be absent; tags are interned (they repeat over many objects).

        Returns:
            ``(parent, tags)``: a key or None, a tuple of tags or None.

        Raises:
            ProtocolError: malformed links.
        """
        if not isinstance(links, dict):
            raise ProtocolError(f"{op}: an item's links must be a map")
        parent, tags = links.get("p"), links.get("t")
        if parent is not None:
            parent = self.records.check_key(parent)
            if parent == key:
                raise ProtocolError(f"{op}: {key!r} names itself as its parent")
        if tags is not None:
            if not (isinstance(tags, list) and len(tags) <= MAX_TAGS):
                raise ProtocolError(f"{op}: tags must be a list of at most {MAX_TAGS} str")
            for t in tags:
                if not (isinstance(t, str) and t and len(t.encode()) <= MAX_TAG_BYTES):
                    raise ProtocolError(
                        f"{op}: a tag must be a non-empty str of at most {MAX_TAG_BYTES} bytes"
                    )
            # tags repeat over many objects: one string each in the master's memory
            tags = tuple(sys.intern(t) for t in dict.fromkeys(tags)) or None
        return parent, tags

    def _group(self, a: dict, op: str) -> tuple:
        """The quota group and quota of a put request (``g``, ``q``).

        Raises:
            ProtocolError: malformed.
        """
        group, quota = a.get("g"), a.get("q")
        if group is not None and not (
            isinstance(group, str) and group and len(group.encode()) <= MAX_TAG_BYTES
        ):
            raise ProtocolError(f"{op}: g must be a non-empty str of at most {MAX_TAG_BYTES} bytes")
        if quota is not None and not (
            group is not None
            and isinstance(quota, int)
            and not isinstance(quota, bool)
            and 0 < quota < 1 << 62
        ):
            raise ProtocolError(f"{op}: q must be an int > 0, with g")
        return (None if group is None else sys.intern(group)), quota

    def _check_parent(self, key: str, parent: str | None, earlier: set | None = None) -> None:
        """Checks that ``key`` may hang off ``parent`` now.

        Args:
            key: the key being put.
            parent: the key it names as its parent (None: none).
            earlier: keys started before in the same request (their commit comes first).

        Raises:
            ParentMissingError: ``parent`` is not committed (nor among ``earlier``).
            ProtocolError: ``key`` would hang off its own descendant.
        """
        if parent is None:
            return
        rec = self.records
        if parent not in rec.objects and (earlier is None or parent not in earlier):
            raise ParentMissingError(
                f"parent {parent!r} of {key!r} is not stored (never put, or dropped since); "
                "put the parent first"
            )
        if key in rec.children:  # an upsert of a key other objects hang off: no cycle
            x, seen = parent, set()
            while x is not None and x not in seen:
                if x == key:
                    raise ProtocolError(f"{key!r} would hang off its own descendant {parent!r}")
                seen.add(x)
                o = rec.objects.get(x)
                x = None if o is None else o.parent

    def _check_new(self, key: str, upsert: bool):
        """``ObjectExistsError`` unless a put of ``key`` may start now."""
        if key in self.records.pending:
            raise ObjectExistsError(f"key {key!r} is being written by another put")
        if key in self.records.objects and not upsert:
            raise ObjectExistsError(f"key {key!r} exists (use upsert to overwrite)")

    def start(self, a: dict) -> dict:
        """The ``put_start`` request: places each item's replicas (evicting as needed).

        Returns where the client writes them.
        """
        rec = self.records
        c = rec.client(a.get("client"))
        items = a.get("items")
        r, pref, pin = a.get("r", 1), a.get("pref"), bool(a.get("pin", False))
        require_all, upsert = bool(a.get("all", False)), bool(a.get("upsert", False))
        if not isinstance(items, list) or len(items) > rec.cfg.max_keys_per_call:
            raise ProtocolError(
                "put_start: items must be a list of at most max_keys_per_call [key, size, meta]"
            )
        group, quota = self._group(a, "put_start") if "g" in a or "q" in a else (None, None)
        if not (isinstance(r, int) and 1 <= r <= 64) or not (pref is None or isinstance(pref, str)):
            raise ProtocolError("put_start: bad replica options")
        avoid = a.get("x", [])
        if not (
            isinstance(avoid, list) and len(avoid) <= 64 and all(isinstance(x, str) for x in avoid)
        ):
            raise ProtocolError("put_start: x must be a list of at most 64 segment names")
        checked = self._items(items, "put_start")
        out, segs, started = [], {}, set()
        now = rec.clock()
        for key, size, meta, parent, tags in checked:
            try:
                self._check_new(key, upsert)
                if parent is not None and parent not in started:
                    self._check_parent(key, parent, rec.pending)
                if group is not None:
                    self.space.fit_group(key, size, group, quota, parent)
                repl = self.space.place(
                    key, size, r, pref, require_all, set(avoid), only_pref=bool(a.get("only"))
                )
                obj = Obj(key, size, rec.next_version(), meta, pin, parent, tags, group)
                obj.serial = rec.invalidations_done
                obj.repl = repl
                obj.want = len(repl) if size else max(1, min(r, len(rec.segments)))
                obj.writer = c.id
                obj.deadline = now + rec.cfg.put_ttl_s
                rec.pending[key] = obj
                started.add(key)
                if group is not None:
                    rec.group_pending[group] = rec.group_pending.get(group, 0) + size
                c.writing.add(key)
                for s, _, _ in repl:
                    rec.segments[s].add_key(key)
                    segs[s] = rec.segments[s].desc
                out.append([0, obj.version, [[s, off] for s, off, _ in repl], r])
            except StoreError as e:
                out.append([1, e.code, str(e)])
        return {"items": out, "segs": segs}

    def end(self, a: dict) -> dict:
        """The ``put_end`` request: commits the puts ``[key, version]`` the client wrote."""
        rec = self.records
        c = rec.client(a.get("client"))
        items = a.get("items")
        if not isinstance(items, list):
            raise ProtocolError("put_end: items must be a list of [key, version]")
        out, linked = [], []
        for it in items:
            if not (isinstance(it, list) and len(it) == 2 and isinstance(it[1], int)):
                raise ProtocolError("put_end: each item must be [key, version]")
        for key, version in items:
            p = rec.pending.get(key) if isinstance(key, str) else None
            if p is None or p.version != version or p.writer != c.id:
                cur = rec.objects.get(key) if isinstance(key, str) else None
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
            del rec.pending[key]
            c.writing.discard(key)
            live = [r for r in p.repl if r[0] in rec.segments]
            if not live and p.size > 0:
                if p.group is not None:
                    rec.unpend_group(p)
                out.append([1, PutLostError.code, f"every segment of {key!r} died during the put"])
                continue
            if p.parent is not None:
                try:
                    self._check_parent(key, p.parent)
                except StoreError as e:  # its parent went meanwhile: it could never be found
                    if p.group is not None:
                        rec.unpend_group(p)
                    rec.release(p)
                    rec.counters.put_aborts += 1
                    out.append([1, e.code, str(e)])
                    continue
                linked.append(key)
            gone = rec.invalidated_since(p)
            if gone is not None:  # what it holds was invalidated while it was written
                if p.group is not None:
                    rec.unpend_group(p)
                rec.release(p)
                rec.counters.put_aborts += 1
                out.append(
                    [
                        1,
                        InvalidatedError.code,
                        f"tag {gone!r} of {key!r} was invalidated during its put",
                    ]
                )
                continue
            p.repl = live
            p.writer = None
            rec.install(p)
            if p.group is not None:  # after install: the group's quota stays with its objects
                rec.unpend_group(p)
            out.append([0, len(live) if p.size else p.want])
        if linked:
            rec.touch(linked, use=False)
        return {"items": out}

    def revoke(self, a: dict) -> dict:
        """The ``put_revoke`` request: the client gives started puts back."""
        c = self.records.client(a.get("client"))
        items = a.get("items")
        if not isinstance(items, list):
            raise ProtocolError("put_revoke: items must be a list of [key, version]")
        self.abort(c.id, items)
        return {}

    def abort(self, cid: str, items: list, grace_s: float = 0.0) -> None:
        """Aborts the puts ``[key, version]`` that client ``cid`` started and has not ended.

        Others are ignored; unlike a request, this does not count as its heartbeat. Their space is
        freed after ``grace_s`` seconds (a writer that may still be copying into it must not land in
        the next object placed there).
        """
        rec = self.records
        for it in items:
            if isinstance(it, list) and len(it) == 2:
                p = rec.pending.get(it[0]) if isinstance(it[0], str) else None
                if p is not None and p.version == it[1] and p.writer == cid:
                    p.lease_until = max(p.lease_until, rec.clock() + grace_s)
                    rec.abort_pending(it[0])

    def commit_reserved(self, a: dict) -> dict:
        """The ``put`` request: commits objects the client already wrote into its reservation.

        The reservation is in ``seg`` (``reservations.py``). Items ``[key, size, meta]`` lie back to
        back (each at an ``aligned`` size) from the reservation's front, whose offset the client
        names (``off``). Per item the same checks and results as ``put_start`` + ``put_end``; a
        refused item's bytes go back to the free space. Returns
        ``{"items": [...], "resv": [offset, bytes] left}``, or ``{"lost": True}`` (nothing done)
        when the master holds no such reservation: the client then puts the same objects the
        two-request way.
        """
        rec = self.records
        c = rec.client(a.get("client"))
        rid = a.get("rid")
        if c.last_put is not None and c.last_put[0] == rid:
            return c.last_put[1]  # the same request again (the reply was lost): same answer
        items, seg_name, off0 = a.get("items"), a.get("seg"), a.get("off")
        pin, upsert = bool(a.get("pin", False)), bool(a.get("upsert", False))
        if not (
            isinstance(items, list)
            and 0 < len(items) <= rec.cfg.max_keys_per_call
            and isinstance(seg_name, str)
            and isinstance(off0, int)
        ):
            raise ProtocolError("put: bad arguments (items, seg, off)")
        checked = self._items(items, "put")
        group, quota = self._group(a, "put") if "g" in a or "q" in a else (None, None)
        total = sum(aligned(c[1]) for c in checked)
        left = self.reservations.take(c, seg_name, off0, total)
        if left is None:
            done = self._done_before(checked, seg_name, off0)
            return {"lost": True} if done is None else {"items": done, "resv": None}
        seg = rec.segments[seg_name]
        out, off, linked = [], off0, []
        for key, size, meta, parent, tags in checked:
            n = aligned(size)
            try:
                self._check_new(key, upsert)
                self._check_parent(key, parent)
                if group is not None:
                    self.space.fit_group(key, size, group, quota, parent)
                obj = Obj(key, size, rec.next_version(), meta, pin, parent, tags, group)
                if n:  # an empty object lives in the master alone (see Space.place)
                    obj.repl = [[seg_name, off, n]]
                    seg.add_key(key)
                rec.install(obj)
                if parent is not None:
                    linked.append(key)
                out.append([0, 1])
            except StoreError as e:
                if n:
                    seg.alloc.free(off, n)
                    rec.used -= n
                out.append([1, e.code, str(e)])
            off += n
        if linked:
            rec.touch(linked, use=False)
        reply = {"items": out, "resv": left}
        if isinstance(rid, int):
            c.last_put = [rid, reply]
        return reply

    def _done_before(self, checked: list, seg_name: str, off0: int) -> list | None:
        """A ``put`` whose reservation this master does not hold may be a resent, committed request.

        It may be a request resent after a leader change whose first sending the old leader
        committed (and wrote to etcd): then its objects are here, each at exactly the range the
        client wrote. Per item success for those, ``PutLostError`` for the others (the client puts
        them again the two-request way); None if no object is found so (nothing was committed).
        """
        out, off, found = [], off0, False
        for key, size, *_ in checked:
            n = aligned(size)
            o = self.records.objects.get(key)
            if n and o is not None and o.size == size and o.repl[:1] == [[seg_name, off, n]]:
                out.append([0, len(o.repl)])
                found = True
            else:
                out.append([1, PutLostError.code, f"put of {key!r} was lost in a leader change"])
            off += n
        return out if found else None
