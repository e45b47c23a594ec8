"""The client's put reservation: segment space the master reserved for this client's next puts.

The space (``master/reservations.py``) is filled from the front and committed with one request
(``put``) instead of two. Given back when idle or when the master asks; its pages are warmed up
ahead of the puts that write them.
"""

from __future__ import annotations

import logging
import threading
import time

from ..common.errors import StoreError, TransferError, from_code
from ..common.layout import aligned
from .config import ReplicateConfig, StoreConfig
from .dataplane import DataPlane
from .link import Link

log = logging.getLogger("mooncake_store")

_RESV_REFUSED_S = (
    1.0  # after the master refused (or took back) a reservation, no new request this long
)
_RESV_IDLE_S = 3.0  # a put reservation unused this long goes back to the master
_WARM_IDLE_S = 0.5  # a reservation unused this long is warmed up again before its next put (_warm)
_WARM_MAX_PUT = 4 << 20  # puts from this size on copy with two threads and warm nothing (_warm)


class Reservation:
    """Segment space the master reserved for this client's next puts (``Core.reserve``)."""

    __slots__ = ("desc", "left", "off", "pref", "seg", "session", "used_at", "valid_until")

    def __init__(self, seg, off, left, desc, pref, session, used_at, valid_until=float("inf")):
        self.seg, self.off, self.left, self.desc = seg, off, left, desc
        self.pref, self.session, self.used_at = pref, session, used_at
        # time.monotonic() until which the master that granted it certainly leads (its
        # leader lease, "lv" in its replies): past it, a successor may have placed other
        # objects in this range, so it is not written before the master answers again
        self.valid_until = valid_until


def put_items(keys: list, views: list, metas: list, links: dict | None) -> list:
    """The items of a put request (both ways).

    Returns:
        ``[key, size, meta]`` per key, and its links (``{"p": parent, "t": [tags]}``) where
        ``links`` has some for it.
    """
    if not links:
        return [[k, len(v), m] for k, v, m in zip(keys, views, metas)]
    return [
        [k, len(v), m] if links.get(k) is None else [k, len(v), m, links[k]]
        for k, v, m in zip(keys, views, metas)
    ]


class Unreachable(str):
    """A segment name ``Reservations.put`` could not write to."""


