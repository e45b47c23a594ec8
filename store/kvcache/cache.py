"""Prefix KV cache on the store (see docs/design.md "Store", ``KVCacheStore``).

Tokens are cut into fixed chunks of ``chunk_tokens``; chunk ``i`` is stored under the
chained hash of the whole prefix up to and including it (``keys.py``). A chunk's value is one tensor ``[layers, 2, heads, chunk_tokens, head_dim]`` (K
and V of every layer for those tokens), stored with ``put_tensor``, whose metadata records
the chunk's dtype and shape: its layout (``layout.py``).

One layout per prefix: ``put`` raises ``ValueError`` (and writes nothing) when the new K/V's
layers, kv heads, head_dim or dtype differ from those of the chunks of the same tokens
already stored (checked from the metadata, without reading the chunks), and ``get``
returns only the leading chunks of the first chunk's layout (never a mix, never an error).

Tenants are namespaces: the same tokens of another tenant never hit. Chunks are a cache:
the store evicts them in LRU order (to the SSD tier when the owner of the segment has
one, where they survive a restart); a chunk that is gone is a miss, never wrong data: a
``get`` returns the longest prefix of whole chunks it could actually read.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..client import MooncakeStore, ReplicateConfig
from ..common.errors import ObjectExistsError, ObjectNotFoundError, StoreError, short_repr
from .config import KVCacheConfig
from .keys import chunk_hashes
from .layout import Layout, dtype_name, layout_from_meta, layout_of

if TYPE_CHECKING:
    import torch

    from .keys import Tokens


@dataclasses.dataclass
class KVCacheStats:
    """Counters of one :class:`KVCacheStore` object (this process).

    Lookups count hits and misses per whole chunk, each chunk once per lookup:
    ``match_prefix`` is a lookup (its matched chunks are hits, the others misses), and so
    is ``get`` (chunks it returns are hits, the others of the ``upto`` it was asked for are
    misses), except for chunks a ``match_prefix`` of this object counted and no ``get``
    has counted since: the usual ``n = match_prefix(t); get(t, n)`` counts each chunk
    once, and a ``get`` alone of n chunks that all hit counts n hits. ``put`` counts chunks
    it wrote and chunks it found already stored (those are hits, not errors).

    ``lost_chunks`` are chunks known to exist (a ``match_prefix`` found them, or ``get``'s
    own read saw them) that ``get`` could not read: evicted after the lookup, or the read
    failed; never chunks that were not stored (nor readable chunks left out after a
    missing one). ``inconsistent_chunks`` are chunks
    ``get`` left out because their layout differs from the prefix's first chunk (see
    ``put``) or they are not K/V chunks.
    """

    lookups: int = 0  #: match_prefix calls, and get calls that counted a chunk
    hit_chunks: int = 0  #: chunks found by lookups
    miss_chunks: int = 0  #: whole chunks looked up and not found
    hit_tokens: int = 0  #: tokens covered by lookup hits
    stored_chunks: int = 0  #: chunks written by put
    existing_chunks: int = 0  #: chunks put found already stored (a hit, no error)
    lost_chunks: int = 0  #: chunks matched (or seen by get) that get could not read
    inconsistent_chunks: int = 0  #: chunks get left out: another layout than the first chunk's

    @property
    def hit_rate(self) -> float:
        """Lookup hits over whole chunks looked up (``match_prefix`` and ``get``)."""
        n = self.hit_chunks + self.miss_chunks
        return self.hit_chunks / n if n else 0.0


class KVPutResult(NamedTuple):
    """What :meth:`KVCacheStore.put` did: chunks written, chunks already there, tokens covered."""

    stored_chunks: int  #: chunks written now
    existing_chunks: int  #: chunks that were already there (hits)
    tokens: int  #: tokens covered by whole chunks


class KVGetResult(NamedTuple):
    """What :meth:`KVCacheStore.get` returned: the prefix's tokens and its K/V."""

    tokens: int  #: tokens of the prefix returned (a multiple of chunk_tokens)
    kv: object  #: tensor [layers, 2, heads, tokens, head_dim], or None when tokens == 0

    def layers(self) -> list:
        """The K/V as per-layer ``(K, V)`` pairs, each ``[heads, tokens, head_dim]`` (views)."""
        return [] if self.kv is None else [(layer[0], layer[1]) for layer in self.kv]


_MATCHED_MAX = 1 << 16  # chunk keys remembered from match_prefix for get's accounting


