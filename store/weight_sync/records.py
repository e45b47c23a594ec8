"""One model's place in the store: its key prefix, where its objects go, and its records.

The key prefix follows the layout in ``sync.py``. Its records, which publishers, readers and relays
all read and write, are msgpack in the metadata of empty objects, kept by the master alone.
"""

from __future__ import annotations

import msgpack

from ..client import MooncakeStore, ReplicateConfig
from ..common.errors import ObjectNotFoundError


class ModelRecords:
    """The keys and records of one model in a store.

    Attributes:
        store: the client (:class:`~mooncake_store.MooncakeStore`).
        model: the model's name.
        prefix: ``ws/<model>/``, the start of every key of the model.
        placement: how the model's objects are placed: pinned as the config says, in this
            client's own segment when it has one (readers on other hosts may contribute
            segments too, to relay: ``relay.py``).
    """

    def __init__(self, store: MooncakeStore, model: str, pin: bool):
        self.store = store
        self.model = model
        self.prefix = f"ws/{model}/"
        own = store.name if store.internal.segment is not None else None
        self.placement = ReplicateConfig(pin=pin, preferred_segment=own)

    def get_msg(self, key: str, default=ObjectNotFoundError):
        """The msgpack value stored under ``key``; ``default`` when it does not exist.

        Raises ``ObjectNotFoundError`` without one.
        """
        try:
            return msgpack.unpackb(self.store.get(key), raw=False)
        except ObjectNotFoundError:
            if default is ObjectNotFoundError:
                raise
            return default

    def put(self, key: str, rec, upsert: bool = True) -> None:
        """Writes ``rec`` (msgpack) as the metadata of an empty object.

        It lives in the master alone, so it needs no segment and outlives whoever wrote it (a
        trainer holding the store's memory that restarts still finds its version history; a reader
        records its holds with no trainer alive). ``upsert=False``: a plain put
        (``ObjectExistsError`` if the key exists).
        """
        self.store.internal.put_many(
            [key], [b""], [msgpack.packb(rec)], self.placement, upsert=upsert
        )

    def get_many(self, keys: list) -> list:
        """The records :meth:`put` wrote.

        None where a key does not exist or holds no valid record.
        """
        out = []
        for key, meta in zip(keys, self.store.internal.metadata(keys)):
            try:
                if meta is None:
                    out.append(None)
                elif (
                    meta is True or not meta
                ):  # an older master without metadata, or a record written as a value
                    out.append(self.get_msg(key, None))
                else:
                    out.append(msgpack.unpackb(meta, raw=False))
            except Exception:  # unreadable or not msgpack: a record that is not there
                out.append(None)
        return out

    def get(self, key: str, default=None):
        """The record under ``key``, or ``default``."""
        rec = self.get_many([key])[0]
        return default if rec is None else rec

    def latest(self) -> tuple:
        """``(the newest committed version or -1, the publish id that committed it or None)``."""
        rec = self.get(self.prefix + "latest")
        if not isinstance(rec, dict):
            return -1, None
        return int(rec["version"]), rec.get("pid")

    def latest_version(self) -> int:
        """The newest committed version in the store (-1: none)."""
        return self.latest()[0]

    def committed_versions(self) -> list:
        """Committed versions not dropped yet, oldest first."""
        return [int(v) for v in (self.get(self.prefix + "versions") or [])]
