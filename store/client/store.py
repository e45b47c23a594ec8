"""``MooncakeStore``: the client of the store (see docs/design.md "Store").

A client optionally contributes a shared-memory segment (and an SSD directory); the
master places objects in segments; data moves from client to client: segments of the
same host are mapped and copied directly, others go through the TCP transfer engine
(``mooncake_pg.transfer.TransferEngine``).

``MooncakeStore`` holds the public API, checks its arguments (``args.py``) and composes
its parts, each an object with the state it owns: the data plane (``dataplane.py``: its
segment, mappings, the transfer engine), the link to the master (``link.py``: requests,
failover, heartbeats), the put reservation (``reservation.py``), the writer
(``write.py``), the reader (``read.py``) and the master's tasks (``tasks.py``). Weight
sync, its relays and the KV cache use :attr:`MooncakeStore.internal`
(``internals.py``), the one interface to these parts beyond the public API.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..common.errors import ObjectNotFoundError, from_code
from ..master import MasterConfig
from . import ssd
from .args import (
    as_bytes_view,
    check_config,
    check_force,
    check_key,
    check_keys,
    chunks,
    dedup,
    writable_view,
)
from .config import ReplicateConfig, StoreConfig
from .dataplane import DataPlane
from .internals import StoreInternals
from .link import Link
from .read import Reader
from .reservation import Reservations
from .segment import tune_malloc
from .tasks import Tasks
from .write import Writer

if TYPE_CHECKING:
    import torch

    from .args import BytesLike, WritableBuffer

log = logging.getLogger("mooncake_store")

log = logging.getLogger("mooncake_store")

_DEFAULT_REPLICATE = ReplicateConfig()


class Placement(NamedTuple):
    """Where an object lives: the segments holding it in memory, and the clients holding it on SSD.

    Both are lists of names.
    """

    memory: list
    ssd: list


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """The master's figures (counters since the master started).

    Attributes:
        objects: objects (committed).
        pending: puts in progress.
        used_bytes: bytes used, of all segments.
        capacity_bytes: bytes of all segments.
        clients: number of clients.
        segments: number of segments.
        deferred: allocations waiting for a lease to end before reuse.
        ssd_objects: objects with an SSD copy.
        puts: number of puts.
        gets: lookups of keys that exist, the same count as hits.
        hits: number of hits.
        misses: number of misses.
        evictions: objects whose memory copies were evicted.
        offloads: objects written to SSD; failed writes not counted.
        removes: number of removes.
        put_aborts: number of puts aborted.
        clients_lost: clients declared dead.
        ssd_drops: objects dropped from a full SSD directory (``StoreConfig.ssd_max_bytes``).
        reserved_bytes: part of used_bytes: space reserved for clients' next puts
            (``StoreConfig.put_reservation_bytes``).
        ssd_corrupt: SSD replicas dropped because their file was missing or failed its checksum.
        invalidations: ``invalidate`` requests.
        holds: holds taken.
        promotes: loads from SSD asked for by ``promote``.
        group_bytes: quota group -> bytes of its committed objects.
        drops: cause -> objects dropped, those dropped with an ancestor included (see
            docs/store.md).
        group_drops: quota group -> cause -> objects of the group dropped.
    """

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
    invalidations: int = 0
    holds: int = 0
    promotes: int = 0
    group_bytes: dict = dataclasses.field(default_factory=dict)
    drops: dict = dataclasses.field(default_factory=dict)
    group_drops: dict = dataclasses.field(default_factory=dict)


def _close_at_exit(ref):
    client = ref()
    if client is not None:
        client._close_at_exit()


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

    Attributes:
        cfg: the options in use (:class:`StoreConfig`, environment and defaults filled in).
        name: this client's name, also its segment's.
        client_id: this client's id at the master.
        internal: the internal interface weight sync, relays and the KV cache use
            (:class:`~mooncake_store.client.internals.StoreInternals`); not a public API.
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
        self.client_id = uuid.uuid4().hex
        self._closed = False
        self._embedded = None  # the master this client runs, without a master address
        self._ssd_lock = None  # the descriptor that holds ssd_dir's lock
        self._dataplane: DataPlane | None = None
        self._link: Link | None = None
        self._tasks: Tasks | None = None
        self._reservations: Reservations | None = None
        self._close_hooks: list = []  # weakref.WeakMethod, run by close() and at exit
        if cfg.tune_malloc:
            tune_malloc()
        if cfg.embedded_master:
            from ..master import Master

            # no busy polling: an embedded master shares the GIL and the cores with its client
            mc = cfg.master_config or MasterConfig(secret=cfg.secret, busy_poll_us=0)
            self._embedded = Master(mc).start()
            cfg.master = self._embedded.address
        try:
            self._dataplane = DataPlane(cfg)
            if cfg.ssd_dir:
                self._ssd_lock = ssd.lock_dir(cfg.ssd_dir)
            self._link = Link(cfg, self.client_id, self._dataplane)
            self._link.register()
        except BaseException:
            self._teardown()
            raise
        self._reservations = Reservations(cfg, self._link, self._dataplane)
        self._writer = Writer(cfg, self._link, self._dataplane, self._reservations)
        self._reader = Reader(cfg, self._link, self._dataplane)
        self._tasks = Tasks(self._link, self._dataplane, self._reservations, cfg.ssd_dir)
        self._link.start(self._tasks.put)
        self.internal = StoreInternals(
            self._link,
            self._dataplane,
            self._reader,
            self._writer,
            self._reservations,
            self._close_hooks,
        )
        # a process that exits without close() unregisters anyway, so that nobody places
        # objects in its vanished segment until its heartbeat times out
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def master_address(self) -> str:
        """``HOST:PORT`` of the master in use (the embedded one's, if embedded)."""
        return self.cfg.master if self.cfg.etcd is None else (self._link.resolve() or "")

    # ------------------------------------------------------------------ puts

    def put(self, key: str, value: BytesLike, config: ReplicateConfig = _DEFAULT_REPLICATE) -> int:
        """Stores ``value`` (bytes-like, ``b""`` allowed) under ``key``.

        Args:
            key: the key.
            value: the value, bytes-like (``b""`` allowed).
            config: how the object is placed (:class:`ReplicateConfig`).

        Returns:
            How many replicas were placed (``config.replica_num`` or fewer when fewer segments can
            hold it).

        Raises:
            ObjectExistsError: the key exists or is being written (use :meth:`upsert`).
            ReplicaShortfallError: ``require_all``; nothing stored.
            NoSpaceError: no segment can hold the object.
            TransferError: the bytes could not be written.
            PutLostError: the master no longer knows the put: it outlasted ``put_ttl_s``, or a
                leader change lost it; nothing stored.
            ValueError: bad arguments (before anything is sent).
        """
        return self._writer.put_many(
            [check_key(key, "put")],
            [as_bytes_view(value, "put: value")],
            [b""],
            check_config(config, "put"),
        )[0]

    def upsert(
        self, key: str, value: BytesLike, config: ReplicateConfig = _DEFAULT_REPLICATE
    ) -> int:
        """Like :meth:`put`, but replaces an existing value (any size).

        Readers see the old value until the new one is complete. Returns the replicas placed.
        """
        return self._writer.put_many(
            [check_key(key, "upsert")],
            [as_bytes_view(value, "upsert: value")],
            [b""],
            check_config(config, "upsert"),
            upsert=True,
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
        """Stores several objects with two metadata round trips.

        Returns the replica count per key. A key that fails does not stop the others: its error is
        raised after the whole batch (the first one), or returned in its place with
        ``return_exceptions``.
        """
        keys = check_keys(keys, "put_batch")
        check_config(config, "put_batch")
        views = [as_bytes_view(v, "put_batch: value") for v in values]
        if len(views) != len(keys):
            raise ValueError(f"put_batch: {len(keys)} keys but {len(views)} values")
        return self._writer.put_many(
            keys,
            views,
            [b""] * len(keys),
            config,
            upsert=upsert,
            return_exceptions=return_exceptions,
        )

    def put_tensor(
        self,
        key: str,
        tensor: torch.Tensor,
        config: ReplicateConfig = _DEFAULT_REPLICATE,
        *,
        upsert: bool = False,
    ) -> int:
        """Stores a CPU tensor; :meth:`get_tensor` returns it with dtype and shape.

        Any dtype and shape; non-contiguous ones are copied first; zero elements allowed.
        """
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
        return self._writer.put_tensors(
            keys, tensors, config, upsert=upsert, return_exceptions=return_exceptions, op=_op
        )

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        """A copy of the value of ``key`` as ``bytes`` (owned by the caller).

        Raises:
            ObjectNotFoundError: the key does not exist or no version is complete yet (a
                ``KeyError``).
            LeaseExpiredError: the copy outlasted the lease.
            TransferError: no replica can be read.
        """
        return self._reader.get(check_key(key, "get"))

    def get_batch(self, keys: Sequence[str], *, return_exceptions: bool = False) -> list:
        """Copies of several values with one metadata round trip.

        A missing key raises ``ObjectNotFoundError`` (after the whole batch) or, with
        ``return_exceptions``, comes back as that exception in its place. A key may repeat: it is
        read once and its value returned at each of its positions.
        """
        keys = check_keys(keys, "get_batch", repeats=True)
        return self._reader.get_batch(keys, return_exceptions)

    def get_into(self, key: str, buffer: WritableBuffer) -> int:
        """Copies the value of ``key`` into ``buffer``.

        Args:
            key: the key.
            buffer: a writable bytes-like object or contiguous CPU tensor, at least the value's
                size.

        Returns:
            The value's size in bytes.

        Raises:
            ValueError: the buffer is too small (nothing written).
            ObjectNotFoundError: the key does not exist or no version is complete yet.
            TransferError: no replica can be read (nothing written: a read from another host lands
                in a temporary first).
            LeaseExpiredError: the copy outlasted the lease: the buffer holds bytes that may have
                been evicted meanwhile and must not be used.
        """
        return self._reader.get_into(check_key(key, "get_into"), writable_view(buffer, "get_into"))

    def get_into_batch(
        self,
        keys: Sequence[str],
        buffers: Sequence[WritableBuffer],
        *,
        return_exceptions: bool = False,
    ) -> list:
        """Batch form of :meth:`get_into`: returns the sizes.

        With ``return_exceptions``, exceptions come back in place. A key may repeat: each of its
        buffers receives the value (one request per repetition).
        """
        keys = check_keys(keys, "get_into_batch", repeats=True)
        mvs = [writable_view(b, "get_into_batch") for b in buffers]
        if len(mvs) != len(keys):
            raise ValueError(f"get_into_batch: {len(keys)} keys but {len(mvs)} buffers")
        return self._reader.get_into_batch(keys, mvs, return_exceptions)

    def get_tensor(self, key: str) -> torch.Tensor:
        """The tensor stored by :meth:`put_tensor` (same dtype and shape).

        Raises:
            ObjectNotFoundError: the key does not exist or no version is complete yet.
            ValueError: the object is not a tensor.
            LeaseExpiredError: the copy outlasted the lease.
            TransferError: no replica can be read.
        """
        return self.get_tensor_batch([check_key(key, "get_tensor")])[0]

    def get_tensor_batch(self, keys: Sequence[str], *, return_exceptions: bool = False) -> list:
        """Batch form of :meth:`get_tensor`.

        A key may repeat: it is read once and each further position gets its own copy (a clone).
        """
        keys = check_keys(keys, "get_tensor_batch", repeats=True)
        return self._reader.get_tensors(keys, return_exceptions)

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
            out += self._link.call("exists", {"keys": uniq[a:b]})["exists"]
        return out if pos is None else [out[j] for j in pos]

    def remove(self, key: str, force: bool = False) -> None:
        """Removes ``key``.

        Args:
            key: the key.
            force: remove it even while a reader holds a lease; the space is reused only once the
                lease has expired, so the reader's copy stays intact.

        Raises:
            ObjectNotFoundError: the key does not exist.
            ObjectHasLeaseError: a reader holds a lease (and ``force`` is False).
        """
        check_force(force, "remove")
        (item,) = self._link.call(
            "remove",
            {"client": self._link.client_id, "keys": [check_key(key, "remove")], "force": force},
        )["items"]
        if item[0] != 0:
            raise from_code(item[1], item[2])

    def remove_batch(
        self, keys: Sequence[str], force: bool = False, *, return_exceptions: bool = False
    ) -> list:
        """:meth:`remove` for several keys (each once).

        Returns ``None`` per key, or the exception in its place with ``return_exceptions``.
        """
        keys = check_keys(keys, "remove_batch")
        check_force(force, "remove_batch")
        res: list = []
        for a, b in chunks(keys):
            res += self._link.call(
                "remove", {"client": self._link.client_id, "keys": keys[a:b], "force": force}
            )["items"]
        out = [None if it[0] == 0 else from_code(it[1], it[2]) for it in res]
        if not return_exceptions:
            for o in out:
                if o is not None:
                    raise o
        return out

    def where(self, key: str) -> Placement:
        """Where ``key`` lives (introspection for tests and operators).

        A :class:`Placement` of segment names (memory) and client names (SSD). Raises
        ``ObjectNotFoundError``.
        """
        (w,) = self._link.call("where", {"keys": [check_key(key, "where")]})["where"]
        if w is None:
            raise ObjectNotFoundError(f"key {key!r} not found")
        return Placement(memory=list(w["memory"]), ssd=list(w["ssd"]))

    def stats(self) -> StoreStats:
        """The master's figures as a :class:`StoreStats`."""
        d = self._link.call("stats", {})
        return StoreStats(
            **{
                f.name: dict(d.get(f.name) or {}) if f.type == "dict" else int(d.get(f.name, 0))
                for f in dataclasses.fields(StoreStats)
            }
        )

    def metrics(self) -> str:
        """The master's Prometheus text metrics."""
        return self._link.call("metrics", {})["text"]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unregisters (objects held only in this client's segment are gone) and frees everything.

        Idempotent.
        """
        if self._closed:
            return
        self._run_close_hooks()
        self._closed = True
        self._link.unregister()
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
        self._link.exiting = True  # each request one short try: exit must not wait for a master
        self._run_close_hooks()
        self._closed = True
        if self._embedded is None:
            self._link.unregister(quick=True)
        self._teardown()

    def _teardown(self):
        self._closed = True
        if self._link is not None:
            self._link.close()
        if self._tasks is not None:
            self._tasks.close()
        if self._reservations is not None:
            self._reservations.close()
        if self._dataplane is not None:
            self._dataplane.close()
        if self._ssd_lock is not None:
            os.close(self._ssd_lock)  # releases the directory's lock
            self._ssd_lock = None
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
