"""The client's write path: puts the two-request way (``put_start``, write, ``put_end``,
in waves when space is short, placed again elsewhere when a segment cannot be reached) and
the one-round-trip way into this client's put reservation (reserve, write, commit with
``put``; give-back when idle or asked; warm-up of its pages).

Mixed into :class:`~mooncake_store.MooncakeStore`, whose ``__init__`` sets the state these
methods use (``cfg``, ``_resv``, ``_resv_lock``, ``_session``, ...).
"""

from __future__ import annotations

import logging
import threading
import time

from ..common.errors import (
    NoSpaceError,
    PutLostError,
    StoreError,
    TransferError,
    from_code,
)
from ..common.layout import aligned
from .args import chunks, raise_first
from .config import ReplicateConfig
from .read import _FAST_COPY_BYTES

log = logging.getLogger("mooncake_store")

_NOSPACE_RETRY_S = 6.0  # a new leader evicts nothing for lease_ttl_s (5 s by default)
_RESV_REFUSED_S = (
    1.0  # after the master refused (or took back) a reservation, no new request this long
)
_WARM_IDLE_S = 0.5  # a reservation unused this long is warmed up again before its next put (_warm)
_WARM_MAX_PUT = 4 << 20  # puts from this size on copy with two threads and warm nothing (_warm)


class _Reservation:
    """Segment space the master reserved for this client's next puts (``Core.reserve``)."""

    __slots__ = ("desc", "left", "off", "pref", "seg", "session", "used_at", "valid_until")

    def __init__(self, seg, off, left, desc, pref, session, used_at, valid_until=float("inf")):
        self.seg, self.off, self.left, self.desc = seg, off, left, desc
        self.pref, self.session, self.used_at = pref, session, used_at
        # time.monotonic() until which the master that granted it certainly leads (its
        # leader lease, "lv" in its replies): past it, a successor may have placed other
        # objects in this range, so it is not written before the master answers again
        self.valid_until = valid_until


class _Unreachable(str):
    """A segment name ``_put_reserved`` could not write to."""