class Reservations:
    """This client's put reservation (at most one at a time) and the one-round-trip puts into it.

    Attributes:
        current: the reservation held (:class:`Reservation`), or None.
        warm_thread: the thread that warms up the reservation's pages, once started.
    """

    def __init__(self, cfg: StoreConfig, link: Link, dataplane: DataPlane):
        self._cfg = cfg
        self._link = link
        self._dataplane = dataplane
        self.current: Reservation | None = None
        self._lock = threading.Lock()  # held from placing a put in the reservation to its commit
        # (until when, for requests of at least how many bytes) not to ask again
        self._refused = (0.0, 0)
        # segments where this client may still hold a reservation it no longer knows the
        # extent of (its commit request failed): given back as a whole with the next request
        self._orphans: set = set()
        self._rid = 0  # request id of the last commit (a resent one gets the same answer)
        self._warm_job: tuple | None = None  # (offset, bytes) of this client's segment to warm up
        self._warm_evt = threading.Event()
        self.warm_thread: threading.Thread | None = None

    def put(
        self,
        keys: list,
        views: list,
        metas: list,
        cfg: ReplicateConfig,
        upsert: bool,
        links: dict | None = None,
        group: str | None = None,
        quota: int | None = None,
    ):
        """One-round-trip put: writes the objects back to back into this client's reservation.

        It commits them with one request (``Core.put``); ``links``, ``group`` and ``quota`` as
        for the two-request way (:func:`put_items`). Returns the results as
        :meth:`Writer.put_many <mooncake_store.client.write.Writer.put_many>` does, or None when
        this path is not taken (more than one replica, ``require_all``, pinned objects, objects
        larger than a quarter of ``put_reservation_bytes``, no reservation granted, another thread
        using it, the master no longer knowing it): the caller then puts them the two-request way,
        from the start. ``Unreachable(segment)`` when the reservation's segment could not be
        written: the same, avoiding that segment.
        """
        want = self._cfg.put_reservation_bytes
        if (
            not want
            or cfg.replica_num != 1
            or cfg.require_all
            # Pinned objects are placed by the master (best fit: small ones next to each
            # other). In a reservation they would lie at its front, wherever the master
            # found room for it; once it is given back (idle, reclaimed, a larger put) the
            # next one lies elsewhere, and every such island of a few pinned KiB splits a
            # free run for good (they cannot be evicted). WeightSync's records did that
            # (attempt, manifest, commit): a segment sized for its buckets had no run left
            # for the last one (NoSpaceError in the second or third rep of weight_sync_bench).
            or cfg.pin
            or (self._cfg.test_pause and self._cfg.test_pause[0] == "put")
        ):
            return None
        sizes = [aligned(len(v)) for v in views]
        total = sum(sizes)
        if total > want // 4 or not self._lock.acquire(blocking=False):
            return None
        try:
            r = self.current
            if (
                r is None
                or r.session != self._link.session
                or r.pref != cfg.preferred_segment
                or r.left < total
                or time.monotonic() >= r.valid_until
            ):
                until, least = self._refused
                if time.monotonic() < until and 4 * total >= least:
                    return None
                r = self._reserve(cfg.preferred_segment, 4 * total)
                if r is None or r.left < total:
                    return None
                warm = True
            else:
                warm = (
                    time.monotonic() - r.used_at > _WARM_IDLE_S
                )  # idle a while: its pages have gone cold
            if (
                warm
                and total < _WARM_MAX_PUT
                and r.seg == self._cfg.name
                and self._dataplane.segment is not None
                and not self._dataplane.segment.all_huge
                and self._dataplane.fast
            ):
                self._warm(r.off + total, r.left - total)  # the part the next puts will write
            jobs, off = [], r.off
            for v, n in zip(views, sizes):
                jobs.append((r.seg, off, v))
                off += n
            try:
                self._dataplane.write(jobs, {r.seg: r.desc})
            except TransferError:
                # its segment cannot be reached: the slow path places them elsewhere, and the
                # next reservation request gives this one back
                r.session = -1
                return Unreachable(r.seg)
            self._rid += 1
            sent = []
            args = {
                "client": self._link.client_id,
                "rid": self._rid,
                "seg": r.seg,
                "off": r.off,
                "items": put_items(keys, views, metas, links),
                "pin": cfg.pin,
                "upsert": upsert,
            }
            if group is not None:
                args["g"] = group
                if quota is not None:
                    args["q"] = quota
            try:
                res = self._link.call("put", args, sent_at=sent)
            except BaseException:
                self.current = None
                self._orphans.add(
                    r.seg
                )  # the master may have moved its front or not: give back all
                raise
            if res.get("lost"):  # another master, or this client was declared dead meanwhile
                self.current = None
                return None
            if res["resv"] is None:  # a new leader found the objects a resent request committed
                self.current = None
            else:
                r.off, r.left = res["resv"]
                r.used_at = time.monotonic()
                r.valid_until = sent[0] + res.get("lv", float("inf"))
            return [it[1] if it[0] == 0 else from_code(it[1], it[2]) for it in res["items"]]
        finally:
            self._lock.release()

    def _reserve(self, pref: str | None, least: int) -> Reservation | None:
        """Gives the current reservation back and asks for a new one of at least ``least`` bytes.

        ``_lock`` is held.
        """
        old, self.current = self.current, None
        sent = []
        res = self._link.call(
            "reserve",
            {
                "client": self._link.client_id,
                "bytes": self._cfg.put_reservation_bytes,
                "pref": pref,
                "min": least,
                "ret": self._returns(old),
            },
            sent_at=sent,
        )
        self._orphans.clear()
        if res["resv"] is None:
            self._refused = (time.monotonic() + _RESV_REFUSED_S, least)
            return None
        seg, off, n = res["resv"]
        self.current = Reservation(
            seg,
            off,
            n,
            res["segs"][seg],
            pref,
            self._link.session,
            time.monotonic(),
            sent[0] + res.get("lv", float("inf")),
        )
        return self.current

    def _warm(self, off: int, n: int):
        """Has a background thread read a byte of every page of ``[off, off + n)`` of the segment.

        The segment is this client's; the thread reads with ``touch_pages``, ahead of the puts that
        will write there: on VMs a page idle for about a second costs ~0.5 us at its next access (a
        1 MiB copy 150-300 us instead of ~60 us on the CI VM), paid there off the put's path. Only
        for puts below _WARM_MAX_PUT: larger ones copy with two threads, which a third would slow.
        Not needed (not done) where the segment is in 2 MiB pages, which do not go cold.
        """
        self._warm_job = (off, n)
        if self.warm_thread is None:
            self.warm_thread = threading.Thread(
                target=self._warm_main, name="mooncake-store-warm", daemon=True
            )
            self.warm_thread.start()
        self._warm_evt.set()

    def _warm_main(self):
        while True:
            self._warm_evt.wait()
            self._warm_evt.clear()
            job, self._warm_job = self._warm_job, None
            seg = self._dataplane.segment
            if self._link.closed or seg is None:
                return
            if job is None:
                continue
            view = seg.view[job[0] : job[0] + job[1]]
            try:
                self._dataplane.fast.touch_pages(view)
            except Exception as e:
                log.debug("store: warming a put reservation failed: %s", e)
            finally:
                view.release()

    def _returns(self, old: Reservation | None) -> list:
        """The ``ret`` list of a reserve request.

        ``old`` as this client knows it, and every orphaned reservation as a whole (offset -1).
        """
        out = [[old.seg, old.off, old.left]] if old is not None else []
        return out + [
            [seg, -1, -1] for seg in sorted(self._orphans) if old is None or seg != old.seg
        ]

    def give_back(self, wait: bool) -> None:
        """Returns the reservation to the master (asked to, or idle).

        ``wait``: after a put in flight in it has committed.
        """
        if not self._lock.acquire(blocking=wait):
            return
        try:
            old, self.current = self.current, None
            if (old is not None or self._orphans) and not self._link.closed:
                if wait:  # the master asked for it back: space is short, do not ask again at once
                    self._refused = (time.monotonic() + _RESV_REFUSED_S, 0)
                try:
                    self._link.call(
                        "reserve",
                        {"client": self._link.client_id, "bytes": 0, "ret": self._returns(old)},
                        fail_fast=False,  # the master holds the space until it hears this
                    )
                    self._orphans.clear()
                except StoreError as e:
                    if (
                        not self._link.closed
                    ):  # closed meanwhile (close() on another thread): nothing to say
                        log.warning("store: giving a put reservation back failed: %s", e)
        finally:
            self._lock.release()

    def give_back_if_idle(self) -> None:
        """Gives the reservation back when unused for a few seconds.

        Also any reservation whose extent this client lost track of.
        """
        r = self.current
        if (r is not None and time.monotonic() - r.used_at > _RESV_IDLE_S) or self._orphans:
            self.give_back(wait=False)

    def close(self) -> None:
        """Stops the warm-up thread (it holds a view of the segment, which is closed next).

        The link is closed already.
        """
        t = self.warm_thread
        if t is not None and t is not threading.current_thread():
            self._warm_evt.set()
            t.join(5)
