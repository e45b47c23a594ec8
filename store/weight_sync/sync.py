"""Weight sync from trainers to rollout workers (see docs/design.md "Store", ``WeightSync``).

Two paths:

* **Store path** (:class:`WeightSync`): the trainer ``publish``-es a state dict under a
  model name and an increasing version; rollout workers ``pull`` the latest (or a given)
  version into their model. Atomic per reader: a reader stages the whole version, checks
  that every piece is present (and its checksum), and only then copies it into its
  tensors; on any error it keeps (and reports) its previous version.
* **Process-group path** (:class:`GroupWeightSync`): a bucketed broadcast over a
  ``mooncake`` (or any) process group from a source rank; atomic for the whole group:
  every bucket is staged, after each bucket the group agrees (``all_reduce`` of a failure
  count) whether to go on, and the staged tensors are installed only when every rank
  staged every bucket.

Store layout of model ``M`` (all values are msgpack or raw tensor bytes; nothing is
unpickled)::

    ws/M/latest            {"version": v, "pid": pid}: newest committed version and the
                           publish that committed it (upserted after commit)
    ws/M/versions          [v, ...]: committed versions not dropped yet (both records are
                           the metadata of empty objects: they live in the master alone)
    ws/M/v<v>/a<k>         {"pid", "shard", "n", "t"}: publish attempt k of version v (a plain
                           put of the first free k, before any piece): what each publisher
                           writes under v, so that a later commit or drop can remove it
    ws/M/v<v>/<pid>/b<s>.<i>  bucket i of shard s of publish <pid> (tensor bytes, packed)
    ws/M/v<v>/<pid>/m<s>   manifest of shard s of publish <pid>: its buckets and tensor pieces
    ws/M/v<v>/commit       {"num_shards": n, "pid": pid}: written (put, never replaced) by shard
                           0 after every shard's manifest exists; a version is visible only
                           then, and readers read only the pieces of the publish it names
    ws/M/slot/<i>          reader slot i (taken with a plain put: first come, first served)
    ws/M/hold/<i>          {"version": v, "t": unix time}: reader i is pulling version v
                           (slot and hold records are metadata of empty objects too)

Two publishers of one version (an old trainer not yet dead while its replacement
republishes ``latest_version() + 1``) write disjoint keys (each publish has its own id
``pid``: a fresh one per call, or ``publish_id`` shared by the shards of one sharded
publish); the commit record is a plain put, so exactly one commits. The loser's shard 0
removes what it wrote and raises ``StaleVersionError``; the winner's commit removes the
pieces of every other attempt at that version (losers, dead publishers), and dropping a
version removes every attempt's.

Old versions: after each commit, shard 0 drops committed versions older than the newest
``keep_versions + 1`` unless a reader holds them (a hold younger than ``hold_ttl_s``):
commit record first, then the pieces (``remove(force=True)``: a copy in progress is safe,
the store reuses leased space only after the lease ends). A reader whose version vanished
under it fails its pull and keeps its old version; the next ``pull()`` takes the newest.
A publish that fails with an exception (``NoSpaceError``, ``TransferError``, ...) before its
commit removes the pieces its shard wrote; a ``NoSpaceError`` while the store still has
space to give back (dropped versions a reader read less than ``lease_ttl_s`` ago) is
retried for up to ``lease_ttl_s``. Pieces of a trainer that died mid-publish stay (pinned)
until a publish of the same version commits (or the version is dropped).

Sharded trainers (DTensor / FSDP2 state dicts): every rank calls ``publish`` with its own
state dict, ``shard=rank``, ``num_shards=world`` and the same ``publish_id`` (unique per
publish, e.g. a uuid broadcast from rank 0); each rank writes only its local
shards (replicated DTensor placements: only the rank at coordinate 0 of those mesh
dimensions; plain tensors: only shard 0) with their global offsets; shard 0 commits once
all manifests exist. Readers assemble full tensors from the pieces and check that the
pieces cover every element.

Across hosts (``WeightSyncConfig.relay``): one pull per host, hosts passing buckets on
along a chain; its records ``ws/M/v<v>/relay/h<host>`` and ``relay/c<k>`` and the copies
``ws/M/v<v>/<pid>/r<rid>/b<s>.<i>.p<j>`` (parts of a bucket, named by the relaying reader) live in the relays' own segments (``relay.py``).

Code: :class:`WeightSync` here, with its publish side in ``publish.py``, its pull side in
``pull.py`` and its relays across hosts in ``relay.py``; :class:`GroupWeightSync` in
``group.py``; the result records, ``tensor_digest`` and shared helpers in ``common.py``;
the options in ``config.py``.
"""

from __future__ import annotations

import threading
import uuid

import msgpack

from ..client import MooncakeStore, ReplicateConfig
from ..common.errors import ObjectNotFoundError, short_repr
from .config import WeightSyncConfig
from .publish import _PublishMixin
from .pull import _PullMixin


