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

Code: :class:`WeightSync` here, composed of its parts: the model's keys and records
(``records.py``, :class:`~mooncake_store.weight_sync.records.ModelRecords`), its publish
side (``publish.py``, ``Publisher``) and its pull side (``pull.py``, ``Puller``, with
the relays across hosts in ``relay.py``); :class:`GroupWeightSync` in ``group.py``; the
result records, ``tensor_digest`` and shared helpers in ``common.py``; the options in
``config.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ..client import MooncakeStore
from ..common.errors import short_repr
from .common import PublishResult, PullResult
from .config import WeightSyncConfig
from .publish import Publisher
from .pull import Puller
from .records import ModelRecords

if TYPE_CHECKING:
    import torch


class WeightSync:
    """Versioned weights of one model in a :class:`~mooncake_store.MooncakeStore`.

    ``WeightSync(store, "policy")``; trainer: ``publish(state_dict, version)``; rollout:
    ``pull(into=model)``. ``config`` is a :class:`WeightSyncConfig`. One object per
    process and model; a reader's ``version`` is the version it holds (-1: none).

    Attributes:
        store: the client.
        model: the model's name.
        cfg: the options.
        records: the model's keys and records in the store (``records.py``).
        publisher: the publishing side (``publish.py``).
        puller: the reading side (``pull.py``).
    """

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
        self.records = ModelRecords(store, model, self.cfg.pin)
        self.publisher = Publisher(self.records, self.cfg)
        self.puller = Puller(self.records, self.cfg)
        # closing the store (or the process exiting) releases this reader first
        store.internal.on_close(self.release)

    @property
    def version(self) -> int:
        """The version this reader holds (-1: none)."""
        return self.puller.version

    @property
    def lapsed_versions(self) -> list:
        """Viewed versions found dropped while this reader still had views of them.

        Its hold lapsed: the process was stopped or starved past ``hold_ttl_s``. Listed until a pull
        installs a newer version.
        """
        return self.puller.lapsed_versions

    def publish(
        self,
        state_dict: dict[str, torch.Tensor] | torch.nn.Module,
        version: int,
        *,
        shard: int = 0,
        num_shards: int = 1,
        publish_id: str | None = None,
    ) -> PublishResult:
        """Writes ``state_dict`` as ``version``.

        With ``num_shards > 1`` every shard calls this with the same ``publish_id``, which names the
        pieces of this publish; shard 0 waits up to ``commit_timeout_s`` for the others' manifests
        and commits. A single-shard publish takes a fresh id when none is given.

        Args:
            state_dict: CPU tensors or DTensors; an ``nn.Module`` is taken by its state dict.
            version: the version to publish, above the latest committed one.
            shard: this shard's index.
            num_shards: how many shards write this publish.
            publish_id: a str of 1-64 letters, digits, ``_.-``, unique per publish (e.g. a uuid4 hex
                broadcast from rank 0); the same on every shard.

        Returns:
            :class:`PublishResult`.

        Raises:
            StaleVersionError: ``version`` is at or below the latest committed one, or another
                publisher committed ``version`` first (two trainers publishing one version: exactly
                one commits; the loser's shard 0 removes what it wrote and raises, naming the
                version).
            ValueError: bad input (before anything is written: sparse or nested tensors, dtypes
                torch cannot copy such as ``torch.int4``).
            StoreError: the store's errors: a failure before the commit removes what this shard
                wrote of ``version``, so a retry needs no more room than the first try; a
                ``NoSpaceError`` while the store has space of dropped versions to give back (read
                leases) is retried until that space is back (up to ``lease_ttl_s``).
        """
        return self.publisher.publish(state_dict, version, shard, num_shards, publish_id)

    def pull(
        self,
        into: torch.nn.Module | dict[str, torch.Tensor] | None = None,
        version: int | Literal["latest"] = "latest",
        *,
        dtype: torch.dtype | None = None,
        strict: bool = True,
        stage_hook: Callable[[int], None] | None = None,
    ) -> PullResult:
        """Installs ``version`` into ``into``.

        All or nothing: the whole version is read and checked (every piece present, checksums,
        shapes, every element covered) before the first tensor of ``into`` changes; on any error the
        previous version stays and the error is raised. Never goes back: ``"latest"`` at or below
        the version held, or before any publish, does nothing (``installed=False``).

        With ``WeightSyncConfig(install="view")`` (``into`` an ``nn.Module`` or ``None``), every
        tensor published whole, in memory on this host and not cast is installed as a view of the
        store's memory (``param.data = view``: no copy, shared by all readers of the host;
        read-only, a write kills the process with SIGSEGV); the reader keeps a hold on that version
        until its next pull or ``release()``. Other tensors are copied as above (into fresh memory
        when the target was a view).

        Args:
            into: an ``nn.Module`` or a dict of tensors; ``None``: the tensors come back in
                ``PullResult.state_dict``.
            version: ``"latest"`` or an int.
            dtype: casts floating-point tensors; a tensor of ``into`` keeps its dtype, and one whose
                dtype differs from the published one raises ``ValueError`` unless both are
                floating-point (then the values are cast).
            strict: ``into`` must have exactly the published names.
            stage_hook: ``stage_hook(i)`` runs before bucket ``i`` is staged (for validation and
                tests; its exception aborts the pull).

        Returns:
            :class:`PullResult`.

        Raises:
            WeightSyncAbortedError: a missing/corrupt piece (other errors are raised as they are).
            StaleVersionError: an int ``version`` below the one held.
            ValueError: a dtype of ``into`` that differs from the published one, unless both are
                floating-point.
        """
        return self.puller.pull(into, version, dtype, strict, stage_hook)

    def release(self) -> None:
        """Gives up this reader's slot (call when the reader goes away for good).

        With ``install="view"`` the parameters it installed as views become private copies first;
        tensors the caller kept or detached from views are not protected after this (a warning says
        so): publishers may reuse that memory.
        """
        self.puller.release()

    def latest_version(self) -> int:
        """The newest committed version in the store (-1: none).

        Read from the master's metadata alone, so a restarted trainer or a new reader sees it, also
        when the segment that held the versions' bytes is gone.
        """
        return self.records.latest_version()

    def committed_versions(self) -> list:
        """Committed versions not dropped yet, oldest first."""
        return self.records.committed_versions()
