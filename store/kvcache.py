"""Prefix KV cache on the store (see DESIGN.md "Store", ``KVCacheStore``).

Tokens are cut into fixed chunks of ``chunk_tokens``; chunk ``i`` is stored under the
chained hash of the whole prefix up to and including it::

    h_0 = blake2b(b"mooncake-kv" + chunk_0)      h_i = blake2b(h_{i-1} + chunk_i)
    key = "kv/<model>/<tenant>/<hex(h_i)>"

(tokens as little-endian int64, BLAKE2b-128: equal in every process and on every host,
unlike Python's ``hash``). Two prompts share exactly the chunks of their common whole-chunk
prefix. A chunk's value is one tensor ``[layers, 2, heads, chunk_tokens, head_dim]`` (K
and V of every layer for those tokens), stored with ``put_tensor``.

Tenants are namespaces: the same tokens of another tenant never hit. Chunks are a cache:
the store evicts them in LRU order (to the SSD tier when the owner of the segment has
one, where they survive a restart); a chunk that is gone is a miss, never wrong data: a
``get`` returns the longest prefix of whole chunks it could actually read.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import NamedTuple, Optional

from .config import KVCacheConfig, ReplicateConfig
from .errors import ObjectExistsError, StoreError

__all__ = ["KVCacheStore", "KVCacheStats", "KVPutResult", "KVGetResult", "chunk_hashes"]


@dataclasses.dataclass
class KVCacheStats:
    """Counters of one :class:`KVCacheStore` object (this process). Lookups
    (``match_prefix``) count hits and misses per whole chunk; ``put`` counts chunks it
    wrote and chunks it found already stored (those are hits, not errors); ``get`` counts
    chunks that were matched but could not be read any more (evicted meanwhile)."""

    lookups: int = 0          #: match_prefix calls
    hit_chunks: int = 0       #: chunks found by lookups
    miss_chunks: int = 0      #: whole chunks looked up and not found
    hit_tokens: int = 0       #: tokens covered by lookup hits
    stored_chunks: int = 0    #: chunks written by put
    existing_chunks: int = 0  #: chunks put found already stored (a hit, no error)
    lost_chunks: int = 0      #: chunks get could not read (evicted after the lookup)

    @property
    def hit_rate(self) -> float:
        """Lookup hits over whole chunks looked up."""
        n = self.hit_chunks + self.miss_chunks
        return self.hit_chunks / n if n else 0.0


class KVPutResult(NamedTuple):
    stored_chunks: int    #: chunks written now
    existing_chunks: int  #: chunks that were already there (hits)
    tokens: int           #: tokens covered by whole chunks


class KVGetResult(NamedTuple):
    tokens: int  #: tokens of the prefix returned (a multiple of chunk_tokens)
    kv: object   #: tensor [layers, 2, heads, tokens, head_dim], or None when tokens == 0

    def layers(self) -> list:
        """The K/V as per-layer ``(K, V)`` pairs, each ``[heads, tokens, head_dim]`` (views)."""
        return [] if self.kv is None else [(layer[0], layer[1]) for layer in self.kv]


def _token_bytes(tokens) -> bytes:
    try:
        import torch

        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
                raise ValueError("tokens must be a 1-D integer tensor")
            return tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
    except ImportError:  # pragma: no cover
        pass
    import array

    vals = list(tokens)
    for t in vals:
        if isinstance(t, bool) or not isinstance(t, int) or not -2**63 <= t < 2**63:
            raise ValueError(f"tokens must be ints, got {t!r}")
    a = array.array("q", vals)
    if a.itemsize != 8:  # pragma: no cover
        raise RuntimeError("array 'q' is not 8 bytes")
    import sys

    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def chunk_hashes(tokens, chunk_tokens: int) -> list:
    """Hex chained hashes of the whole chunks of ``tokens`` (a partial tail is left out)."""
    b = _token_bytes(tokens)
    step = 8 * chunk_tokens
    out, prev = [], b"mooncake-kv"
    for i in range(len(b) // step):
        prev = hashlib.blake2b(prev + b[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(prev.hex())
    return out


class KVCacheStore:
    """Prefix K/V chunks of one tenant in a :class:`~mooncake_store.MooncakeStore`.

    ``kv = KVCacheStore(store, tenant="acme", config=KVCacheConfig(chunk_tokens=256))``;
    ``kv.put(tokens, kv_tensor)``, ``kv.match_prefix(tokens) -> matched tokens``,
    ``kv.get(tokens, upto)``. ``kv_tensor`` is ``[layers, 2, heads, T, head_dim]`` with
    ``T >= `` the whole-chunk part of ``tokens``."""

    def __init__(self, store, *, tenant: str = "default", config: Optional[KVCacheConfig] = None):
        if not isinstance(tenant, str) or not tenant or "/" in tenant or len(tenant) > 200:
            raise ValueError(f"tenant must be a non-empty str without '/' (at most 200 chars), got {tenant!r}")
        self.cfg = config or KVCacheConfig()
        if not isinstance(self.cfg, KVCacheConfig):
            raise ValueError("config must be a KVCacheConfig")
        self.store = store
        self.tenant = tenant
        self._p = f"kv/{self.cfg.model}/{tenant}/"
        self._rc = ReplicateConfig(pin=self.cfg.pin)
        self.stats = KVCacheStats()

    def keys(self, tokens) -> list:
        """Store keys of the whole chunks of ``tokens``."""
        return [self._p + h for h in chunk_hashes(tokens, self.cfg.chunk_tokens)]

    def put(self, tokens, kv) -> KVPutResult:
        """Stores the K/V of every whole chunk of ``tokens`` that is not stored yet."""
        import torch

        keys = self.keys(tokens)
        c = self.cfg.chunk_tokens
        if isinstance(kv, (list, tuple)):  # per-layer (K, V) pairs, each [heads, tokens, head_dim]
            try:
                kv = torch.stack([torch.stack([k, v]) for k, v in kv])
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"kv as a list must hold per-layer (K, V) tensors of one shape: {e}") from None
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError("kv must be a tensor [layers, 2, heads, tokens, head_dim] or a list of per-layer "
                             "(K, V) pairs [heads, tokens, head_dim]")
        if kv.device.type != "cpu":
            raise ValueError(f"kv must be on the CPU, got {kv.device}")
        if kv.shape[3] < len(keys) * c:
            raise ValueError(f"kv covers {kv.shape[3]} tokens, the whole chunks of tokens need {len(keys) * c}")
        have = self.store.exists_batch(keys) if keys else []
        todo = [i for i, h in enumerate(have) if not h]
        existing = len(keys) - len(todo)
        stored = 0
        if todo:
            res = self.store.put_tensor_batch([keys[i] for i in todo],
                                              [kv[:, :, :, i * c:(i + 1) * c].contiguous() for i in todo],
                                              self._rc, return_exceptions=True)
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

    def match_prefix(self, tokens) -> int:
        """How many leading tokens (whole chunks) have their K/V stored."""
        keys = self.keys(tokens)
        have = self.store.exists_batch(keys) if keys else []
        n = 0
        while n < len(have) and have[n]:
            n += 1
        self.stats.lookups += 1
        self.stats.hit_chunks += n
        self.stats.miss_chunks += len(keys) - n
        self.stats.hit_tokens += n * self.cfg.chunk_tokens
        return n * self.cfg.chunk_tokens

    def get(self, tokens, upto: Optional[int] = None) -> KVGetResult:
        """The K/V of the first ``upto`` tokens (a multiple of ``chunk_tokens``; default:
        every whole chunk), or of the longest prefix of whole chunks that could be read
        (chunks evicted meanwhile are misses; nothing after a missing chunk is used)."""
        import torch

        keys = self.keys(tokens)
        c = self.cfg.chunk_tokens
        if upto is None:
            upto = len(keys) * c
        if isinstance(upto, bool) or not isinstance(upto, int) or upto < 0 or upto % c or upto > len(keys) * c:
            raise ValueError(f"upto must be a multiple of {c} within the whole chunks of tokens "
                             f"({len(keys) * c}), got {upto!r}")
        keys = keys[:upto // c]
        got = self.store.get_tensor_batch(keys, return_exceptions=True) if keys else []
        parts = []
        for g in got:
            if isinstance(g, BaseException):
                if not isinstance(g, StoreError):
                    raise g
                break
            parts.append(g)
        self.stats.lost_chunks += len(keys) - len(parts)
        if not parts:
            return KVGetResult(0, None)
        return KVGetResult(len(parts) * c, torch.cat(parts, dim=3))
