// mooncake_ep's CPU row kernel (ep/rows.hpp).
#include "ep/rows.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/numeric.hpp"

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

// acc += w * row (w is 1 for an unweighted sum: 1 * x is exact, so one loop serves both)
MOONCAKE_ROW_LOOP void add_bf16(float* __restrict acc, const uint16_t* __restrict r, float w, int64_t H) {
  for (int64_t h = 0; h < H; ++h) acc[h] += w * num::bf16_to_float(r[h]);
}

MOONCAKE_ROW_LOOP void store_bf16(uint16_t* __restrict o, const float* __restrict acc, int64_t H) {
  for (int64_t h = 0; h < H; ++h) o[h] = num::float_to_bf16(acc[h]);
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
void add_row<num::BFloat16>(float* acc, const num::BFloat16* r, float w, int64_t H) {
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
void store_row<num::BFloat16>(num::BFloat16* o, const float* acc, int64_t H) {
  store_bf16(reinterpret_cast<uint16_t*>(o), acc, H);
}

template <typename T>
void sum_typed(const T* rows, const int64_t* order, const int64_t* start, const int64_t* src, const float* w,
               T* out, int64_t t0, int64_t t1, int64_t H) {
  // each output row sums its rows into an accumulator of its own (a cache-resident row)
  // and is written once: rows are read once, out written once
  std::vector<acc_t<T>> acc(H);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc.begin(), acc.end(), acc_t<T>(0));
    for (int64_t j = start[t]; j < start[t + 1]; ++j) {
      const int64_t n = order[j];
      add_row<T>(acc.data(), rows + (src ? src[n] : n) * H, w ? w[n] : 1.0f, H);
    }
    store_row<T>(out + t * H, acc.data(), H);
  }
}

}  // namespace

int64_t order_rows(const int64_t* idx, int64_t N, int64_t T, std::vector<int64_t>* start,
                   std::vector<int64_t>* order) {
  start->assign(T + 1, 0);
  order->assign(N, 0);
  for (int64_t n = 0; n < N; ++n) {
    if (idx[n] < 0 || idx[n] >= T) return n;
    ++(*start)[idx[n] + 1];
  }
  for (int64_t t = 0; t < T; ++t) (*start)[t + 1] += (*start)[t];
  std::vector<int64_t> at(start->begin(), start->end() - 1);
  for (int64_t n = 0; n < N; ++n) (*order)[at[idx[n]]++] = n;
  return -1;
}

bool sums_rows_of(DType dt) {
  return dt == DType::F32 || dt == DType::F64 || dt == DType::BF16 || dt == DType::F16;
}

void sum_rows(DType dt, const void* rows, const int64_t* order, const int64_t* start, const int64_t* src,
              const float* w, void* out, int64_t t0, int64_t t1, int64_t H) {
  switch (dt) {
    case DType::F32:
      return sum_typed(static_cast<const float*>(rows), order, start, src, w, static_cast<float*>(out), t0,
                       t1, H);
    case DType::F64:
      return sum_typed(static_cast<const double*>(rows), order, start, src, w, static_cast<double*>(out), t0,
                       t1, H);
    case DType::BF16:
      return sum_typed(static_cast<const num::BFloat16*>(rows), order, start, src, w,
                       static_cast<num::BFloat16*>(out), t0, t1, H);
    case DType::F16:
      return sum_typed(static_cast<const num::Half*>(rows), order, start, src, w,
                       static_cast<num::Half*>(out), t0, t1, H);
    default:
      return;  // sums_rows_of(dt) is false: the caller checked
  }
}

}  // namespace mooncake::ep
