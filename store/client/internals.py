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
* :meth:`StoreInternals.on_close`: something to do before the client goes;
* links between objects and what the master does with them (the KV cache's chunk chains
  and tenants): a ``parent`` per object (dropping it drops the objects that hang off
  it), ``tags`` (:meth:`StoreInternals.invalidate` drops every object carrying one), a
  quota ``group`` (all in :meth:`StoreInternals.put_many`); why keys were dropped
  (:meth:`StoreInternals.history`); holds against eviction (:meth:`StoreInternals.hold`,
  :meth:`StoreInternals.release`); loads from SSD ahead of reads
  (:meth:`StoreInternals.promote`); keys by prefix (:meth:`StoreInternals.list_prefixes`,
  :meth:`StoreInternals.remove_prefix`).

Its attributes ``link``, ``dataplane``, ``reader``, ``writer`` and ``reservations`` are the
client's parts, for tests and operators that look inside.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

from .args import as_bytes_view, check_key, check_keys, chunks
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


MAX_TAGS = 16  # tags of one object (the master's limit too)
MAX_TAG_BYTES = 256  # UTF-8 bytes of a tag or a group's name (the master's limit too)
MAX_HOLD_KEYS = 2048  # keys of one hold (one request)
MAX_HOLD_TTL_S = 3600.0


class DropRecord(NamedTuple):
    """Why the master dropped a key (:meth:`StoreInternals.history`)."""

    cause: str  #: "evicted", "invalidated", "holder_lost", "removed", "corrupt" or "orphaned"
    tier: str  #: where it was dropped from: "memory", "ssd" or "master" (an empty object)
    unix_s: float  #: when (the master's wall clock)
    detail: str  #: the tag, client, group quota...; "with parent <key>: ..." when an ancestor's drop took it


class HoldId(int):
    """The id of a hold (:meth:`StoreInternals.hold`), an ``int``.

    Attributes:
        held: how many of the keys existed and are held.
    """

    held: int

    def __new__(cls, hold_id: int, held: int):
        """A hold id ``hold_id`` of ``held`` keys."""
        self = super().__new__(cls, hold_id)
        self.held = held
        return self


