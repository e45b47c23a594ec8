r"""``mooncake_store``: a distributed object store for tensors (see docs/design.md "Store").

    from mooncake_store import MooncakeStore, ReplicateConfig
    store = MooncakeStore()                       # embedded master, 256 MiB segment
    store.put("w", b"\x01\x02")
    store.get("w")

Master as a service: ``mooncake-store-master`` / ``python -m mooncake_store.master``.

The package's folders follow its jobs: ``client/`` (:class:`MooncakeStore`), ``master/``
(the metadata service), ``weight_sync/`` (:class:`WeightSync`: versioned weights, trainer
-> rollout, atomic per reader; :class:`GroupWeightSync`: the same over a process group,
atomic for the group), ``kvcache/`` (:class:`KVCacheStore`: prefix K/V chunks) and
``common/`` (errors, wire format, environment, segment layout).
"""

from .client import MooncakeStore, Placement, ReplicateConfig, StoreConfig, StoreStats
from .common.config import env_defaults
from .common.errors import (
    AuthError,
    InvalidatedError,
    LeaseExpiredError,
    NoSpaceError,
    NotLeaderError,
    ObjectExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ParentMissingError,
    ProtocolError,
    PutLostError,
    ReplicaShortfallError,
    StaleVersionError,
    StoreError,
    TransferError,
    WeightSyncAbortedError,
)
from .kvcache import (
    KVCacheConfig,
    KVCacheStats,
    KVCacheStore,
    KVExplain,
    KVGetResult,
    KVPutResult,
    chunk_hashes,
)
from .master import MasterConfig
from .weight_sync import (
    GroupSyncResult,
    GroupWeightSync,
    PublishResult,
    PullResult,
    WeightSync,
    WeightSyncConfig,
    tensor_digest,
)

__all__ = [
    "AuthError",
    "GroupSyncResult",
    "GroupWeightSync",
    "InvalidatedError",
    "KVCacheConfig",
    "KVCacheStats",
    "KVCacheStore",
    "KVExplain",
    "KVGetResult",
    "KVPutResult",
    "LeaseExpiredError",
    "Master",
    "MasterConfig",
    "MooncakeStore",
    "NoSpaceError",
    "NotLeaderError",
    "ObjectExistsError",
    "ObjectHasLeaseError",
    "ObjectNotFoundError",
    "ParentMissingError",
    "Placement",
    "ProtocolError",
    "PublishResult",
    "PullResult",
    "PutLostError",
    "ReplicaShortfallError",
    "ReplicateConfig",
    "StaleVersionError",
    "StoreConfig",
    "StoreError",
    "StoreStats",
    "TransferError",
    "WeightSync",
    "WeightSyncAbortedError",
    "WeightSyncConfig",
    "chunk_hashes",
    "env_defaults",
    "tensor_digest",
]


def __getattr__(name):
    # ``Master`` is imported on first use: only a process that runs a master pays for its
    # asyncio server (a client with a master elsewhere never loads it)
    if name == "Master":
        from .master import Master

        return Master
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
