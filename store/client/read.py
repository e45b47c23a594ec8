"""The client's read path: the ``get`` metadata request (leases, waits for SSD loads on
other hosts), copies from the first replica that works (mapped segments of this host in one
parallel copy, other hosts through the transfer engine), segments whose owner could not be
reached, and reads that outlast their lease.

Mixed into :class:`~mooncake_store.MooncakeStore`, whose ``__init__`` sets the state these
methods use (``cfg``, ``_te``, ``_fast``, ``_unreachable``, ...).
"""

from __future__ import annotations

import sys
import time

import msgpack

from ..common.errors import (
    LeaseExpiredError,
    ObjectNotFoundError,
    TransferError,
)
from . import ssd
from .args import check_keys, chunks, raise_first

_LOAD_STALL_S = (
    1.0  # a batch read waiting for SSD loads on another host gives up this long after the last one
)
_FAST_COPY_BYTES = 64 << 10  # copies from this size on go through the parallel C++ copy
# Seconds for which reads skip a segment whose owner could not be reached (a failed
# connection): one wait for the first read that meets a dead or stopped owner, none for
# the reads after it, which go to other replicas or fail at once with TransferError.
UNREACHABLE_SKIP_S = 10.0


class _Obj:
    __slots__ = ("key", "meta", "replicas", "size", "version")

    def __init__(self, key, size, version, meta, replicas):
        self.key, self.size, self.version, self.meta, self.replicas = (
            key,
            size,
            version,
            meta,
            replicas,
        )


