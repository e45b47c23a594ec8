"""``mooncake_store``: a distributed object store for tensors (see docs/design.md "Store").

    from mooncake_store import MooncakeStore, ReplicateConfig
    store = MooncakeStore()                       # embedded master, 256 MiB segment
    store.put("w", b"\\x01\\x02")
    store.get("w")

Master as a service: ``mooncake-store-master`` / ``python -m mooncake_store.master``.

On top of it: :class:`WeightSync` (versioned weights, trainer -> rollout, atomic per
reader) and :class:`GroupWeightSync` (the same over a process group, atomic for the
group) in ``weight_sync.py``; :class:`KVCacheStore` (prefix K/V chunks) in ``kvcache.py``.
"""

from .client import MooncakeStore, Placement, StoreStats
from .config import (
    KVCacheConfig,
    MasterConfig,
    ReplicateConfig,
    StoreConfig,
    WeightSyncConfig,
    env_defaults,
)
from .errors import (
    AuthError,
    LeaseExpiredError,
    NoSpaceError,
    NotLeaderError,
    ObjectExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ProtocolError,
    PutLostError,
    ReplicaShortfallError,
    StaleVersionError,
    StoreError,
    TransferError,
    WeightSyncAbortedError,
)
from .kvcache import KVCacheStats, KVCacheStore, KVGetResult, KVPutResult, chunk_hashes
from .weight_sync import (
    GroupSyncResult,
    GroupWeightSync,
    PublishResult,
    PullResult,
    WeightSync,
    tensor_digest,
)

__all__ = [
    "AuthError",
    "GroupSyncResult",
    "GroupWeightSync",
    "KVCacheConfig",
    "KVCacheStats",
    "KVCacheStore",
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
    # ``Master`` is imported on first use, so that ``python -m mooncake_store.master`` does not
    # find the module already imported by the package (runpy's RuntimeWarning).
    if name == "Master":
        from .master import Master

        return Master
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
