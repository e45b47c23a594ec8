"""The store client's internal interface (``MooncakeStore.internal``).

What weight sync, its relays across hosts and the KV cache use beyond the public API of
:class:`~mooncake_store.MooncakeStore`, in one place and by name. Not a public API: it changes with
the code that uses it.

What it offers, and who uses it today:

* records in metadata: :meth:`StoreInternals.put_many` with per-object metadata bytes,
  and :meth:`StoreInternals.metadata` to read them back from the master alone
  (``WeightSync``'s version records and reader holds; ``KVCacheStore``'s chunk layouts);
* reads into staging memory, whole or in part (:meth:`StoreInternals.read_into`), and
  read-only views of this host's memory with no copy (:meth:`StoreInternals.local_views`,
  ``WeightSync(install="view")``);
* writes in place in this client's own segment: :meth:`StoreInternals.place`, then
  :meth:`StoreInternals.commit` or :meth:`StoreInternals.revoke` (a relay lands the bytes
  it reads from another host straight in its copy);
* where objects lie (:meth:`StoreInternals.locate`, :meth:`StoreInternals.replica_is_local`)
  and what this client offers (:attr:`StoreInternals.segment`,
  :attr:`StoreInternals.serves_transfers`, :attr:`StoreInternals.lease_ttl_s`);
* :meth:`StoreInternals.on_close`: something to do before the client goes.

Its attributes ``link``, ``dataplane``, ``reader``, ``writer`` and ``reservations`` are the
client's parts, for tests and operators that look inside.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

from .args import as_bytes_view, check_keys
from .config import ReplicateConfig
from .dataplane import DataPlane
from .link import Link
from .read import Reader
from .reservation import Reservations
from .segment import LocalSegment
from .write import Writer


class Located(NamedTuple):
    """Where objects lie (:meth:`StoreInternals.locate`)."""

    objects: list  #: per key an ``ObjectMeta`` (``read.py``), or None when it is missing
    segments: dict  #: segment name -> descriptor, for the segments named in ``objects``
    deadline: float  #: ``time.monotonic()`` at which the read leases taken end


class StoreInternals:
    """The internal interface of one :class:`~mooncake_store.MooncakeStore`.

    See the module docstring. Keys are checked as the public API checks them (``ValueError``).

    Attributes:
        link: the link to the master (``link.py``).
        dataplane: segments, mappings and the transfer engine (``dataplane.py``).
        reader: the read path (``read.py``).
        writer: the write path (``write.py``).
        reservations: the put reservation (``reservation.py``).
    """

    def __init__(
        self,
        link: Link,
        dataplane: DataPlane,
        reader: Reader,
        writer: Writer,
        reservations: Reservations,
        close_hooks: list,
    ):
        self.link = link
        self.dataplane = dataplane
        self.reader = reader
        self.writer = writer
        self.reservations = reservations
        self._close_hooks = close_hooks

    # ------------------------------------------------------------------ this client
    @property
    def segment(self) -> LocalSegment | None:
        """This client's own segment (None: it contributes none)."""
        return self.dataplane.segment

    @property
    def serves_transfers(self) -> bool:
        """Whether clients of other hosts can read this client's segment.

        They can when a transfer engine serves it.
        """
        return self.dataplane.te_desc() is not None

    @property
    def lease_ttl_s(self) -> float:
        """Seconds a read lease lasts (the master's ``lease_ttl_s``).

        Space the master defers for a reader comes back at most this long after its read.
        """
        return self.link.lease_ttl_s

    def on_close(self, method: Callable[[], None]) -> None:
        """Runs the bound ``method`` when the client closes (or the process exits).

        It runs before the client unregisters. Held weakly: an object that goes away is not kept
        alive by this, and its method is not run.
        """
        self._close_hooks.append(weakref.WeakMethod(method))

    # ------------------------------------------------------------------ records
    def put_many(
        self,
        keys: list,
        values: list,
        metas: list,
        config: ReplicateConfig,
        *,
        upsert: bool = False,
        own_segment_only: bool = False,
    ) -> list:
        """Stores ``values[i]`` (bytes-like) under ``keys[i]`` with ``metas[i]`` as its metadata.

        ``metas[i]`` (bytes, at most ``MasterConfig.max_meta_bytes``) is the metadata the master
        keeps with the object, which :meth:`metadata` returns without a read. An empty value lives
        in the master alone: its metadata is a record that outlives every segment.

        Args:
            keys: one entry per object (each key once).
            values: one entry per object, as ``keys``.
            metas: one entry per object, as ``keys``.
            config: placement, as for ``put``.
            upsert: replace existing values (else ``ObjectExistsError`` for those).
            own_segment_only: placed in ``config.preferred_segment`` alone (``NoSpaceError`` when it
                has no room: no other segment takes the object).

        Returns:
            The replicas placed per key.

        Raises:
            StoreError: the first key's error, after the whole batch (``ObjectExistsError``,
                ``NoSpaceError``, ...).
        """
        keys = check_keys(keys, "put_many")
        views = [as_bytes_view(v, "put_many: value") for v in values]
        return self.writer.put_many(
            keys, views, list(metas), config, upsert=upsert, only_preferred=own_segment_only
        )

    def metadata(self, keys: list) -> list:
        """Per key ``None`` if it does not exist, else the metadata bytes stored with it.

        The metadata is ``b""`` for plain values, dtype and shape for ``put_tensor``; ``True`` where
        the master sends none (an older master). From the master alone: no lease, no bytes read,
        nothing loaded from SSD. A key may repeat.
        """
        return self.reader.exists_meta(check_keys(keys, "metadata", repeats=True))

    # ------------------------------------------------------------------ reads
    def read_into(
        self, key: str, buffer: memoryview, *, scratch: bool = False, offset: int | None = None
    ) -> int:
        """``get_into`` of ``key`` into the flat writable byte view ``buffer``.

        Returns the bytes read.

        Args:
            key: the key to read.
            buffer: the flat writable byte view the bytes land in.
            scratch: the caller throws ``buffer`` away on any error (a staging buffer), so a read
                from another host lands in it directly (one copy less per byte; a failed read may
                leave part of the bytes there).
            offset: reads bytes ``[offset, offset + len(buffer))`` of the value (from its replicas
                in memory only) instead of all of it.

        Raises:
            ValueError: the buffer is too small, or the range not within the value.
            StoreError: as ``get_into`` (``ObjectNotFoundError``, ``TransferError``,
                ``LeaseExpiredError``).
        """
        (key,) = check_keys([key], "read_into")
        return self.reader.get_into(key, buffer, scratch, offset)

    def local_views(self, keys: list) -> tuple:
        """``(views, deadline)``: per key a read-only view of the value in this host's memory.

        The view is a ``memoryview`` of the value's first replica where it lies in memory on this
        host (this client's own segment too), else None (also for a missing key); ``deadline`` is
        the ``time.monotonic()`` at which the read lease ends. No copy: the bytes stay the store's,
        valid while the object is not removed (the caller protects them: ``WeightSync`` holds the
        version). A view of another client's segment keeps its mapping alive after the segment goes
        away.
        """
        return self.reader.local_views(check_keys(keys, "local_views"))

    def locate(self, keys: list) -> Located:
        """Where each key's replicas are (:class:`Located`).

        Takes a read lease on each, as a ``get`` does.
        """
        return Located(*self.reader.meta(check_keys(keys, "locate")))

    def replica_is_local(self, key: str) -> bool | None:
        """Whether the first replica of ``key`` lies in memory on this host (mapped: no network).

        False when it lies in another host's memory; None when ``key`` is missing or lies only on
        SSD. Takes a read lease, as a ``get`` does.
        """
        (obj,), segs, _ = self.locate([key])
        if obj is None or not obj.replicas or obj.replicas[0][0] != "m":
            return None
        return self.dataplane.is_local(segs[obj.replicas[0][1]])

    # ------------------------------------------------------------------ writes in place
    def place(self, keys: list, sizes: list, *, pin: bool = True) -> list | None:
        """Starts upserts of ``keys`` in this client's own segment, with one request.

        One replica each; ``sizes`` are in bytes, each > 0. The caller writes each object's bytes
        into its view, then :meth:`commit`-s it or :meth:`revoke`-s what it will not.

        Returns:
            ``[(view, version)]`` in the order of ``keys``: a writable view of each
            object's place, and the version to commit; None (nothing started) when the
            segment has no room for all of them.

        Raises:
            StoreError: the master refused a put (its error), or placed one elsewhere.
        """
        return self.writer.place_own(check_keys(keys, "place"), list(sizes), pin=pin)

    def commit(self, key: str, version: int) -> None:
        """Commits ``key`` at ``version`` (from :meth:`place`): readers see it from now on.

        Raises the master's ``StoreError`` (``PutLostError``: it forgot the put).
        """
        self.writer.commit_one(key, version)

    def revoke(self, items: list) -> None:
        """Gives puts that :meth:`place` started back (``[key, version]`` items).

        Never raises (a master out of reach drops them with this client's other state).
        """
        self.writer.revoke(items)
