"""The client's read path: the ``get`` request, copies from replicas, unreachable owners, leases.

The ``get`` metadata request (leases, waits for SSD loads on other hosts), copies from the first
replica that works (mapped segments of this host in one parallel copy, other hosts through the
transfer engine), segments whose owner could not be reached, and reads that outlast their lease.
"""

from __future__ import annotations

import sys
import threading
import time

import msgpack

from ..common.errors import (
    LeaseExpiredError,
    ObjectNotFoundError,
    TransferError,
)
from . import ssd
from .args import chunks, dedup, raise_first
from .config import StoreConfig
from .dataplane import DataPlane
from .link import Link

_LOAD_STALL_S = (
    1.0  # a batch read waiting for SSD loads on another host gives up this long after the last one
)
# Seconds for which reads skip a segment whose owner could not be reached (a failed
# connection): one wait for the first read that meets a dead or stopped owner, none for
# the reads after it, which go to other replicas or fail at once with TransferError.
UNREACHABLE_SKIP_S = 10.0


class ObjectMeta:
    """What the master says of one object in a ``get``.

    ``key``, ``size`` (bytes), ``version``, ``meta`` (the metadata bytes stored with it) and
    ``replicas``, first choice first: ``["m", segment name, offset]`` in memory,
    ``["s", host, path]`` on SSD.
    """

    __slots__ = ("key", "lease", "meta", "replicas", "size", "version")

    def __init__(self, key, size, version, meta, replicas, lease=None):
        self.key, self.size, self.version, self.meta, self.replicas = (
            key,
            size,
            version,
            meta,
            replicas,
        )
        self.lease = lease  # the master's lease generation, for the note that the read is done


def _batch_result(keys: list, out: list, deadline: float, return_exceptions: bool) -> list:
    """A batch read's results, with every read that ended after the lease turned into an error.

    That error is ``LeaseExpiredError``. The first error is raised unless ``return_exceptions``.
    """
    if time.monotonic() > deadline:
        out = [
            o
            if isinstance(o, BaseException)
            else LeaseExpiredError(f"the read of {k!r} outlasted its lease")
            for k, o in zip(keys, out)
        ]
    if not return_exceptions:
        raise_first(out)
    return out


def _connection_failed(e: BaseException) -> bool:
    """Whether a transfer-engine error is a failed connection to the peer.

    The binding raises the engine's ``PeerConnectionError`` as
    ``torch.distributed.DistNetworkError`` (torch is loaded wherever an engine is).
    """
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(e, dist.DistNetworkError)


