"""The layout of a K/V chunk: ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` and its dtype.

Every chunk of one prefix shares it (recorded by ``put_tensor`` in the chunk's metadata).
"""

from __future__ import annotations

from typing import NamedTuple


class Layout(NamedTuple):
    """What every chunk of one prefix shares: its shape and its dtype.

    The shape is ``[layers, 2, kv_heads, chunk_tokens, head_dim]``.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def __str__(self):
        return f"layers={self.layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}"


def layout_of(shape, dtype: str, chunk_tokens: int) -> Layout | None:
    """The layout of a chunk of ``shape`` and ``dtype``, or None.

    None if it is not a K/V chunk of ``chunk_tokens`` tokens.
    """
    if len(shape) != 5 or shape[1] != 2 or shape[3] != chunk_tokens:
        return None
    return Layout(int(shape[0]), int(shape[2]), int(shape[4]), dtype)


def layout_from_meta(meta, chunk_tokens: int):
    """The layout recorded in a chunk's metadata (``put_tensor``: dtype and shape).

    None if it is not a K/V chunk; True if the store did not say (an older master).
    """
    if meta is True:
        return True
    try:
        import msgpack

        m = msgpack.unpackb(meta, raw=False)
        return layout_of([int(d) for d in m["shape"]], str(m["dtype"]), chunk_tokens)
    except Exception:
        return None


def dtype_name(dtype) -> str:
    """The name of ``dtype`` without the ``torch.`` prefix (e.g. ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")
