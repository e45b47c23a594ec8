"""Checks of the arguments of :class:`~mooncake_store.MooncakeStore`'s public calls, and helpers.

The helpers: flat byte views of the values and buffers the calls take, and the batch helpers they
share (splitting keys into metadata requests, repeated keys, raising the first error of a batch).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..common.errors import short_repr
from .config import ReplicateConfig

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import torch

    # a value ``put`` stores: a bytes-like object (NumPy arrays included) or a CPU tensor
    BytesLike: TypeAlias = "bytes | bytearray | memoryview | np.ndarray | torch.Tensor"
    # a buffer ``get_into`` writes: a writable bytes-like object or a contiguous CPU tensor
    WritableBuffer: TypeAlias = "bytearray | memoryview | np.ndarray | torch.Tensor"


def as_bytes_view(value, what="value") -> memoryview:
    """A flat read-only byte view of ``value`` (bytes-like or a CPU tensor); ValueError otherwise."""
    if isinstance(value, str):
        raise ValueError(f"{what} must be bytes-like (got str; encode it first)")
    if is_tensor(value):
        return tensor_bytes(value, what)
    try:
        mv = memoryview(value)
    except TypeError:
        raise ValueError(
            f"{what} must be bytes-like or a tensor, got {type(value).__name__}"
        ) from None
    if not mv.contiguous:
        raise ValueError(f"{what} must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch ``Tensor`` or ``Parameter`` (without importing torch)."""
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def tensor_bytes(t, what="tensor") -> memoryview:
    """The bytes of CPU tensor ``t`` as a flat byte view (of a contiguous copy where needed).

    Conjugate and negative views get their flag applied first. Raises ``ValueError`` naming ``what``
    for a tensor that is not on the CPU or not dense (strided).
    """
    import torch

    if t.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, got {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{what} must be a dense (strided) tensor, got layout {t.layout}")
    # conjugate and negative views keep their bit in a flag: their bytes need it applied
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


@functools.cache
def copyable(dt) -> bool:
    """Whether torch can copy tensors of ``dt``.

    A reader copies or views them back, and some sub-byte dtypes (``torch.int4``, ``torch.uint4``,
    ``torch.uint1``) have no copy kernel.
    """
    import torch

    try:
        t = torch.empty(2, dtype=dt)
        t[0:1].copy_(t[1:2])
        return True
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def writable_view(buffer, op="get_into") -> memoryview:
    """``buffer`` as a flat writable byte view (``memoryview`` of format ``B``).

    ``buffer`` is a writable contiguous bytes-like object or a dense contiguous CPU tensor; anything
    else raises ``ValueError`` naming ``op``.
    """
    if is_tensor(buffer):
        import torch

        if (
            buffer.device.type != "cpu"
            or buffer.layout != torch.strided
            or not buffer.is_contiguous()
        ):
            raise ValueError(f"{op}: buffer tensor must be a dense contiguous CPU tensor")
        if buffer.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(buffer.detach().reshape(-1).view(torch.uint8).numpy())
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise ValueError(
            f"{op}: buffer must be a writable bytes-like object or tensor, got {type(buffer).__name__}"
        ) from None
    if mv.readonly:
        raise ValueError(f"{op}: buffer is read-only")
    if not mv.contiguous:
        raise ValueError(f"{op}: buffer must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def check_key(key, op: str) -> str:
    """``key`` if it is a valid key (a non-empty str of at most 4096 bytes of UTF-8).

    ValueError naming ``op`` and the problem otherwise.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"{op}: key must be a non-empty str, got {key!r}")
    if key.isascii():
        n = len(key)
    else:
        try:
            n = len(key.encode())
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. from os.fsdecode of bad bytes)
            raise ValueError(
                f"{op}: key must be valid Unicode text (encodable as UTF-8); it has a lone surrogate "
                f"{key[e.start]!r} at index {e.start}: {short_repr(key)}"
            ) from None
    if n > 4096:
        raise ValueError(
            f"{op}: key must be at most 4096 bytes of UTF-8, got {n} bytes: {short_repr(key)}"
        )
    return key


def check_config(config, op: str):
    """``config`` if it is a :class:`ReplicateConfig`.

    ValueError naming ``op`` otherwise (the store reports every bad argument as ValueError).
    """
    if not isinstance(config, ReplicateConfig):
        raise ValueError(
            f"{op}: config must be a mooncake_store.ReplicateConfig, got {type(config).__name__} "
            "(e.g. ReplicateConfig(replica_num=2))"
        )
    return config


def check_keys(keys, op: str, *, repeats: bool = False) -> list:
    """The keys of a batch call as a list (each checked by :func:`check_key`).

    A key may repeat only where ``repeats`` (reads); otherwise a repeat is a ValueError naming it.
    """
    if isinstance(keys, (str, bytes)):
        raise ValueError(f"{op}: keys must be a sequence of str, not a single key")
    try:
        keys = list(keys)
    except TypeError:
        raise ValueError(
            f"{op}: keys must be a sequence of str, got {type(keys).__name__}"
        ) from None
    # the common batch (short ASCII str keys) is checked whole in C: per-key Python checks
    # cost about as much as the master's answer to a 128-key lookup
    if not (
        keys
        and set(map(type, keys)) == {str}
        and min(map(len, keys)) > 0
        and max(map(len, keys)) <= 4096
        and "".join(keys).isascii()
    ):
        keys = [check_key(k, op) for k in keys]
    if not repeats and len(set(keys)) != len(keys):
        seen: set = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ValueError(
            f"{op}: key {short_repr(dup)} repeats within one batch (each key may be written or removed "
            "once per call)"
        )
    return keys


def dedup(keys: list) -> tuple:
    """``(unique keys in first-seen order, position in it of each key)``.

    ``(keys, None)`` when no key repeats.
    """
    if len(set(keys)) == len(keys):
        return keys, None
    first: dict = {}
    pos = [first.setdefault(k, len(first)) for k in keys]
    return list(first), pos


def raise_first(out: list) -> None:
    """Raises the first exception in a batch's results ``out``, if any."""
    for o in out:
        if isinstance(o, BaseException):
            raise o


def chunks(keys: list, max_keys: int = 2048, max_bytes: int = 1 << 20, extra: list | None = None):
    """Index ranges of ``keys`` small enough for one metadata request.

    The master limits keys per call and frame bytes; ``extra``: more bytes each key's item
    takes (its metadata and links, in a put).
    """
    if (
        extra is None
        and len(keys) <= max_keys
        and sum(map(len, keys)) * 4 + 64 * len(keys) <= max_bytes
    ):
        yield 0, len(keys)  # one request, as the loop below would find
        return
    start, size = 0, 0
    for i, k in enumerate(keys):
        n = len(k) * 4 + 64 + (extra[i] if extra is not None else 0)
        if i > start and (i - start >= max_keys or size + n > max_bytes):
            yield start, i
            start, size = i, 0
        size += n
    if start < len(keys) or not keys:
        yield start, len(keys)


def check_force(force, op: str):
    """Raises ``ValueError`` naming ``op`` unless ``force`` is True or False."""
    if not isinstance(force, bool):  # "no" is truthy: it removed leased objects
        raise ValueError(f"{op}: force must be True or False, got {force!r}")
