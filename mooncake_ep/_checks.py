"""Argument checks of :class:`mooncake_ep.Buffer`'s ops.

A check raises :class:`BadArgs`; the op catches it, tells every rank through its header
exchange, and raises ``ValueError`` on every rank before any token moves (see
:mod:`mooncake_ep.buffer`). Checks only read their arguments.
"""

from __future__ import annotations

import operator

import torch

# dtypes of the token rows, and their codes in the header (0: not one of them)
DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
DTYPE_NAMES = {code: str(dt).replace("torch.", "") for dt, code in DTYPES.items()}


class BadArgs(Exception):
    """A rank's own arguments are invalid (the message says which).

    Raised to the caller as ValueError after the header exchange told every rank.
    """


def check_int_arg(name: str, v: object) -> int:
    """``v`` as an int: Python or NumPy integers, never a bool, float or string."""
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise BadArgs(f"{name} must be an int, got {v!r}")
    return operator.index(v)


def check_int_tensor(name: str, t: object, shape0: int | None = None) -> None:
    """``t`` must be an int64 (or int32) tensor [T, K] (``T == shape0`` when given).

    Raises :class:`BadArgs`; the caller's BadArgs handler adds the op and the rank.
    """
    if not isinstance(t, torch.Tensor):
        raise BadArgs(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise BadArgs(f"{name} must be int64 (or int32), got {t.dtype}")
    if t.dim() != 2:
        raise BadArgs(f"{name} must be 2-D [num_tokens, num_topk], got shape {tuple(t.shape)}")
    if shape0 is not None and t.shape[0] != shape0:
        raise BadArgs(f"{name} has {t.shape[0]} rows but x has {shape0} tokens")


def check_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every id of ``topk_idx`` [T, K] must be -1 (no expert) or in ``[0, num_experts)``.

    Raises :class:`BadArgs`; the error names the first bad position and how many there are.
    """
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        val = int(topk_idx[pos[0], pos[1]])
        n = int(bad.sum())
        raise BadArgs(
            f"topk_idx[{pos[0]}, {pos[1]}] = {val} ({n} bad id{'s' if n > 1 else ''}); "
            f"expected -1 (no expert) or an expert id in [0, {num_experts})"
        )


def check_same_device(
    name: str, t: object, device: torch.device, whose: str = "x's device"
) -> None:
    """``t`` must be on ``device`` (all inputs of an op share one device)."""
    if isinstance(t, torch.Tensor) and t.device != device:
        raise BadArgs(
            f"{name} is on {t.device}, expected {device} ({whose}): all inputs of one op "
            "must be on one device"
        )


def input_device(x: object) -> torch.device:
    """``x``'s device, CPU for a non-tensor (its check raises later)."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def check_x(x: object, what: str = "x") -> None:
    """``x`` must be a float32/bfloat16/float16/float64 tensor [T, H]."""
    if not isinstance(x, torch.Tensor):
        raise BadArgs(f"{what} must be a tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise BadArgs(f"{what} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() != 2:
        raise BadArgs(f"{what} must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")


def check_weights(w: object, shape: tuple[int, ...], what: str = "topk_weights") -> None:
    """``w`` must be a float32 tensor of ``shape``."""
    if not isinstance(w, torch.Tensor):
        raise BadArgs(f"{what} must be a tensor, got {type(w).__name__}")
    if w.dtype != torch.float32:
        raise BadArgs(f"{what} must be float32, got {w.dtype}")
    if tuple(w.shape) != tuple(shape):
        raise BadArgs(f"{what} must have shape {tuple(shape)}, got {tuple(w.shape)}")
