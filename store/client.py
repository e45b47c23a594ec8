"""``MooncakeStore``: the client of the store (see DESIGN.md "Store").

A client optionally contributes a shared-memory segment (and an SSD directory); the
master places objects in segments; data moves from client to client: segments of the
same host are mapped and copied directly, others go through the TCP transfer engine
(``mooncake_pg.transfer.TransferEngine``).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import msgpack

from . import protocol, ssd
from .alloc import aligned
from .config import MasterConfig, ReplicateConfig, StoreConfig, _parse_hostport
from .core import SEG_HEADER
from .errors import (
    LeaseExpiredError,
    NoSpaceError,
    NotLeaderError,
    ObjectNotFoundError,
    ProtocolError,
    PutLostError,
    StoreError,
    TransferError,
    UnknownClientError,
    from_code,
)
from .segment import LocalSegment, SegmentCache, tune_malloc

log = logging.getLogger("mooncake_store")

_DEFAULT_REPLICATE = ReplicateConfig()
_NOSPACE_RETRY_S = 6.0  # a new leader evicts nothing for lease_ttl_s (5 s by default)
_LOAD_STALL_S = (
    1.0  # a batch read waiting for SSD loads on another host gives up this long after the last one
)
_RESV_IDLE_S = 3.0  # a put reservation unused this long goes back to the master
_RESV_REFUSED_S = (
    1.0  # after the master refused (or took back) a reservation, no new request this long
)
_WARM_IDLE_S = 0.5  # a reservation unused this long is warmed up again before its next put (_warm)
_WARM_MAX_PUT = 4 << 20  # puts from this size on copy with two threads and warm nothing (_warm)
_FAST_COPY_BYTES = 64 << 10  # copies from this size on go through the parallel C++ copy
# Seconds for which reads skip a segment whose owner could not be reached (a failed
# connection): one wait for the first read that meets a dead or stopped owner, none for
# the reads after it, which go to other replicas or fail at once with TransferError.
UNREACHABLE_SKIP_S = 10.0


def _as_bytes_view(value, what="value") -> memoryview:
    """A flat read-only byte view of ``value`` (bytes-like or a CPU tensor); ValueError otherwise."""
    if isinstance(value, str):
        raise ValueError(f"{what} must be bytes-like (got str; encode it first)")
    if _is_tensor(value):
        return _tensor_bytes(value, what)
    try:
        mv = memoryview(value)
    except TypeError:
        raise ValueError(
            f"{what} must be bytes-like or a tensor, got {type(value).__name__}"
        ) from None
    if not mv.contiguous:
        raise ValueError(f"{what} must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _is_tensor(x) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def _tensor_bytes(t, what="tensor") -> memoryview:
    import torch

    if t.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, got {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{what} must be a dense (strided) tensor, got layout {t.layout}")
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _writable_view(buffer, op="get_into") -> memoryview:
    if _is_tensor(buffer):
        import torch

        if (
            buffer.device.type != "cpu"
            or buffer.layout != torch.strided
            or not buffer.is_contiguous()
        ):
            raise ValueError(f"{op}: buffer tensor must be a dense contiguous CPU tensor")
        if buffer.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise ValueError(
            f"{op}: buffer must be a writable bytes-like object or tensor, got {type(buffer).__name__}"
        ) from None
    if mv.readonly:
        raise ValueError(f"{op}: buffer is read-only")
    if not mv.contiguous:
        raise ValueError(f"{op}: buffer must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _short(key: str) -> str:
    return repr(key) if len(key) <= 80 else repr(key[:80]) + f"... ({len(key)} chars)"


def _check_key(key, op: str) -> str:
    """``key`` if it is a valid key (a non-empty str of at most 4096 bytes of UTF-8);
    ValueError naming ``op`` and the problem otherwise."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{op}: key must be a non-empty str, got {key!r}")
    if key.isascii():
        n = len(key)
    else:
        try:
            n = len(key.encode())
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. from os.fsdecode of bad bytes)
            raise ValueError(
                f"{op}: key must be valid Unicode text (encodable as UTF-8); it has a lone surrogate "
                f"{key[e.start]!r} at index {e.start}: {_short(key)}"
            ) from None
    if n > 4096:
        raise ValueError(
            f"{op}: key must be at most 4096 bytes of UTF-8, got {n} bytes: {_short(key)}"
        )
    return key


