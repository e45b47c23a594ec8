"""Prefix KV cache on the store: :class:`KVCacheStore`.

Tokens are cut into chunks of ``chunk_tokens``; chunk ``i`` is stored under the chained
hash of the whole prefix up to and including it, in a namespace of the model, tenant,
salt and weight version (``keys.py``). A chunk's value is one tensor
``[layers, 2, kv_heads, tokens, head_dim]`` (K and V of every layer for its tokens), and its
metadata records its dtype and shape: its layout (``layout.py``). Each chunk names the
chunk before it as its parent, so the store never keeps a chunk whose prefix is gone
(dropping a chunk drops every chunk after it).

Whole chunks serve every longer prompt. A breakpoint (``put(..., breakpoints=[i])``) also
stores the partial chunk that ends at token ``i``, so the prefix up to ``i`` is a hit to
its exact end (hosted APIs' prompt-caching breakpoints); without one, a prompt's tail
shorter than a chunk is not stored.

One layout per prefix: ``put`` raises ``ValueError`` (and writes nothing) when the new
K/V's layers, kv heads, head_dim or dtype differ from those of the chunks of the same
tokens already stored, and lookups stop at a chunk of another layout. Chunks are a cache:
the store evicts them in LRU order (to the SSD tier when the owner of the segment has
one); a chunk that is gone is a miss, never wrong data.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import math
import numbers
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ..client import MooncakeStore, ReplicateConfig
from ..common.errors import (
    InvalidatedError,
    ObjectExistsError,
    ParentMissingError,
    StoreError,
    short_repr,
)
from .config import KVCacheConfig, _name_ok
from .hf import is_hf_cache, stack_cache
from .keys import ROOT, chain, partial_digests, token_bytes
from .layout import Layout, dtype_name, layout_from_meta
from .results import KVCacheStats, KVExplain, KVGetResult, KVPutResult, _Metrics

if TYPE_CHECKING:
    import torch

    from ..weight_sync import WeightSync
    from .keys import Tokens

    KV = torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]] | Any

_MEMO_MAX = 1024  # prompts looked up by match_prefix whose get has not come yet
# the store bounds a tag to 256 bytes and an object to 16 tags; a chunk's tag is "kv" + 16
# hex digits of its namespace + "#" + the name
MAX_TAG_NAME_BYTES = 200
MAX_TAGS_PER_CHUNK = 16
MAX_HOLD_S = 3600.0  # the master's bound on a hold's TTL


class _Piece(NamedTuple):
    """A stored chunk that serves part of a prompt: tokens ``[start, start + tokens)``."""

    key: str
    start: int
    tokens: int


class _Match(NamedTuple):
    """The longest stored prefix of a prompt under one weight version."""

    tokens: int  #: tokens served
    version: int | None
    pieces: list  #: _Piece covering [0, tokens); the last may hold more (get slices)
    layout: Layout | None  #: the first chunk's layout
    stopped_by_layout: bool  #: the next chunk exists with another layout


class _Prompt:
    """A prompt's tokens as bytes and the digests of its whole chunks."""

    def __init__(self, tokens: Tokens, chunk_tokens: int, op: str):
        self.bytes = token_bytes(tokens, op)
        self.n = len(self.bytes) // 8
        self.c = chunk_tokens
        self.digests = chain(self.bytes, chunk_tokens)
        self.fingerprint = hashlib.blake2b(self.bytes, digest_size=16).digest()

    def parent(self, k: int) -> bytes:
        """The digest before chunk ``k``."""
        return self.digests[k - 1] if k else ROOT

    def tail(self, k: int) -> bytes:
        """The token bytes from chunk ``k`` on."""
        return self.bytes[8 * k * self.c :]


def _piece_layout(meta: object, tokens: int) -> Layout | bool | None:
    """The layout in a chunk's metadata if it holds ``tokens`` tokens; None if not; True if unknown."""
    return layout_from_meta(meta, tokens)


