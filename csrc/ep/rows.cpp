#include "ep/rows.hpp"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace mooncake::ep {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
void sum_rows(const T* rows, const int64_t* order, const int64_t* start, const int64_t* src, const float* w,
              T* out, int64_t T_out, int64_t H) {
  // Output rows in parallel; each sums its rows into an accumulator of its own (a cache-
  // resident row) and writes once: rows are read once, out written once.
  at::parallel_for(0, T_out, 16, [&](int64_t t0, int64_t t1) {
    std::vector<acc_t<T>> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), acc_t<T>(0));
      for (int64_t j = start[t]; j < start[t + 1]; ++j) {
        const int64_t n = order[j];
        const T* r = rows + (src ? src[n] : n) * H;
        if (w) {
          const acc_t<T> f = w[n];
          for (int64_t h = 0; h < H; ++h) acc[h] += f * static_cast<acc_t<T>>(r[h]);
        } else {
          for (int64_t h = 0; h < H; ++h) acc[h] += static_cast<acc_t<T>>(r[h]);
        }
      }
      T* o = out + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(acc[h]);
    }
  });
}

}  // namespace

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
  // a stable counting sort of n by idx[n]: each output row's rows in increasing n
  std::vector<int64_t> start(T_out + 1, 0), order(N);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(ix[n] >= 0 && ix[n] < T_out, op, ": idx[", n, "] = ", ix[n], " not in [0, ", T_out, ")");
    ++start[ix[n] + 1];
  }
  for (int64_t t = 0; t < T_out; ++t) start[t + 1] += start[t];
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t n = 0; n < N; ++n) order[at[ix[n]]++] = n;
  }
  switch (rows.scalar_type()) {
    case at::kFloat:
      sum_rows(rows.data_ptr<float>(), order.data(), start.data(), sx, wx, out.data_ptr<float>(), T_out, H);
      break;
    case at::kDouble:
      sum_rows(rows.data_ptr<double>(), order.data(), start.data(), sx, wx, out.data_ptr<double>(), T_out, H);
      break;
    case at::kBFloat16:
      sum_rows(rows.data_ptr<c10::BFloat16>(), order.data(), start.data(), sx, wx,
               out.data_ptr<c10::BFloat16>(), T_out, H);
      break;
    case at::kHalf:
      sum_rows(rows.data_ptr<c10::Half>(), order.data(), start.data(), sx, wx, out.data_ptr<c10::Half>(),
               T_out, H);
      break;
    default:
      TORCH_CHECK(false, op, ": expected float32, float64, bfloat16 or float16 rows, got ",
                  rows.scalar_type());
  }
}

}  // namespace mooncake::ep