def _check_keys(keys, op: str, *, repeats: bool = False) -> list:
    """The keys of a batch call as a list (each checked by :func:`_check_key`). A key may
    repeat only where ``repeats`` (reads); otherwise a repeat is a ValueError naming it."""
    if isinstance(keys, (str, bytes)):
        raise ValueError(f"{op}: keys must be a sequence of str, not a single key")
    try:
        keys = list(keys)
    except TypeError:
        raise ValueError(
            f"{op}: keys must be a sequence of str, got {type(keys).__name__}"
        ) from None
    keys = [_check_key(k, op) for k in keys]
    if not repeats and len(set(keys)) != len(keys):
        seen: set = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ValueError(
            f"{op}: key {_short(dup)} repeats within one batch (each key may be written or removed "
            "once per call)"
        )
    return keys


def _dedup(keys: list) -> tuple:
    """``(unique keys in first-seen order, position in it of each key)``; ``(keys, None)``
    when no key repeats."""
    if len(set(keys)) == len(keys):
        return keys, None
    first: dict = {}
    pos = [first.setdefault(k, len(first)) for k in keys]
    return list(first), pos


def _raise_first(out: list) -> None:
    for o in out:
        if isinstance(o, BaseException):
            raise o


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


def _chunks(keys: list, max_keys: int = 2048, max_bytes: int = 1 << 20):
    """Index ranges of ``keys`` small enough for one metadata request (the master limits
    keys per call and frame bytes)."""
    start, size = 0, 0
    for i, k in enumerate(keys):
        n = len(k) * 4 + 64
        if i > start and (i - start >= max_keys or size + n > max_bytes):
            yield start, i
            start, size = i, 0
        size += n
    if start < len(keys) or not keys:
        yield start, len(keys)


def _close_at_exit(ref):
    store = ref()
    if store is not None:
        store._close_at_exit()


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
        _raise_first(out)
    return out


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


def _check_force(force, op: str):
    if not isinstance(force, bool):  # "no" is truthy: it removed leased objects
        raise ValueError(f"{op}: force must be True or False, got {force!r}")


