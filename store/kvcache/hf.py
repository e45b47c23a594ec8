"""K/V in and out as ``transformers`` caches.

``transformers`` keeps a decoder's K/V in a ``Cache`` (``DynamicCache``): one layer object
per decoder layer with ``keys`` and ``values`` of shape ``[batch, kv_heads, T, head_dim]``.
The store keeps one tensor ``[layers, 2, kv_heads, T, head_dim]`` per chunk; these
functions convert between the two for a batch of one prompt. ``transformers`` is imported
only when a cache is given or asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_hf_cache(obj: object) -> bool:
    """Whether ``obj`` is a ``transformers`` ``Cache`` (without importing transformers)."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "Cache" and cls.__module__.startswith("transformers"):
            return True
    return False


def stack_cache(cache: Any, op: str) -> torch.Tensor:
    """The K/V of a ``transformers`` cache as one ``[layers, 2, kv_heads, T, head_dim]`` tensor.

    Args:
        cache: a ``DynamicCache`` (``transformers`` 4.56 and later: ``cache.layers``) of a
            batch of one, every layer holding the whole prompt (no sliding window).
        op: the calling operation, for error messages.

    Returns:
        A new CPU-or-same-device tensor (stacked copies of the layers' K and V).

    Raises:
        ValueError: an empty cache, a layer without K/V, a batch other than 1, a sliding
            window layer (it keeps only the last tokens), or layers whose shape, dtype or
            device differ.
    """
    import torch

    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(
            f"{op}: a transformers Cache without .layers ({type(cache).__name__}); use "
            "transformers >= 4.56 or pass per-layer (K, V) pairs"
        )
    if len(layers) == 0:
        raise ValueError(f"{op}: the cache has no layers")
    pairs, ref = [], None
    for li, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                f"{op}: layer {li} is a sliding-window layer ({type(layer).__name__}): it keeps "
                "only the last tokens, not the prefix's K/V"
            )
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.numel() == 0:
            raise ValueError(f"{op}: layer {li} of the cache holds no K/V")
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(
                f"{op}: layer {li} K must be [1, kv_heads, tokens, head_dim] (a batch of one "
                f"prompt), got {list(k.shape)}"
            )
        this = (list(k.shape), k.dtype, k.device)
        for name, t in (("K", k), ("V", v)):
            if (list(t.shape), t.dtype, t.device) != (ref or this):
                want = ref or this
                raise ValueError(
                    f"{op}: the cache's layers disagree: expected {want[0]} {want[1]} on "
                    f"{want[2]} (layer 0 K), got {list(t.shape)} {t.dtype} on {t.device} "
                    f"(layer {li} {name})"
                )
        ref = ref or this
        pairs.append(torch.stack([k[0], v[0]]))
    return torch.stack(pairs)


def to_dynamic_cache(kv: torch.Tensor | None, *, config: Any = None, device: Any = None) -> Any:
    """A ``transformers`` ``DynamicCache`` holding ``kv`` for a batch of one prompt.

    Args:
        kv: ``[layers, 2, kv_heads, T, head_dim]``, or None for an empty cache.
        config: the model's config, passed to ``DynamicCache`` (models that mix layer
            types need it); None builds plain full-attention layers.
        device: where the cache's tensors go (default: where ``kv`` is).

    Returns:
        A ``DynamicCache`` whose layer ``i`` holds ``kv[i, 0]`` and ``kv[i, 1]`` as
        ``[1, kv_heads, T, head_dim]`` (the cache concatenates into new tensors, so ``kv``
        is never written).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if kv is None:
        return cache
    if device is not None:
        kv = kv.to(device)
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
    return cache