def _check_tag(tag, op: str, what: str = "tag") -> str:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"{op}: a {what} must be a non-empty str, got {tag!r}")
    try:
        n = len(tag.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{op}: {what} {tag!r} is not valid Unicode text") from None
    if n > MAX_TAG_BYTES:
        raise ValueError(f"{op}: a {what} must be at most {MAX_TAG_BYTES} bytes, got {n}")
    return tag


def _links(keys: list, parents, tags, op: str) -> dict | None:
    """The links of a ``put_many``'s keys, as the master takes them.

    Returns:
        ``key -> {"p": parent, "t": [tags]}`` for the keys with a parent or tags; None when
        none has.

    Raises:
        ValueError: malformed parents or tags (naming ``op``).
    """
    out: dict = {}
    if parents is not None:
        parents = list(parents)
        if len(parents) != len(keys):
            raise ValueError(f"{op}: {len(parents)} parents for {len(keys)} keys")
        for k, p in zip(keys, parents):
            if p is None:
                continue
            check_key(p, f"{op}: parent")
            if p == k:
                raise ValueError(f"{op}: key {k!r} names itself as its parent")
            out[k] = {"p": p}
    if tags is not None:
        tags = list(tags)
        if len(tags) != len(keys):
            raise ValueError(f"{op}: {len(tags)} tag lists for {len(keys)} keys")
        for k, ts in zip(keys, tags):
            if ts is None:
                continue
            if isinstance(ts, (str, bytes)) or not hasattr(ts, "__iter__"):
                raise ValueError(f"{op}: the tags of {k!r} must be a list of str, got {ts!r}")
            ts = [_check_tag(t, op) for t in ts]
            if len(ts) > MAX_TAGS:
                raise ValueError(f"{op}: {k!r} has {len(ts)} tags, at most {MAX_TAGS} allowed")
            if ts:
                out.setdefault(k, {})["t"] = ts
    return out or None


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
        parents: list | None = None,
        tags: list | None = None,
        group: str | None = None,
        quota_bytes: int | None = None,
        return_exceptions: bool = False,
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
            own_segment_only: placed in ``config.preferred_segment`` alone (``NoSpaceError``
                when it has no room: no other segment takes the object).
            parents: per key None or the key of its parent: the object commits only while
                the parent is stored (an earlier key of this call counts), and is dropped
                whenever the parent is (``ParentMissingError`` otherwise; nothing stored).
            tags: per key None or up to 16 tags (non-empty str of at most 256 bytes of
                UTF-8, namespaced by the caller): :meth:`invalidate` drops by them.
            group: the quota group of every object (a non-empty str of at most 256 bytes):
                the master counts its bytes (value sizes, wherever the objects lie).
            quota_bytes: the group's quota (> 0): a put that would take the group above it
                first drops the group's least recently used objects that may be evicted,
                and fails with ``NoSpaceError`` when that is not enough. Without it, the
                quota the group's last put named holds.
            return_exceptions: each key's error in its place instead of raising the first.

        Returns:
            The replicas placed per key (or its error, with ``return_exceptions``).

        Raises:
            ValueError: a malformed argument (nothing is sent).
            StoreError: the first key's error, after the whole batch (``ObjectExistsError``,
                ``NoSpaceError``, ``ParentMissingError``, ...).
        """
        keys = check_keys(keys, "put_many")
        views = [as_bytes_view(v, "put_many: value") for v in values]
        metas = list(metas)
        if len(views) != len(keys) or len(metas) != len(keys):
            raise ValueError(
                f"put_many: {len(keys)} keys, {len(views)} values and {len(metas)} metas"
            )
        links = _links(keys, parents, tags, "put_many")
        if group is not None:
            _check_tag(group, "put_many", "group")
        if quota_bytes is not None and not (
            isinstance(quota_bytes, int)
            and not isinstance(quota_bytes, bool)
            and 0 < quota_bytes < 1 << 62
        ):
            raise ValueError(f"put_many: quota_bytes must be an int > 0, got {quota_bytes!r}")
        if quota_bytes is not None and group is None:
            raise ValueError("put_many: quota_bytes needs a group")
        return self.writer.put_many(
            keys,
            views,
            metas,
            config,
            upsert=upsert,
            only_preferred=own_segment_only,
            return_exceptions=return_exceptions,
            links=links,
            group=group,
            quota=quota_bytes,
        )

    def metadata(self, keys: list, *, touch: bool = False) -> list:
        """Per key ``None`` if it does not exist, else the metadata bytes stored with it.

        The metadata is ``b""`` for plain values, dtype and shape for ``put_tensor``; ``True`` where
        the master sends none (an older master). From the master alone: no lease, no bytes read,
        nothing loaded from SSD. A key may repeat.

        Args:
            keys: the keys.
            touch: the keys found count as just used for eviction (as a ``get`` does, without a
                lease): a lookup that precedes a read keeps what it found from being evicted
                first.
        """
        return self.reader.exists_meta(check_keys(keys, "metadata", repeats=True), touch)

    def history(self, keys: list) -> list:
        """Why the master dropped each of ``keys`` (a key may repeat).

        The master remembers the last ``MasterConfig.history_entries`` drops; a new leader
        remembers none.

        Returns:
            Per key a :class:`DropRecord`, or None (never dropped, stored again since, or
            forgotten).
        """
        keys = check_keys(keys, "history", repeats=True)
        out: list = []
        for a, b in chunks(keys):
            out += self.link.call("history", {"keys": keys[a:b]})["history"]
        return [None if e is None else DropRecord(*e) for e in out]

    def invalidate(self, tags: list) -> int:
        """Drops every object carrying any of ``tags``, with the objects that hang off them.

        Leased, pinned and held objects go too (the memory of leased ones is reused once the
        readers' leases end). After it returns, no ``get`` or ``exists`` finds them. A
        two-request put of an object carrying one of the tags that is in progress when it runs
        fails with ``InvalidatedError``; a put committed in one request after it stores a new
        object. An unknown tag drops nothing.

        Returns:
            How many objects were dropped.

        Raises:
            ValueError: a malformed tag (nothing is sent).
        """
        if isinstance(tags, (str, bytes)):
            raise ValueError("invalidate: tags must be a list of str, not a single tag")
        tags = [_check_tag(t, "invalidate") for t in tags]
        n = 0
        for a, b in chunks(tags):
            n += self.link.call("invalidate", {"client": self.link.client_id, "tags": tags[a:b]})[
                "dropped"
            ]
        return n

    def add_tags(self, keys: list, tags: list) -> int:
        """Adds tags to objects already stored, so that :meth:`invalidate` drops them too.

        Args:
            keys: the objects' keys (missing ones are skipped).
            tags: per key a list of tags (non-empty str of at most 256 bytes of UTF-8); an
                object carries at most 16.

        Returns:
            How many objects got a new tag.

        Raises:
            ValueError: malformed keys or tags, or lists of different lengths (nothing is sent).
            ProtocolError: an object would carry more than 16 tags.
        """
        keys = check_keys(keys, "add_tags")
        if not isinstance(tags, (list, tuple)) or len(tags) != len(keys):
            raise ValueError(f"add_tags: one list of tags per key ({len(keys)}), got {tags!r}")
        tags = [[_check_tag(t, "add_tags") for t in ts] for ts in tags]
        n = 0
        for a, b in chunks(keys):
            n += self.link.call(
                "tag", {"client": self.link.client_id, "keys": keys[a:b], "tags": tags[a:b]}
            )["tagged"]
        return n

    def hold(self, keys: list, ttl_s: float) -> HoldId:
        """Keeps the objects of ``keys`` from eviction for ``ttl_s`` seconds.

        Nor are they dropped with an evicted ancestor, until :meth:`release`, the TTL, or the
        death of this client. A forced remove, :meth:`invalidate` and :meth:`remove_prefix`
        still drop them; keys that do not exist are ignored; a new leader knows no hold.

        Args:
            keys: at most 2048 keys.
            ttl_s: seconds, in (0, 3600].

        Returns:
            The hold's id, a :class:`HoldId` (an int whose ``held`` says how many keys existed
            and are held).

        Raises:
            ValueError: too many keys, or a bad ``ttl_s`` (nothing is sent).
        """
        keys = check_keys(keys, "hold", repeats=True)
        if len(keys) > MAX_HOLD_KEYS:
            raise ValueError(f"hold: at most {MAX_HOLD_KEYS} keys per hold, got {len(keys)}")
        if not (
            isinstance(ttl_s, (int, float))
            and not isinstance(ttl_s, bool)
            and 0 < ttl_s <= MAX_HOLD_TTL_S
        ):
            raise ValueError(
                f"hold: ttl_s must be in (0, {MAX_HOLD_TTL_S:g}] seconds, got {ttl_s!r}"
            )
        res = self.link.call(
            "hold", {"client": self.link.client_id, "keys": keys, "ttl_s": float(ttl_s)}
        )
        return HoldId(res["id"], res["held"])

    def release(self, hold_id: int) -> bool:
        """Ends the hold ``hold_id``.

        Returns:
            False when the master knows no such hold (released, expired, or taken from an
            earlier leader).
        """
        if not isinstance(hold_id, int) or isinstance(hold_id, bool):
            raise ValueError(f"release: hold_id must be an int, got {hold_id!r}")
        return bool(self.link.call("release", {"id": int(hold_id)})["released"])

    def promote(self, keys: list) -> int:
        """Has each object of ``keys`` that lies only on SSD loaded into memory (a prefetch).

        The load goes into the segment of the client whose SSD holds it. Nothing waits for the
        loads and no read lease is taken (a loaded copy is evicted as any other); missing keys
        and objects in memory or being loaded are skipped.

        Returns:
            How many loads were scheduled.
        """
        keys = check_keys(keys, "promote", repeats=True)
        n = 0
        for a, b in chunks(keys):
            n += self.link.call("promote", {"keys": keys[a:b]})["scheduled"]
        return n

    def list_prefixes(self, prefix: str, sep: str = "/") -> dict:
        """Counts the committed keys that start with ``prefix`` by their next segment.

        The segment is what follows ``prefix`` up to the first ``sep`` (the whole rest where
        there is none). The master scans every key (O(objects)): for housekeeping, not per
        request.

        Returns:
            ``{segment: objects}``.
        """
        if not isinstance(prefix, str):
            raise ValueError(f"list_prefixes: prefix must be a str, got {prefix!r}")
        if prefix:
            check_key(prefix, "list_prefixes: prefix")
        if not (isinstance(sep, str) and sep and len(sep) <= 16):
            raise ValueError(
                f"list_prefixes: sep must be a non-empty str of at most 16 chars, got {sep!r}"
            )
        return dict(self.link.call("list_prefixes", {"prefix": prefix, "sep": sep})["prefixes"])

    def remove_prefix(self, prefix: str, keep: tuple = ()) -> int:
        """Drops every committed object whose key starts with ``prefix`` but with none of ``keep``.

        The objects that hang off them go too, whatever their keys, and leased ones as well
        (their memory is reused once the readers' leases end). The master scans every key
        (O(objects)).

        Returns:
            How many objects were dropped.

        Raises:
            ValueError: an empty or malformed prefix (nothing is sent).
        """
        check_key(prefix, "remove_prefix: prefix")
        if isinstance(keep, str):
            raise ValueError("remove_prefix: keep must be a sequence of prefixes, not one str")
        keep = [check_key(k, "remove_prefix: keep") for k in keep]
        if len(keep) > 1024:
            raise ValueError(f"remove_prefix: at most 1024 prefixes to keep, got {len(keep)}")
        return self.link.call(
            "remove_prefix", {"client": self.link.client_id, "prefix": prefix, "keep": keep}
        )["dropped"]

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
