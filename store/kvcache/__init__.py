"""Prefix KV cache on the store.

:class:`KVCacheStore` (``cache.py``), its results and statistics (``results.py``), chunk
keys (``keys.py``), chunk layouts (``layout.py``), ``transformers`` caches in and out
(``hf.py``), miss diagnosis (``explain.py``) and options (``config.py``).
"""

from .cache import KVCacheStore
from .config import KVCacheConfig
from .keys import chunk_hashes
from .results import KVCacheStats, KVExplain, KVGetResult, KVPutResult

__all__ = [
    "KVCacheConfig",
    "KVCacheStats",
    "KVCacheStore",
    "KVExplain",
    "KVGetResult",
    "KVPutResult",
    "chunk_hashes",
]