class Reader:
    """Reads: their metadata requests (with read leases), and the copies out of the segments.

    Keys and buffers come checked (``args.py``).
    """

    def __init__(self, cfg: StoreConfig, link: Link, dataplane: DataPlane):
        self._cfg = cfg
        self._link = link
        self._dataplane = dataplane
        self._unreachable: dict = {}  # segment name -> time.monotonic() until which reads skip it
        self._unreachable_marks = 0  # how many times a segment was found unreachable
        # [key, version, lease generation] of reads done within their lease, sent with the next
        # get or exists request: the master may evict those objects before their leases end
        self._done: list = []
        self._done_lock = threading.Lock()  # a note sent twice would end another reader's lease

    def _finished(self, objs: list, deadline: float) -> None:
        """Notes that the reads of ``objs`` (None: skipped) are over, copies made or failed.

        Only within the lease: a note after it could end the lease another reader took since.
        """
        if not self._cfg.release_leases:
            return
        notes = [[o.key, o.version, o.lease] for o in objs if o is not None and o.lease]
        if notes and time.monotonic() < deadline:
            with self._done_lock:
                self._done += notes

    def _take_done(self, req: dict) -> dict:
        """``req`` with the pending notes of reads done (at most 1024), which leave the queue."""
        if self._done:
            with self._done_lock:
                req["done"], self._done = self._done[:1024], self._done[1024:]
        return req

    def _local_src(self, obj: ObjectMeta, segs: dict):
        """A view of ``obj``'s first replica when it is in a mapped segment, else None."""
        if obj.size == 0 or not obj.replicas or obj.replicas[0][0] != "m":
            return None
        desc = segs[obj.replicas[0][1]]
        if not self._dataplane.is_local(desc):
            return None
        try:
            view = self._dataplane.view(desc)
        except TransferError:
            return None
        off = obj.replicas[0][2]
        return view[off : off + obj.size]

    def _read_many(
        self, objs: list, segs: dict, outs: list | None = None, scratch: bool = False
    ) -> list:
        """Reads every object (None entries skipped), with one parallel copy for mapped segments.

        Returns bytes (``outs`` None) or None per object, or the ``TransferError`` in its place.
        ``scratch``: the caller throws ``outs`` away on any error, so reads from other hosts land in
        them directly (no temporary).
        """
        res: list = [None] * len(objs)
        local_i, local_src = [], []
        remote: dict = {}  # segment name -> indexes of objects whose first replica is there
        skipped = self._skipped()
        for i, obj in enumerate(objs):
            if obj is None:
                continue
            src = self._local_src(obj, segs)
            if src is not None:
                local_i.append(i)
                local_src.append(src)
            elif (
                obj.size
                and obj.replicas
                and obj.replicas[0][0] == "m"
                and obj.replicas[0][1] not in skipped
                and not self._dataplane.is_local(segs[obj.replicas[0][1]])
            ):
                remote.setdefault(obj.replicas[0][1], []).append(i)
            else:
                try:
                    res[i] = self._read_one(
                        obj, segs, None if outs is None else outs[i], skipped, scratch
                    )
                except TransferError as e:
                    res[i] = e
        for name, idx in remote.items():
            # one pipelined transfer-engine batch per segment; if it fails, each object
            # again on its own, through its other replicas (not through this segment again
            # when its owner could not be reached at all: each try would wait for the
            # engine's connect timeout)
            got, skip = None, skipped
            if len(idx) > 1:
                try:
                    host, port, region = self._dataplane.engine_for(segs[name])
                    got = self._dataplane.te.batch_read_bytes(
                        host,
                        port,
                        region,
                        [objs[i].replicas[0][2] for i in idx],
                        [objs[i].size for i in idx],
                    )
                except (TransferError, RuntimeError) as e:
                    got = None
                    # Unless the owner answered and refused one op (a live peer: a plain
                    # RuntimeError), its segment cannot be reached: no engine for it
                    # (TransferError) or a failed connection (DistNetworkError): a dead
                    # owner (each new connect would retry for 2 s) or a stopped one (each
                    # would wait 5 s for the handshake).
                    if not isinstance(e, RuntimeError) or _connection_failed(e):
                        self._mark_unreachable(name)
                        skip = skipped | {name}
            for j, i in enumerate(idx):
                try:
                    if got is None:
                        res[i] = self._read_one(
                            objs[i], segs, None if outs is None else outs[i], skip, scratch
                        )
                    elif outs is None:
                        res[i] = got[j]
                    else:
                        outs[i][:] = got[j]  # written only once the whole read worked
                except TransferError as e:
                    res[i] = e
        if local_i:
            if outs is None:
                for i, b in zip(local_i, self._dataplane.to_bytes(local_src)):
                    res[i] = b
            else:
                self._dataplane.copy([outs[i] for i in local_i], local_src)
        return res

    def _skipped(self) -> frozenset:
        """Segments that reads skip now.

        Their owner could not be reached within the last ``UNREACHABLE_SKIP_S`` seconds.
        """
        if not self._unreachable:
            return frozenset()
        now = time.monotonic()
        for name, until in list(self._unreachable.items()):
            if until < now:
                self._unreachable.pop(name, None)
        return frozenset(self._unreachable)

    def _mark_unreachable(self, name: str):
        self._unreachable[name] = time.monotonic() + UNREACHABLE_SKIP_S
        self._unreachable_marks += 1

    def _leased(self, read):
        """``read() -> (result, deadline)``, run once more when it outlasted its read lease.

        It runs again while a segment owner was found unreachable: the first try waited for that
        owner (up to the transfer engine's timeouts, longer than a lease), and its results must not
        be used (``LeaseExpiredError``); the second try gets a new lease and skips that segment
        (other replicas, or ``TransferError`` at once).
        """
        marks = self._unreachable_marks
        res = read()
        if time.monotonic() > res[-1] and self._unreachable_marks != marks:
            res = read()
        return res

    def _read_one(
        self,
        obj: ObjectMeta,
        segs: dict,
        out: memoryview | None = None,
        skip: frozenset = frozenset(),
        scratch: bool = False,
    ):
        """Copies ``obj`` into ``out`` from the first replica that works.

        No replica in a segment named in ``skip`` (found unreachable just before) is tried; with
        ``out=None`` returns a new ``bytes`` (one copy). ``scratch``: a read from another host goes
        into ``out`` directly (it may hold part of the bytes after a failed transfer).
        """
        if obj.size == 0:  # empty objects have no replica (they live in the master alone)
            return b"" if out is None else None
        errors = []
        for rep in obj.replicas:
            try:
                if rep[0] == "m" and rep[1] in skip:
                    raise TransferError(
                        f"segment {rep[1]!r}: its owner could not be reached (within the last "
                        f"{UNREACHABLE_SKIP_S:g} s)"
                    )
                if rep[0] == "m":
                    desc = segs[rep[1]]
                    if obj.size == 0:
                        return b"" if out is None else None
                    off = rep[2]
                    if self._dataplane.is_local(desc):
                        src = self._dataplane.view(desc)[off : off + obj.size]
                        if out is None:
                            return bytes(src)
                        out[:] = src
                        return None
                    host, port, region = self._dataplane.engine_for(desc)
                    try:
                        if scratch and out is not None:
                            self._dataplane.te.batch_read(
                                host, port, region, [off], [out[: obj.size]]
                            )
                            return None
                        data = self._dataplane.te.batch_read_bytes(
                            host, port, region, [off], [obj.size]
                        )[0]
                        if out is None:
                            return data
                        out[:] = (
                            data  # the caller's buffer is written only once the whole read worked
                        )
                        return None
                    except RuntimeError as e:
                        if _connection_failed(e):
                            self._mark_unreachable(rep[1])
                        raise TransferError(f"read from {host}:{port} failed: {e}") from None
                else:
                    if rep[1] != self._cfg.host_id:
                        raise TransferError(
                            "SSD replica on another host could not be loaded into memory"
                        )
                    try:
                        if out is None:
                            buf = bytearray(obj.size)
                            ssd.read_into(rep[2], obj.key, obj.version, buf)
                            return bytes(buf)
                        ssd.read_into(rep[2], obj.key, obj.version, out)
                        return None
                    except ssd.CorruptError:
                        self._link.report_corrupt(obj.key, obj.version, rep[2])
                        raise
            except TransferError as e:
                errors.append(str(e))
        if not obj.replicas:
            raise TransferError(f"{obj.key!r} has no replica left")
        raise TransferError(f"no replica of {obj.key!r} could be read: " + "; ".join(errors))

    def meta(self, keys: list) -> tuple:
        """``(objects, segments, deadline)`` of checked ``keys``.

        Per key an :class:`ObjectMeta` (None: missing), the descriptors of the segments holding them
        by name, and the ``time.monotonic()`` at which the read leases this request took end. Waits
        (up to ``rpc_timeout_s``) while the master loads objects that lie only on another host's SSD
        into memory.
        """
        parts = list(chunks(keys))
        if len(parts) > 1:
            objs, segs, deadline = [], {}, float("inf")
            for a, b in parts:
                o, sg, d = self.meta(keys[a:b])
                objs += o
                segs.update(sg)
                deadline = min(deadline, d)
            return objs, segs, deadline
        give_up = time.monotonic() + self._cfg.rpc_timeout_s
        ready, progress_at = -1, time.monotonic()
        while True:
            sent = []
            res = self._link.call(
                "get",
                self._take_done({"client": self._link.client_id, "keys": keys}),
                sent_at=sent,
            )
            t0 = sent[0]
            # an object only on another host's SSD is being loaded into memory: ask again
            waiting = sum(1 for o in res["objs"] if o is not None and o[4])
            now = time.monotonic()
            if not waiting or now > give_up:
                break
            if len(keys) - waiting != ready:
                ready, progress_at = len(keys) - waiting, now
            elif ready > 0 and now - progress_at > _LOAD_STALL_S:
                # loads stopped while part is ready: the owner's memory is full of this very
                # batch (leased by these requests), so waiting longer cannot help; the rest
                # fails with TransferError (else a KV get of a long prefix on another host's
                # SSD would wait rpc_timeout_s for nothing)
                break
            time.sleep(0.01)
        deadline = t0 + res["ttl_ms"] / 1000.0
        objs = [
            None
            if o is None
            else ObjectMeta(k, o[0], o[1], o[2], o[3], o[5] if len(o) > 5 else None)
            for k, o in zip(keys, res["objs"])
        ]
        if self._cfg.test_pause and self._cfg.test_pause[0] == "get":
            time.sleep(self._cfg.test_pause[1])
        return objs, res["segs"], deadline

    @staticmethod
    def _check_lease(deadline: float, key: str):
        if time.monotonic() > deadline:
            raise LeaseExpiredError(
                f"the read of {key!r} outlasted its lease; the bytes may have been evicted meanwhile"
            )

    def local_views(self, keys: list) -> tuple:
        """``(views, deadline)``: per checked key a read-only view of the value on this host.

        The view is a ``memoryview`` of the value's first replica where it lies in memory on this
        host (this client's own segment included, through a read-only mapping of it), else ``None``
        (also for a missing key); ``deadline`` is the ``time.monotonic()`` at which the read lease
        ends. No copy: the bytes stay the store's, valid while the object is not removed (the caller
        protects them, e.g. ``WeightSync`` holds). A view of another client's segment keeps its
        mapping alive after the segment goes away.
        """
        objs, segs, deadline = self.meta(keys)
        out = []
        for obj in objs:
            view = None
            if obj is not None and obj.replicas and obj.replicas[0][0] == "m":
                desc = segs[obj.replicas[0][1]]
                if self._dataplane.is_local(desc):
                    try:
                        # this client's own segment too goes through a read-only mapping:
                        # a view handed out must not be writable in the owner either
                        base = self._dataplane.readonly_view(desc)
                        off = obj.replicas[0][2]
                        view = base[off : off + obj.size]
                    except TransferError:
                        view = None
            out.append(view)
        return out, deadline

    def _read_tensors(self, keys: list) -> tuple:
        """One try of :meth:`get_tensor_batch`: ``(results, lease deadline)``."""
        import torch

        objs, segs, deadline = self.meta(keys)
        out: list = []
        todo, views = [], []
        for k, obj in zip(keys, objs):
            todo.append(None)
            views.append(None)
            if obj is None:
                out.append(ObjectNotFoundError(f"key {k!r} not found"))
                continue
            try:
                meta = msgpack.unpackb(obj.meta, raw=False) if obj.meta else None
                dtype = getattr(torch, meta["dtype"]) if isinstance(meta, dict) else None
                if not isinstance(dtype, torch.dtype):
                    raise ValueError
                shape = [int(d) for d in meta["shape"]]
            except Exception:
                out.append(ValueError(f"{k!r} was not stored by put_tensor"))
                continue
            t = torch.empty(shape, dtype=dtype)
            if t.numel() * t.element_size() != obj.size:
                out.append(
                    ValueError(f"{k!r}: stored size {obj.size} does not match {dtype} {shape}")
                )
                continue
            out.append(t)
            if obj.size:
                todo[-1] = obj
                views[-1] = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        got = self._read_many(todo, segs, views)
        self._finished(objs, deadline)
        return [g if isinstance(g, BaseException) else o for o, g in zip(out, got)], deadline

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        """:meth:`MooncakeStore.get <mooncake_store.MooncakeStore.get>` of a checked key."""

        def read():
            (obj,), segs, deadline = self.meta([key])
            if obj is None:
                raise ObjectNotFoundError(f"key {key!r} not found")
            got = self._read_many([obj], segs)[0]
            self._finished([obj], deadline)
            return got, deadline

        out, deadline = self._leased(read)
        if isinstance(out, BaseException):
            raise out
        self._check_lease(deadline, key)
        return out

    def get_batch(self, keys: list, return_exceptions: bool) -> list:
        """``MooncakeStore.get_batch`` of checked keys (a key may repeat)."""
        uniq, pos = dedup(keys)
        if pos is not None:
            res = self.get_batch(uniq, True)
            out = [res[j] for j in pos]  # bytes: the same object at each position
            if not return_exceptions:
                raise_first(out)
            return out

        def read():
            objs, segs, deadline = self.meta(keys)
            got = self._read_many(objs, segs)
            self._finished(objs, deadline)
            return [
                ObjectNotFoundError(f"key {k!r} not found") if obj is None else g
                for k, obj, g in zip(keys, objs, got)
            ], deadline

        out, deadline = self._leased(read)
        return _batch_result(keys, out, deadline, return_exceptions)

    def get_into(
        self, key: str, mv: memoryview, scratch: bool = False, offset: int | None = None
    ) -> int:
        """``MooncakeStore.get_into`` of a checked key and buffer; returns the bytes read.

        Args:
            key: the checked key.
            mv: the checked buffer, a flat writable byte view.
            scratch: the caller throws the buffer away on any error (a staging buffer), so a read
                from another host's segment lands in it directly, without the temporary that keeps
                it untouched on a failed transfer (one copy less per byte).
            offset: reads bytes ``[offset, offset + len(mv))`` of the value (from its replicas in
                memory only) instead of all of it; ``ValueError`` when they are not all within it.
        """

        def read():
            (obj,), segs, deadline = self.meta([key])
            if obj is None:
                raise ObjectNotFoundError(f"key {key!r} not found")
            if offset is not None:
                if offset < 0 or offset + len(mv) > obj.size:
                    raise ValueError(
                        f"get_into: bytes [{offset}, {offset + len(mv)}) of {key!r} are not all "
                        f"within its {obj.size} bytes (nothing written)"
                    )
                reps = [(r[0], r[1], r[2] + offset) for r in obj.replicas if r[0] == "m"]
                obj = ObjectMeta(obj.key, len(mv), obj.version, obj.meta, reps, obj.lease)
            elif obj.size > len(mv):
                raise ValueError(
                    f"get_into: buffer of {len(mv)} bytes is too small for {key!r} "
                    f"({obj.size} bytes; nothing written)"
                )
            (err,) = self._read_many([obj], segs, [mv[: obj.size]], scratch)
            self._finished([obj], deadline)
            return obj.size, err, deadline

        size, err, deadline = self._leased(read)
        if isinstance(err, BaseException):
            raise err
        self._check_lease(deadline, key)
        return size

    def get_into_batch(self, keys: list, mvs: list, return_exceptions: bool) -> list:
        """``MooncakeStore.get_into_batch`` of checked keys and buffers.

        A key may repeat: each of its buffers receives the value, one request per repetition.
        """
        if len(set(keys)) != len(keys):
            # rounds of distinct keys: the n-th occurrences of each key together
            seen: dict = {}
            rounds: dict = {}
            for i, k in enumerate(keys):
                n = seen[k] = seen.get(k, -1) + 1
                rounds.setdefault(n, []).append(i)
            out: list = [None] * len(keys)
            for idx in rounds.values():
                res = self.get_into_batch([keys[i] for i in idx], [mvs[i] for i in idx], True)
                for i, r in zip(idx, res):
                    out[i] = r
            if not return_exceptions:
                raise_first(out)
            return out

        def read():
            objs, segs, deadline = self.meta(keys)
            out: list = [None] * len(keys)
            todo = [None] * len(keys)
            for i, (k, obj, mv) in enumerate(zip(keys, objs, mvs)):
                if obj is None:
                    out[i] = ObjectNotFoundError(f"key {k!r} not found")
                elif obj.size > len(mv):
                    out[i] = ValueError(
                        f"get_into_batch: buffer of {len(mv)} bytes is too small for {k!r} "
                        f"({obj.size} bytes; nothing written)"
                    )
                else:
                    todo[i] = obj
            got = self._read_many(
                todo, segs, [mv[: o.size] if o is not None else None for mv, o in zip(mvs, todo)]
            )
            self._finished(todo, deadline)
            for i, obj in enumerate(todo):
                if obj is not None:
                    out[i] = got[i] if isinstance(got[i], BaseException) else obj.size
            return out, deadline

        out, deadline = self._leased(read)
        return _batch_result(keys, out, deadline, return_exceptions)

    def get_tensors(self, keys: list, return_exceptions: bool) -> list:
        """``MooncakeStore.get_tensor_batch`` of checked keys.

        A key may repeat: each further position gets its own copy, a clone.
        """
        import torch

        uniq, pos = dedup(keys)
        if pos is not None:
            res = self.get_tensors(uniq, True)
            out, used = [], set()
            for j in pos:
                r = res[j]
                if j in used and isinstance(r, torch.Tensor):
                    r = r.clone()
                used.add(j)
                out.append(r)
            if not return_exceptions:
                raise_first(out)
            return out
        out, deadline = self._leased(lambda: self._read_tensors(keys))
        return _batch_result(keys, out, deadline, return_exceptions)

    def exists_meta(self, keys: list, touch: bool = False) -> list:
        """Per checked key ``None`` if it does not exist, else the metadata stored with it.

        The metadata is bytes: what ``put_tensor`` records, ``b""`` for plain values; or ``True``
        where the master does not send metadata (an older master). From the master alone: no lease,
        no bytes read, nothing loaded from SSD. ``touch``: the keys found count as used (LRU).
        """
        uniq, pos = dedup(keys)
        out: list = []
        for a, b in chunks(uniq):
            req = self._take_done({"keys": uniq[a:b], "meta": True})
            if touch:
                req["touch"] = True
            r = self._link.call("exists", req)
            metas = r.get("meta")
            if not isinstance(metas, list) or len(metas) != len(r["exists"]):
                metas = [True if e else None for e in r["exists"]]
            out += [m if e else None for e, m in zip(r["exists"], metas)]
        return out if pos is None else [out[j] for j in pos]
