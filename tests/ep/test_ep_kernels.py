"""The CPU row kernel behind ``mooncake_ep.kernels.scatter_add_rows`` (the C++
``mooncake_pg._C._ep_scatter_add_rows``): its sums against float64 loops written here, bit
equality with a float32 ``index_add_`` rounded once (the order the docstring promises), and
its errors. One process, no group."""

from __future__ import annotations

import pytest
import torch

from mooncake_ep import kernels as K_

pytestmark = pytest.mark.timeout(120)


def _loop_sum(rows, idx, num_out, src=None, weights=None):
    """float64 [num_out, H]: the sum of each output row's rows, one by one."""
    out = torch.zeros(num_out, rows.shape[1], dtype=torch.float64)
    for n in range(idx.numel()):
        r = rows[int(src[n]) if src is not None else n].double()
        out[int(idx[n])] += r * (float(weights[n]) if weights is not None else 1.0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_src", [False, True], ids=["rows", "src"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_scatter_add_rows_equals_loops(dtype, with_src, weighted):
    g = torch.Generator().manual_seed(7)
    N, T, H = 300, 37, 67  # the last 5 outputs get no row (zeros), the others ~10 each
    rows = (torch.randn(N + 11, H, generator=g) * 4).to(dtype)
    idx = torch.randint(0, T - 5, (N,), generator=g)
    src = torch.randperm(N + 11, generator=g)[:N] if with_src else None
    if not with_src:
        rows = rows[:N].contiguous()
    w = torch.rand(N, generator=g) if weighted else None
    got = K_.scatter_add_rows(rows, idx, T, src=src, weights=w)
    assert got.dtype == dtype and got.shape == (T, H)
    ref = _loop_sum(rows, idx, T, src, w)
    # one rounding of a sum of up to ~20 terms accumulated in float32 (float64: its own)
    eps = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2**-7)
    tol = eps * (ref.abs().max() + 1)
    assert float((got.double() - ref).abs().max()) <= float(tol)
    empty = torch.bincount(idx, minlength=T) == 0
    assert empty.any() and (got[empty] == 0).all()


def test_sixteen_bit_sums_round_once_like_a_float32_index_add():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2000, 256, generator=g).bfloat16()
    idx = torch.randint(0, 100, (2000,), generator=g)
    want = torch.zeros(100, 256).index_add_(0, idx, rows.float()).bfloat16()
    assert torch.equal(K_.scatter_add_rows(rows, idx, 100), want)


def test_no_rows_gives_zeros():
    out = K_.scatter_add_rows(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), 3)
    assert torch.equal(out, torch.zeros(3, 5))


@pytest.mark.parametrize(
    "idx, src, match",
    [
        ([0, 3], None, r"idx\[1\] = 3 not in \[0, 3\)"),
        ([0, -1], None, r"idx\[1\] = -1 not in \[0, 3\)"),
        ([0, 1], [0, 9], r"src\[1\] = 9 not in \[0, 2\)"),
    ],
)
def test_indices_out_of_range_raise_before_writing(idx, src, match):
    rows = torch.ones(2, 4)
    out = torch.full((3, 4), 5.0)
    from mooncake_pg import _C

    s = torch.tensor(src) if src is not None else None
    with pytest.raises(RuntimeError, match=match):
        _C._ep_scatter_add_rows(rows, torch.tensor(idx), s, None, out)
    assert (out == 5.0).all()  # nothing written