class KVCacheStore:
    """Prefix K/V chunks of one tenant in a :class:`~mooncake_store.MooncakeStore`.

    ``kv = KVCacheStore(store, tenant="acme", config=KVCacheConfig(chunk_tokens=256))``;
    ``kv.put(tokens, kv_tensor)``, ``kv.match_prefix(tokens) -> matched tokens``,
    ``kv.get(tokens, upto)``. ``kv_tensor`` is ``[layers, 2, heads, T, head_dim]`` with
    ``T >= `` the whole-chunk part of ``tokens``. All chunks of one prefix share one
    layout (layers, kv heads, head_dim, dtype): see :meth:`put`. Statistics: ``stats``
    (:class:`KVCacheStats`).
    """

    def __init__(
        self, store: MooncakeStore, *, tenant: str = "default", config: KVCacheConfig | None = None
    ):
        if not isinstance(tenant, str) or not tenant or "/" in tenant or len(tenant) > 200:
            raise ValueError(
                f"KVCacheStore: tenant must be a non-empty str without '/' (at most 200 chars), "
                f"got {short_repr(tenant) if isinstance(tenant, str) else repr(tenant)}"
            )
        self.cfg = config or KVCacheConfig()
        if not isinstance(self.cfg, KVCacheConfig):
            raise ValueError(
                f"KVCacheStore: config must be a KVCacheConfig, got {type(self.cfg).__name__}"
            )
        if not isinstance(store, MooncakeStore):
            raise TypeError(
                f"KVCacheStore: store must be a MooncakeStore, got {type(store).__name__}"
            )
        self.store = store
        self.tenant = tenant
        self._p = f"kv/{self.cfg.model}/{tenant}/"
        self._rc = ReplicateConfig(pin=self.cfg.pin)
        self.stats = KVCacheStats()
        # chunk key -> found, for chunks match_prefix counted and no get has counted since
        self._matched: collections.OrderedDict[str, bool] = collections.OrderedDict()

    def keys(self, tokens: Tokens, *, _op: str = "KVCacheStore.keys") -> list:
        """Store keys of the whole chunks of ``tokens``."""
        return [self._p + h for h in chunk_hashes(tokens, self.cfg.chunk_tokens, _op=_op)]

    def put(
        self, tokens: Tokens, kv: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> KVPutResult:
        """Stores the K/V of every whole chunk of ``tokens`` that is not stored yet.

        One layout per prefix: a model's cache is not mixed with another one's, nor bf16 chunks with
        float32 ones; use another ``KVCacheConfig.model`` or tenant for another layout.

        Args:
            tokens: the prompt's token ids.
            kv: a CPU tensor ``[layers, 2, kv_heads, T, head_dim]``, or per-layer ``(K, V)`` pairs,
                each ``[kv_heads, T, head_dim]`` (all of one shape and dtype).

        Returns:
            :class:`KVPutResult`.

        Raises:
            ValueError: before anything is written, for malformed K/V, and when its layout (layers,
                kv heads, head_dim, dtype) differs from that of the chunks of these tokens already
                stored.
        """
        import torch

        op = "KVCacheStore.put"
        keys = self.keys(tokens, _op=op)
        c = self.cfg.chunk_tokens
        if isinstance(kv, (list, tuple)):  # per-layer (K, V) pairs, each [heads, tokens, head_dim]
            kv = self._stack_pairs(kv, op)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            got = (
                f"a tensor of shape {list(kv.shape)}"
                if isinstance(kv, torch.Tensor)
                else type(kv).__name__
            )
            raise ValueError(
                f"{op}: kv must be a tensor [layers, 2, heads, tokens, head_dim] or a list of per-layer "
                f"(K, V) pairs [heads, tokens, head_dim], got {got}"
            )
        if kv.device.type != "cpu":
            raise ValueError(f"{op}: kv must be on the CPU, got {kv.device}")
        if kv.shape[3] < len(keys) * c:
            raise ValueError(
                f"{op}: kv covers {kv.shape[3]} tokens, the whole chunks of tokens need {len(keys) * c}"
            )
        if kv.shape[0] == 0 or kv.shape[2] == 0 or kv.shape[4] == 0:
            raise ValueError(
                f"{op}: kv must have at least one layer, head and head_dim element, got {list(kv.shape)}"
            )
        mine = Layout(int(kv.shape[0]), int(kv.shape[2]), int(kv.shape[4]), dtype_name(kv.dtype))
        metas = self.store.internal.metadata(keys) if keys else []
        for i, m in enumerate(metas):
            if m is None:
                continue
            theirs = layout_from_meta(m, c)
            if theirs is not True and theirs != mine:
                want = (
                    "a K/V chunk there (it holds another object)" if theirs is None else str(theirs)
                )
                raise ValueError(
                    f"{op}: kv layout differs from the chunks already stored for these tokens (one "
                    f"layout per prefix): expected {want} as stored in chunk {i} of {len(keys)}, got "
                    f"{mine}; nothing was written"
                )
        todo = [i for i, m in enumerate(metas) if m is None]
        existing = len(keys) - len(todo)
        stored = 0
        if todo:
            res = self.store.put_tensor_batch(
                [keys[i] for i in todo],
                [kv[:, :, :, i * c : (i + 1) * c].contiguous() for i in todo],
                self._rc,
                return_exceptions=True,
            )
            for r in res:
                if isinstance(r, ObjectExistsError):  # another writer stored it meanwhile
                    existing += 1
                elif isinstance(r, BaseException):
                    raise r
                else:
                    stored += 1
        self.stats.stored_chunks += stored
        self.stats.existing_chunks += existing
        return KVPutResult(stored, existing, len(keys) * c)

    @staticmethod
    def _stack_pairs(pairs, op: str):
        import torch

        ref = None
        for li, pair in enumerate(pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(
                    f"{op}: kv as a list must hold per-layer (K, V) pairs, got {type(pair).__name__} "
                    f"at layer {li}"
                )
            for name, t in zip("KV", pair):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    got = (
                        f"shape {list(t.shape)}"
                        if isinstance(t, torch.Tensor)
                        else type(t).__name__
                    )
                    raise ValueError(
                        f"{op}: layer {li} {name} must be a tensor [heads, tokens, head_dim], got {got}"
                    )
                this = (list(t.shape), t.dtype, t.device)
                if ref is None:
                    ref = this
                elif this != ref:
                    raise ValueError(
                        f"{op}: per-layer K and V must all have one shape, dtype and device: expected "
                        f"{ref[0]} {dtype_name(ref[1])} on {ref[2]} (layer 0 K), got {this[0]} "
                        f"{dtype_name(this[1])} on {this[2]} (layer {li} {name})"
                    )
        if ref is None:
            raise ValueError(f"{op}: kv as a list must hold at least one layer's (K, V)")
        return torch.stack([torch.stack([k, v]) for k, v in pairs])

    def match_prefix(self, tokens: Tokens) -> int:
        """How many leading tokens (whole chunks) have their K/V stored.

        A lookup: see :class:`KVCacheStats`.
        """
        keys = self.keys(tokens, _op="KVCacheStore.match_prefix")
        have = self.store.exists_batch(keys) if keys else []
        n = 0
        while n < len(have) and have[n]:
            n += 1
        self.stats.lookups += 1
        self.stats.hit_chunks += n
        self.stats.miss_chunks += len(keys) - n
        self.stats.hit_tokens += n * self.cfg.chunk_tokens
        m = self._matched
        for i, k in enumerate(keys):
            m[k] = i < n
            m.move_to_end(k)
        while len(m) > _MATCHED_MAX:
            m.popitem(last=False)
        return n * self.cfg.chunk_tokens

    def get(self, tokens: Tokens, upto: int | None = None) -> KVGetResult:
        """The K/V of the first ``upto`` tokens, or of the longest readable prefix of them.

        That prefix is of whole chunks that could be read and share the first chunk's layout (chunks
        evicted meanwhile are misses; nothing after a missing or differing chunk is used). Never
        raises for what the store holds. Counts as a lookup (see :class:`KVCacheStats`).

        Args:
            tokens: the prompt's token ids.
            upto: a multiple of ``chunk_tokens``; default: every whole chunk.

        Returns:
            :class:`KVGetResult`.

        Raises:
            ValueError: bad arguments.
        """
        import torch

        op = "KVCacheStore.get"
        keys = self.keys(tokens, _op=op)
        c = self.cfg.chunk_tokens
        if upto is None:
            upto = len(keys) * c
        if (
            isinstance(upto, bool)
            or not isinstance(upto, int)
            or upto < 0
            or upto % c
            or upto > len(keys) * c
        ):
            raise ValueError(
                f"{op}: upto must be a multiple of {c} within the whole chunks of tokens "
                f"({len(keys) * c}), got {upto!r}"
            )
        keys = keys[: upto // c]
        got = self.store.get_tensor_batch(keys, return_exceptions=True) if keys else []
        parts, first = [], None
        for g in got:  # the longest prefix of readable chunks of the first chunk's layout
            if isinstance(g, BaseException):
                if not isinstance(
                    g, (StoreError, ValueError)
                ):  # ValueError: not stored by put_tensor
                    raise g
                break
            lay = layout_of(list(g.shape), dtype_name(g.dtype), c)
            if lay is None or (first is not None and lay != first):
                break
            first = lay
            parts.append(g)
        # classify each chunk not returned (see KVCacheStats)
        n = len(parts)
        counted = hits = misses = lost = inconsistent = 0
        for i, (k, g) in enumerate(zip(keys, got)):
            prior = self._matched.pop(k, None)
            if prior is None:  # not counted by a match_prefix: get's own lookup
                counted += 1
                if i < n:
                    hits += 1
                else:
                    misses += 1
            if i < n:
                continue
            if isinstance(g, ObjectNotFoundError):
                lost += bool(prior)
            elif isinstance(g, StoreError):  # it existed: the read failed (transfer, lease)
                lost += 1
            elif isinstance(g, ValueError):
                inconsistent += 1
            else:  # read, but not usable: after a missing chunk, or of another layout
                lay = layout_of(list(g.shape), dtype_name(g.dtype), c)
                inconsistent += lay is None or (first is not None and lay != first)
        st = self.stats
        st.lookups += counted > 0
        st.hit_chunks += hits
        st.miss_chunks += misses
        st.hit_tokens += hits * c
        st.lost_chunks += lost
        st.inconsistent_chunks += inconsistent
        if not parts:
            return KVGetResult(0, None)
        return KVGetResult(n * c, parts[0] if n == 1 else torch.cat(parts, dim=3))