class _WriteMixin:
    """Puts: the two-request way and into the put reservation."""

    def _write_all(self, jobs, segs):
        """jobs: [(segment name, offset, view)]; raises TransferError."""
        remote: dict = {}
        dsts, srcs, total = [], [], 0
        for name, off, mv in jobs:
            desc = segs[name]
            if len(mv) == 0:
                continue
            if self._is_local(desc):
                try:
                    view = self._seg_view(desc)
                except TransferError as e:
                    e.segment = name  # its owner is gone: the put is placed again elsewhere
                    raise
                if off + len(mv) > len(view):
                    raise TransferError(f"write to segment {name!r} at {off} leaves the segment")
                dsts.append(view[off : off + len(mv)])
                srcs.append(mv)
                total += len(mv)
            else:
                remote.setdefault(name, []).append((off, mv))
        if dsts:
            if self._fast is not None and total >= _FAST_COPY_BYTES:
                self._fast.copy_buffers(dsts, srcs)
            else:
                for d, m in zip(dsts, srcs):
                    d[:] = m
        for name, items in remote.items():
            host, port, region = self._te_for(segs[name])
            try:
                self._te.batch_write(
                    host, port, region, [o for o, _ in items], [m for _, m in items]
                )
            except RuntimeError as e:
                err = TransferError(f"write to segment {name!r} at {host}:{port} failed: {e}")
                err.segment = name
                raise err from None

    def _put_many(
        self,
        keys: list,
        views: list,
        metas: list,
        cfg: ReplicateConfig,
        upsert: bool,
        return_exceptions: bool,
        _retry=True,
        _avoid: tuple = (),
    ) -> list:
        if not keys:
            return []
        parts = list(chunks(keys))
        if len(parts) > 1:
            out: list = []
            for a, b in parts:
                got = self._put_many(
                    keys[a:b], views[a:b], metas[a:b], cfg, upsert, True, _retry, _avoid
                )
                out += got
                # a segment that could not be reached is not tried again by the next parts
                # (each try would wait for the engine's timeout)
                bad = {getattr(r, "segment", None) for r in got if isinstance(r, TransferError)} - {
                    None
                }
                _avoid = _avoid + tuple(sorted(bad - set(_avoid)))
            if not return_exceptions:
                raise_first(out)
            return out
        results = self._put_part(keys, views, metas, cfg, upsert, True, _retry, _avoid)
        wave = range(len(keys))
        while True:
            # a batch larger than the space free or evictable now goes in waves: what was
            # placed is written and committed (and so becomes evictable); the rest is
            # placed again while each wave stores something (a KV put of more chunks than
            # the owner's memory failed with NoSpaceError after a few, found by a trial)
            rest = [i for i in wave if isinstance(results[i], NoSpaceError)]
            if not rest or len(rest) == len(wave):
                break
            self._redo(
                self._put_part, rest, results, keys, views, metas, cfg, upsert, True, _retry, _avoid
            )
            wave = rest
        if not return_exceptions:
            raise_first(results)
        return results

    @staticmethod
    def _redo(put, idx: list, results: list, keys: list, views: list, metas: list, *args, **kw):
        """Puts the keys at positions ``idx`` again with ``put`` (``_put_part`` or
        ``_put_many``; ``args``/``kw``: its arguments after the metadata) and writes each
        outcome into ``results`` at its position."""
        again = put(
            [keys[i] for i in idx], [views[i] for i in idx], [metas[i] for i in idx], *args, **kw
        )
        for i, r in zip(idx, again):
            results[i] = r

    def _put_part(
        self,
        keys: list,
        views: list,
        metas: list,
        cfg: ReplicateConfig,
        upsert: bool,
        return_exceptions: bool,
        _retry: bool,
        _avoid: tuple,
    ) -> list:
        """One wave of ``_put_many`` for keys that fit in one metadata request."""
        if not _avoid and _retry:
            fast = self._put_reserved(keys, views, metas, cfg, upsert)
            if isinstance(fast, _Unreachable):  # the two-request way, elsewhere
                return self._put_many(
                    keys, views, metas, cfg, upsert, return_exceptions, _retry, (str(fast),)
                )
            lost = [i for i, r in enumerate(fast or ()) if isinstance(r, PutLostError)]
            if lost:  # lost in a leader change: the two-request way, once
                self._redo(
                    self._put_many, lost, fast, keys, views, metas, cfg, upsert, True, _retry=False
                )
            if fast is not None:
                if not return_exceptions:
                    raise_first(fast)
                return fast
        args = self._start_args(cfg, upsert, _avoid)
        deadline = time.monotonic() + _NOSPACE_RETRY_S
        results: list = [None] * len(keys)
        todo = list(range(len(keys)))
        started = []  # (index, version, replica list)
        segs: dict = {}
        while todo:
            args["items"] = [[keys[i], len(views[i]), metas[i]] for i in todo]
            res = self._call("put_start", args)
            segs.update(res["segs"])
            retry = []
            for i, item in zip(todo, res["items"]):
                if item[0] == 0:
                    started.append((i, item[1], item[2]))
                elif item[1] == "NoSpaceRetry" and time.monotonic() < deadline:
                    retry.append(i)
                else:
                    code = "NoSpace" if item[1] == "NoSpaceRetry" else item[1]
                    results[i] = from_code(code, item[2])
            todo = retry
            if todo:
                time.sleep(0.05)
        if started and self.cfg.test_pause and self.cfg.test_pause[0] == "put":
            time.sleep(self.cfg.test_pause[1])
        jobs = [(s, off, views[i]) for i, _, reps in started for s, off in reps]
        try:
            self._write_all(jobs, segs)
        except BaseException as e:
            self._revoke([[keys[i], v] for i, v, _ in started])
            bad = getattr(e, "segment", None)
            if isinstance(e, TransferError) and bad and bad not in _avoid and len(_avoid) < 8:
                # a segment that cannot be reached (its owner died and the master does not know
                # yet): the same puts again, placed elsewhere
                idx = [i for i, _, _ in started]
                again = self._put_many(
                    [keys[i] for i in idx],
                    [views[i] for i in idx],
                    [metas[i] for i in idx],
                    cfg,
                    upsert,
                    True,
                    _retry,
                    _avoid + (bad,),
                )
                for i, r in zip(idx, again):
                    if isinstance(
                        r, NoSpaceError
                    ):  # nowhere else to go: the write failure is the news
                        r = TransferError(f"{e} (and no other segment could take the object: {r})")
                        r.segment = bad
                    results[i] = r
            else:
                if isinstance(e, TransferError) and not return_exceptions:
                    raise
                for i, _, _ in started:
                    results[i] = e if isinstance(e, StoreError) else TransferError(str(e))
                if not isinstance(e, StoreError):
                    raise
            started = []
        if started:
            res = self._call(
                "put_end",
                {"client": self.client_id, "items": [[keys[i], v] for i, v, _ in started]},
            )
            lost = []
            for (i, _, _reps), item in zip(started, res["items"]):
                if item[0] == 0:
                    results[i] = item[1]
                elif item[1] == PutLostError.code and _retry:
                    lost.append(i)
                else:
                    results[i] = from_code(item[1], item[2])
            if lost:  # the master lost the put (leader change, writer declared dead): redo once
                self._redo(
                    self._put_many, lost, results, keys, views, metas, cfg, True, True, _retry=False
                )
        if not return_exceptions:
            raise_first(results)
        return results

    def _start_args(self, cfg: ReplicateConfig, upsert: bool, avoid: tuple = ()) -> dict:
        """A ``put_start`` request's arguments but its items."""
        args = {
            "client": self.client_id,
            "r": cfg.replica_num,
            "pref": cfg.preferred_segment,
            "pin": cfg.pin,
            "all": cfg.require_all,
            "upsert": upsert,
        }
        if avoid:
            args["x"] = list(avoid)
        if getattr(cfg, "only_preferred", False):
            args["only"] = True
        return args

    def _revoke(self, items: list) -> None:
        """Gives started puts (``[key, version]`` items) back; a master out of reach drops
        them with this client's other state."""
        try:
            self._call("put_revoke", {"client": self.client_id, "items": items})
        except StoreError:
            pass

    def _place_own(self, keys: list, sizes: list, cfg: ReplicateConfig):
        """Starts upserts of ``keys`` (``sizes`` in bytes, each > 0; one replica, ``cfg``
        naming this client's own segment, ``only_preferred``) with one request; the caller
        writes their bytes in place (a read from another host lands there, without a
        staging copy), then commits each (:meth:`_commit_one`) or gives it back
        (:meth:`_revoke`). Returns ``[(view, version)]`` in the order of ``keys``, or None
        (nothing started) when the segment has no room for all of them."""
        args = self._start_args(cfg, True)
        args["items"] = [[k, n, b""] for k, n in zip(keys, sizes)]
        items = self._call("put_start", args)["items"]
        started = [[k, it[1]] for k, it in zip(keys, items) if it[0] == 0]
        for it in items:
            if it[0] == 0:
                continue
            self._revoke(started)
            if it[1] in ("NoSpace", "NoSpaceRetry"):
                return None
            raise from_code(it[1], it[2])
        if self._segment is None or any(it[2][0][0] != self.name for it in items):
            self._revoke(started)
            raise StoreError(
                f"put of {keys[0]!r}: placed in another segment than this client's own"
            )
        view = self._segment.view
        return [(view[it[2][0][1] : it[2][0][1] + n], it[1]) for it, n in zip(items, sizes)]

    def _commit_one(self, key: str, version: int) -> None:
        """Commits a put that :meth:`_place_own` started."""
        (item,) = self._call("put_end", {"client": self.client_id, "items": [[key, version]]})[
            "items"
        ]
        if item[0] != 0:
            raise from_code(item[1], item[2])

    def _put_reserved(
        self, keys: list, views: list, metas: list, cfg: ReplicateConfig, upsert: bool
    ):
        """One-round-trip put: writes the objects back to back into this client's
        reservation and commits them with one request (``Core.put``). Returns the results
        as ``_put_many`` does, or None when this path is not taken (more than one replica,
        ``require_all``, pinned objects, objects larger than a quarter of
        ``put_reservation_bytes``, no reservation granted, another thread using it, the
        master no longer knowing it): the caller then puts them the two-request way, from
        the start. ``_Unreachable(segment)`` when the reservation's segment could not be
        written: the same, avoiding that segment."""
        want = self.cfg.put_reservation_bytes
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
            or (self.cfg.test_pause and self.cfg.test_pause[0] == "put")
        ):
            return None
        sizes = [aligned(len(v)) for v in views]
        total = sum(sizes)
        if total > want // 4 or not self._resv_lock.acquire(blocking=False):
            return None
        try:
            r = self._resv
            if (
                r is None
                or r.session != self._session
                or r.pref != cfg.preferred_segment
                or r.left < total
                or time.monotonic() >= r.valid_until
            ):
                until, least = self._resv_refused
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
                and r.seg == self.name
                and self._segment is not None
                and not self._segment.all_huge
                and self._fast
            ):
                self._warm(r.off + total, r.left - total)  # the part the next puts will write
            jobs, off = [], r.off
            for v, n in zip(views, sizes):
                jobs.append((r.seg, off, v))
                off += n
            try:
                self._write_all(jobs, {r.seg: r.desc})
            except TransferError:
                # its segment cannot be reached: the slow path places them elsewhere, and the
                # next reservation request gives this one back (was: forgotten, held until exit)
                r.session = -1
                return _Unreachable(r.seg)
            self._resv_rid += 1
            sent = []
            try:
                res = self._call(
                    "put",
                    {
                        "client": self.client_id,
                        "rid": self._resv_rid,
                        "seg": r.seg,
                        "off": r.off,
                        "items": [[k, len(v), m] for k, v, m in zip(keys, views, metas)],
                        "pin": cfg.pin,
                        "upsert": upsert,
                    },
                    sent_at=sent,
                )
            except BaseException:
                self._resv = None
                self._resv_orphans.add(
                    r.seg
                )  # the master may have moved its front or not: give back all
                raise
            if res.get("lost"):  # another master, or this client was declared dead meanwhile
                self._resv = None
                return None
            if res["resv"] is None:  # a new leader found the objects a resent request committed
                self._resv = None
            else:
                r.off, r.left = res["resv"]
                r.used_at = time.monotonic()
                r.valid_until = sent[0] + res.get("lv", float("inf"))
            return [it[1] if it[0] == 0 else from_code(it[1], it[2]) for it in res["items"]]
        finally:
            self._resv_lock.release()

    def _reserve(self, pref: str | None, least: int) -> _Reservation | None:
        """Gives the current reservation back and asks for a new one of at least ``least``
        bytes (``_resv_lock`` held)."""
        old, self._resv = self._resv, None
        sent = []
        res = self._call(
            "reserve",
            {
                "client": self.client_id,
                "bytes": self.cfg.put_reservation_bytes,
                "pref": pref,
                "min": least,
                "ret": self._returns(old),
            },
            sent_at=sent,
        )
        self._resv_orphans.clear()
        if res["resv"] is None:
            self._resv_refused = (time.monotonic() + _RESV_REFUSED_S, least)
            return None
        seg, off, n = res["resv"]
        self._resv = _Reservation(
            seg,
            off,
            n,
            res["segs"][seg],
            pref,
            self._session,
            time.monotonic(),
            sent[0] + res.get("lv", float("inf")),
        )
        return self._resv

    def _warm(self, off: int, n: int):
        """Has a background thread read a byte of every page of ``[off, off + n)`` of this
        client's segment (``touch_pages``) ahead of the puts that will write there: on VMs a
        page idle for about a second costs ~0.5 us at its next access (a 1 MiB copy 150-300
        us instead of ~60 us on the CI VM), paid there off the put's path. Only for puts
        below _WARM_MAX_PUT: larger ones copy with two threads, which a third would slow.
        Not needed (not done) where the segment is in 2 MiB pages, which do not go cold."""
        self._warm_job = (off, n)
        if self._warm_thread is None:
            self._warm_thread = threading.Thread(
                target=self._warm_main, name="mooncake-store-warm", daemon=True
            )
            self._warm_thread.start()
        self._warm_evt.set()

    def _warm_main(self):
        while True:
            self._warm_evt.wait()
            self._warm_evt.clear()
            job, self._warm_job = self._warm_job, None
            seg = self._segment
            if self._closed or seg is None:
                return
            if job is None:
                continue
            view = seg.view[job[0] : job[0] + job[1]]
            try:
                self._fast.touch_pages(view)
            except Exception as e:
                log.debug("store: warming a put reservation failed: %s", e)
            finally:
                view.release()

    def _returns(self, old: _Reservation | None) -> list:
        """The ``ret`` list of a reserve request: ``old`` as this client knows it, and every
        orphaned reservation as a whole (offset -1)."""
        out = [[old.seg, old.off, old.left]] if old is not None else []
        return out + [
            [seg, -1, -1] for seg in sorted(self._resv_orphans) if old is None or seg != old.seg
        ]

    def _give_back_reservation(self, wait: bool):
        """Returns the reservation to the master (asked to, or idle); ``wait``: after a put
        in flight in it has committed."""
        if not self._resv_lock.acquire(blocking=wait):
            return
        try:
            old, self._resv = self._resv, None
            if (old is not None or self._resv_orphans) and not self._closed:
                if wait:  # the master asked for it back: space is short, do not ask again at once
                    self._resv_refused = (time.monotonic() + _RESV_REFUSED_S, 0)
                try:
                    self._call(
                        "reserve",
                        {"client": self.client_id, "bytes": 0, "ret": self._returns(old)},
                        fail_fast=False,  # the master holds the space until it hears this
                    )
                    self._resv_orphans.clear()
                except StoreError as e:
                    if (
                        not self._closed
                    ):  # closed meanwhile (close() on another thread): nothing to say
                        log.warning("store: giving a put reservation back failed: %s", e)
        finally:
            self._resv_lock.release()
