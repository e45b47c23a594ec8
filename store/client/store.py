"""``MooncakeStore``: the client of the store (see docs/design.md "Store").

A client optionally contributes a shared-memory segment (and an SSD directory); the
master places objects in segments; data moves from client to client: segments of the
same host are mapped and copied directly, others go through the TCP transfer engine
(``mooncake_pg.transfer.TransferEngine``).

``MooncakeStore`` holds the public API and the client's state; its parts are mixed in:
``link.py`` (metadata requests, failover, heartbeats, the master's tasks), ``read.py``
(the read path) and ``write.py`` (puts, put reservations); ``args.py`` checks arguments.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import sys
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ..common import protocol
from ..common.config import parse_hostport
from ..common.errors import (
    ObjectNotFoundError,
    StoreError,
    TransferError,
    from_code,
)
from ..master import MasterConfig
from . import ssd
from .args import (
    as_bytes_view,
    check_config,
    check_force,
    check_key,
    check_keys,
    chunks,
    copyable,
    dedup,
    is_tensor,
    raise_first,
    tensor_bytes,
    writable_view,
)
from .config import ReplicateConfig, StoreConfig
from .link import _LinkMixin
from .read import _batch_result, _Obj, _ReadMixin
from .segment import LocalSegment, SegmentCache, tune_malloc
from .write import _Reservation, _WriteMixin

if TYPE_CHECKING:
    import torch

    from .args import BytesLike, WritableBuffer

log = logging.getLogger("mooncake_store")

_DEFAULT_REPLICATE = ReplicateConfig()


class Placement(NamedTuple):
    """Where an object lives: names of the segments holding it in memory, and of the
    clients holding it on SSD."""

    memory: list
    ssd: list


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """The master's figures (counters since the master started).

    Attributes: objects (committed), pending (puts in progress), used_bytes and
    capacity_bytes (of all segments; bytes), clients, segments, deferred (allocations
    waiting for a lease to end before reuse), ssd_objects (objects with an SSD copy), puts,
    gets (lookups of keys that exist, the same count as hits), hits, misses, evictions
    (objects whose memory copies were evicted), offloads (objects written to SSD; failed
    writes not counted), removes, put_aborts, clients_lost (declared dead), ssd_drops
    (objects dropped from a full SSD directory, ``StoreConfig.ssd_max_bytes``),
    reserved_bytes (part of used_bytes: space reserved for clients' next puts,
    ``StoreConfig.put_reservation_bytes``), ssd_corrupt (SSD replicas dropped because their
    file was missing or failed its checksum)."""

    objects: int
    pending: int
    used_bytes: int
    capacity_bytes: int
    clients: int
    segments: int
    deferred: int
    ssd_objects: int
    puts: int
    gets: int
    hits: int
    misses: int
    evictions: int
    offloads: int
    removes: int
    put_aborts: int
    clients_lost: int
    ssd_drops: int
    reserved_bytes: int = 0
    ssd_corrupt: int = 0


def _close_at_exit(ref):
    store = ref()
    if store is not None:
        store._close_at_exit()


class MooncakeStore(_LinkMixin, _ReadMixin, _WriteMixin):
    """A client of the store. ``MooncakeStore()`` alone starts an embedded master.

    Thread-safe: calls from several threads are serialised on one metadata connection
    (data copies run outside that lock). Keys are non-empty ``str`` (at most 4096 bytes
    of UTF-8); values are bytes-like objects (``bytes``, ``bytearray``, ``memoryview``,
    NumPy arrays) or CPU tensors through ``put_tensor``. Reads hold a lease of
    ``MasterConfig.lease_ttl_s`` (default 5 s): a copy that finishes after it raises
    :class:`LeaseExpiredError` instead of returning bytes that may have been evicted.

    Options: a :class:`StoreConfig`, or its fields as keywords
    (``MooncakeStore(master="127.0.0.1:50051", segment_size=1 << 30)``).
    Raises ``ValueError`` for bad options; ``StoreError`` if no master answers.
    """

    def __init__(self, config: StoreConfig | None = None, **kw: Any):
        if config is not None and kw:
            raise ValueError("pass either a StoreConfig or keyword options, not both")
        if config is not None and not isinstance(config, StoreConfig):
            raise ValueError(
                "MooncakeStore: config must be a StoreConfig (or pass its fields as keywords), "
                f"got {type(config).__name__}"
            )
        cfg = (config if config is not None else StoreConfig(**kw)).resolved()
        self.cfg = cfg
        self.name = cfg.name
        serve_tcp = cfg.serve_tcp
        self.client_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._closed = False
        self._gave_up: tuple | None = (
            None  # (when, why) of the last metadata call that gave up (link.py)
        )
        self._conn: protocol.Connection | None = None
        self._etcd = None
        self._etcd_error: str | None = (
            None  # why etcd could not be asked who leads, when it could not
        )
        self._embedded = None
        self._segment: LocalSegment | None = None
        self._te = None
        self._te_region = None
        self._maps = SegmentCache(prefault=cfg.prefault)
        self._close_hooks: list = []  # weakref.WeakMethod, run by close() and at exit
        self._exiting = False
        self._ro_maps = SegmentCache(prefault=cfg.prefault, readonly=True)  # for _local_views
        self._fast = None  # mooncake_pg.transfer (parallel C++ copies) when loaded
        self._lease_ttl = 5.0
        self._client_ttl = (
            5.0  # the master's client_ttl_s (from register): heartbeats must reach it within
        )
        self._epoch = -1
        # one-round-trip puts (Core.reserve / Core.put): the reservation this client fills
        self._resv: _Reservation | None = None
        self._resv_lock = (
            threading.Lock()
        )  # held from placing a put in the reservation to its commit
        self._resv_refused = (
            0.0,
            0,
        )  # (until when, for requests of at least how many bytes) not to ask again
        # segments where this client may still hold a reservation it no longer knows the
        # extent of (its commit request failed): given back as a whole with the next request
        self._resv_orphans: set = set()
        self._resv_rid = 0
        self._warm_job: tuple | None = None  # (offset, bytes) of this client's segment to warm up
        self._warm_evt = threading.Event()
        self._warm_thread: threading.Thread | None = None
        self._session = 0  # counts connections to a master: a reservation is valid only in its own
        self._unreachable: dict = {}  # segment name -> time.monotonic() until which reads skip it
        self._unreachable_marks = 0  # how many times a segment was found unreachable
        if cfg.tune_malloc:
            tune_malloc()
        if cfg.master is None and cfg.etcd is None:
            from ..master import Master

            mc = cfg.master_config or MasterConfig(secret=cfg.secret)
            self._embedded = Master(mc).start()
            cfg.master = self._embedded.address
        try:
            if cfg.segment_size:
                phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                if (
                    cfg.prefault and cfg.segment_size > phys
                ):  # it would be committed at once, until memory ran out
                    raise ValueError(
                        f"segment_size of {cfg.segment_size} bytes is more than this machine's memory "
                        f"({phys} bytes), and prefault commits it at start"
                    )
                self._segment = LocalSegment(
                    self.name, cfg.segment_size, prefault=cfg.prefault, huge_pages=cfg.huge_pages
                )
            if serve_tcp or cfg.transfer == "tcp":
                self._start_te(serve=serve_tcp and self._segment is not None)
            if self._te is not None or "torch" in sys.modules:
                try:
                    from mooncake_pg import transfer as _fast

                    self._fast = _fast
                except ImportError:  # the extension is not built: plain memoryview copies
                    pass
            if cfg.ssd_dir:
                self._ssd_lock = ssd.lock_dir(cfg.ssd_dir)
            self._register()
        except BaseException:
            self._teardown()
            raise
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._task_thread = threading.Thread(
            target=self._task_main, name="mooncake-store-tasks", daemon=True
        )
        self._task_thread.start()
        self._poll_thread = threading.Thread(
            target=self._poll_main, name="mooncake-store-heartbeat", daemon=True
        )
        self._poll_thread.start()
        # a process that exits without close() unregisters anyway, so that nobody places
        # objects in its vanished segment until its heartbeat times out
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ set-up
    @property
    def master_address(self) -> str:
        """``HOST:PORT`` of the master in use (the embedded one's, if embedded)."""
        return self.cfg.master if self.cfg.etcd is None else (self._resolve() or "")

    def _start_te(self, serve: bool):
        from mooncake_pg.transfer import TransferEngine

        host = ""
        if serve:
            host = self.cfg.listen_host
            if host is None:
                mhost = (
                    parse_hostport(self.cfg.master, "master")[0] if self.cfg.master else "127.0.0.1"
                )
                host = TransferEngine.local_address_for(mhost, self.cfg.ifname or "")
        self._te = TransferEngine(listen_host=host, secret=self.cfg.secret or "")
        if serve:
            self._te_region = self._te.register_memory(self._segment.view)

    def _te_desc(self):
        if self._te is None or self._te_region is None:
            return None
        return [self._te.host, self._te.port, self._te_region]

    # ------------------------------------------------------------------ data movement
    def _is_local(self, desc: dict) -> bool:
        return self.cfg.transfer == "auto" and desc.get("host") == self.cfg.host_id

    def _seg_view(self, desc: dict) -> memoryview:
        if self._segment is not None and desc["name"] == self.name:
            return self._segment.view
        return self._maps.get(desc).view

    def _te_for(self, desc):
        te = desc.get("te")
        if not te:
            raise TransferError(
                f"segment {desc['name']!r} is on another host and serves no transfer engine"
            )
        if self._te is None:
            with self._lock:
                if self._te is None:
                    self._start_te(serve=False)
        return te

    # ------------------------------------------------------------------ puts

    def put(self, key: str, value: BytesLike, config: ReplicateConfig = _DEFAULT_REPLICATE) -> int:
        """Stores ``value`` (bytes-like, ``b""`` allowed) under ``key``.

        Returns how many replicas were placed (``config.replica_num`` or fewer when fewer
        segments can hold it). Raises ``ObjectExistsError`` if the key exists or is being
        written (use :meth:`upsert`), ``ReplicaShortfallError`` (``require_all``; nothing
        stored), ``NoSpaceError``, ``TransferError``, ``PutLostError`` (the master no longer
        knows the put: it outlasted ``put_ttl_s``, or a leader change lost it; nothing
        stored); ``ValueError`` for bad arguments (before anything is sent)."""
        return self._put_many(
            [check_key(key, "put")],
            [as_bytes_view(value, "put: value")],
            [b""],
            check_config(config, "put"),
            False,
            False,
        )[0]

    def upsert(
        self, key: str, value: BytesLike, config: ReplicateConfig = _DEFAULT_REPLICATE
    ) -> int:
        """Like :meth:`put`, but replaces an existing value (any size). Readers see the
        old value until the new one is complete. Returns the replicas placed."""
        return self._put_many(
            [check_key(key, "upsert")],
            [as_bytes_view(value, "upsert: value")],
            [b""],
            check_config(config, "upsert"),
            True,
            False,
        )[0]

    def put_batch(
        self,
        keys: Sequence[str],
        values: Sequence[BytesLike],
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
        return_exceptions: bool = False,
    ) -> list:
        """Stores several objects with two metadata round trips. Returns the replica count
        per key; a key that fails does not stop the others: its error is raised after the
        whole batch (the first one), or returned in its place with ``return_exceptions``."""
        keys = check_keys(keys, "put_batch")
        check_config(config, "put_batch")
        views = [as_bytes_view(v, "put_batch: value") for v in values]
        if len(views) != len(keys):
            raise ValueError(f"put_batch: {len(keys)} keys but {len(views)} values")
        return self._put_many(keys, views, [b""] * len(keys), config, upsert, return_exceptions)

    def put_tensor(
        self,
        key: str,
        tensor: torch.Tensor,
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
    ) -> int:
        """Stores a CPU tensor (any dtype and shape, non-contiguous ones are copied
        first; zero elements allowed); :meth:`get_tensor` returns it with dtype and shape."""
        return self.put_tensor_batch(
            [check_key(key, "put_tensor")], [tensor], config, upsert=upsert, _op="put_tensor"
        )[0]

    def put_tensor_batch(
        self,
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
        return_exceptions: bool = False,
        _op: str = "put_tensor_batch",
    ) -> list:
        """Batch form of :meth:`put_tensor` (a key may appear once per call)."""
        keys = check_keys(keys, _op)
        check_config(config, _op)
        if len(tensors) != len(keys):
            raise ValueError(f"{_op}: {len(keys)} keys but {len(tensors)} tensors")
        metas, views = [], []
        for t in tensors:
            if not is_tensor(t):
                raise ValueError(f"{_op}: expected a torch.Tensor, got {type(t).__name__}")
            if not copyable(t.dtype):
                raise ValueError(
                    f"{_op}: dtype {t.dtype} cannot be stored as a tensor: torch has no copy "
                    "kernel for it, so get_tensor could not return it (store its bytes, e.g. "
                    "t.view(torch.uint8), instead)"
                )
            metas.append(
                msgpack.packb(
                    {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                )
            )
            views.append(tensor_bytes(t, f"{_op}: tensor"))
        return self._put_many(keys, views, metas, config, upsert, return_exceptions)

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        """A copy of the value of ``key`` as ``bytes`` (owned by the caller).

        Raises ``ObjectNotFoundError`` (a ``KeyError``) if the key does not exist or no
        version is complete yet, ``LeaseExpiredError`` if the copy outlasted the lease,
        ``TransferError`` if no replica can be read."""
        key = check_key(key, "get")

        def read():
            (obj,), segs, deadline = self._get_meta([key])
            if obj is None:
                raise ObjectNotFoundError(f"key {key!r} not found")
            return self._read_many([obj], segs)[0], deadline

        out, deadline = self._leased(read)
        if isinstance(out, BaseException):
            raise out
        self._check_lease(deadline, key)
        return out

    def get_batch(self, keys: Sequence[str], *, return_exceptions: bool = False) -> list:
        """Copies of several values with one metadata round trip. A missing key raises
        ``ObjectNotFoundError`` (after the whole batch) or, with ``return_exceptions``,
        comes back as that exception in its place. A key may repeat: it is read once and
        its value returned at each of its positions."""
        keys = check_keys(keys, "get_batch", repeats=True)
        uniq, pos = dedup(keys)
        if pos is not None:
            res = self.get_batch(uniq, return_exceptions=True)
            out = [res[j] for j in pos]  # bytes: the same object at each position
            if not return_exceptions:
                raise_first(out)
            return out

        def read():
            objs, segs, deadline = self._get_meta(keys)
            got = self._read_many(objs, segs)
            return [
                ObjectNotFoundError(f"key {k!r} not found") if obj is None else g
                for k, obj, g in zip(keys, objs, got)
            ], deadline

        out, deadline = self._leased(read)
        return _batch_result(keys, out, deadline, return_exceptions)

    def get_into(self, key: str, buffer: WritableBuffer) -> int:
        """Copies the value of ``key`` into ``buffer`` (writable bytes-like or contiguous CPU
        tensor, at least the value's size); returns the value's size in bytes.

        Raises ``ValueError`` if the buffer is too small (nothing written),
        ``ObjectNotFoundError``, ``TransferError`` (nothing written: a read from another
        host lands in a temporary first), ``LeaseExpiredError`` (the copy outlasted the
        lease: the buffer holds bytes that may have been evicted meanwhile and must not be
        used)."""
        return self._get_into(check_key(key, "get_into"), writable_view(buffer, "get_into"))

    def _get_into(
        self, key: str, mv: memoryview, scratch: bool = False, offset: int | None = None
    ) -> int:
        """:meth:`get_into` of a checked key and buffer. ``scratch``: the caller throws the
        buffer away on any error (a staging buffer), so a read from another host's segment
        lands in it directly, without the temporary that keeps it untouched on a failed
        transfer (one copy less per byte). ``offset``: reads bytes ``[offset, offset +
        len(mv))`` of the value (from its replicas in memory only) instead of all of it;
        ``ValueError`` when they are not all within it."""

        def read():
            (obj,), segs, deadline = self._get_meta([key])
            if obj is None:
                raise ObjectNotFoundError(f"key {key!r} not found")
            if offset is not None:
                if offset < 0 or offset + len(mv) > obj.size:
                    raise ValueError(
                        f"get_into: bytes [{offset}, {offset + len(mv)}) of {key!r} are not all "
                        f"within its {obj.size} bytes (nothing written)"
                    )
                reps = [(r[0], r[1], r[2] + offset) for r in obj.replicas if r[0] == "m"]
                obj = _Obj(obj.key, len(mv), obj.version, obj.meta, reps)
            elif obj.size > len(mv):
                raise ValueError(
                    f"get_into: buffer of {len(mv)} bytes is too small for {key!r} "
                    f"({obj.size} bytes; nothing written)"
                )
            (err,) = self._read_many([obj], segs, [mv[: obj.size]], scratch)
            return obj.size, err, deadline

        size, err, deadline = self._leased(read)
        if isinstance(err, BaseException):
            raise err
        self._check_lease(deadline, key)
        return size

    def get_into_batch(
        self,
        keys: Sequence[str],
        buffers: Sequence[WritableBuffer],
        *,
        return_exceptions: bool = False,
    ) -> list:
        """Batch form of :meth:`get_into`: returns the sizes (or exceptions in place with
        ``return_exceptions``). A key may repeat: each of its buffers receives the value
        (one request per repetition)."""
        keys = check_keys(keys, "get_into_batch", repeats=True)
        mvs = [writable_view(b, "get_into_batch") for b in buffers]
        if len(mvs) != len(keys):
            raise ValueError(f"get_into_batch: {len(keys)} keys but {len(mvs)} buffers")
        if len(set(keys)) != len(
            keys
        ):  # rounds of distinct keys: the n-th occurrences of each key together
            seen: dict = {}
            rounds: dict = {}
            for i, k in enumerate(keys):
                n = seen[k] = seen.get(k, -1) + 1
                rounds.setdefault(n, []).append(i)
            out: list = [None] * len(keys)
            for idx in rounds.values():
                res = self.get_into_batch(
                    [keys[i] for i in idx], [mvs[i] for i in idx], return_exceptions=True
                )
                for i, r in zip(idx, res):
                    out[i] = r
            if not return_exceptions:
                raise_first(out)
            return out

        def read():
            objs, segs, deadline = self._get_meta(keys)
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
            for i, obj in enumerate(todo):
                if obj is not None:
                    out[i] = got[i] if isinstance(got[i], BaseException) else obj.size
            return out, deadline

        out, deadline = self._leased(read)
        return _batch_result(keys, out, deadline, return_exceptions)

    def get_tensor(self, key: str) -> torch.Tensor:
        """The tensor stored by :meth:`put_tensor` (same dtype and shape).

        Raises ``ObjectNotFoundError``, ``ValueError`` if the object is not a tensor,
        ``LeaseExpiredError``, ``TransferError``."""
        return self.get_tensor_batch([check_key(key, "get_tensor")])[0]

    def get_tensor_batch(self, keys: Sequence[str], *, return_exceptions: bool = False) -> list:
        """Batch form of :meth:`get_tensor`. A key may repeat: it is read once and each
        further position gets its own copy (a clone)."""
        import torch

        keys = check_keys(keys, "get_tensor_batch", repeats=True)
        uniq, pos = dedup(keys)
        if pos is not None:
            res = self.get_tensor_batch(uniq, return_exceptions=True)
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

    # ------------------------------------------------------------------ other
    def exists(self, key: str) -> bool:
        """True if a complete version of ``key`` exists (an empty value counts)."""
        return self.exists_batch([check_key(key, "exists")])[0]

    def exists_batch(self, keys: Sequence[str]) -> list:
        """``exists`` for several keys (one request per 2048 keys; a key may repeat)."""
        keys = check_keys(keys, "exists_batch", repeats=True)
        uniq, pos = dedup(keys)
        out: list = []
        for a, b in chunks(uniq):
            out += self._call("exists", {"keys": uniq[a:b]})["exists"]
        return out if pos is None else [out[j] for j in pos]

    def _exists_meta(self, keys: Sequence[str]) -> list:
        """Per key ``None`` if it does not exist, else the metadata stored with it (bytes:
        what :meth:`put_tensor` records, ``b""`` for plain values), or ``True`` where the
        master does not send metadata (an older master). From the master alone: no lease,
        no bytes read, nothing loaded from SSD (``KVCacheStore`` checks layouts with it)."""
        keys = check_keys(keys, "exists_batch", repeats=True)
        uniq, pos = dedup(keys)
        out: list = []
        for a, b in chunks(uniq):
            r = self._call("exists", {"keys": uniq[a:b], "meta": True})
            metas = r.get("meta")
            if not isinstance(metas, list) or len(metas) != len(r["exists"]):
                metas = [True if e else None for e in r["exists"]]
            out += [m if e else None for e, m in zip(r["exists"], metas)]
        return out if pos is None else [out[j] for j in pos]

    def remove(self, key: str, force: bool = False) -> None:
        """Removes ``key``. Raises ``ObjectNotFoundError``, or ``ObjectHasLeaseError`` while a
        reader holds a lease (``force=True`` removes anyway; the space is reused only once
        the lease has expired, so the reader's copy stays intact)."""
        check_force(force, "remove")
        (item,) = self._call(
            "remove",
            {"client": self.client_id, "keys": [check_key(key, "remove")], "force": force},
        )["items"]
        if item[0] != 0:
            raise from_code(item[1], item[2])

    def remove_batch(
        self, keys: Sequence[str], force: bool = False, *, return_exceptions: bool = False
    ) -> list:
        """:meth:`remove` for several keys (each once); returns ``None`` per key, or the
        exception in its place with ``return_exceptions``."""
        keys = check_keys(keys, "remove_batch")
        check_force(force, "remove_batch")
        res: list = []
        for a, b in chunks(keys):
            res += self._call(
                "remove", {"client": self.client_id, "keys": keys[a:b], "force": force}
            )["items"]
        out = [None if it[0] == 0 else from_code(it[1], it[2]) for it in res]
        if not return_exceptions:
            for o in out:
                if o is not None:
                    raise o
        return out

    def where(self, key: str) -> Placement:
        """Where ``key`` lives (introspection for tests and operators): a
        :class:`Placement` of segment names (memory) and client names (SSD).
        Raises ``ObjectNotFoundError``."""
        (w,) = self._call("where", {"keys": [check_key(key, "where")]})["where"]
        if w is None:
            raise ObjectNotFoundError(f"key {key!r} not found")
        return Placement(memory=list(w["memory"]), ssd=list(w["ssd"]))

    def stats(self) -> StoreStats:
        """The master's figures as a :class:`StoreStats`."""
        d = self._call("stats", {})
        return StoreStats(**{f.name: int(d.get(f.name, 0)) for f in dataclasses.fields(StoreStats)})

    def metrics(self) -> str:
        """The master's Prometheus text metrics."""
        return self._call("metrics", {})["text"]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unregisters (objects held only in this client's segment are gone) and frees
        everything. Idempotent."""
        if self._closed:
            return
        self._run_close_hooks()
        self._closed = True
        try:
            self._call("unregister", {"client": self.client_id})
        except StoreError:
            pass
        self._teardown()

    def _run_close_hooks(self):
        # users of this client that must act before it goes (WeightSync: views of the
        # store's memory become private copies, the reader slot is given back)
        for ref in list(self._close_hooks):
            fn = ref()
            if fn is not None:
                try:
                    fn()
                except Exception as e:
                    log.warning("store: close hook failed: %s", e)
        self._close_hooks.clear()

    def _close_at_exit(self):
        if self._closed:
            return
        self._exiting = True
        self._run_close_hooks()
        self._closed = True
        if self._embedded is None and self._lock.acquire(timeout=1.0):
            try:  # one short try: exit must not wait for an unreachable master
                if self._conn is not None:
                    self._conn.call("unregister", {"client": self.client_id}, timeout=1.0)
            except Exception:
                pass
            finally:
                self._lock.release()
        self._teardown()

    def _teardown(self):
        self._closed = True
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        t = getattr(self, "_poll_thread", None)
        if t is not None and t is not threading.current_thread():
            t.join(self.cfg.heartbeat_interval_s + 3)
        t = getattr(self, "_task_thread", None)
        if t is not None and t is not threading.current_thread():
            self._tasks.put(None)
            t.join(30)  # an SSD load may be writing into the segment, which is closed next
        t = getattr(self, "_warm_thread", None)
        if t is not None and t is not threading.current_thread():
            self._warm_evt.set()
            t.join(5)  # holds a view of the segment, which is closed next
        if self._te is not None:
            self._te.close()
            self._te = None
        self._maps.close()
        self._ro_maps.close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if getattr(self, "_ssd_lock", None) is not None:
            os.close(self._ssd_lock)  # releases the directory's lock
            self._ssd_lock = None
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
