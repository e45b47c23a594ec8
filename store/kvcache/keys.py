"""The keys of the KV cache.

Chunk ``i`` of a prompt is stored under the chained hash of the whole prefix up to and
including it, and the partial chunk of ``n`` tokens that ends at a breakpoint under the
hash of its parent and those tokens::

    h_0 = blake2b(b"mooncake-kv" + chunk_0)      h_i = blake2b(h_{i-1} + chunk_i)
    p   = blake2b(b"mooncake-kv-partial" + h_{i-1} + tokens[i*c : i*c + n])
    key = "kv/<model>/<tenant>/<salt>/<version>/<hex(h_i)>"   (partial: ".../p<hex(p)>")

(tokens as little-endian int64, BLAKE2b-128: equal in every process and on every host,
unlike Python's ``hash``; ``-`` stands for no salt and no weight version, a salt is
written ``=<salt>``). Two prompts
share exactly the chunks of their common prefix; the namespace in front keeps models,
tenants, salts and weight versions apart at every tier, since the SSD tier and other hosts
use the same keys.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    # tokens of a prompt: a 1-D integer tensor or a sequence of ints
    Tokens = Sequence[int] | torch.Tensor


def _token_bytes(tokens, op="chunk_hashes") -> bytes:
    try:
        import torch

        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
                raise ValueError(
                    f"{op}: tokens must be a 1-D integer tensor, got {tokens.dtype} {list(tokens.shape)}"
                )
            return (
                tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
            )
    except ImportError:  # pragma: no cover
        pass
    import array
    import operator

    np = sys.modules.get("numpy")
    if np is not None and isinstance(tokens, np.ndarray):
        if (
            tokens.ndim != 1
            or tokens.dtype.kind not in "iu"
            or (tokens.dtype.kind == "u" and tokens.size and int(tokens.max()) >= 2**63)
        ):
            raise ValueError(
                f"{op}: tokens must be a 1-D array of int64 values, got {tokens.dtype} {list(tokens.shape)}"
            )
        return tokens.astype("<i8").tobytes()
    try:
        vals = list(tokens)
    except TypeError:
        raise ValueError(
            f"{op}: tokens must be a sequence of ints or a 1-D integer tensor, "
            f"got {type(tokens).__name__}"
        ) from None
    for i, t in enumerate(vals):
        try:
            if isinstance(t, bool):
                raise TypeError
            vals[i] = t = operator.index(t)  # ints, and NumPy's integer scalars (not NumPy's bools)
        except TypeError:
            raise ValueError(f"{op}: tokens must be ints (int64), got {t!r}") from None
        if not -(2**63) <= t < 2**63:
            raise ValueError(f"{op}: tokens must be ints (int64), got {t!r}")
    a = array.array("q", vals)
    if a.itemsize != 8:  # pragma: no cover
        raise RuntimeError("array 'q' is not 8 bytes")
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


ROOT = b"mooncake-kv"  # the "parent" of a prompt's first chunk


def chain(token_bytes: bytes, chunk_tokens: int) -> list[bytes]:
    """Chained digests of the whole chunks of ``token_bytes`` (int64 little-endian)."""
    step = 8 * chunk_tokens
    out, prev = [], ROOT
    for i in range(len(token_bytes) // step):
        prev = hashlib.blake2b(
            prev + token_bytes[i * step : (i + 1) * step], digest_size=16
        ).digest()
        out.append(prev)
    return out


def partial_digests(parent: bytes, tail: bytes, lengths: Sequence[int]) -> list[bytes]:
    """Digests of the partial chunks of ``lengths`` tokens of ``tail`` after ``parent``.

    Args:
        parent: the digest of the whole chunk before (:data:`ROOT` for the first chunk).
        tail: int64 little-endian tokens that follow ``parent``'s chunk.
        lengths: token counts, each at least 1 and within ``tail``.
    """
    out = []
    for n in lengths:
        h = hashlib.blake2b(b"mooncake-kv-partial", digest_size=16)
        h.update(parent)
        h.update(tail[: 8 * n])
        out.append(h.digest())
    return out


def token_bytes(tokens: Tokens, op: str) -> bytes:
    """``tokens`` as int64 little-endian bytes; ``ValueError`` naming ``op`` otherwise."""
    return _token_bytes(tokens, op)


def chunk_hashes(tokens: Tokens, chunk_tokens: int, *, _op: str = "chunk_hashes") -> list:
    """Hex chained hashes of the whole chunks of ``tokens`` (a partial tail is left out).

    Args:
        tokens: a sequence of ints or a 1-D integer tensor or array.
        chunk_tokens: tokens per chunk.

    Returns:
        One 32-digit hex string per whole chunk, equal in every process and host.
    """
    return [d.hex() for d in chain(_token_bytes(tokens, _op), chunk_tokens)]
