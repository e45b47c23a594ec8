"""The store's client: :class:`MooncakeStore` (``store.py``) and its parts: the link to the
master (``link.py``), the read path (``read.py``), the write path (``write.py``), argument
checks (``args.py``), shared-memory segments (``segment.py``) and SSD files (``ssd.py``);
its options in ``config.py``.
"""

from .config import ReplicateConfig, StoreConfig
from .store import MooncakeStore, Placement, StoreStats

__all__ = ["MooncakeStore", "Placement", "ReplicateConfig", "StoreConfig", "StoreStats"]
