"""Prefix KV cache on the store: :class:`KVCacheStore` and its keys, layouts and options.

:class:`KVCacheStore` (``cache.py``), its chunk keys (``keys.py``), chunk layouts (``layout.py``)
and options (``config.py``).
"""

from .cache import KVCacheStats, KVCacheStore, KVGetResult, KVPutResult
from .config import KVCacheConfig
from .keys import chunk_hashes

__all__ = [
    "KVCacheConfig",
    "KVCacheStats",
    "KVCacheStore",
    "KVGetResult",
    "KVPutResult",
    "chunk_hashes",
]
