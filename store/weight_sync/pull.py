"""The reader's side of :class:`~mooncake_store.WeightSync`: ``pull`` and ``release``.

``pull``: holds on versions and their refresh thread, staging a whole version and checking it before
anything is installed, views of the store's memory. The store layout it reads and writes is
described in ``sync.py``; relays across hosts are ``relay.py``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
import warnings
import weakref

import msgpack

from ..common.errors import (
    LeaseExpiredError,
    ObjectExistsError,
    ObjectNotFoundError,
    StaleVersionError,
    StoreError,
    WeightSyncAbortedError,
)
from .common import (
    PullResult,
    _byte_view,
    _dtype_of,
    _piece_digest,
    _StreamDigests,
    _target_dict,
    _torch,
    _unref,
)
from .config import WeightSyncConfig
from .records import ModelRecords
from .relay import RelayPull
from .timeline import PullTimeline

# logs under the name of the module WeightSync lives in
log = logging.getLogger("mooncake_store.weight_sync")

_READS_IN_FLIGHT = 2  # buckets read at once: the link stays busy between two reads


class Puller:
    """The reading side of one :class:`~mooncake_store.WeightSync`: ``pull``, holds, ``release``.

    Holds are on versions.

    Attributes:
        version: the version this reader holds (-1: none).
        held_pid: the publish id of the version held (a version number committed again
            with other bytes, after a master restart without etcd lost the records, is
            installed again).
        rid: this reader's id, in its slot and hold records and its relay copies' keys.
        relay: the relay role of the last pull (``relay.RelayPull``), or None.
        lapsed_versions: viewed versions found dropped while this reader still had views
            of them (its hold lapsed: the process was stopped or starved past
            ``hold_ttl_s``); see ``_check_not_dropped``.
    """

    def __init__(self, records: ModelRecords, cfg: WeightSyncConfig):
        self.records = records
        self.store = records.store
        self.model = records.model
        self.cfg = cfg
        self.version = -1
        self.held_pid: str | None = None
        self._staged_pid: str | None = None  # the publish id of the version last staged
        self._warned_behind = False  # a store whose latest is below the held version: said once
        self._slot: int | None = None
        self._spare: dict = {}  # staging tensors of the last pull, reused by the next one
        self.rid = uuid.uuid4().hex
        self._hold_lock = threading.Lock()  # pulls and the refresh thread write one hold key
        # version -> live view arrays of it: a version stays held while any tensor viewing
        # it lives (also one the caller detached or kept from an earlier pull)
        self._refs: dict = {}
        self._view_targets: dict = {}  # id(target tensor) -> (weakref to it, data_ptr of its view)
        self._into = None  # (id, weakref or None) of the last `into`, or "none" (into=None)
        self._refresher: threading.Thread | None = None
        self.relay: RelayPull | None = None
        self.timeline: PullTimeline | None = None  # the last pull's
        self._stop = threading.Event()
        self.lapsed_versions: list = []

    def held_versions(self) -> list:
        """Versions that tensors alive view (held until they go)."""
        return sorted(v for v, c in list(self._refs.items()) if c > 0)

    def _hold(self, versions: list, verify: bool = False) -> bool:
        """Records that this reader uses ``versions`` (publishers do not drop them).

        False if no reader slot is free. ``verify``: check first that the slot is still ours (a
        publisher reclaims the slot of a reader silent for ``hold_ttl_s``).
        """
        with self._hold_lock:
            return self._hold_locked(versions, verify)

    def _hold_locked(self, versions: list, verify: bool) -> bool:
        if self._slot is not None and verify:
            rec = self.records.get(f"{self.records.prefix}slot/{self._slot}")
            if not isinstance(rec, dict) or rec.get("rid") != self.rid:
                self._slot = None
        if self._slot is None:
            rec = {"rid": self.rid, "t": time.time()}
            for i in range(self.cfg.max_readers):
                try:
                    self.records.put(f"{self.records.prefix}slot/{i}", rec, upsert=False)
                    self._slot = i
                    break
                except ObjectExistsError:
                    continue
            else:
                return False  # no slot: copies still work, the version is just not protected from dropping
        self.records.put(
            f"{self.records.prefix}hold/{self._slot}",
            {"rid": self.rid, "versions": list(versions), "t": time.time()},
        )
        return True

    def _refresh_main(self):
        # keeps the holds on viewed versions younger than hold_ttl_s while this reader lives
        written = True
        while not self._stop.wait(self.cfg.hold_ttl_s / 4):
            held = self.held_versions()
            if held or written:
                try:
                    self._hold(held, verify=True)
                    written = bool(held)
                    if held:
                        self._check_not_dropped(held)
                except StoreError:
                    pass  # retried at the next tick; the hold counts for hold_ttl_s

    def _check_not_dropped(self, held: list):
        """Makes a lapsed hold loud: a version this reader still views may have been dropped.

        A reader stopped or starved past ``hold_ttl_s`` (a debugger, a paused VM) lost its hold: a
        publisher may have dropped a version it still views and reused that memory. Nothing can stop
        the model from reading it then; this makes it loud (``lapsed_versions``, an error in the log
        and a ``RuntimeWarning``) until the next pull installs a newer version.
        """
        alive = self.store.exists_batch([f"{self.records.prefix}v{v}/commit" for v in held])
        gone = [v for v, ok in zip(held, alive) if not ok]
        if gone and gone != self.lapsed_versions:
            self.lapsed_versions = gone
            msg = (
                f"{self.model}: version(s) {gone} were dropped while this reader still had views of them (its "
                f"hold lapsed: stopped or starved past hold_ttl_s={self.cfg.hold_ttl_s} s); those parameters may "
                "now read another version's bytes: pull() again"
            )
            log.error(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=1)

    def release(self) -> None:
        """:meth:`WeightSync.release <mooncake_store.WeightSync.release>`."""
        self._stop.set()
        if self.relay is not None:  # the copies this reader relayed go with it
            self.relay.resign()
            self.relay = None
        torch = _torch()
        with torch.no_grad():
            for ref, ptr in self._view_targets.values():  # installed views become private copies
                t = ref()
                if t is not None and t.numel() and t.data_ptr() == ptr:
                    t.data = t.data.clone()
        self._view_targets = {}
        left = self.held_versions()
        if left:
            log.warning(
                "%s: release() while tensors viewing version(s) %s are alive (kept or detached by the "
                "caller): their bytes may change once publishers reuse the memory",
                self.model,
                left,
            )
        if self._slot is not None:
            self.store.remove_batch(
                [
                    f"{self.records.prefix}hold/{self._slot}",
                    f"{self.records.prefix}slot/{self._slot}",
                ],
                force=True,
                return_exceptions=True,
            )
            self._slot = None

    def pull(self, into, version, dtype, strict: bool, stage_hook) -> PullResult:
        """:meth:`WeightSync.pull <mooncake_store.WeightSync.pull>`.

        Its docstring says what it does and raises.
        """
        self.timeline = tl = PullTimeline(self.store.internal.link)
        try:
            res = self._pull(into, version, dtype, strict, stage_hook)
        finally:
            events = tl.close()
        return res._replace(timeline=events)

    def _pull(self, into, version, dtype, strict: bool, stage_hook) -> PullResult:
        torch = _torch()
        tl = self.timeline
        view_mode = self.cfg.install == "view"
        if view_mode and into is not None and not isinstance(into, torch.nn.Module):
            raise ValueError(
                f"{self.model}: pull: install='view' needs into=nn.Module (its parameters take the views) "
                f"or None, got {type(into).__name__}"
            )
        targets = _target_dict(into, f"{self.model}: pull")
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(
                f"{self.model}: pull: dtype must be a floating-point torch.dtype or None (only "
                f"floating-point tensors are cast), got {dtype!r}"
            )
        prev = self.version
        # a different `into` than last time gets the held version too (it is not installed there yet)
        if into is None:
            same_into = self._into == "none"
        else:
            same_into = (
                isinstance(self._into, tuple)
                and self._into[0] == id(into)
                and (self._into[1] is None or self._into[1]() is into)
            )
        if version == "latest":
            v, pid = self.records.latest()
            tl.mark("latest", f"v{v}")
            if 0 <= v < prev and not self._warned_behind:
                self._warned_behind = True
                log.warning(
                    "%s: the store's latest version %d is below the held %d (its master "
                    "restarted without etcd and lost the versions?); keeping %d until a "
                    "version above it is published",
                    self.model,
                    v,
                    prev,
                    prev,
                )
            # the held number committed again by another publish (a master restart forgot
            # it): install that one, so that every reader's v holds the same bytes
            again = v == prev and None not in (pid, self.held_pid) and pid != self.held_pid
            if v < 0 or v < prev or (v == prev and same_into and not again):
                return PullResult(prev, prev, False, 0, None)
        elif isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            v = version
            if v < prev:
                raise StaleVersionError(
                    f"{self.model}: holds version {prev}; will not go back to {v}"
                )
            if v == prev and same_into:
                return PullResult(prev, prev, False, 0, None)
        else:
            raise ValueError(
                f"{self.model}: pull: version must be 'latest' or an int >= 0, got {version!r}"
            )
        kept = self.held_versions()  # viewed versions stay held while the new one is staged
        if not self._hold(kept + [v], verify=True) and view_mode:
            view_mode = (
                False  # every reader slot taken: unprotected memory must not be viewed; copy
            )
        tl.mark("hold")
        try:
            for attempt in range(3 if version == "latest" else 1):
                try:
                    staged, raw, nbytes, viewed = self._stage(
                        v, targets, dtype, strict, stage_hook, view_mode
                    )
                    break
                except (ObjectNotFoundError, WeightSyncAbortedError):
                    # "latest" dropped under us by a faster publisher: take the newer one
                    newer = self.records.latest_version() if version == "latest" else v
                    if attempt == 2 or newer <= v:
                        raise
                    v = newer
                    self._hold(kept + [v])
            handed = set()
            swap, swapped_out = self.cfg.install == "swap", {}
            self._view_targets = {k: e for k, e in self._view_targets.items() if e[0]() is not None}
            tl.mark("fetched")
            with torch.no_grad():
                for name, t in staged.items():
                    if name not in targets:
                        continue
                    tgt = targets[name]
                    e = self._view_targets.get(id(tgt))
                    is_view = (
                        e is not None and e[0]() is tgt and tgt.numel() and tgt.data_ptr() == e[1]
                    )
                    if name in viewed or is_view:
                        # a view goes in by reference; a copy replaces a view by reference too
                        # (the view's memory is read-only), in the target's dtype
                        targets[name].data = (
                            t if t.dtype == targets[name].dtype else t.to(targets[name].dtype)
                        )
                        handed.add(name)
                        if name in viewed:
                            self._view_targets[id(targets[name])] = (
                                weakref.ref(targets[name]),
                                t.data_ptr() if t.numel() else -1,
                            )
                        else:
                            self._view_targets.pop(id(targets[name]), None)
                    elif (
                        swap
                        and tgt.device == t.device
                        and tgt.dtype == t.dtype
                        and tgt.shape == t.shape
                        and tgt.stride() == t.stride()
                        and raw.get(name) is t
                    ):
                        # install="swap": the staged tensor becomes the target's storage, and
                        # the target's old storage stages the next pull
                        swapped_out[name] = tgt.data
                        tgt.data = t
                        handed.add(name)
                    else:
                        targets[name].copy_(t)
            # keep the staging tensors for the next pull (into given and they were not handed out)
            if into is not None and (dtype is None or raw is not staged):
                self._spare = {k: t for k, t in raw.items() if k not in handed and k not in viewed}
                self._spare.update(swapped_out)
            else:
                self._spare = {}
            staged = staged if into is None else None
            raw = None
            tl.mark("installed")
        finally:
            try:
                self._hold(self.held_versions())  # the new version if viewed, and views still alive
            except StoreError:
                pass
        if into is None:
            self._into = "none"
        else:
            try:
                self._into = (id(into), weakref.ref(into))
            except TypeError:  # a dict: its id alone (a reused id only costs an install skipped)
                self._into = (id(into), None)
        if self._refs and (self._refresher is None or not self._refresher.is_alive()):
            self._stop = threading.Event()
            self._refresher = threading.Thread(
                target=self._refresh_main, name="ws-hold", daemon=True
            )
            self._refresher.start()
        if v >= prev:
            self.version, self.held_pid = v, self._staged_pid
        self.lapsed_versions = [x for x in self.lapsed_versions if x in self.held_versions()]
        position = None if self.relay is None else self.relay.position
        return PullResult(v, prev, True, nbytes, staged, position)

    def _stage(
        self, v: int, targets: dict, dtype, strict: bool, stage_hook, view_mode: bool = False
    ) -> tuple:
        torch = _torch()
        vp = f"{self.records.prefix}v{v}/"
        try:
            commit = self.records.get_msg(vp + "commit")
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"{self.model}: version {v} cannot be read ({self._why_gone(v)})"
            ) from None
        tl = self.timeline
        tl.mark("records", "commit")
        n = int(commit["num_shards"])
        self._staged_pid = commit.get("pid")
        pp = vp + (
            f"{commit['pid']}/" if commit.get("pid") else ""
        )  # the committed publish's pieces only
        try:
            mans = [
                msgpack.unpackb(m, raw=False)
                for m in self.store.get_batch([f"{pp}m{s}" for s in range(n)])
            ]
        except ObjectNotFoundError as e:
            raise WeightSyncAbortedError(
                f"{self.model} v{v}: a manifest is missing ({e}); kept version {self.version}"
            ) from None
        tl.mark("records", "manifests")
        # full tensors, in the published dtype
        specs: dict = {}
        for m in mans:
            for p in m["pieces"]:
                spec = specs.setdefault(p["name"], [p["dtype"], p["gshape"], 0])
                if spec[0] != p["dtype"] or spec[1] != p["gshape"]:
                    raise WeightSyncAbortedError(
                        f"{self.model} v{v}: shards disagree on {p['name']!r}"
                    )
                c = 1
                for d in p["shape"]:
                    c *= d
                spec[2] += c
        if strict and targets and set(targets) != set(specs):
            missing, extra = sorted(set(specs) - set(targets)), sorted(set(targets) - set(specs))
            raise ValueError(
                f"{self.model} v{v}: names differ (not in into: {missing[:5]}; not published: "
                f"{extra[:5]}); kept version {self.version}"
            )
        staged = {}
        for name, (dt, gshape, count) in specs.items():
            numel = 1
            for d in gshape:
                numel *= d
            if count != numel:
                raise WeightSyncAbortedError(
                    f"{self.model} v{v}: pieces of {name!r} cover {count} of {numel} elements"
                )
            if name in targets and tuple(targets[name].shape) != tuple(gshape):
                raise ValueError(
                    f"{self.model} v{v}: {name!r} has shape {tuple(gshape)}, into has "
                    f"{tuple(targets[name].shape)}; kept version {self.version}"
                )
            pub, tdt = _dtype_of(dt), (targets[name].dtype if name in targets else None)
            if (
                tdt is not None
                and tdt != pub
                and not (tdt.is_floating_point and pub.is_floating_point)
            ):
                raise ValueError(
                    f"{self.model} v{v}: {name!r} is published as {pub}, into has {tdt} (only "
                    f"floating-point tensors are cast); kept version {self.version}"
                )
        buckets = [
            (b[0], b[1], [p for p in m["pieces"] if p["bucket"] == i])
            for m in mans
            for i, b in enumerate(m["buckets"])
        ]
        views: dict = {}  # name -> read-only tensor over the store's memory (install="view")
        if view_mode and buckets:
            import numpy as np

            bviews, _ = self.store.internal.local_views([b[0] for b in buckets])
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message="The given (buffer|NumPy array) is not writable"
                )
                for b, bv in zip(buckets, bviews):
                    if bv is None:
                        continue
                    for p in b[2]:
                        dt = _dtype_of(p["dtype"])
                        tgt = targets.get(p["name"])
                        if (
                            p["shape"] != p["gshape"]
                            or not p["nbytes"]
                            or p["boff"] + p["nbytes"] > len(bv)
                            or (dtype is not None and dt.is_floating_point and dt != dtype)
                            or (tgt is not None and tgt.dtype != dt)
                        ):
                            continue
                        if p["digest"] is not None:
                            flat = torch.frombuffer(
                                bv[p["boff"] : p["boff"] + p["nbytes"]], dtype=torch.uint8
                            )
                            if (
                                _piece_digest(flat, str(p["digest"]).partition(":")[0])
                                != p["digest"]
                            ):
                                raise WeightSyncAbortedError(
                                    f"{self.model} v{v}: checksum of {p['name']!r} differs; "
                                    f"kept version {self.version}"
                                )
                        # through a NumPy array: torch keeps it alive as long as any tensor
                        # shares the bytes, and its finalizer tells when none does
                        arr = np.frombuffer(bv[p["boff"] : p["boff"] + p["nbytes"]], dtype=np.uint8)
                        self._refs[v] = self._refs.get(v, 0) + 1
                        weakref.finalize(arr, _unref, self._refs, v)
                        views[p["name"]] = torch.from_numpy(arr).view(dt).reshape(p["gshape"])
        for name, (dt, gshape, _count) in specs.items():
            if name in views:
                staged[name] = views[name]
                continue
            spare = self._spare.pop(name, None)
            if (
                spare is not None
                and spare.dtype == _dtype_of(dt)
                and list(spare.shape) == list(gshape)
            ):
                staged[name] = spare  # the last pull's staging tensor: no fresh pages to fault in
            else:
                staged[name] = torch.empty(gshape, dtype=_dtype_of(dt))
        fetched = [b for b in buckets if any(p["name"] not in views for p in b[2])]
        total = sum(b[1] for b in buckets if b not in fetched)  # bytes viewed in place
        if self.relay is not None:  # this reader's copies of the version it relayed last
            self.relay.resign()
            self.relay = None
        sized = [b[0] for b in fetched if b[1]]
        if self.cfg.relay and sized:
            part = commit.get("part")
            part = part if isinstance(part, int) and part > 0 else self.cfg.relay_part_bytes
            self.relay = RelayPull.start(
                self.records, self.cfg, self.rid, vp, pp, sized[0], sum(b[1] for b in fetched), part
            )
        relay = self.relay
        if relay is None:
            tl.mark("role", "reads the publisher's pieces")

            def get_into(key, dst):  # staging memory: a failed read only costs this pull
                tl.first_byte(key[len(pp) :])
                self.store.internal.read_into(key, memoryview(dst.numpy()), scratch=True)
                return dst

        else:
            relay.timeline = tl
            tl.mark("role", relay.describe())
            get_into = relay.read_into
        # digests of the pieces of the buckets read in parts, taken part by part while the next
        # part is on the wire (bucket key -> _StreamDigests); the others are digested whole
        streamed: dict = {}

        def fetch(b):
            for attempt in range(
                3
            ):  # a copy that outlasted its read lease (a loaded host) is redone
                try:
                    return fetch_once(b)
                except LeaseExpiredError:
                    if attempt == 2:
                        raise

        def fetch_once(b):
            key, nb, pieces = b
            if relay is None or not nb:
                read = get_into
            else:
                dig = streamed[key] = _StreamDigests([p for p in pieces if p["name"] not in views])

                def read(key, dst):
                    return relay.read_into(key, dst, dig.feed)

            # a bucket that is one whole tensor is read straight into the staged tensor (a
            # relay's land in its copy, which is staged from there)
            if len(pieces) == 1 and pieces[0]["shape"] == pieces[0]["gshape"] and nb:
                return read(key, _byte_view(staged[pieces[0]["name"]]))
            buf = torch.empty(nb, dtype=torch.uint8)
            return read(key, buf) if nb else buf

        try:
            self._fetch_all(v, fetched, fetch, staged, views, stage_hook, streamed)
            if relay is not None:
                relay.finish()
        except BaseException:
            if relay is not None:  # the chain goes on without this reader
                try:
                    relay.resign()
                except StoreError:  # the master is out of reach too: the pull's error says why
                    pass
            raise
        total += sum(b[1] for b in fetched)
        raw = staged
        if dtype is not None:
            staged = {
                k: (t.to(dtype) if t.is_floating_point() and k not in views else t)
                for k, t in staged.items()
            }
        return staged, raw, total, set(views)

    def _why_gone(self, v: int) -> str:
        """Why a piece of committed version ``v`` was not found, as far as the master knows."""
        try:
            latest = self.records.latest_version()  # the master's records, not a segment's
            listed = v in self.records.committed_versions()
        except StoreError:
            return "the master is out of reach too"
        if v > latest:
            return f"it was never committed: the latest committed version is {latest}"
        if not listed:
            return "the version was dropped: newer ones were published"
        return (
            "the version is still listed as committed but its bytes are gone: the client "
            "whose segment held them (the publisher's) was declared lost, e.g. exited or its "
            "host cut off for longer than the master's client_ttl_s; publish a newer version"
        )

    def _fetch_all(self, v, fetched, fetch, staged, views, stage_hook, streamed) -> None:
        """Reads the buckets and checks every piece's digest.

        The next buckets are read while this one is checked and copied into the staged tensors.
        ``streamed``: bucket key -> the ``_StreamDigests`` its read fed (pieces digested on the way).
        """
        # two in flight for a relay too: transfers from one peer go one at a time over its
        # connection, so the copies still come in order, and the next bucket's requests to
        # the master (its copy's place, the source's metadata) overlap this one's transfer
        depth = _READS_IN_FLIGHT
        with concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="ws-get") as ex:
            futs = [ex.submit(fetch, b) for b in fetched[:depth]]
            for i, b in enumerate(fetched):
                try:
                    buf = futs[i].result()
                    self.timeline.mark("bucket", str(i))
                except ObjectNotFoundError as e:
                    raise WeightSyncAbortedError(
                        f"{self.model} v{v}: {e} ({self._why_gone(v)}); kept version {self.version}"
                    ) from None
                if stage_hook is not None:
                    stage_hook(i)
                if i + depth < len(fetched):
                    futs.append(ex.submit(fetch, fetched[i + depth]))
                futs[i] = None  # its buffer goes once staged
                for p in b[2]:
                    if p["name"] in views:
                        continue
                    piece = buf[p["boff"] : p["boff"] + p["nbytes"]]
                    if p["digest"] is not None:
                        got = streamed[b[0]].result(p) if b[0] in streamed else None
                        if got is None:
                            got = _piece_digest(piece, str(p["digest"]).partition(":")[0])
                        if got != p["digest"]:
                            raise WeightSyncAbortedError(
                                f"{self.model} v{v}: checksum of {p['name']!r} differs; "
                                f"kept version {self.version}"
                            )
                    dst = staged[p["name"]]
                    if piece.data_ptr() == (_byte_view(dst).data_ptr() if dst.numel() else -1):
                        continue  # read in place
                    if p["nbytes"]:
                        src = piece.view(dst.dtype).reshape(p["shape"])
                        dst[tuple(slice(o, o + s) for o, s in zip(p["offset"], p["shape"]))].copy_(
                            src
                        )
                self.timeline.mark("staged", str(i))
