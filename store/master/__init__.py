"""The store master: metadata RPC service, metadata core, high availability and options.

The metadata RPC service (``service.py``), its metadata core (``core.py``, composed of
``records.py``, ``reservations.py``, ``puts.py``, ``space.py`` and ``ssd.py``), high availability
through etcd (``ha.py``) and its options (``config.py``).

``mooncake-store-master`` / ``python -m mooncake_store.master`` run :func:`main`.
"""

from .config import MasterConfig

__all__ = ["Master", "MasterConfig", "main"]


def __getattr__(name):
    # the service (asyncio, the metadata core) is imported on first use: clients import
    # this package for MasterConfig, and only a process that runs a master needs the rest
    if name in ("Master", "main"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
