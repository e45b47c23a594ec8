"""Miss diagnosis for :meth:`KVCacheStore.explain`: why a prompt's stored prefix ends where it does.

The lookup says where the prefix ends; the store's bounded history of drops says what
became of the chunk there (evicted, invalidated, its holder lost, removed); a scan of the
key namespaces says whether the same tokens are stored under another weight version, or
another tenant or salt. Each question costs one or a few metadata requests; the scans of
tenants and versions read key listings, so ``explain`` is for diagnosis, not for every
request (it also reads the prefix it finds, as ``get`` would, to tell a listed chunk that
can no longer be read).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from .keys import partial_digests
from .results import KVExplain

if TYPE_CHECKING:
    from .cache import KVCacheStore, _Match, _Prompt

MAX_NAMESPACES = 4096  # tenants x salts x versions looked at for "stored elsewhere"


def _when(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _from_history(entry: list) -> tuple[str, str]:
    """``(cause, detail)`` of a history entry ``[cause, tier, unix_s, detail]``."""
    cause, tier, unix_s, detail = entry
    when = _when(unix_s)
    if cause == "evicted":
        text = f"evicted from {tier} at {when}" + (f" ({detail})" if detail else "")
    elif cause == "invalidated":
        inherited = detail.startswith("with parent ")
        own = detail.rsplit(": ", 1)[-1] if inherited else detail
        tag = own.partition("#")[2] or own
        text = f"invalidated by tag {tag!r} at {when}"
        if inherited:
            text += " (with a chunk before it)"
    elif cause == "holder_lost":
        text = f"its only holder ({detail}) died at {when}"
    else:
        text = f"{cause} at {when}" + (f" ({detail})" if detail else "")
    return cause, text


def _elsewhere(kv: KVCacheStore, suffix: str) -> tuple[str, str] | None:
    """Whether key ``suffix`` (a chunk's last path segment) is stored in another namespace."""
    internal = kv._internal
    here_version = kv._ns(kv.weight_version)
    # other weight versions of this tenant and salt
    names = [
        n for n in internal.list_prefixes(kv._space) if n != "-" or kv.weight_version is not None
    ]
    keys = [f"{kv._space}{n}/{suffix}" for n in names]
    keys = [k for k in keys if not k.startswith(here_version)]
    metas = internal.metadata(keys) if keys else []
    versions = sorted(k[len(kv._space) :].split("/")[0] for k, m in zip(keys, metas) if m)
    if versions:
        return "other_weight_version", f"the same tokens are stored for weight versions {versions}"
    # other tenants and salts of this model (which ones is not said)
    model_prefix = f"kv/{kv.cfg.model}/"
    keys = []
    for tenant in internal.list_prefixes(model_prefix):
        for salt in internal.list_prefixes(f"{model_prefix}{tenant}/"):
            space = f"{model_prefix}{tenant}/{salt}/"
            if space == kv._space:
                continue
            for version in internal.list_prefixes(space):
                keys.append(f"{space}{version}/{suffix}")
                if len(keys) >= MAX_NAMESPACES:
                    break
    if keys and any(internal.metadata(keys)):
        return "other_tenant", "the same tokens are stored for another tenant or salt"
    return None


def _unreachable(kv: KVCacheStore, m: _Match) -> tuple[int, str] | None:
    """``(start, segment)`` of the first chunk of ``m`` that no replica can serve to this client.

    Every memory replica of it lies in a segment whose owner this client could not reach
    lately, and it has no SSD replica: its holder died (or is cut off) and the master has
    not declared it dead yet, so the chunk is still listed but a ``get`` stops before it.
    """
    internal = kv._internal
    skipped = internal.reader._skipped()
    if not skipped or not m.pieces:
        return None
    where = internal.link.call("where", {"keys": [piece.key for piece in m.pieces]})["where"]
    for piece, w in zip(m.pieces, where):
        if w is not None and w["memory"] and not w["ssd"] and set(w["memory"]) <= skipped:
            return piece.start, w["memory"][0]
    return None


def explain(kv: KVCacheStore, p: _Prompt, m: _Match) -> KVExplain:
    """The diagnosis of prompt ``p`` whose best lookup is ``m`` (see ``KVCacheStore.explain``)."""
    c = p.c
    lost = _unreachable(kv, m)
    if lost is not None:
        start, seg = lost
        return KVExplain(
            start,
            start,
            start // c,
            "holder_lost",
            f"its holder (segment {seg!r}) cannot be reached; the master has not declared it "
            "dead yet",
        )
    if m.tokens:
        # the lookup lists what the master knows; a chunk whose holder died before the
        # master noticed (or that was dropped since) is listed but cannot be read: read the
        # prefix as get would, and explain the first chunk it could not
        got = kv._read(m, m.tokens, count=False).tokens
        if got < m.tokens:
            piece = next(pc for pc in m.pieces if pc.start <= got < pc.start + pc.tokens)
            (entry,) = kv._internal.history([piece.key])
            if entry is not None:
                cause, detail = _from_history(entry)
            else:
                cause, detail = (
                    "holder_lost",
                    f"chunk {got // c} is listed but could not be read: its holder died or is "
                    "cut off, and the master has not declared it dead yet",
                )
            return KVExplain(got, got, got // c, cause, detail)
    if m.tokens >= p.n:
        detail = "" if m.version == kv._versions()[0] else f"served from weight version {m.version}"
        return KVExplain(p.n, None, None, "hit", detail)
    miss = m.tokens
    k = miss // c
    if m.stopped_by_layout:
        return KVExplain(
            miss,
            miss,
            k,
            "layout_mismatch",
            f"chunk {k} is stored with another layout than the prefix's ({m.layout})",
        )
    ns = kv._ns(m.version)
    if (k + 1) * c <= p.n:
        suffix = p.digests[k].hex()
    else:  # the prompt ends inside chunk k: the partial chunk to its end
        (d,) = partial_digests(p.parent(k), p.tail(k), [p.n - k * c])
        suffix = "p" + d.hex()
    (entry,) = kv._internal.history([ns + suffix])
    if entry is not None:
        cause, detail = _from_history(entry)
        return KVExplain(miss, miss, k, cause, detail)
    found = _elsewhere(kv, suffix)
    if found is not None:
        return KVExplain(miss, miss, k, *found)
    if suffix.startswith("p"):
        return KVExplain(
            miss,
            miss,
            k,
            "unsaved_tail",
            f"the prompt ends at token {p.n}, inside chunk {k}, and no breakpoint was put there",
        )
    return KVExplain(miss, miss, k, "never_stored", f"chunk {k} was never stored here")
