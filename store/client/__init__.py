"""The store's client: :class:`MooncakeStore` (``store.py``) composed of its parts.

The parts: the data plane (``dataplane.py``: its segment, mappings of the host's other segments, the
transfer engine), the link to the master (``link.py``), the put reservation (``reservation.py``),
the write and read paths (``write.py``, ``read.py``) and the master's tasks (``tasks.py``); the
internal interface weight sync and the KV cache use (``internals.py``); argument checks
(``args.py``), shared-memory segments (``segment.py``), SSD files (``ssd.py``) and its options
(``config.py``).
"""

from .config import ReplicateConfig, StoreConfig
from .store import MooncakeStore, Placement, StoreStats

__all__ = ["MooncakeStore", "Placement", "ReplicateConfig", "StoreConfig", "StoreStats"]
