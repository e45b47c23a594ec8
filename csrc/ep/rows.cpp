#include "ep/rows.hpp"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace mooncake::ep {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The loops over a row, also compiled for AVX2 and picked when the process starts by the
// CPU it runs on (an IFUNC, as torch's own kernels dispatch): the build's baseline is
// x86-64 (SSE2), at which the bfloat16 sum runs at about half the speed.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOONCAKE_ROW_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define MOONCAKE_ROW_LOOP
#endif

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c10::BFloat16's rounding (round to nearest even, NaN to the quiet NaN 0x7FC0), written
// so that the loop vectorizes
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// acc += w * row (w is 1 for an unweighted sum: 1 * x is exact, so one loop serves both)
MOONCAKE_ROW_LOOP void add_bf16(float* __restrict acc, const uint16_t* __restrict r, float w, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] += w * bf16_bits_to_float(r[h]);
}

MOONCAKE_ROW_LOOP void store_bf16(uint16_t* __restrict o, const float* __restrict acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) o[h] = float_to_bf16_bits(acc[h]);
}

MOONCAKE_ROW_LOOP void add_f32(float* __restrict acc, const float* __restrict r, float w, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] += w * r[h];
}

// one row into the accumulator, and the accumulator out: generic, then the fast ones
template <typename T>
void add_row(acc_t<T>* acc, const T* r, float w, int64_t H) {
  const acc_t<T> f = w;
  for (int64_t h = 0; h < H; ++h) acc[h] += f * static_cast<acc_t<T>>(r[h]);
}
template <>
void add_row<c10::BFloat16>(float* acc, const c10::BFloat16* r, float w, int64_t H) {
  add_bf16(acc, reinterpret_cast<const uint16_t*>(r), w, H);
}
template <>
void add_row<float>(float* acc, const float* r, float w, int64_t H) {
  add_f32(acc, r, w, H);
}

template <typename T>
void store_row(T* o, const acc_t<T>* acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(acc[h]);
}
template <>
void store_row<c10::BFloat16>(c10::BFloat16* o, const float* acc, int64_t H) {
  store_bf16(reinterpret_cast<uint16_t*>(o), acc, H);
}

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
        add_row<T>(acc.data(), rows + (src ? src[n] : n) * H, w ? w[n] : 1.0f, H);
      }
      store_row<T>(out + t * H, acc.data(), H);
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
