"""Row kernels of the dispatch/combine data path: vectorized torch ops, or Triton kernels.

The Triton kernels (:mod:`mooncake_ep.triton_kernels`) serve CUDA tensors
(``kernels="auto"``/``"triton"``) and, with ``kernels="triton"`` and ``TRITON_INTERPRET=1``, CPU
tensors under Triton's interpreter (how the Triton path is tested without a GPU). Every tensor a
function here allocates is on its input's device.

Names of dimensions: ``T`` tokens of this rank, ``N`` rows moved (one per token and destination rank
in normal mode, one per distinct (token, expert) pair in low-latency mode), ``H`` hidden size.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_DTYPES = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)  # what fp8_dequantize and the row exchange take
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # channels per scale
FP8_MIN_AMAX = 1e-4  # a block of zeros gets scale FP8_MIN_AMAX / FP8_MAX


_CPU_SUM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cpu_kernels():
    """The extension holding the CPU row kernels (imported on first use: torch first)."""
    from mooncake_pg import _C

    return _C


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _use_triton(t: torch.Tensor, kernels: str) -> bool:
    """Whether ``t`` goes through the Triton kernels, per ``kernels``.

    ``"torch"`` never; ``"auto"`` for CUDA tensors when Triton imports; ``"triton"`` for CUDA
    tensors (an ImportError propagates) and for CPU tensors when ``TRITON_INTERPRET=1`` (else CPU
    tensors use torch ops).
    """
    if kernels == "torch":
        return False
    if not t.is_cuda and not (kernels == "triton" and t.device.type == "cpu" and _interpreting()):
        return False
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        if kernels == "triton":
            raise
        return False
    return True


def gather_rows(
    x: torch.Tensor,
    idx: torch.Tensor,
    kernels: str = "auto",
    alloc: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[n] = x[idx[n]]``: the rows of ``x`` that ``idx`` names.

    Args:
        x: [T, H].
        idx: int64 [N].
        kernels: ``"auto"``, ``"torch"`` or ``"triton"``: which kernels serve ``x`` (see the module
            docstring).
        alloc: ``alloc(shape, dtype, device)`` supplies the output (torch path).

    Returns:
        [N, H] of x's dtype.
    """
    if _use_triton(x, kernels):
        from .triton_kernels import permute

        return permute(x, idx)
    if alloc is None:
        return torch.index_select(x, 0, idx)
    out = alloc((idx.numel(),) + tuple(x.shape[1:]), x.dtype, x.device)
    return torch.index_select(x, 0, idx, out=out)


