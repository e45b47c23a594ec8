"""The store master: metadata RPC service (``service.py``), its metadata core (``core.py``
and its parts: ``records.py``, ``puts.py``, ``space.py``, ``ssd.py``) and high
availability through etcd (``ha.py``); its options in ``config.py``.

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