class KVCacheStore:
    """Prefix K/V chunks of one tenant in a :class:`~mooncake_store.MooncakeStore`.

    ``kv = KVCacheStore(store, tenant="acme", config=KVCacheConfig(chunk_tokens=256))``,
    then ``kv.put(tokens, past_key_values)``, ``n = kv.match_prefix(tokens)``,
    ``kv.get(tokens, n).to_dynamic_cache()``. K/V goes in and out as a ``transformers``
    ``Cache``, a tensor ``[layers, 2, kv_heads, T, head_dim]`` or per-layer ``(K, V)``
    pairs. Statistics: :attr:`stats` (:class:`KVCacheStats`), and the process's Prometheus
    series ``mooncake_kv_*``.

    Args:
        store: the store client the chunks go through.
        tenant: the namespace of this object's chunks (a non-empty str without ``/``).
        config: chunk size, model, salt, weight version, quota, replicas.
        weights: a ``WeightSync`` reader whose installed version is the weight version
            (read at each call); instead of ``config.weight_version``.

    Raises:
        ValueError: a bad tenant or config, or both ``weights`` and
            ``config.weight_version`` given.
        TypeError: ``store`` is not a ``MooncakeStore``.
    """

    def __init__(
        self,
        store: MooncakeStore,
        *,
        tenant: str = "default",
        config: KVCacheConfig | None = None,
        weights: WeightSync | None = None,
    ):
        if not _name_ok(tenant):
            shown = short_repr(tenant) if isinstance(tenant, str) else repr(tenant)
            raise ValueError(
                "KVCacheStore: tenant must be a non-empty str without '/' (at most 200 chars), "
                f"got {shown}"
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
        if weights is not None:
            from ..weight_sync import WeightSync

            if not isinstance(weights, WeightSync):
                raise ValueError(
                    f"KVCacheStore: weights must be a WeightSync, got {type(weights).__name__}"
                )
            if self.cfg.weight_version is not None:
                raise ValueError(
                    "KVCacheStore: give the weight version either as config.weight_version or "
                    "through weights=, not both"
                )
        if self.cfg.max_stale_versions and self.cfg.weight_version is None and weights is None:
            raise ValueError(
                "KVCacheStore: max_stale_versions needs a weight version (config.weight_version "
                "or weights=)"
            )
        self.store = store
        self.tenant = tenant
        self.weights = weights
        self._internal = store.internal
        self._tenant_prefix = f"kv/{self.cfg.model}/{tenant}/"
        # "-" is no salt and a salt is "=<salt>": no salt can name the unsalted namespace
        salt = "-" if self.cfg.salt is None else f"={self.cfg.salt}"
        self._space = f"{self._tenant_prefix}{salt}/"
        self._rc = ReplicateConfig(replica_num=self.cfg.replica_num, pin=self.cfg.pin)
        # the tenant's group in the store: its bytes, quota and drops by cause (the store
        # bounds a group's name to 256 bytes)
        self._group = self._tenant_prefix
        if len(self._group.encode()) > 256:
            self._group = "kv" + hashlib.blake2b(self._group.encode(), digest_size=16).hexdigest()
        self.stats = KVCacheStats()
        self._metrics = _Metrics.get()
        self._labels = (self.cfg.model, tenant)
        # prompt fingerprint -> the lookup match_prefix made, for the get that follows it
        # (prompt fingerprint, the versions looked in) -> the lookup match_prefix made, for
        # the get that follows it; the versions are in the key so that a lookup made before a
        # new weight version is installed never serves the get after it
        self._memo: collections.OrderedDict[tuple, _Match] = collections.OrderedDict()

    # ------------------------------------------------------------------ namespaces
    @property
    def weight_version(self) -> int | None:
        """The weight version keys are made for now (None: unversioned).

        Raises:
            ValueError: ``weights`` holds no version yet (pull one first).
        """
        if self.weights is None:
            return self.cfg.weight_version
        v = self.weights.version
        if v < 0:
            raise ValueError(
                f"KVCacheStore: the weights reader of {self.weights.model!r} holds no version "
                "yet; pull one before using the cache"
            )
        return v

    def _ns(self, version: int | None) -> str:
        return f"{self._space}{'-' if version is None else f'v{version}'}/"

    def _versions(self) -> list:
        """The weight versions a lookup may serve from, current first."""
        v = self.weight_version
        if v is None or not self.cfg.max_stale_versions:
            return [v]
        return [v - j for j in range(self.cfg.max_stale_versions + 1) if v - j >= 0]

    def _tag(self, tag: str) -> str:
        # the store bounds a tag to 256 bytes: the namespace goes in as a digest
        return f"kv{hashlib.blake2b(self._space.encode(), digest_size=8).hexdigest()}#{tag}"

    def keys(self, tokens: Tokens, *, _op: str = "KVCacheStore.keys") -> list[str]:
        """Store keys of the whole chunks of ``tokens`` under the current weight version.

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.
        """
        ns = self._ns(self.weight_version)
        return [ns + d.hex() for d in _Prompt(tokens, self.cfg.chunk_tokens, _op).digests]

    # ------------------------------------------------------------------ lookups
    def _lookup(self, p: _Prompt, limit: int, versions: list, touch: bool) -> list[_Match]:
        """The longest stored prefix of ``p`` up to ``limit`` tokens under each version.

        Two metadata requests at most: the whole chunks of every version, then the
        partial chunks that could extend each version's prefix. ``touch``: the chunks found
        count as used for eviction, so that the ``get`` that follows a lookup finds them
        (LRU would otherwise take the oldest of them first while other clients put).
        """
        c = p.c
        wanted = min(len(p.digests), -(-limit // c))
        whole = [[self._ns(v) + d.hex() for d in p.digests[:wanted]] for v in versions]
        flat = [k for keys in whole for k in keys]
        metas = self._internal.metadata(flat, touch=touch) if flat else []
        found = []
        for vi, _v in enumerate(versions):
            m = metas[vi * wanted : (vi + 1) * wanted]
            first, k, stop = None, 0, False
            while k < wanted and m[k] is not None:
                lay = _piece_layout(m[k], c)
                if lay is True:
                    lay = first
                if lay is None or (first is not None and lay != first):
                    stop = True
                    break
                first = lay
                k += 1
            pieces = [_Piece(whole[vi][i], i * c, c) for i in range(k)]
            found.append([k, pieces, first, stop])
        # partial chunks: only where the prefix ends inside the prompt at a missing chunk
        probes = []
        for vi, (k, _pieces, _first, stop) in enumerate(found):
            room = min(c - 1, p.n - k * c)
            if stop or k * c >= limit or room < 1:
                continue
            lengths = list(range(room, 0, -1))
            digests = partial_digests(p.parent(k), p.tail(k), lengths)
            ns = self._ns(versions[vi])
            probes.append((vi, k, lengths, [ns + "p" + d.hex() for d in digests]))
        if probes:
            flat = [key for *_, keys in probes for key in keys]
            metas = self._internal.metadata(flat, touch=touch)
            at = 0
            for vi, k, lengths, keys in probes:
                m = metas[at : at + len(keys)]
                at += len(keys)
                first = found[vi][2]
                for n, key, meta in zip(lengths, keys, m):
                    if meta is None:
                        continue
                    lay = _piece_layout(meta, n)
                    if lay is True or (lay is not None and (first is None or lay == first)):
                        found[vi][1].append(_Piece(key, k * c, n))
                        found[vi][2] = first if lay is True else lay
                    else:
                        found[vi][3] = True
                    break
        out = []
        for vi, (_k, pieces, first, stop) in enumerate(found):
            end = pieces[-1].start + pieces[-1].tokens if pieces else 0
            out.append(_Match(min(end, limit), versions[vi], pieces, first, stop))
        return out

    def _best(self, p: _Prompt, limit: int, touch: bool = False) -> _Match:
        """The longest prefix over the versions a lookup may serve (the current one on ties)."""
        matches = self._lookup(p, limit, self._versions(), touch)
        best = matches[0]
        for m in matches[1:]:
            if m.tokens > best.tokens:
                best = m
        return best

    def _memo_key(self, p: _Prompt) -> tuple:
        return (p.fingerprint, tuple(self._versions()))

    def _count_lookup(self, m: _Match, looked_up: int) -> None:
        st = self.stats
        hit = m.tokens
        st.lookups += 1
        st.hit_tokens += hit
        st.miss_tokens += looked_up - hit
        st.hit_chunks += sum(1 for pc in m.pieces if pc.start < hit)
        st.inconsistent_chunks += m.stopped_by_layout
        stale = bool(hit) and m.version != self._versions()[0]
        if stale:
            st.stale_hit_tokens += hit
        mt = self._metrics
        mt.hit_tokens.labels(*self._labels).inc(hit)
        mt.miss_tokens.labels(*self._labels).inc(looked_up - hit)
        if stale:
            mt.stale_hit_tokens.labels(*self._labels).inc(hit)
        if looked_up:
            mt.request_hit_ratio.labels(*self._labels).observe(hit / looked_up)

    def match_prefix(self, tokens: Tokens) -> int:
        """How many leading tokens of ``tokens`` have their K/V stored.

        Whole chunks, then the longest partial chunk stored at a breakpoint. Counts one
        lookup (:class:`KVCacheStats`); a ``get`` of the same prompt that follows reuses
        this lookup (one that follows a ``put`` of the same prompt looks again).

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.

        Returns:
            Tokens of the longest stored prefix (any count, not only whole chunks).

        Raises:
            ValueError: malformed tokens; ``weights`` holds no version yet.
        """
        p = _Prompt(tokens, self.cfg.chunk_tokens, "KVCacheStore.match_prefix")
        m = self._best(p, p.n, touch=True)
        self._count_lookup(m, p.n)
        key = self._memo_key(p)
        self._memo[key] = m
        self._memo.move_to_end(key)
        while len(self._memo) > _MEMO_MAX:
            self._memo.popitem(last=False)
        return m.tokens

    def get(self, tokens: Tokens, upto: int | None = None) -> KVGetResult:
        """The K/V of the longest stored prefix of ``tokens``, up to ``upto`` tokens.

        Reads the chunks a lookup found (the one of a ``match_prefix`` of the same prompt
        just before, else its own) and returns the longest prefix it could read: chunks
        evicted since the lookup are misses (``stats.lost_tokens``), never wrong data.
        A whole chunk serves a prefix that ends inside it (sliced).

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.
            upto: the most tokens wanted, in ``[0, len(tokens)]`` (default: all).

        Returns:
            :class:`KVGetResult` with ``tokens <= upto`` and ``kv`` of
            ``[layers, 2, kv_heads, tokens, head_dim]`` (CPU), or ``kv=None`` when nothing
            is stored.

        Raises:
            ValueError: bad arguments (nothing is read); ``weights`` holds no version yet.
        """
        t0 = time.perf_counter()
        op = "KVCacheStore.get"
        p = _Prompt(tokens, self.cfg.chunk_tokens, op)
        if upto is None:
            upto = p.n
        if isinstance(upto, bool) or not isinstance(upto, int) or not 0 <= upto <= p.n:
            raise ValueError(
                f"{op}: upto must be an int in [0, {p.n}] (the prompt's tokens), got {upto!r}"
            )
        m = self._memo.pop(self._memo_key(p), None)
        if m is None:
            m = self._best(p, upto, touch=True)
            self._count_lookup(m, upto)
        want = min(upto, m.tokens)
        res = self._read(m, want)
        self.stats.lost_tokens += want - res.tokens
        self._metrics.get_seconds.labels(*self._labels).observe(time.perf_counter() - t0)
        return res

    def _read(self, m: _Match, want: int, *, count: bool = True) -> KVGetResult:
        """Reads the pieces of ``m`` that cover ``[0, want)``: the longest readable prefix.

        ``count=False`` (``explain``) leaves ``stats`` alone: a diagnosis is not a get.
        """
        import torch

        stale = m.version != self._versions()[0]
        pieces = [pc for pc in m.pieces if pc.start < want]
        if not pieces:
            return KVGetResult(0, None, m.version, False)
        got = self.store.get_tensor_batch([pc.key for pc in pieces], return_exceptions=True)
        parts, end = [], 0
        for pc, g in zip(pieces, got):
            if isinstance(g, BaseException):
                if not isinstance(g, (StoreError, ValueError)):  # ValueError: not a tensor
                    raise g
                break
            lay = (
                Layout(int(g.shape[0]), int(g.shape[2]), int(g.shape[4]), dtype_name(g.dtype))
                if g.dim() == 5 and g.shape[1] == 2 and g.shape[3] == pc.tokens
                else None
            )
            if lay is None or (m.layout is not None and lay != m.layout):
                self.stats.inconsistent_chunks += count
                break
            take = min(pc.tokens, want - pc.start)
            parts.append(g if take == pc.tokens else g[:, :, :, :take])
            end = pc.start + take
        if not parts:
            return KVGetResult(0, None, m.version, False)
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        if not kv.is_contiguous():
            kv = kv.contiguous()
        return KVGetResult(end, kv, m.version, stale)

    # ------------------------------------------------------------------ puts
    def put(
        self,
        tokens: Tokens,
        kv: KV,
        *,
        breakpoints: Sequence[int] | None = None,
        tags: Mapping[str, tuple[int, int]] | None = None,
    ) -> KVPutResult:
        """Stores the K/V of the whole chunks of ``tokens``, and partial chunks at breakpoints.

        Chunks already stored are hits, not errors. Each chunk names the one before it as
        its parent; a chunk whose parent another process dropped meanwhile is not stored
        (``stats.skipped_chunks``), nor is one whose tag ``invalidate`` dropped while it was
        being written.

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.
            kv: a ``transformers`` ``Cache`` (``DynamicCache``, a batch of one), a CPU
                tensor ``[layers, 2, kv_heads, T, head_dim]``, or per-layer ``(K, V)`` pairs
                each ``[kv_heads, T, head_dim]`` (or ``[1, kv_heads, T, head_dim]``), all of
                one shape and dtype; ``T`` is at most ``len(tokens)`` and covers at least
                the tokens stored (the K/V of a prompt whose last token is not yet computed
                serves its whole chunks).
            breakpoints: token counts ``i`` (strictly increasing, in ``[1, len(tokens)]``)
                whose prefix is stored to its exact end: the partial chunk that ends at
                ``i`` is stored too (none at a multiple of ``chunk_tokens``: a whole chunk
                ends there).
            tags: ``{name: (start, end)}``: token ranges ``[start, end)`` (non-empty, within
                the tokens, not overlapping) that :meth:`invalidate` of ``name`` retires,
                with every chunk of any prompt that continues them. A name is a non-empty
                str of at most 200 bytes of UTF-8; a chunk carries at most 16 tags (those of
                this put and of earlier puts of it).

        Returns:
            :class:`KVPutResult`.

        Raises:
            ValueError: before anything is written: malformed tokens, K/V, breakpoints or
                tags; a K/V layout (layers, kv heads, head_dim, dtype) other than that of
                the chunks of these tokens already stored (one layout per prefix); the
                ``weights`` reader holds no version.
            StoreError: the store refused a chunk (``NoSpaceError``: nothing could be
                evicted, also within the tenant's quota).
        """
        op = "KVCacheStore.put"
        c = self.cfg.chunk_tokens
        p = _Prompt(tokens, c, op)
        bps = self._check_breakpoints(breakpoints, p.n, op)
        ranges = self._check_tags(tags, p.n, op)
        kv = self._as_tensor(kv, op)
        if kv.shape[3] > p.n:
            # K/V of tokens not given: the tokens and the K/V are not of one prompt
            raise ValueError(
                f"{op}: kv covers {kv.shape[3]} tokens, more than the {p.n} tokens given; "
                "nothing was written"
            )
        covered = max([len(p.digests) * c, *bps])
        if kv.shape[3] < covered:
            raise ValueError(
                f"{op}: kv covers {kv.shape[3]} tokens, the chunks to store need {covered}"
            )
        mine = Layout(int(kv.shape[0]), int(kv.shape[2]), int(kv.shape[4]), dtype_name(kv.dtype))
        ns = self._ns(self.weight_version)
        whole_keys = [ns + d.hex() for d in p.digests]
        # (key, parent key, first token, tokens)
        plan = [
            (key, whole_keys[i - 1] if i else None, i * c, c) for i, key in enumerate(whole_keys)
        ]
        for bp in bps:
            k, n = divmod(bp, c)
            if n == 0:
                continue
            (d,) = partial_digests(p.parent(k), p.tail(k), [n])
            plan.append((ns + "p" + d.hex(), whole_keys[k - 1] if k else None, k * c, n))
        if not plan:
            return KVPutResult(0, 0, 0)
        # a lookup of this prompt made before this put missed what it stores: the get
        # that follows looks again
        self._memo.pop(self._memo_key(p), None)
        metas = self._internal.metadata([key for key, *_ in plan])
        for i, ((_key, _parent, _start, n), meta) in enumerate(zip(plan, metas)):
            if meta is None:
                continue
            theirs = _piece_layout(meta, n)
            if theirs is not True and theirs != mine:
                want = (
                    "a K/V chunk there (it holds another object)" if theirs is None else str(theirs)
                )
                raise ValueError(
                    f"{op}: kv layout differs from the chunks already stored for these tokens "
                    f"(one layout per prefix): expected {want} as stored in chunk {i} of "
                    f"{len(plan)}, got {mine}; nothing was written"
                )
        names = [
            [self._tag(t) for t, (a, b) in ranges.items() if a < s + n and s < b]
            for _k, _pa, s, n in plan
        ]
        for i, ts in enumerate(names):
            if len(ts) > MAX_TAGS_PER_CHUNK:
                raise ValueError(
                    f"{op}: chunk {i} (tokens {plan[i][2]}..{plan[i][2] + plan[i][3]}) would carry "
                    f"{len(ts)} tags, at most {MAX_TAGS_PER_CHUNK}; nothing was written"
                )
        todo = [i for i, meta in enumerate(metas) if meta is None]
        existing = len(plan) - len(todo)
        retag = [i for i, meta in enumerate(metas) if meta is not None and names[i]]
        if retag:
            self._internal.add_tags([plan[i][0] for i in retag], [names[i] for i in retag])
        stored = partial = skipped = 0
        if todo:
            values, tensor_metas = [], []
            for i in todo:
                _key, _parent, s, n = plan[i]
                piece = kv[:, :, :, s : s + n].contiguous()
                values.append(piece)
                tensor_metas.append(
                    msgpack.packb({"dtype": dtype_name(piece.dtype), "shape": list(piece.shape)})
                )
            res = self._internal.put_many(
                [plan[i][0] for i in todo],
                values,
                tensor_metas,
                self._rc,
                parents=[plan[i][1] for i in todo],
                tags=[names[i] for i in todo],
                group=self._group,
                quota_bytes=self.cfg.tenant_quota_bytes,
                return_exceptions=True,
            )
            for i, r in zip(todo, res):
                if isinstance(r, ObjectExistsError):  # another writer stored it meanwhile
                    existing += 1
                elif isinstance(r, (ParentMissingError, InvalidatedError)):
                    skipped += 1
                elif isinstance(r, BaseException):
                    raise r
                else:
                    stored += 1
                    partial += plan[i][3] != c
        st = self.stats
        st.stored_chunks += stored
        st.partial_chunks += partial
        st.existing_chunks += existing
        st.skipped_chunks += skipped
        return KVPutResult(stored, existing, covered, skipped)

    @staticmethod
    def _check_breakpoints(breakpoints: Sequence[int] | None, n: int, op: str) -> list[int]:
        if breakpoints is None:
            return []
        if isinstance(breakpoints, (str, bytes)) or not isinstance(breakpoints, Sequence):
            raise ValueError(f"{op}: breakpoints must be a sequence of ints, got {breakpoints!r}")
        out = []
        for b in breakpoints:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 1 <= b <= n:
                raise ValueError(
                    f"{op}: each breakpoint must be an int in [1, {n}] (the prompt's tokens), "
                    f"got {b!r}"
                )
            if out and b <= out[-1]:
                raise ValueError(
                    f"{op}: breakpoints must be strictly increasing, got {list(breakpoints)!r}"
                )
            out.append(int(b))
        return out

    @staticmethod
    def _check_tags(
        tags: Mapping[str, tuple[int, int]] | None, n: int, op: str
    ) -> dict[str, tuple[int, int]]:
        if tags is None:
            return {}
        if not isinstance(tags, Mapping):
            raise ValueError(f"{op}: tags must be a dict {{name: (start, end)}}, got {tags!r}")
        out = {}
        for name, rng in tags.items():
            if not isinstance(name, str) or not name or len(name.encode()) > MAX_TAG_NAME_BYTES:
                raise ValueError(
                    f"{op}: a tag name must be a non-empty str of at most {MAX_TAG_NAME_BYTES} "
                    f"bytes of UTF-8, got {short_repr(name) if isinstance(name, str) else repr(name)}"
                )
            ok = (
                isinstance(rng, (tuple, list))
                and len(rng) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in rng)
            )
            if not ok or not 0 <= rng[0] < rng[1] <= n:
                raise ValueError(
                    f"{op}: tag {name!r} must be a non-empty token range (start, end) with "
                    f"0 <= start < end <= {n}, got {rng!r}"
                )
            out[name] = (int(rng[0]), int(rng[1]))
        spans = sorted((a, b, t) for t, (a, b) in out.items())
        for (a0, b0, t0), (a1, _b1, t1) in itertools.pairwise(spans):
            if a1 < b0:
                raise ValueError(
                    f"{op}: tag ranges overlap: {t0!r} {(a0, b0)} and {t1!r} {out[t1]}"
                )
        return out

    def _as_tensor(self, kv: KV, op: str) -> torch.Tensor:
        import torch

        if is_hf_cache(kv):
            kv = stack_cache(kv, op)
        elif isinstance(kv, (list, tuple)):
            kv = self._stack_pairs(kv, op)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            got = (
                f"a tensor of shape {list(kv.shape)}"
                if isinstance(kv, torch.Tensor)
                else type(kv).__name__
            )
            raise ValueError(
                f"{op}: kv must be a transformers Cache, a tensor [layers, 2, heads, tokens, "
                f"head_dim] or a list of per-layer (K, V) pairs [heads, tokens, head_dim], got {got}"
            )
        if kv.device.type != "cpu":
            raise ValueError(f"{op}: kv must be on the CPU, got {kv.device}")
        if kv.shape[0] == 0 or kv.shape[2] == 0 or kv.shape[4] == 0:
            raise ValueError(
                f"{op}: kv must have at least one layer, head and head_dim element, got {list(kv.shape)}"
            )
        return kv

    @staticmethod
    def _stack_pairs(pairs: Sequence, op: str) -> torch.Tensor:
        import torch

        ref = None
        out = []
        for li, pair in enumerate(pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(
                    f"{op}: kv as a list must hold per-layer (K, V) pairs, got "
                    f"{type(pair).__name__} at layer {li}"
                )
            kv2 = []
            for name, t in zip("KV", pair):
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == 1:
                    t = t[0]  # transformers' legacy format: [batch of 1, heads, tokens, head_dim]
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
                        f"{op}: per-layer K and V must all have one shape, dtype and device: "
                        f"expected {ref[0]} {dtype_name(ref[1])} on {ref[2]} (layer 0 K), got "
                        f"{this[0]} {dtype_name(this[1])} on {this[2]} (layer {li} {name})"
                    )
                kv2.append(t)
            out.append(torch.stack(kv2))
        if ref is None:
            raise ValueError(f"{op}: kv as a list must hold at least one layer's (K, V)")
        return torch.stack(out)

    # ------------------------------------------------------------------ retirement
    def invalidate(self, tag: str) -> int:
        """Retires every chunk ``put`` tagged ``tag`` and every chunk that continues them.

        For this model, tenant and salt, in every weight version. After it returns, no
        lookup in any process or host finds one of them; chunks before the tagged range
        stay. An unknown tag retires nothing.

        Args:
            tag: a tag name given to ``put(..., tags=)``.

        Returns:
            How many chunks were retired (descendants included).

        Raises:
            ValueError: ``tag`` is not a non-empty str of at most 200 bytes of UTF-8.
        """
        if not isinstance(tag, str) or not tag or len(tag.encode()) > MAX_TAG_NAME_BYTES:
            shown = short_repr(tag) if isinstance(tag, str) else repr(tag)
            raise ValueError(
                "KVCacheStore.invalidate: tag must be a non-empty str of at most "
                f"{MAX_TAG_NAME_BYTES} bytes of UTF-8, got {shown}"
            )
        n = self._internal.invalidate([self._tag(tag)])
        self._metrics.invalidated_chunks.labels(*self._labels).inc(n)
        return n

    def retire_versions(self, keep: int = 1) -> int:
        """Drops the chunks of all but the ``keep`` newest weight versions.

        For this model, tenant and salt; unversioned chunks stay.

        Args:
            keep: how many of the newest versions stored keep their chunks (>= 0).

        Returns:
            How many chunks were dropped.

        Raises:
            ValueError: ``keep`` is not an int >= 0.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(
                f"KVCacheStore.retire_versions: keep must be an int >= 0, got {keep!r}"
            )
        found = self._internal.list_prefixes(self._space)
        versions = sorted(
            (int(name[1:]) for name in found if name[:1] == "v" and name[1:].isdigit()),
            reverse=True,
        )
        return sum(self._internal.remove_prefix(self._ns(v)) for v in versions[keep:])

    # ------------------------------------------------------------------ agents
    @contextlib.contextmanager
    def hold(self, tokens: Tokens, ttl_s: float = 60.0) -> Iterator[int]:
        """Keeps the stored prefix of ``tokens`` from eviction while the block runs.

        For a tool call in flight: the agent's next turn finds its prefix still in
        memory. The hold ends at the block's exit or after ``ttl_s``, whichever comes
        first; it does not stop ``invalidate`` or ``retire_versions``.

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.
            ttl_s: seconds, in ``(0, 3600]``.

        Yields:
            The tokens of the prefix held (what ``match_prefix`` would return).

        Raises:
            ValueError: malformed tokens or a TTL outside ``(0, 3600]``.
        """
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, numbers.Real)
            or not 0 < ttl_s <= MAX_HOLD_S
            or math.isnan(ttl_s)
        ):
            raise ValueError(
                f"KVCacheStore.hold: ttl_s must be seconds in (0, {MAX_HOLD_S:g}], got {ttl_s!r}"
            )
        p = _Prompt(tokens, self.cfg.chunk_tokens, "KVCacheStore.hold")
        m = self._best(p, p.n)
        hold_id = (
            self._internal.hold([pc.key for pc in m.pieces], float(ttl_s)) if m.pieces else None
        )
        try:
            yield m.tokens
        finally:
            if hold_id is not None:
                self._internal.release(hold_id)

    def prefetch(self, tokens: Tokens) -> int:
        """Starts loading the stored prefix of ``tokens`` from the SSD tier into memory.

        Returns at once; the loads run in the background (the next agent's turn then
        reads memory).

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.

        Returns:
            How many chunks are being loaded (those only on SSD).
        """
        p = _Prompt(tokens, self.cfg.chunk_tokens, "KVCacheStore.prefetch")
        m = self._best(p, p.n)
        return self._internal.promote([pc.key for pc in m.pieces]) if m.pieces else 0

    def explain(self, tokens: Tokens) -> KVExplain:
        """Why the stored prefix of ``tokens`` ends where it does.

        Looks the prompt up as ``match_prefix`` does (without counting it) and asks the
        store about the first chunk it misses: its history of drops (bounded: the master
        keeps ``MasterConfig.history_entries`` of them), other weight versions and other
        tenants or salts holding the same tokens.

        Args:
            tokens: a sequence of ints or a 1-D integer tensor or array.

        Returns:
            :class:`KVExplain` (an empty prompt: a ``hit`` of 0 tokens).

        Raises:
            ValueError: malformed tokens; ``weights`` holds no version yet.
        """
        from .explain import explain

        p = _Prompt(tokens, self.cfg.chunk_tokens, "KVCacheStore.explain")
        return explain(self, p, self._best(p, p.n))