def _batch_result(keys: list, out: list, deadline: float, return_exceptions: bool) -> list:
    """A batch read's results: every read that ended after the lease becomes a
    ``LeaseExpiredError``; the first error is raised unless ``return_exceptions``."""
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
    """Whether a transfer-engine error is a failed connection to the peer: the binding
    raises the engine's ``PeerConnectionError`` as ``torch.distributed.DistNetworkError``
    (torch is loaded wherever an engine is)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(e, dist.DistNetworkError)


class _ReadMixin:
    """Metadata of reads, and the copies out of the segments."""

    def _local_src(self, obj: _Obj, segs: dict):
        """A view of ``obj``'s first replica when it is in a mapped segment, else None."""
        if obj.size == 0 or not obj.replicas or obj.replicas[0][0] != "m":
            return None
        desc = segs[obj.replicas[0][1]]
        if not self._is_local(desc):
            return None
        try:
            view = self._seg_view(desc)
        except TransferError:
            return None
        off = obj.replicas[0][2]
        return view[off : off + obj.size]

    def _read_many(
        self, objs: list, segs: dict, outs: list | None = None, scratch: bool = False
    ) -> list:
        """Reads every object (None entries skipped) with one parallel copy for those in
        mapped segments; returns bytes (``outs`` None) or None per object, or the
        ``TransferError`` in its place. ``scratch``: the caller throws ``outs`` away on any
        error, so reads from other hosts land in them directly (no temporary)."""
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
                and not self._is_local(segs[obj.replicas[0][1]])
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
                    host, port, region = self._te_for(segs[name])
                    got = self._te.batch_read_bytes(
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
            total = sum(len(v) for v in local_src)
            fast = self._fast is not None and total >= _FAST_COPY_BYTES
            if outs is None:
                got = self._fast.copy_to_bytes(local_src) if fast else [bytes(v) for v in local_src]
                for i, b in zip(local_i, got):
                    res[i] = b
            else:
                dsts = [outs[i] for i in local_i]
                if fast:
                    self._fast.copy_buffers(dsts, local_src)
                else:
                    for d, v in zip(dsts, local_src):
                        d[:] = v
        return res

    def _skipped(self) -> frozenset:
        """Segments that reads skip now: their owner could not be reached within the
        last ``UNREACHABLE_SKIP_S`` seconds."""
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
        """``read() -> (result, deadline)``, run once more when it outlasted its read lease
        while a segment owner was found unreachable: the first try waited for that owner
        (up to the transfer engine's timeouts, longer than a lease), and its results must
        not be used (``LeaseExpiredError``); the second try gets a new lease and skips that
        segment (other replicas, or ``TransferError`` at once)."""
        marks = self._unreachable_marks
        res = read()
        if time.monotonic() > res[-1] and self._unreachable_marks != marks:
            res = read()
        return res

    def _read_one(
        self,
        obj: _Obj,
        segs: dict,
        out: memoryview | None = None,
        skip: frozenset = frozenset(),
        scratch: bool = False,
    ):
        """Copies ``obj`` into ``out`` from the first replica that works (none in a segment
        named in ``skip``: found unreachable just before); with ``out=None`` returns a new
        ``bytes`` (one copy). ``scratch``: a read from another host goes into ``out``
        directly (it may hold part of the bytes after a failed transfer)."""
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
                    if self._is_local(desc):
                        src = self._seg_view(desc)[off : off + obj.size]
                        if out is None:
                            return bytes(src)
                        out[:] = src
                        return None
                    host, port, region = self._te_for(desc)
                    try:
                        if scratch and out is not None:
                            self._te.batch_read(host, port, region, [off], [out[: obj.size]])
                            return None
                        data = self._te.batch_read_bytes(host, port, region, [off], [obj.size])[0]
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
                    if rep[1] != self.cfg.host_id:
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
                        self._report_corrupt(obj.key, obj.version, rep[2])
                        raise
            except TransferError as e:
                errors.append(str(e))
        if not obj.replicas:
            raise TransferError(f"{obj.key!r} has no replica left")
        raise TransferError(f"no replica of {obj.key!r} could be read: " + "; ".join(errors))

    def _get_meta(self, keys: list):
        parts = list(chunks(keys))
        if len(parts) > 1:
            objs, segs, deadline = [], {}, float("inf")
            for a, b in parts:
                o, sg, d = self._get_meta(keys[a:b])
                objs += o
                segs.update(sg)
                deadline = min(deadline, d)
            return objs, segs, deadline
        give_up = time.monotonic() + self.cfg.rpc_timeout_s
        ready, progress_at = -1, time.monotonic()
        while True:
            sent = []
            res = self._call("get", {"client": self.client_id, "keys": keys}, sent_at=sent)
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
                # fails with TransferError (a KV get of a long prefix on another host's SSD
                # waited rpc_timeout_s for nothing, found by a trial)
                break
            time.sleep(0.01)
        deadline = t0 + res["ttl_ms"] / 1000.0
        objs = [
            None if o is None else _Obj(k, o[0], o[1], o[2], o[3])
            for k, o in zip(keys, res["objs"])
        ]
        if self.cfg.test_pause and self.cfg.test_pause[0] == "get":
            time.sleep(self.cfg.test_pause[1])
        return objs, res["segs"], deadline

    @staticmethod
    def _check_lease(deadline: float, key: str):
        if time.monotonic() > deadline:
            raise LeaseExpiredError(
                f"the read of {key!r} outlasted its lease; the bytes may have been evicted meanwhile"
            )

    def _local_views(self, keys: list) -> tuple:
        """``(views, deadline)``: per key a read-only ``memoryview`` of the value's first
        replica where it lies in memory on this host (this client's own segment
        included, through a read-only mapping of it), else ``None`` (also for a missing key); ``deadline`` is the
        ``time.monotonic()`` at which the read lease ends. No copy: the bytes stay the
        store's, valid while the object is not removed (the caller protects them, e.g.
        ``WeightSync`` holds). A view of another client's segment keeps its mapping alive
        after the segment goes away."""
        objs, segs, deadline = self._get_meta(check_keys(keys, "local_views"))
        out = []
        for obj in objs:
            view = None
            if obj is not None and obj.replicas and obj.replicas[0][0] == "m":
                desc = segs[obj.replicas[0][1]]
                if self._is_local(desc):
                    try:
                        # this client's own segment too goes through a read-only mapping:
                        # a view handed out must not be writable in the owner either
                        base = self._ro_maps.get(desc).view
                        off = obj.replicas[0][2]
                        view = base[off : off + obj.size]
                    except TransferError:
                        view = None
            out.append(view)
        return out, deadline

    def _read_tensors(self, keys: list) -> tuple:
        """One try of :meth:`get_tensor_batch`: ``(results, lease deadline)``."""
        import torch

        objs, segs, deadline = self._get_meta(keys)
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
        return [g if isinstance(g, BaseException) else o for o, g in zip(out, got)], deadline
