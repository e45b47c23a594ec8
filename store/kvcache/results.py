"""What :class:`~mooncake_store.KVCacheStore` returns and counts.

Its results, statistics and Prometheus series.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class KVCacheStats:
    """Counters of one :class:`KVCacheStore` object (this process), in tokens and chunks.

    Lookups count, per prompt, the tokens of its longest stored prefix as hits and the
    rest as misses. ``match_prefix`` is a lookup, and so is ``get``, except a ``get`` of
    the prompt a ``match_prefix`` of this object just looked up (the usual
    ``n = match_prefix(t); get(t, n)`` counts the prompt once). A ``get``'s misses are the
    tokens up to its ``upto`` it does not return. Hits served from an older weight version
    (``max_stale_versions``) count in ``stale_hit_tokens`` as well.

    ``lost_tokens`` are tokens a lookup found that ``get`` could not read (evicted after
    the lookup, or the read failed); never tokens that were not stored.
    ``inconsistent_chunks`` are chunks that ended a lookup's prefix, or that ``get`` left
    out, because their layout differs from the prefix's first chunk or they are not K/V
    chunks.
    """

    lookups: int = 0  #: prompts looked up (match_prefix, and get without a match before it)
    hit_tokens: int = 0  #: tokens of the prefixes found
    miss_tokens: int = 0  #: tokens looked up and not found
    stale_hit_tokens: int = 0  #: hit tokens served from an older weight version
    hit_chunks: int = 0  #: chunks (whole or partial) behind the hit tokens
    stored_chunks: int = 0  #: chunks written by put (partial ones included)
    partial_chunks: int = 0  #: of which partial chunks, ending at a breakpoint
    existing_chunks: int = 0  #: chunks put found already stored (a hit, no error)
    skipped_chunks: int = 0  #: chunks put did not store: their parent went away meanwhile
    lost_tokens: int = 0  #: found by a lookup, not readable by get
    inconsistent_chunks: int = 0  #: left out: another layout than the prefix's first chunk

    @property
    def hit_rate(self) -> float:
        """Hit tokens over tokens looked up (0.0 before any lookup)."""
        n = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / n if n else 0.0


class KVPutResult(NamedTuple):
    """What one ``put`` stored.

    ``stored_chunks + existing_chunks + skipped_chunks`` are the chunks the put had (whole
    chunks, and partial chunks at breakpoints). A prompt is then a hit up to its first
    skipped chunk at most (and less after evictions).
    """

    stored_chunks: int  #: chunks written now (whole and partial)
    existing_chunks: int  #: chunks that were already there (hits)
    tokens: int  #: tokens the put's chunks cover (whole chunks, and breakpoints past them)
    #: chunks not stored: their parent was dropped meanwhile (evicted to make room for
    #: the put, invalidated, removed) or their tag was invalidated while they were written
    skipped_chunks: int = 0


class KVGetResult(NamedTuple):
    """The K/V of a prompt's prefix, as ``get`` read it."""

    tokens: int  #: tokens of the prefix returned
    kv: Any  #: ``[layers, 2, kv_heads, tokens, head_dim]`` CPU tensor, None when tokens == 0
    version: int | None = None  #: the weight version the K/V was computed with
    stale: bool = False  #: True when that version is older than the current one

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K/V as per-layer ``(K, V)`` pairs, each ``[kv_heads, tokens, head_dim]`` (views)."""
        return [] if self.kv is None else [(layer[0], layer[1]) for layer in self.kv]

    def to_dynamic_cache(self, config: Any = None, device: Any = None) -> Any:
        """The K/V as a ``transformers`` ``DynamicCache`` that a model continues from.

        Pass it as ``cache=`` (``past_key_values=`` before transformers 5) to the model's
        forward with the tokens after :attr:`tokens`, or to ``generate`` with the whole
        prompt (at least one token must be left for the model: ask ``get`` for at most
        ``len(tokens) - 1``).

        Args:
            config: the model's config (models that mix layer types need it).
            device: where the cache's tensors go (default: the CPU).
        """
        from .hf import to_dynamic_cache

        return to_dynamic_cache(self.kv, config=config, device=device)


class KVExplain(NamedTuple):
    """Why a prompt's prefix hits where it does (:meth:`KVCacheStore.explain`).

    ``cause`` is one of:

    * ``"hit"``: every token is served (``miss_token`` is None);
    * ``"never_stored"``: the chunk holding ``miss_token`` was never stored here;
    * ``"evicted"``: it was evicted (``detail``: the tier and when);
    * ``"invalidated"``: ``invalidate`` retired it (``detail``: the tag and when);
    * ``"holder_lost"``: the process holding its only replica died (or this client cannot
      reach it and the master has not declared it dead yet);
    * ``"removed"``: it was removed (``retire_versions``, or a remove);
    * ``"other_tenant"``: these tokens are stored, for another tenant or salt;
    * ``"other_weight_version"``: these tokens are stored, for other weight versions;
    * ``"unsaved_tail"``: the prompt ends inside a chunk and no breakpoint was put there;
    * ``"layout_mismatch"``: the chunk is stored with another layout than the prefix's.
    """

    hit_tokens: int  #: tokens served by the cache
    miss_token: int | None  #: the first token not served (None: all served)
    chunk: int | None  #: index of the chunk holding miss_token
    cause: str  #: see the class docstring
    detail: str  #: what the store knows of it (tier, tag, when, versions, ...), "" if nothing


class _Metrics:
    """The process's Prometheus series of the KV cache (one set, labelled by model and tenant)."""

    _made: _Metrics | None = None

    def __init__(self):
        from prometheus_client import Counter, Histogram

        labels = ("model", "tenant")
        self.hit_tokens = Counter(
            "mooncake_kv_hit_tokens", "Tokens found by KV cache lookups", labels
        )
        self.miss_tokens = Counter(
            "mooncake_kv_miss_tokens", "Tokens looked up in the KV cache and not found", labels
        )
        self.stale_hit_tokens = Counter(
            "mooncake_kv_stale_hit_tokens",
            "Hit tokens served from an older weight version (max_stale_versions)",
            labels,
        )
        self.request_hit_ratio = Histogram(
            "mooncake_kv_request_hit_ratio",
            "Per lookup: hit tokens over the prompt's tokens",
            labels,
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
        )
        self.get_seconds = Histogram(
            "mooncake_kv_get_seconds",
            "Time of KVCacheStore.get (lookup if any, and the read)",
            labels,
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
        )
        self.invalidated_chunks = Counter(
            "mooncake_kv_invalidated_chunks",
            "Chunks retired by invalidate (with their descendants)",
            labels,
        )

    @classmethod
    def get(cls) -> _Metrics:
        """The series, made once per process (prometheus_client refuses duplicates)."""
        if cls._made is None:
            cls._made = cls()
        return cls._made
