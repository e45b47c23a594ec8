"""Options of :class:`~mooncake_store.KVCacheStore` (:class:`KVCacheConfig`)."""

from __future__ import annotations

import dataclasses

from ..common.errors import short_repr


@dataclasses.dataclass(kw_only=True)
class KVCacheConfig:
    """Options of :class:`~mooncake_store.kvcache.KVCacheStore`.

    Attributes:
        chunk_tokens: tokens per chunk; only whole chunks are stored and matched.
        model: name of the model whose K/V these are (part of every key: K/V of
            different models never mix).
        pin: store chunks pinned (default False: chunks are a cache, evicted in LRU order
            and, with an SSD tier, dropped to SSD).
    """

    chunk_tokens: int = 256
    model: str = "default"
    pin: bool = False

    def __post_init__(self):
        if (
            not isinstance(self.chunk_tokens, int)
            or isinstance(self.chunk_tokens, bool)
            or self.chunk_tokens < 1
        ):
            raise ValueError(
                f"KVCacheConfig: chunk_tokens must be an int >= 1, got {self.chunk_tokens!r}"
            )
        if (
            not isinstance(self.model, str)
            or not self.model
            or "/" in self.model
            or len(self.model) > 200
        ):
            raise ValueError(
                "KVCacheConfig: model must be a non-empty str without '/' (at most 200 chars), "
                f"got {short_repr(self.model) if isinstance(self.model, str) else repr(self.model)}"
            )
