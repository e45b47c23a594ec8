"""Options of :class:`~mooncake_store.KVCacheStore` (:class:`KVCacheConfig`)."""

from __future__ import annotations

import dataclasses

from ..common.errors import short_repr


def _name_ok(value: object) -> bool:
    """Whether ``value`` can stand in a key path.

    That is a non-empty str without ``/``, at most 200 chars, encodable as UTF-8 (keys
    are; a lone surrogate is not).
    """
    if not (isinstance(value, str) and value and "/" not in value and len(value) <= 200):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclasses.dataclass(kw_only=True)
class KVCacheConfig:
    """Options of :class:`~mooncake_store.kvcache.KVCacheStore`.

    Every field that names a namespace (``model``, ``salt``, ``weight_version``, and the
    store's ``tenant``) is part of every chunk key, at every tier: K/V stored under one
    never answers a lookup under another.

    Attributes:
        chunk_tokens: tokens per chunk; whole chunks serve every longer prompt, partial
            chunks are stored only at breakpoints (``put(..., breakpoints=)``).
        model: name of the model whose K/V these are.
        pin: store chunks pinned (default False: chunks are a cache, evicted in LRU order
            and, with an SSD tier, dropped to SSD).
        weight_version: the version of the weights the K/V is computed with (an int >= 0;
            None: unversioned). ``KVCacheStore(weights=reader)`` takes it from a
            ``WeightSync`` reader instead.
        max_stale_versions: also serve chunks up to this many versions older than the
            current one (0: never; PipelineRL serves slightly stale K/V on purpose), counted
            apart in the stats. Needs an int weight version.
        salt: an extra namespace inside the tenant (vLLM's ``cache_salt``): a lookup hits
            only chunks stored with the same salt. None: no salt.
        tenant_quota_bytes: the most bytes of chunks this tenant keeps (all its salts and
            versions); a put beyond it evicts the tenant's own least recently used chunks
            first. None: no quota.
        replica_num: memory replicas of each chunk (on different segments, so on other
            hosts where there are); 2 keeps a chunk readable after one holder dies.
    """

    chunk_tokens: int = 256
    model: str = "default"
    pin: bool = False
    weight_version: int | None = None
    max_stale_versions: int = 0
    salt: str | None = None
    tenant_quota_bytes: int | None = None
    replica_num: int = 1

    def __post_init__(self):
        if not _count(self.chunk_tokens, 1):
            raise ValueError(
                f"KVCacheConfig: chunk_tokens must be an int >= 1, got {self.chunk_tokens!r}"
            )
        for field in ("model", "salt"):
            value = getattr(self, field)
            if field == "salt" and value is None:
                continue
            if not _name_ok(value):
                shown = short_repr(value) if isinstance(value, str) else repr(value)
                raise ValueError(
                    f"KVCacheConfig: {field} must be a non-empty str without '/' (at most 200 "
                    f"chars), got {shown}"
                )
        if not isinstance(self.pin, bool):
            raise ValueError(f"KVCacheConfig: pin must be a bool, got {self.pin!r}")
        if self.weight_version is not None and not _count(self.weight_version, 0):
            raise ValueError(
                "KVCacheConfig: weight_version must be None or an int >= 0, got "
                f"{self.weight_version!r}"
            )
        if not _count(self.max_stale_versions, 0):
            raise ValueError(
                "KVCacheConfig: max_stale_versions must be an int >= 0, got "
                f"{self.max_stale_versions!r}"
            )
        if self.tenant_quota_bytes is not None and not _count(self.tenant_quota_bytes, 1):
            raise ValueError(
                "KVCacheConfig: tenant_quota_bytes must be None or an int >= 1, got "
                f"{self.tenant_quota_bytes!r}"
            )
        if not _count(self.replica_num, 1) or self.replica_num > 64:
            raise ValueError(
                f"KVCacheConfig: replica_num must be an int in [1, 64], got {self.replica_num!r}"
            )