def _connection_failed(e: BaseException) -> bool:
    """Whether a transfer-engine error is a failed connection to the peer: the binding
    raises the engine's ``PeerConnectionError`` as ``torch.distributed.DistNetworkError``
    (torch is loaded wherever an engine is)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(e, dist.DistNetworkError)


class _Unreachable(str):
    """A segment name ``_put_reserved`` could not write to."""


class MooncakeStore:
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

    def __init__(self, config: StoreConfig | None = None, **kw):
        if config is not None and kw:
            raise ValueError("pass either a StoreConfig or keyword options, not both")
        cfg = (config or StoreConfig(**kw)).resolved()
        self.cfg = cfg
        self.name = cfg.name
        serve_tcp = cfg.serve_tcp
        self.client_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._closed = False
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
            from .master import Master

            mc = cfg.master_config or MasterConfig(secret=cfg.secret)
            self._embedded = Master(mc).start()
            cfg.master = self._embedded.address
        try:
            if cfg.segment_size:
                if cfg.segment_size <= SEG_HEADER:
                    raise ValueError(f"segment_size must be 0 or more than {SEG_HEADER} bytes")
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
                    _parse_hostport(self.cfg.master, "master")[0]
                    if self.cfg.master
                    else "127.0.0.1"
                )
                host = TransferEngine.local_address_for(mhost, self.cfg.ifname or "")
        self._te = TransferEngine(listen_host=host, secret=self.cfg.secret or "")
        if serve:
            self._te_region = self._te.register_memory(self._segment.view)

    def _te_desc(self):
        if self._te is None or self._te_region is None:
            return None
        return [self._te.host, self._te.port, self._te_region]

    def _register(self):
        segs = [self._segment.desc(self.cfg.host_id, self._te_desc())] if self._segment else []
        res = self._call(
            "register",
            {
                "client": self.client_id,
                "name": self.name,
                "host": self.cfg.host_id,
                "pid": os.getpid(),
                "segs": segs,
                "ssd_dir": self.cfg.ssd_dir,
                "ssd_max": self.cfg.ssd_max_bytes,
                "ssd": [],
            },
            register=False,
        )
        self._lease_ttl = res["ttl_ms"] / 1000.0
        self._client_ttl = res.get("client_ttl_ms", 5000) / 1000.0
        if self.cfg.ssd_dir:  # files found on disk, in chunks well below the frame limit
            chunk, size = [], 0
            for e in ssd.scan(self.cfg.ssd_dir) + [None]:
                if e is not None:
                    chunk.append(e)
                    size += len(e[0]) + len(e[3]) + len(e[4]) + 32
                if chunk and (e is None or size > (512 << 10)):
                    self._call(
                        "adopt_ssd", {"client": self.client_id, "entries": chunk}, register=False
                    )
                    chunk, size = [], 0

    def _resolve(self) -> str | None:
        if self.cfg.etcd is None:
            return self.cfg.master
        from .ha import Etcd

        if self._etcd is None:
            self._etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
        try:
            rec = self._etcd.leader()
        except Exception as e:  # etcd unreachable: said in the error the caller sees
            self._etcd_error = f"etcd {self.cfg.etcd} unreachable: {type(e).__name__}: {e}"
            return None
        self._etcd_error = None
        return rec["addr"] if rec else None

    def _connect(self) -> protocol.Connection:
        addr = self._resolve()
        if addr is None:
            raise ConnectionError(
                f"no store master leads ({self._etcd_error or 'etcd has no leader record'})"
            )
        host, port = _parse_hostport(addr, "master")
        return protocol.Connection(
            host,
            port,
            secret=self.cfg.secret,
            timeout=self.cfg.rpc_timeout_s,
            busy_poll_us=self.cfg.rpc_busy_poll_us,
        )

    def _call(self, method: str, args: dict, register=True, sent_at: list | None = None):
        """One metadata request; follows leader changes for ``failover_timeout_s`` from the
        first failure (a request that waited out ``rpc_timeout_s`` on a stopped leader then
        still goes to its successor). ``sent_at``: a list that gets the ``time.monotonic()``
        at which the request that answered was sent (a lease runs from then)."""
        deadline = None
        reregistered = False
        if self._exiting:  # interpreter exit: one short try, never a wait for a failover
            if not self._lock.acquire(timeout=1.0):
                raise StoreError(f"{method}: the store client is busy at exit")
            try:
                if self._conn is None:
                    raise StoreError(f"{method}: no connection at exit")
                return self._conn.call(method, args, timeout=1.0)
            except (OSError, ProtocolError) as e:
                raise StoreError(f"{method} at exit: {e}") from None
            finally:
                self._lock.release()
        while True:
            try:
                with self._lock:
                    if self._closed and method != "unregister":
                        raise StoreError("the store client is closed")
                    if self._conn is None:
                        self._conn = self._connect()
                        self._session += 1
                    t = time.monotonic()
                    res = self._conn.call(method, args)
                    if sent_at is not None:
                        sent_at.append(t)
                    return res
            except UnknownClientError:
                if not register or reregistered:
                    raise
                reregistered = True
                self._session += 1  # the master forgot this client, and its reservation
                self._register()
            except (OSError, NotLeaderError) as e:
                with self._lock:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                if deadline is None:
                    deadline = time.monotonic() + self.cfg.failover_timeout_s
                elif time.monotonic() > deadline:
                    raise StoreError(
                        f"no store master answered {method} within {self.cfg.failover_timeout_s} s: {e}"
                    ) from None
                time.sleep(0.1)

    # ------------------------------------------------------------------ heartbeat
    def _poll_main(self):
        conn = None
        connected = False
        while not self._closed:
            try:
                if conn is None:
                    conn = self._connect_poll()
                    if connected:
                        self._session += (
                            1  # perhaps another master now: put reservations are asked for again
                        )
                    connected = True
                res = conn.call(
                    "poll",
                    {
                        "client": self.client_id,
                        "wait_ms": int(self.cfg.heartbeat_interval_s * 1000),
                        "epoch": self._epoch,
                    },
                    timeout=self.cfg.heartbeat_interval_s + self._poll_slack(),
                )
                if "segs" in res:
                    self._epoch = res["epoch"]
                    self._maps.retain(set(res["segs"]))
                    self._ro_maps.retain(set(res["segs"]))
                for task in res["tasks"]:
                    self._tasks.put(
                        task
                    )  # run by the task thread: heartbeats never wait for a disk or an RPC
            except UnknownClientError:
                if self._closed:
                    break
                try:
                    self._register()
                except Exception as e:
                    log.warning("store: re-registering failed: %s", e)
                    time.sleep(0.2)
            except Exception:
                if conn is not None:
                    conn.close()
                    conn = None
                if not self._closed:
                    time.sleep(0.1)
        if conn is not None:
            conn.close()

    def _task_main(self):
        """Runs the master's tasks (SSD offloads and loads, deletes, reservation returns)
        in order, and gives an idle put reservation back. Apart from the heartbeat thread:
        a long SSD write or an RPC stuck on a stopped master must not delay heartbeats past
        the master's client TTL."""
        while not self._closed:
            try:
                task = self._tasks.get(timeout=0.25)
            except queue.Empty:
                task = None
            if task is None and self._closed:
                break
            try:
                if task is not None:
                    self._run_task(task)
                r = self._resv
                if (
                    r is not None and time.monotonic() - r.used_at > _RESV_IDLE_S
                ) or self._resv_orphans:
                    self._give_back_reservation(wait=False)
            except Exception as e:
                if not self._closed:
                    log.warning(
                        "store: task %r failed: %s", task[0] if task else "reservation give-back", e
                    )

    def _poll_slack(self) -> float:
        """Seconds a heartbeat may go unanswered (and a connect take) before the poll
        thread gives up on that master and finds the leader again: a third of the master's
        client TTL, so a stopped (SIGSTOP) or hung leader still lets heartbeats reach its
        successor within the TTL it grants every client (found by a new-user trial: stuck
        for rpc_timeout_s + 3 s, the client was declared dead and all its objects dropped)."""
        return min(self.cfg.rpc_timeout_s, max(1.0, self._client_ttl / 3))

    def _connect_poll(self):
        if self.cfg.etcd is None:
            host, port = _parse_hostport(self.cfg.master, "master")
        else:
            from .ha import Etcd

            if not hasattr(self, "_poll_etcd"):
                self._poll_etcd = Etcd(self.cfg.etcd, self.cfg.etcd_prefix)
            rec = self._poll_etcd.leader()
            if rec is None:
                raise ConnectionError("no leader")
            host, port = _parse_hostport(rec["addr"], "master")
        return protocol.Connection(host, port, secret=self.cfg.secret, timeout=self._poll_slack())

    def _run_task(self, task):
        op = task[0]
        if op == "unreserve":
            self._give_back_reservation(wait=True)
        elif op == "delete" and self.cfg.ssd_dir:
            path = task[1]
            if os.path.realpath(path).startswith(os.path.realpath(self.cfg.ssd_dir) + os.sep):
                ssd.delete(path)
        elif op == "load" and self._segment is not None:
            _, key, version, path, off, size = task
            ok, corrupt = False, False
            try:
                ssd.read_into(path, key, version, self._segment.view[off : off + size])
                ok = True
            except TransferError as e:
                corrupt = isinstance(e, ssd.CorruptError)
                log.warning("store: loading %r from SSD failed: %s", key, e)
            try:
                self._call(
                    "load_done",
                    {"client": self.client_id, "key": key, "version": version, "ok": ok},
                )
            except StoreError as e:
                log.warning("store: load_done: %s", e)
            if corrupt:
                self._report_corrupt(key, version, path)
        elif op == "offload" and self._segment is not None and self.cfg.ssd_dir:
            _, key, version, off, size, meta = task
            ok, path = False, ""
            try:
                path = ssd.write(
                    self.cfg.ssd_dir, key, version, meta, self._segment.view[off : off + size]
                )
                ok = True
            except OSError as e:
                log.warning("store: offload of %r failed: %s", key, e)
            try:
                self._call(
                    "offload_done",
                    {
                        "client": self.client_id,
                        "key": key,
                        "version": version,
                        "path": path,
                        "ok": ok,
                    },
                )
            except StoreError as e:
                log.warning("store: offload_done: %s", e)

    def _report_corrupt(self, key: str, version: int, path: str):
        """Tells the master an SSD file of ``key`` is missing or corrupt: it drops that
        replica (and the object when none is left), so later gets miss instead of failing."""
        try:
            self._call(
                "ssd_bad", {"client": self.client_id, "key": key, "version": version, "path": path}
            )
        except StoreError as e:
            log.warning("store: reporting the corrupt SSD file %s: %s", path, e)

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

    def _read_many(self, objs: list, segs: dict, outs: list | None = None) -> list:
        """Reads every object (None entries skipped) with one parallel copy for those in
        mapped segments; returns bytes (``outs`` None) or None per object, or the
        ``TransferError`` in its place."""
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
                    res[i] = self._read_one(obj, segs, None if outs is None else outs[i], skipped)
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
                            objs[i], segs, None if outs is None else outs[i], skip
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
        self, obj: _Obj, segs: dict, out: memoryview | None = None, skip: frozenset = frozenset()
    ):
        """Copies ``obj`` into ``out`` from the first replica that works (none in a segment
        named in ``skip``: found unreachable just before); with ``out=None`` returns a new
        ``bytes`` (one copy)."""
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

    # ------------------------------------------------------------------ puts
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
        if not isinstance(cfg, ReplicateConfig):
            raise ValueError("config must be a ReplicateConfig")
        if not keys:
            return []
        parts = list(_chunks(keys))
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
                _raise_first(out)
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
            again = self._put_part(
                [keys[i] for i in rest],
                [views[i] for i in rest],
                [metas[i] for i in rest],
                cfg,
                upsert,
                True,
                _retry,
                _avoid,
            )
            for i, r in zip(rest, again):
                results[i] = r
            wave = rest
        if not return_exceptions:
            _raise_first(results)
        return results

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
                again = self._put_many(
                    [keys[i] for i in lost],
                    [views[i] for i in lost],
                    [metas[i] for i in lost],
                    cfg,
                    upsert,
                    True,
                    _retry=False,
                )
                for i, r in zip(lost, again):
                    fast[i] = r
            if fast is not None:
                if not return_exceptions:
                    _raise_first(fast)
                return fast
        args = {
            "client": self.client_id,
            "items": [[k, len(v), m] for k, v, m in zip(keys, views, metas)],
            "r": cfg.replica_num,
            "pref": cfg.preferred_segment,
            "pin": cfg.pin,
            "all": cfg.require_all,
            "upsert": upsert,
        }
        if _avoid:
            args["x"] = list(_avoid)
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
            try:
                self._call(
                    "put_revoke",
                    {"client": self.client_id, "items": [[keys[i], v] for i, v, _ in started]},
                )
            except StoreError:
                pass
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
                again = self._put_many(
                    [keys[i] for i in lost],
                    [views[i] for i in lost],
                    [metas[i] for i in lost],
                    cfg,
                    True,
                    True,
                    _retry=False,
                )
                for i, r in zip(lost, again):
                    results[i] = r
        if not return_exceptions:
            _raise_first(results)
        return results

    def _put_reserved(
        self, keys: list, views: list, metas: list, cfg: ReplicateConfig, upsert: bool
    ):
        """One-round-trip put: writes the objects back to back into this client's
        reservation and commits them with one request (``Core.put``). Returns the results
        as ``_put_many`` does, or None when this path is not taken (more than one replica,
        ``require_all``, objects larger than a quarter of ``put_reservation_bytes``, no
        reservation granted, another thread using it, the master no longer knowing it):
        the caller then puts them the two-request way, from the start. ``_Unreachable(segment)``
        when the reservation's segment could not be written: the same, avoiding that segment."""
        want = self.cfg.put_reservation_bytes
        if (
            not want
            or cfg.replica_num != 1
            or cfg.require_all
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
                        "reserve", {"client": self.client_id, "bytes": 0, "ret": self._returns(old)}
                    )
                    self._resv_orphans.clear()
                except StoreError as e:
                    if (
                        not self._closed
                    ):  # closed meanwhile (close() on another thread): nothing to say
                        log.warning("store: giving a put reservation back failed: %s", e)
        finally:
            self._resv_lock.release()

    def put(self, key: str, value, config: ReplicateConfig = _DEFAULT_REPLICATE) -> int:
        """Stores ``value`` (bytes-like, ``b""`` allowed) under ``key``.

        Returns how many replicas were placed (``config.replica_num`` or fewer when fewer
        segments can hold it). Raises ``ObjectExistsError`` if the key exists or is being
        written (use :meth:`upsert`), ``ReplicaShortfallError`` (``require_all``; nothing
        stored), ``NoSpaceError``, ``TransferError``, ``PutLostError`` (the master no longer
        knows the put: it outlasted ``put_ttl_s``, or a leader change lost it; nothing
        stored); ``ValueError`` for bad arguments (before anything is sent)."""
        return self._put_many(
            [_check_key(key, "put")],
            [_as_bytes_view(value, "put: value")],
            [b""],
            config,
            False,
            False,
        )[0]

    def upsert(self, key: str, value, config: ReplicateConfig = _DEFAULT_REPLICATE) -> int:
        """Like :meth:`put`, but replaces an existing value (any size). Readers see the
        old value until the new one is complete. Returns the replicas placed."""
        return self._put_many(
            [_check_key(key, "upsert")],
            [_as_bytes_view(value, "upsert: value")],
            [b""],
            config,
            True,
            False,
        )[0]

    def put_batch(
        self,
        keys: Sequence[str],
        values: Sequence,
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
        return_exceptions: bool = False,
    ) -> list:
        """Stores several objects with two metadata round trips. Returns the replica count
        per key; a key that fails does not stop the others: its error is raised after the
        whole batch (the first one), or returned in its place with ``return_exceptions``."""
        keys = _check_keys(keys, "put_batch")
        views = [_as_bytes_view(v, "put_batch: value") for v in values]
        if len(views) != len(keys):
            raise ValueError(f"put_batch: {len(keys)} keys but {len(views)} values")
        return self._put_many(keys, views, [b""] * len(keys), config, upsert, return_exceptions)

    def put_tensor(
        self,
        key: str,
        tensor,
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
    ) -> int:
        """Stores a CPU tensor (any dtype and shape, non-contiguous ones are copied
        first; zero elements allowed); :meth:`get_tensor` returns it with dtype and shape."""
        return self.put_tensor_batch(
            [_check_key(key, "put_tensor")], [tensor], config, upsert=upsert, _op="put_tensor"
        )[0]

    def put_tensor_batch(
        self,
        keys: Sequence[str],
        tensors: Sequence,
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
        return_exceptions: bool = False,
        _op: str = "put_tensor_batch",
    ) -> list:
        """Batch form of :meth:`put_tensor` (a key may appear once per call)."""
        keys = _check_keys(keys, _op)
        if len(tensors) != len(keys):
            raise ValueError(f"{_op}: {len(keys)} keys but {len(tensors)} tensors")
        metas, views = [], []
        for t in tensors:
            if not _is_tensor(t):
                raise ValueError(f"{_op}: expected a torch.Tensor, got {type(t).__name__}")
            metas.append(
                msgpack.packb(
                    {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                )
            )
            views.append(_tensor_bytes(t, f"{_op}: tensor"))
        return self._put_many(keys, views, metas, config, upsert, return_exceptions)

    # ------------------------------------------------------------------ reads
    def _get_meta(self, keys: list):
        parts = list(_chunks(keys))
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

    def get(self, key: str) -> bytes:
        """A copy of the value of ``key`` as ``bytes`` (owned by the caller).

        Raises ``ObjectNotFoundError`` (a ``KeyError``) if the key does not exist or no
        version is complete yet, ``LeaseExpiredError`` if the copy outlasted the lease,
        ``TransferError`` if no replica can be read."""
        key = _check_key(key, "get")

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
        keys = _check_keys(keys, "get_batch", repeats=True)
        uniq, pos = _dedup(keys)
        if pos is not None:
            res = self.get_batch(uniq, return_exceptions=True)
            out = [res[j] for j in pos]  # bytes: the same object at each position
            if not return_exceptions:
                _raise_first(out)
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

    def _local_views(self, keys: list) -> tuple:
        """``(views, deadline)``: per key a read-only ``memoryview`` of the value's first
        replica where it lies in memory on this host (this client's own segment: a
        writable one), else ``None`` (also for a missing key); ``deadline`` is the
        ``time.monotonic()`` at which the read lease ends. No copy: the bytes stay the
        store's, valid while the object is not removed (the caller protects them, e.g.
        ``WeightSync`` holds). A view of another client's segment keeps its mapping alive
        after the segment goes away."""
        objs, segs, deadline = self._get_meta(_check_keys(keys, "local_views"))
        out = []
        for obj in objs:
            view = None
            if obj is not None and obj.replicas and obj.replicas[0][0] == "m":
                desc = segs[obj.replicas[0][1]]
                if self._is_local(desc):
                    try:
                        own = self._segment is not None and desc["name"] == self.name
                        base = self._segment.view if own else self._ro_maps.get(desc).view
                        off = obj.replicas[0][2]
                        view = base[off : off + obj.size]
                    except TransferError:
                        view = None
            out.append(view)
        return out, deadline

    def get_into(self, key: str, buffer) -> int:
        """Copies the value of ``key`` into ``buffer`` (writable bytes-like or contiguous CPU
        tensor, at least the value's size); returns the value's size in bytes.

        Raises ``ValueError`` if the buffer is too small (nothing written),
        ``ObjectNotFoundError``, ``TransferError`` (nothing written: a read from another
        host lands in a temporary first), ``LeaseExpiredError`` (the copy outlasted the
        lease: the buffer holds bytes that may have been evicted meanwhile and must not be
        used)."""
        key = _check_key(key, "get_into")
        mv = _writable_view(buffer, "get_into")

        def read():
            (obj,), segs, deadline = self._get_meta([key])
            if obj is None:
                raise ObjectNotFoundError(f"key {key!r} not found")
            if obj.size > len(mv):
                raise ValueError(
                    f"buffer of {len(mv)} bytes is too small for {key!r} ({obj.size} bytes)"
                )
            (err,) = self._read_many([obj], segs, [mv[: obj.size]])
            return obj.size, err, deadline

        size, err, deadline = self._leased(read)
        if isinstance(err, BaseException):
            raise err
        self._check_lease(deadline, key)
        return size

    def get_into_batch(
        self, keys: Sequence[str], buffers: Sequence, *, return_exceptions: bool = False
    ) -> list:
        """Batch form of :meth:`get_into`: returns the sizes (or exceptions in place with
        ``return_exceptions``). A key may repeat: each of its buffers receives the value
        (one request per repetition)."""
        keys = _check_keys(keys, "get_into_batch", repeats=True)
        mvs = [_writable_view(b, "get_into_batch") for b in buffers]
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
                _raise_first(out)
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
                        f"buffer of {len(mv)} bytes is too small for {k!r} ({obj.size} bytes)"
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

    def get_tensor(self, key: str):
        """The tensor stored by :meth:`put_tensor` (same dtype and shape).

        Raises ``ObjectNotFoundError``, ``ValueError`` if the object is not a tensor,
        ``LeaseExpiredError``, ``TransferError``."""
        return self.get_tensor_batch([_check_key(key, "get_tensor")])[0]

    def get_tensor_batch(self, keys: Sequence[str], *, return_exceptions: bool = False) -> list:
        """Batch form of :meth:`get_tensor`. A key may repeat: it is read once and each
        further position gets its own copy (a clone)."""
        import torch

        keys = _check_keys(keys, "get_tensor_batch", repeats=True)
        uniq, pos = _dedup(keys)
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
                _raise_first(out)
            return out
        out, deadline = self._leased(lambda: self._read_tensors(keys))
        return _batch_result(keys, out, deadline, return_exceptions)

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

    # ------------------------------------------------------------------ other
    def exists(self, key: str) -> bool:
        """True if a complete version of ``key`` exists (an empty value counts)."""
        return self.exists_batch([_check_key(key, "exists")])[0]

    def exists_batch(self, keys: Sequence[str]) -> list:
        """``exists`` for several keys (one request per 2048 keys; a key may repeat)."""
        keys = _check_keys(keys, "exists_batch", repeats=True)
        uniq, pos = _dedup(keys)
        out: list = []
        for a, b in _chunks(uniq):
            out += self._call("exists", {"keys": uniq[a:b]})["exists"]
        return out if pos is None else [out[j] for j in pos]

    def _exists_meta(self, keys: Sequence[str]) -> list:
        """Per key ``None`` if it does not exist, else the metadata stored with it (bytes:
        what :meth:`put_tensor` records, ``b""`` for plain values), or ``True`` where the
        master does not send metadata (an older master). From the master alone: no lease,
        no bytes read, nothing loaded from SSD (``KVCacheStore`` checks layouts with it)."""
        keys = _check_keys(keys, "exists_batch", repeats=True)
        uniq, pos = _dedup(keys)
        out: list = []
        for a, b in _chunks(uniq):
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
        _check_force(force, "remove")
        (item,) = self._call(
            "remove",
            {"client": self.client_id, "keys": [_check_key(key, "remove")], "force": force},
        )["items"]
        if item[0] != 0:
            raise from_code(item[1], item[2])

    def remove_batch(
        self, keys: Sequence[str], force: bool = False, *, return_exceptions: bool = False
    ) -> list:
        """:meth:`remove` for several keys (each once); returns ``None`` per key, or the
        exception in its place with ``return_exceptions``."""
        keys = _check_keys(keys, "remove_batch")
        _check_force(force, "remove_batch")
        res: list = []
        for a, b in _chunks(keys):
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
        (w,) = self._call("where", {"keys": [_check_key(key, "where")]})["where"]
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
    def close(self):
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