def scatter_add_rows(
    rows: torch.Tensor,
    idx: torch.Tensor,
    num_out: int,
    *,
    src: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    fp32_accumulate: bool = True,
    out_dtype: torch.dtype | None = None,
    max_per_row: int | None = None,
    alloc: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[t] = sum over n with idx[n] == t of weights[n] * rows[src[n]]``.

    On CPU rows add in index order (the result is deterministic; the C++ kernel
    ``mooncake_pg._C._ep_scatter_add_rows`` sums each output row in one pass when the dtypes allow);
    on CUDA ``index_add_`` adds them in no fixed order (identical results only where at most two
    rows meet). Everything is allocated on ``rows``' device.

    Args:
        rows: [R, H].
        idx: int64 [N] in ``[0, num_out)``.
        num_out: the number of output rows.
        src: int64 [N] in ``[0, R)``; ``src[n] = n`` when ``None``.
        weights: float [N]; 1 when ``None``.
        fp32_accumulate: 16-bit rows accumulate in float32 when it is set (or when weighted) and
            round once.
        out_dtype: the output's dtype (default rows' dtype).
        max_per_row: at most this many rows add into one output row; with 2 or fewer, unweighted
            sums in the data's own dtype already round exactly once (0 + a is exact, a + b rounds
            once), so the float32 detour is skipped.
        alloc: ``alloc(shape, dtype, device)`` supplies the (uninitialised) output/accumulator
            tensors.

    Returns:
        [num_out, H] of ``out_dtype``, on rows' device.
    """
    out_dtype = out_dtype or rows.dtype
    H = rows.shape[1] if rows.dim() == 2 else 0
    acc_dtype = out_dtype
    if out_dtype in (torch.bfloat16, torch.float16) and (fp32_accumulate or weights is not None):
        if weights is not None or rows.dtype != out_dtype or max_per_row is None or max_per_row > 2:
            acc_dtype = torch.float32
    if (
        rows.device.type == "cpu"
        and rows.dim() == 2
        and rows.dtype == out_dtype
        and rows.dtype in _CPU_SUM_DTYPES
        # the kernel sums 16-bit rows in float32 and rounds once: 16-bit sums that round at
        # every add stay with torch, unless at most two rows meet (the same result then)
        and (
            rows.dtype in (torch.float32, torch.float64)
            or acc_dtype == torch.float32
            or (weights is None and max_per_row is not None and max_per_row <= 2)
        )
    ):
        shape = (num_out, H)
        out = (
            torch.empty(shape, dtype=out_dtype)
            if alloc is None
            else alloc(shape, out_dtype, rows.device)
        )
        w = None if weights is None else weights.to(torch.float32).contiguous()
        if src is not None:
            src = src.to(torch.int64).contiguous()
        _cpu_kernels()._ep_scatter_add_rows(
            rows.contiguous(), idx.to(torch.int64).contiguous(), src, w, out
        )
        return out
    if src is not None:
        rows = rows.index_select(0, src)
    if alloc is None:
        out = torch.zeros((num_out, H), dtype=acc_dtype, device=rows.device)
    else:
        out = alloc((num_out, H), acc_dtype, rows.device).zero_()
    if rows.shape[0]:
        if rows.dtype == acc_dtype:
            terms = rows
        elif alloc is None:
            terms = rows.to(acc_dtype)
        else:  # a recycled buffer: a fresh one costs a page fault per 4 KiB on first touch
            terms = alloc(tuple(rows.shape), acc_dtype, rows.device).copy_(rows)
        if weights is not None:
            w = weights.to(acc_dtype).unsqueeze(1)
            terms = terms * w if terms is rows else terms.mul_(w)  # a copy of its own: in place
        out.index_add_(0, idx, terms)
    if acc_dtype == out_dtype:
        return out
    if alloc is None:
        return out.to(out_dtype)
    return alloc((num_out, H), out_dtype, rows.device).copy_(out)


def sum_rows_by_table(
    rows: torch.Tensor,
    pos: torch.Tensor,
    *,
    fp32_accumulate: bool = True,
    max_per_row: int | None = None,
    kernels: str = "auto",
) -> torch.Tensor | None:
    """``out[t] = sum_j rows[pos[t, j]]`` over ``pos[t, j] >= 0``, in ``j`` order, with Triton.

    The kernel is Triton's ``unpermute``. Equal bit for bit to :func:`scatter_add_rows` on CPU when
    ``pos`` lists each token's rows in increasing row order (its CPU index order), and deterministic
    on CUDA.

    Args:
        rows: [N, H] float32/bfloat16.
        pos: int64 [T, M] on rows' device.
        fp32_accumulate: 16-bit sums of more than two rows are served only with it (float32
            accumulation, one rounding).
        max_per_row: at most this many rows add into one output row, as in :func:`scatter_add_rows`.
        kernels: which kernels serve ``rows``, as in :func:`gather_rows`.

    Returns:
        [T, H] of rows' dtype (float32 accumulation, one rounding), or ``None`` where the Triton
        path does not apply (kernels, device, dtype, or 16-bit sums of more than two rows without
        ``fp32_accumulate``); the caller then uses ``scatter_add_rows``.
    """
    if rows.dtype not in (torch.float32, torch.bfloat16) or rows.dim() != 2 or rows.stride(1) != 1:
        return None
    if (
        rows.dtype != torch.float32
        and not fp32_accumulate
        and (max_per_row is None or max_per_row > 2)
    ):
        return None
    if not _use_triton(rows, kernels):
        return None
    if rows.shape[0] == 0:  # no rows came back: no kernel (an empty CUDA tensor has no address)
        return torch.zeros((pos.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
    from .triton_kernels import unpermute

    return unpermute(rows, pos)


def scatter_rows(rows: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[idx[n]] = rows[n]`` in place (indices distinct); returns ``out``."""
    if rows.shape[0]:
        if rows.element_size() == 1 and rows.dtype != torch.uint8:  # float8: no CPU index_copy_
            out.view(torch.uint8).index_copy_(0, idx, rows.view(torch.uint8))
        else:
            out.index_copy_(0, idx, rows)
    return out


def fp8_quantize(x: torch.Tensor, kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 cast: ``x`` [N, H] float -> ``(q, scales)``.

    ``q`` is float8_e4m3fn [N, H] and ``scales`` float32 [N, ceil(H / 128)]; block ``b`` covers
    channels ``[128 b, min(128 (b + 1), H))`` (the last block may be shorter) and
    ``x ~= q.float() * scales[:, b]`` there. ``scale = max(amax, 1e-4) / 448``. Raises
    ``ValueError`` unless ``x`` is a 2-D floating-point tensor.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        what = (
            f"shape {tuple(x.shape)}, dtype {x.dtype}"
            if isinstance(x, torch.Tensor)
            else type(x).__name__
        )
        raise ValueError(
            f"fp8_quantize: x must be a 2-D floating-point tensor [N, H] (one row per token; "
            f"reshape to (-1, H) first), got {what}"
        )
    if _use_triton(x, kernels):
        from .triton_kernels import fp8_cast

        return fp8_cast(x)
    N, H = x.shape
    nb = (H + FP8_BLOCK - 1) // FP8_BLOCK
    xf = x.float()
    pad = nb * FP8_BLOCK - H
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.view(N, nb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_(min=FP8_MIN_AMAX)
    scales = amax / FP8_MAX
    q = (blocks / scales.unsqueeze(2)).clamp_(-FP8_MAX, FP8_MAX).view(N, nb * FP8_BLOCK)[:, :H]
    return q.to(FP8_DTYPE).contiguous(), scales.contiguous()


def fp8_dequantize(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize` on the last dimension.

    ``q`` [..., H] float8, ``scales`` [..., ceil(H / 128)] float32 -> [..., H] of ``dtype``. Raises
    ``ValueError`` for another dtype of ``q`` or ``scales`` or mismatched shapes.
    """
    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dequantize: q must be float8 (e4m3fn or e5m2), got {q.dtype}")
    H = q.shape[-1]
    want = (*q.shape[:-1], -(-H // FP8_BLOCK))
    if scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise ValueError(
            f"fp8_dequantize: scales must be float32 of shape {want}, got {scales.dtype} of "
            f"shape {tuple(scales.shape)}"
        )
    s = scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :H]
    return (q.float() * s).to(dtype)
