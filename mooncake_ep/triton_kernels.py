"""Triton kernels of the dispatch/combine data path (CUDA tensors).

Valid on Triton 3.6 and 3.9: only core ``tl`` operations (no ``tl.dot``, no autotune, no
descriptors). Checked by tests/ep/test_ep_triton.py on CPU tensors under
``TRITON_INTERPRET=1`` and compiled ahead of time for ``GPUTarget("cuda", 90, 32)``.

Kernels (names of dimensions as in :mod:`mooncake_ep.kernels`):

* ``permute``: ``out[n] = x[src[n]]`` -- rows of ``x`` [T, H] into send order [N, H].
* ``unpermute``: ``out[t] = sum_j rows[pos[t, j]]`` over ``pos[t, j] >= 0`` -- each token
  sums the rows that came back for it (``pos`` int64 [T, M], -1 = none); float32
  accumulation, one rounding.
* ``weighted_combine``: ``out[t] = sum_j w[t, j] * rows[pos[t, j]]`` (weights float32 [T, M]).
* ``fp8_cast``: per-row, per-128-channel e4m3 cast with a float32 scale
  ``max(amax, 1e-4) / 448`` (the last block may be shorter).

16-bit inputs are upcast to float32 before any arithmetic; the final roundings (to bf16,
to e4m3) are done in float32 integer arithmetic, ties to even, so the last cast is exact
and the interpreter, the GPU and torch's own casts agree bit for bit. One program handles one row
and one block of ``BLOCK_H`` channels; the grids are 2-D ``(rows, cdiv(H, BLOCK_H))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 128
FP8_BLOCK = 128


@triton.jit
def _rtne_bf16(v):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32.

    That makes the final cast exact (the interpreter's own fp32 -> bf16 cast truncates).
    """
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rtne_e4m3(y):
    """float32 with |y| <= 448 -> the nearest float8_e4m3fn value (ties to even), still as float32.

    The interpreter's own fp32 -> fp8 cast loses a carry into the exponent.
    """
    b = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((b >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6's step
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 1 / step, exact
    r = y * inv
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to an integer, ties to even
    r = r * step
    return tl.where(r == 0.0, y * 0.0, r)  # keep the sign of values that round to zero


@triton.jit
def _permute_kernel(x_ptr, src_ptr, out_ptr, H, stride_x, stride_o, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    hb = tl.program_id(1)
    cols = hb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    src = tl.load(src_ptr + n).to(tl.int64)
    v = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0)
    tl.store(out_ptr + n.to(tl.int64) * stride_o + cols, v, mask=mask)


@triton.jit
def _combine_kernel(
    rows_ptr,
    pos_ptr,
    w_ptr,
    out_ptr,
    M: tl.constexpr,
    H,
    stride_r,
    stride_o,
    HAS_W: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    cols = hb * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(M):  # M (ranks or top-k slots) is small: unrolled
        p = tl.load(pos_ptr + t.to(tl.int64) * M + j).to(tl.int64)
        pv = (
            cols.to(tl.int64) * 0 + p
        )  # the row index as a vector (a scalar mask breaks the interpreter)
        ok = cmask & (pv >= 0)
        pc = tl.where(pv >= 0, pv, 0)
        v = tl.load(rows_ptr + pc * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            wt = tl.load(w_ptr + t.to(tl.int64) * M + j).to(tl.float32)
            v = v * wt
        acc += v
    if OUT_BF16:
        acc = _rtne_bf16(acc)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask
    )


@triton.jit
def _fp8_cast_kernel(x_ptr, q_ptr, s_ptr, H, NB, stride_x, stride_q, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    v = tl.load(x_ptr + n.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    amax = tl.maximum(amax, 1e-4)
    scale = tl.math.div_rn(amax, 448.0)  # IEEE division, as torch's
    q = _rtne_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))
    tl.store(q_ptr + n.to(tl.int64) * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + n.to(tl.int64) * NB + b, scale)


def _check_rows(x, name):
    if x.dim() != 2:
        raise ValueError(
            f"mooncake_ep.triton_kernels: {name} must be 2-D, got shape {tuple(x.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError(
            f"mooncake_ep.triton_kernels: {name} must have unit stride in its last dimension"
        )


def permute(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out[n] = x[src[n]]``: ``x`` [T, H], ``src`` int64 [N] in ``[0, T)`` -> [N, H]."""
    _check_rows(x, "x")
    N, H = src.numel(), x.shape[1]
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    if N and H:
        _permute_kernel[(N, triton.cdiv(H, BLOCK_H))](
            x, src.contiguous(), out, H, x.stride(0), out.stride(0), BLOCK=BLOCK_H
        )
    return out


def _combine(rows, pos, w, out_dtype):
    _check_rows(rows, "rows")
    if pos.dim() != 2:
        raise ValueError(
            f"mooncake_ep.triton_kernels: pos must be 2-D [T, M], got shape {tuple(pos.shape)}"
        )
    T, M = pos.shape
    H = rows.shape[1]
    out = torch.empty((T, H), dtype=out_dtype or rows.dtype, device=rows.device)
    if T and H:
        pos = pos.to(torch.int64).contiguous()
        wt = (
            w.to(torch.float32).contiguous() if w is not None else pos
        )  # unused when HAS_W is False
        _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](
            rows,
            pos,
            wt,
            out,
            M,
            H,
            rows.stride(0),
            out.stride(0),
            HAS_W=w is not None,
            OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK=BLOCK_H,
        )
    return out


def unpermute(
    rows: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``out[t] = sum_j rows[pos[t, j]]`` over ``pos[t, j] >= 0``; float32 accumulation.

    ``rows`` [N, H], ``pos`` int [T, M] -> [T, H] (``out_dtype``, default rows').
    """
    return _combine(rows, pos, None, out_dtype)


def weighted_combine(
    rows: torch.Tensor,
    pos: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[pos[t, j]]`` over ``pos[t, j] >= 0``.

    ``weights`` float [T, M]; float32 accumulation.
    """
    if tuple(weights.shape) != tuple(pos.shape):
        raise ValueError(
            f"mooncake_ep.triton_kernels: weights {tuple(weights.shape)} and pos "
            f"{tuple(pos.shape)} differ in shape"
        )
    return _combine(rows, pos, weights, out_dtype)


def fp8_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [N, H] -> ``(q float8_e4m3fn [N, H], scales float32 [N, ceil(H / 128)])``."""
    _check_rows(x, "x")
    N, H = x.shape
    nb = triton.cdiv(H, FP8_BLOCK)
    q = torch.empty((N, H), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((N, nb), dtype=torch.float32, device=x.device)
    if N and H:
        _fp8_cast_kernel[(N, nb)](x, q, s, H, nb, x.stride(0), q.stride(0), BLOCK=FP8_BLOCK)
    return q, s


# Signatures for ahead-of-time compilation (triton.compile(ASTSource(...))).
AOT_SIGNATURES = {
    "permute": (
        _permute_kernel,
        {
            "x_ptr": "*bf16",
            "src_ptr": "*i64",
            "out_ptr": "*bf16",
            "H": "i32",
            "stride_x": "i64",
            "stride_o": "i64",
            "BLOCK": "constexpr",
        },
        {"BLOCK": BLOCK_H},
    ),
    "unpermute": (
        _combine_kernel,
        {
            "rows_ptr": "*bf16",
            "pos_ptr": "*i64",
            "w_ptr": "*fp32",
            "out_ptr": "*bf16",
            "M": "constexpr",
            "H": "i32",
            "stride_r": "i64",
            "stride_o": "i64",
            "HAS_W": "constexpr",
            "OUT_BF16": "constexpr",
            "BLOCK": "constexpr",
        },
        {"M": 4, "HAS_W": False, "OUT_BF16": True, "BLOCK": BLOCK_H},
    ),
    "weighted_combine": (
        _combine_kernel,
        {
            "rows_ptr": "*bf16",
            "pos_ptr": "*i64",
            "w_ptr": "*fp32",
            "out_ptr": "*bf16",
            "M": "constexpr",
            "H": "i32",
            "stride_r": "i64",
            "stride_o": "i64",
            "HAS_W": "constexpr",
            "OUT_BF16": "constexpr",
            "BLOCK": "constexpr",
        },
        {"M": 8, "HAS_W": True, "OUT_BF16": True, "BLOCK": BLOCK_H},
    ),
    "fp8_cast": (
        _fp8_cast_kernel,
        {
            "x_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32",
            "H": "i32",
            "NB": "i32",
            "stride_x": "i64",
            "stride_q": "i64",
            "BLOCK": "constexpr",
        },
        {"BLOCK": FP8_BLOCK},
    ),
}
