"""The client's write path: two-request puts, one-round-trip puts, and puts written in place.

Puts the two-request way (``put_start``, write, ``put_end``, in waves when space is short, placed
again elsewhere when a segment cannot be reached), or the one-round-trip way into this client's put
reservation (``reservation.py``); and puts the caller writes in place in this client's own segment
(:meth:`Writer.place_own`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgpack

from ..common.errors import (
    NoSpaceError,
    ParentMissingError,
    PutLostError,
    StoreError,
    TransferError,
    from_code,
)
from .args import chunks, copyable, is_tensor, raise_first, tensor_bytes
from .config import ReplicateConfig, StoreConfig
from .dataplane import DataPlane
from .link import Link
from .reservation import Reservations, Unreachable, put_items

_NOSPACE_RETRY_S = 6.0  # a new leader evicts nothing for lease_ttl_s (5 s by default)
# waits between put_start tries while the master answers NoSpaceRetry: room usually comes
# back within milliseconds (an offload burst reported, a lease ended), so the first waits are
# short and double up to the longest, which bounds the retries sent to a master under load
_NOSPACE_WAIT_FIRST_S = 0.002
_NOSPACE_WAIT_MAX_S = 0.05


class _PutOptions(NamedTuple):
    """How one batch of puts places its objects."""

    cfg: ReplicateConfig
    upsert: bool  # replaces existing values
    only_preferred: bool = False  # in cfg.preferred_segment alone (NoSpaceError otherwise)
    links: dict | None = None  # key -> {"p": parent, "t": [tags]} (what the master keeps)
    group: str | None = None  # quota group of every object
    quota: int | None = None  # that group's quota in bytes


class Writer:
    """Puts."""

    def __init__(
        self, cfg: StoreConfig, link: Link, dataplane: DataPlane, reservations: Reservations
    ):
        self._cfg = cfg
        self._link = link
        self._dataplane = dataplane
        self._reservations = reservations

    def put_many(
        self,
        keys,
        views,
        metas,
        cfg,
        *,
        upsert=False,
        return_exceptions=False,
        only_preferred=False,
        links=None,
        group=None,
        quota=None,
    ) -> list:
        """Stores ``views[i]`` (flat byte views) under the checked ``keys[i]`` with ``metas[i]``.

        ``metas[i]`` are bytes the master keeps with the object as its metadata: ``exists`` returns
        them without a read.

        Args:
            keys: the checked keys, one per object.
            views: the objects' flat byte views, as ``keys``.
            metas: the objects' metadata bytes, as ``keys``.
            cfg: placement of every object.
            upsert: replace existing values (else ``ObjectExistsError`` for those).
            return_exceptions: a key's error in its place instead of raised (the first)
                after the whole batch.
            only_preferred: in ``cfg.preferred_segment`` alone: ``NoSpaceError`` when it
                has no room (no other segment takes the object).
            links: checked key -> ``{"p": parent, "t": [tags]}`` for the keys that have
                a parent or tags.
            group: the quota group of every object.
            quota: the group's quota in bytes.

        Returns:
            The replicas placed per key (or its error, with ``return_exceptions``).
        """
        return self._put_many(
            keys,
            views,
            metas,
            _PutOptions(cfg, upsert, only_preferred, links or None, group, quota),
            return_exceptions,
        )

    def put_tensors(
        self,
        keys: list,
        tensors: list,
        cfg: ReplicateConfig,
        *,
        upsert: bool,
        return_exceptions: bool,
        op: str,
    ) -> list:
        """:meth:`put_many` of CPU tensors, each with its dtype and shape as metadata.

        ``ValueError`` naming ``op`` for a value that is no tensor or of a dtype torch cannot copy
        (before anything is sent).
        """
        metas, views = [], []
        for t in tensors:
            if not is_tensor(t):
                raise ValueError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
            if not copyable(t.dtype):
                raise ValueError(
                    f"{op}: dtype {t.dtype} cannot be stored as a tensor: torch has no copy "
                    "kernel for it, so get_tensor could not return it (store its bytes, e.g. "
                    "t.view(torch.uint8), instead)"
                )
            metas.append(
                msgpack.packb(
                    {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                )
            )
            views.append(tensor_bytes(t, f"{op}: tensor"))
        return self.put_many(
            keys, views, metas, cfg, upsert=upsert, return_exceptions=return_exceptions
        )

    def _put_many(
        self,
        keys: list,
        views: list,
        metas: list,
        opts: _PutOptions,
        return_exceptions: bool,
        retry: bool = True,
        avoid: tuple = (),
    ) -> list:
        """:meth:`put_many` of checked keys, in parts of one metadata request each.

        ``retry``: a put the master lost is put again once; ``avoid``: segments found unreachable
        (not placed in again).
        """
        if not keys:
            return []
        extra = None
        if opts.links:  # up to 16 tags of 256 bytes and a parent of 4 KiB per item
            extra = [len(m) + len(str(opts.links.get(k, "")).encode()) for k, m in zip(keys, metas)]
        parts = list(chunks(keys, extra=extra))
        if len(parts) > 1:
            out: list = []
            for a, b in parts:
                got = self._put_many(keys[a:b], views[a:b], metas[a:b], opts, True, retry, avoid)
                out += got
                # a segment that could not be reached is not tried again by the next parts
                # (each try would wait for the engine's timeout)
                bad = {getattr(r, "segment", None) for r in got if isinstance(r, TransferError)} - {
                    None
                }
                avoid = avoid + tuple(sorted(bad - set(avoid)))
            if not return_exceptions:
                raise_first(out)
            return out
        results = self._put_part(keys, views, metas, opts, True, retry, avoid)
        index = {k: i for i, k in enumerate(keys)} if opts.links else {}
        wave = range(len(keys))
        while True:
            # a batch larger than the space free or evictable now goes in waves: what was
            # placed is written and committed (and so becomes evictable); the rest is
            # placed again while each wave stores something (so a KV put of more chunks than
            # the owner's memory holds does not fail with NoSpaceError after a few).
            # A child refused because its parent in this batch found no space goes again
            # with it, or after it when the parent went in by itself (a one-request put
            # refuses the children of the objects it leaves to the two-request way).
            rest, again = [], set()
            for i in wave:
                r = results[i]
                parent = opts.links.get(keys[i], {}).get("p") if opts.links else None
                if isinstance(r, NoSpaceError) or (
                    isinstance(r, ParentMissingError)
                    and parent is not None
                    and (
                        parent in again
                        or (
                            parent in index
                            and not isinstance(results[index[parent]], BaseException)
                        )
                    )
                ):
                    rest.append(i)
                    again.add(keys[i])
            if not rest or len(rest) == len(wave):
                break
            self._redo(self._put_part, rest, results, keys, views, metas, opts, True, retry, avoid)
            wave = rest
        if not return_exceptions:
            raise_first(results)
        return results

    @staticmethod
    def _redo(put, idx: list, results: list, keys: list, views: list, metas: list, *args, **kw):
        """Puts the keys at positions ``idx`` again with ``put``; outcomes go into ``results``.

        ``put`` is ``_put_part`` or ``_put_many``; ``args``/``kw``: its arguments after the
        metadata. Each outcome goes into ``results`` at its position.
        """
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
        opts: _PutOptions,
        return_exceptions: bool,
        retry: bool,
        avoid: tuple,
    ) -> list:
        """One wave of ``_put_many`` for keys that fit in one metadata request."""
        if not avoid and retry:
            fast = self._reservations.put(
                keys, views, metas, opts.cfg, opts.upsert, opts.links, opts.group, opts.quota
            )
            if isinstance(fast, Unreachable):  # the two-request way, elsewhere
                return self._put_many(
                    keys, views, metas, opts, return_exceptions, retry, (str(fast),)
                )
            # lost in a leader change, or no space yet (the two-request way waits for it):
            # the two-request way, once
            lost = [
                i
                for i, r in enumerate(fast or ())
                if isinstance(r, PutLostError) or getattr(r, "code", None) == "NoSpaceRetry"
            ]
            if lost:
                self._redo(self._put_many, lost, fast, keys, views, metas, opts, True, retry=False)
            if fast is not None:
                if not return_exceptions:
                    raise_first(fast)
                return fast
        args = self._start_args(opts, avoid)
        deadline = time.monotonic() + _NOSPACE_RETRY_S
        wait_s = _NOSPACE_WAIT_FIRST_S
        results: list = [None] * len(keys)
        todo = list(range(len(keys)))
        started = []  # (index, version, replica list)
        segs: dict = {}
        while todo:
            args["items"] = put_items(
                [keys[i] for i in todo],
                [views[i] for i in todo],
                [metas[i] for i in todo],
                opts.links,
            )
            res = self._link.call("put_start", args)
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
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, _NOSPACE_WAIT_MAX_S)
        if started and self._cfg.test_pause and self._cfg.test_pause[0] == "put":
            time.sleep(self._cfg.test_pause[1])
        jobs = [(s, off, views[i]) for i, _, reps in started for s, off in reps]
        try:
            self._dataplane.write(jobs, segs)
        except BaseException as e:
            self.revoke([[keys[i], v] for i, v, _ in started])
            bad = getattr(e, "segment", None)
            if isinstance(e, TransferError) and bad and bad not in avoid and len(avoid) < 8:
                # a segment that cannot be reached (its owner died and the master does not know
                # yet): the same puts again, placed elsewhere
                idx = [i for i, _, _ in started]
                again = self._put_many(
                    [keys[i] for i in idx],
                    [views[i] for i in idx],
                    [metas[i] for i in idx],
                    opts,
                    True,
                    retry,
                    avoid + (bad,),
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
            res = self._link.call(
                "put_end",
                {"client": self._link.client_id, "items": [[keys[i], v] for i, v, _ in started]},
            )
            lost = []
            for (i, _, _reps), item in zip(started, res["items"]):
                if item[0] == 0:
                    results[i] = item[1]
                elif item[1] == PutLostError.code and retry:
                    lost.append(i)
                else:
                    results[i] = from_code(item[1], item[2])
            if lost:  # the master lost the put (leader change, writer declared dead): redo once
                self._redo(
                    self._put_many,
                    lost,
                    results,
                    keys,
                    views,
                    metas,
                    opts._replace(upsert=True),
                    True,
                    retry=False,
                )
        if not return_exceptions:
            raise_first(results)
        return results

    def _start_args(self, opts: _PutOptions, avoid: tuple = ()) -> dict:
        """A ``put_start`` request's arguments but its items."""
        cfg = opts.cfg
        args = {
            "client": self._link.client_id,
            "r": cfg.replica_num,
            "pref": cfg.preferred_segment,
            "pin": cfg.pin,
            "all": cfg.require_all,
            "upsert": opts.upsert,
        }
        if avoid:
            args["x"] = list(avoid)
        if opts.only_preferred:
            args["only"] = True
        if opts.group is not None:
            args["g"] = opts.group
            if opts.quota is not None:
                args["q"] = opts.quota
        return args

    def revoke(self, items: list) -> None:
        """Gives started puts (``[key, version]`` items) back.

        A master out of reach drops them with this client's other state.
        """
        try:
            self._link.call("put_revoke", {"client": self._link.client_id, "items": items})
        except StoreError:
            pass

    def place_own(self, keys: list, sizes: list, *, pin: bool) -> list | None:
        """Starts upserts of ``keys`` with one request, each in this client's own segment.

        ``sizes`` in bytes, each > 0; one replica each, in this client's own segment alone. The
        caller writes their bytes in place (a read from another host lands there, without a staging
        copy), then commits each (:meth:`commit_one`) or gives it back (:meth:`revoke`). Returns
        ``[(view, version)]`` in the order of ``keys``, or None (nothing started) when the segment
        has no room for all of them.
        """
        opts = _PutOptions(ReplicateConfig(preferred_segment=self._cfg.name, pin=pin), True, True)
        args = self._start_args(opts)
        args["items"] = [[k, n, b""] for k, n in zip(keys, sizes)]
        items = self._link.call("put_start", args)["items"]
        started = [[k, it[1]] for k, it in zip(keys, items) if it[0] == 0]
        for it in items:
            if it[0] == 0:
                continue
            self.revoke(started)
            if it[1] in ("NoSpace", "NoSpaceRetry"):
                return None
            raise from_code(it[1], it[2])
        segment = self._dataplane.segment
        if segment is None or any(it[2][0][0] != self._cfg.name for it in items):
            self.revoke(started)
            raise StoreError(
                f"put of {keys[0]!r}: placed in another segment than this client's own"
            )
        view = segment.view
        return [(view[it[2][0][1] : it[2][0][1] + n], it[1]) for it, n in zip(items, sizes)]

    def commit_one(self, key: str, version: int) -> None:
        """Commits a put that :meth:`place_own` started."""
        (item,) = self._link.call(
            "put_end", {"client": self._link.client_id, "items": [[key, version]]}
        )["items"]
        if item[0] != 0:
            raise from_code(item[1], item[2])
