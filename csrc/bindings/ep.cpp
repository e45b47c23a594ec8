// Bindings of mooncake_ep's CPU row kernel (ep/rows.hpp): the tensors' checks, and the output
// rows split among torch's intra-op threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "bindings/bindings.hpp"
#include "ep/rows.hpp"
#include "pg/convert.hpp"

namespace py = pybind11;

namespace mooncake::bindings {

namespace {

// out[t] = sum over n with idx[n] == t of weights[n] * rows[src[n]] (ep/rows.hpp).
// rows [R, H] contiguous float32/float64/bfloat16/float16 on CPU; idx int64 [N] in [0, T);
// src int64 [N] in [0, R) or undefined (then N == R); weights float32 [N] or undefined;
// out [T, H] contiguous, rows' dtype. Raises RuntimeError on anything else.
void scatter_add_rows(const at::Tensor& rows, const at::Tensor& idx, const at::Tensor& src,
                      const at::Tensor& weights, at::Tensor& out) {
  const char* op = "mooncake_ep scatter_add_rows";
  TORCH_CHECK(rows.device().is_cpu() && out.device().is_cpu() && idx.device().is_cpu(), op,
              ": expected CPU tensors");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), op, ": rows must be [R, H] contiguous, got ",
              rows.sizes());
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == rows.size(1), op, ": out must be [T, ",
              rows.size(1), "] contiguous, got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == rows.scalar_type(), op, ": out must be ", rows.scalar_type(), ", got ",
              out.scalar_type());
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous(), op,
              ": idx must be contiguous int64 [N]");
  const int64_t N = idx.numel(), T_out = out.size(0), H = rows.size(1), R = rows.size(0);
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t* sx = nullptr;
  if (src.defined()) {
    TORCH_CHECK(src.device().is_cpu() && src.dim() == 1 && src.scalar_type() == at::kLong &&
                    src.is_contiguous() && src.numel() == N,
                op, ": src must be contiguous int64 [", N, "] on CPU");
    sx = src.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(sx[n] >= 0 && sx[n] < R, op, ": src[", n, "] = ", sx[n], " not in [0, ", R, ")");
  } else {
    TORCH_CHECK(R == N, op, ": rows must have ", N, " rows (one per idx), got ", R);
  }
  const float* wx = nullptr;
  if (weights.defined()) {
    TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 1 && weights.scalar_type() == at::kFloat &&
                    weights.is_contiguous() && weights.numel() == N,
                op, ": weights must be contiguous float32 [", N, "] on CPU");
    wx = weights.data_ptr<float>();
  }
  std::vector<int64_t> start, order;
  const int64_t bad = ep::order_rows(ix, N, T_out, &start, &order);
  TORCH_CHECK(bad < 0, op, ": idx[", bad, "] = ", bad < 0 ? 0 : ix[bad], " not in [0, ", T_out, ")");
  const std::optional<DType> dt = to_dtype(rows.scalar_type());
  TORCH_CHECK(dt && ep::sums_rows_of(*dt), op, ": expected float32, float64, bfloat16 or float16 rows, got ",
              rows.scalar_type());
  const void* rp = rows.data_ptr();
  void* op_out = out.data_ptr();
  // output rows in parallel, each written by one thread
  at::parallel_for(0, T_out, 16, [&](int64_t t0, int64_t t1) {
    ep::sum_rows(*dt, rp, order.data(), start.data(), sx, wx, op_out, t0, t1, H);
  });
}

}  // namespace

void register_ep(py::module_& m) {
  // mooncake_ep's CPU row kernel (mooncake_ep/kernels.py)
  m.def(
      "_ep_scatter_add_rows",
      [](const at::Tensor& rows, const at::Tensor& idx, const std::optional<at::Tensor>& src,
         const std::optional<at::Tensor>& weights, at::Tensor out) {
        scatter_add_rows(rows, idx, src.value_or(at::Tensor()), weights.value_or(at::Tensor()), out);
      },
      py::arg("rows"), py::arg("idx"), py::arg("src"), py::arg("weights"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace mooncake::bindings
