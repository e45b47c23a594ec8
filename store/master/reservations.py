"""Put reservations in the master's metadata core.

A client may hold one reservation per segment: a range the master allocated to it
(counted as used), which it fills from the front with the bytes of its next puts and then
commits with one request (``put``, :meth:`Puts.commit_reserved
<mooncake_store.master.puts.Puts.commit_reserved>`) instead of two (``put_start``,
``put_end``). Only that client writes into its reservation, so no other put can be handed
its bytes. The master frees what is left when the client gives it back (``reserve`` with
``ret``), dies or unregisters; when space runs short it asks holders to give theirs back
(an ``unreserve`` task) before anything is evicted. Reservations are not written to etcd:
a new leader treats their space as free, and clients drop theirs when their connection to
the master changes.
"""

from __future__ import annotations

from ..common.errors import ProtocolError
from ..common.layout import aligned
from .records import Client, Records


class Reservations:
    """The put reservations of every client.

    Each client's are in ``Client.reserved``: segment name ->
    ``[offset of the next byte, bytes left]``.
    """

    def __init__(self, records: Records):
        self.records = records

    def reserve(self, a: dict) -> dict:
        """The ``reserve`` request: gives back the reservations in ``ret``; may reserve new space.

        ``ret`` holds [segment, offset, bytes] as last known to the client, others are ignored;
        offset -1: whatever it holds in that segment. With ``bytes`` > 0, it reserves up to that
        many bytes in ``pref`` (or the segment with the most free space not in ``x``). Grants only
        what fits without eviction while the store stays below its low watermark, at most 1/16 of
        the segment, and nothing if that is less than ``min`` bytes. Returns
        ``{"resv": [segment, offset, bytes] or None, "segs": {name: descriptor}}``.
        """
        rec = self.records
        c = rec.client(a.get("client"))
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
                self.unreserve(c, seg_name)
        if want <= 0:
            return {"resv": None, "segs": {}}
        cands = [
            s
            for s in rec.segments.values()
            if s.name not in avoid and s.name not in c.reserved and (pref is None or s.name == pref)
        ]
        cands.sort(key=lambda s: -(s.alloc.size - s.alloc.used))
        for seg in cands[:1]:
            n = aligned(min(want, seg.alloc.size // 16))
            if (
                n < max(4096, least)
                or rec.used + n > rec.cfg.low_watermark * rec.capacity
                or seg.alloc.largest_free() < 4 * n
            ):
                break
            off = seg.alloc.alloc(n)
            if off is None:
                break
            rec.used += n
            rec.reserved_bytes += n
            c.reserved[seg.name] = [off, n]
            return {"resv": [seg.name, off, n], "segs": {seg.name: seg.desc}}
        return {"resv": None, "segs": {}}

    def take(self, c: Client, seg_name: str, off: int, nbytes: int) -> list | None:
        """Takes ``nbytes`` from the front of ``c``'s reservation in ``seg_name``.

        The reservation must start at ``off`` (the client's objects lie there now). Returns what is
        left, ``[offset, bytes]``, or None when ``c`` holds no such reservation (another master
        granted it, it is smaller, or its segment is gone).
        """
        resv = c.reserved.get(seg_name)
        if (
            resv is None
            or resv[0] != off
            or nbytes > resv[1]
            or seg_name not in self.records.segments
        ):
            return None
        resv[0] += nbytes
        resv[1] -= nbytes
        self.records.reserved_bytes -= nbytes
        return list(resv)

    def unreserve(self, c: Client, seg_name: str) -> None:
        """Frees what is left of ``c``'s reservation in ``seg_name``."""
        rec = self.records
        off, n = c.reserved.pop(seg_name)
        rec.reserved_bytes -= n
        seg = rec.segments.get(seg_name)
        if seg is not None and n > 0:
            seg.alloc.free(off, n)
            rec.used -= n

    def reclaim(self, seg_names) -> bool:
        """Asks every holder of a reservation in ``seg_names`` to give it back.

        At most every 0.2 s per holder. True if there was any.
        """
        rec = self.records
        now = rec.clock()
        found = False
        for c in rec.clients.values():
            if any(n in c.reserved for n in seg_names):
                found = True
                if now - c.reclaim_at > 0.2:
                    c.reclaim_at = now
                    rec.queue(c, ["unreserve"])
        return found