class WeightSync(_PublishMixin, _PullMixin):
    """Versioned weights of one model in a :class:`~mooncake_store.MooncakeStore`.

    ``WeightSync(store, "policy")``; trainer: ``publish(state_dict, version)``; rollout:
    ``pull(into=model)``. ``config`` is a :class:`WeightSyncConfig`. One object per
    process and model; a reader's ``version`` is the version it holds (-1: none)."""

    def __init__(self, store: MooncakeStore, model: str, *, config: WeightSyncConfig | None = None):
        if not isinstance(model, str) or not model or "/" in model or len(model) > 200:
            raise ValueError(
                "model must be a non-empty str without '/' (at most 200 chars), got "
                f"{short_repr(model) if isinstance(model, str) else repr(model)}"
            )
        if not isinstance(store, MooncakeStore):
            raise TypeError(
                f"WeightSync: store must be a MooncakeStore, got {type(store).__name__}"
            )
        self.store = store
        self.model = model
        self.cfg = config or WeightSyncConfig()
        if not isinstance(self.cfg, WeightSyncConfig):
            raise TypeError(
                f"WeightSync: config must be a WeightSyncConfig, got {type(self.cfg).__name__}"
            )
        self._p = f"ws/{model}/"
        # a publisher's pieces go to its own segment when it has one (readers on other
        # hosts may contribute segments too, to relay: relay.py)
        own = store.name if store.internal.segment is not None else None
        self._rc = ReplicateConfig(pin=self.cfg.pin, preferred_segment=own)
        self.version = -1
        # the publish id of the version held (a version number committed again with other
        # bytes, after a master restart without etcd lost the records, is installed again)
        self._held_pid: str | None = None
        self._staged_pid: str | None = None  # the publish id of the version last staged
        self._warned_behind = False  # a store whose latest is below the held version: said once
        self._published = (
            -1
        )  # the highest version this object committed (a floor the master may forget)
        self._slot: int | None = None
        self._spare: dict = {}  # staging tensors of the last pull, reused by the next one
        self._rid = uuid.uuid4().hex  # this reader, in its slot and hold records
        self._hold_lock = threading.Lock()  # pulls and the refresh thread write one hold key
        # version -> live view arrays of it: a version stays held while any tensor viewing
        # it lives (also one the caller detached or kept from an earlier pull)
        self._refs: dict = {}
        self._view_targets: dict = {}  # id(target tensor) -> (weakref to it, data_ptr of its view)
        self._into = None  # (id, weakref or None) of the last `into`, or "none" (into=None)
        self._refresher: threading.Thread | None = None
        self._relay = None  # the relay role of the last pull (relay.RelayPull), or None
        self._stop = threading.Event()
        # viewed versions found dropped while this reader still had views of them (its hold
        # lapsed: the process was stopped or starved past hold_ttl_s); see _refresh_main
        self.lapsed_versions: list = []
        # closing the store (or the process exiting) releases this reader first
        store.internal.on_close(self.release)

    # ------------------------------------------------------------------ helpers
    def _get_msg(self, key, default=ObjectNotFoundError):
        try:
            return msgpack.unpackb(self.store.get(key), raw=False)
        except ObjectNotFoundError:
            if default is ObjectNotFoundError:
                raise
            return default

    def _put_record(self, key: str, rec, upsert: bool = True) -> None:
        """Writes ``rec`` (msgpack) as the metadata of an empty object: it lives in the
        master alone, so it needs no segment and outlives whoever wrote it (a trainer
        holding the store's memory that restarts still finds its version history; a reader
        records its holds with no trainer alive). ``upsert=False``: a plain put
        (``ObjectExistsError`` if the key exists)."""
        self.store.internal.put_many([key], [b""], [msgpack.packb(rec)], self._rc, upsert=upsert)

    def _get_records(self, keys: list) -> list:
        """The records :meth:`_put_record` wrote (None where a key does not exist or holds
        no valid record)."""
        out = []
        for key, meta in zip(keys, self.store.internal.metadata(keys)):
            try:
                if meta is None:
                    out.append(None)
                elif (
                    meta is True or not meta
                ):  # an older master without metadata, or a record written as a value
                    out.append(self._get_msg(key, None))
                else:
                    out.append(msgpack.unpackb(meta, raw=False))
            except Exception:
                out.append(None)
        return out

    def _get_record(self, key: str, default=None):
        rec = self._get_records([key])[0]
        return default if rec is None else rec

    def latest_version(self) -> int:
        """The newest committed version in the store (-1: none). Read from the master's
        metadata alone, so a restarted trainer or a new reader sees it, also when the
        segment that held the versions' bytes is gone."""
        return self._latest()[0]

    def _latest(self) -> tuple:
        """(the newest committed version or -1, the publish id that committed it or None)."""
        rec = self._get_record(self._p + "latest")
        if not isinstance(rec, dict):
            return -1, None
        return int(rec["version"]), rec.get("pid")

    def committed_versions(self) -> list:
        """Committed versions not dropped yet, oldest first."""
        return [int(v) for v in (self._get_record(self._p + "versions") or [])]
