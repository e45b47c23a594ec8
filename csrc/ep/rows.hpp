// CPU row kernels of mooncake_ep's data path (mooncake_ep/kernels.py calls them for CPU
// tensors; CUDA tensors take its Triton kernels).
#pragma once
#include <ATen/ATen.h>

namespace mooncake::ep {

// out[t] = sum, in increasing n, over the n with idx[n] == t of weights[n] * rows[src[n]]
// (weights 1 when undefined, src[n] = n when undefined): a token's rows summed in one pass,
// accumulated in float (double for float64 rows) from zero and rounded once to out's dtype,
// so 16-bit sums equal a float32 index_add_ in row order rounded once.
// rows [R, H] contiguous float32/float64/bfloat16/float16 on CPU; idx int64 [N] in
// [0, T); src int64 [N] in [0, R) or undefined (then N == R); weights float32 [N] or
// undefined; out [T, H] contiguous, rows' dtype. Throws (TORCH_CHECK) on anything else.
void scatter_add_rows(const at::Tensor& rows, const at::Tensor& idx, const at::Tensor& src,
                      const at::Tensor& weights, at::Tensor& out);

}  // namespace mooncake::ep
