// CPU row kernel of mooncake_ep's data path (mooncake_ep/kernels.py calls it through
// _C._ep_scatter_add_rows, bindings/ep.cpp, for CPU tensors; CUDA tensors take its Triton
// kernels): a token's rows summed in one pass. Raw pointers and the core's DType; the
// binding checks the tensors and splits the output rows among torch's threads.
#pragma once
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"

namespace mooncake::ep {

// The N input rows ordered by output row: a stable counting sort of n by idx[n], so output
// row t sums rows order[start[t]] .. order[start[t + 1] - 1], in increasing n. Returns -1,
// or the first n whose idx[n] is outside [0, T) (then nothing is ordered).
int64_t order_rows(const int64_t* idx, int64_t N, int64_t T, std::vector<int64_t>* start,
                   std::vector<int64_t>* order);

// Whether sum_rows takes rows of this dtype (float32, float64, bfloat16, float16).
bool sums_rows_of(DType dt);

// Output rows [t0, t1) of out ([T, H], contiguous, dtype dt): out[t] = the sum over t's
// ordered rows n of w[n] * rows[src ? src[n] : n] (w[n] = 1 when w is null), accumulated in
// float (double for float64 rows) from zero and rounded once to dt, so 16-bit sums equal a
// float32 index_add_ in row order rounded once. rows: [R, H] contiguous of dtype dt.
void sum_rows(DType dt, const void* rows, const int64_t* order, const int64_t* start, const int64_t* src,
              const float* w, void* out, int64_t t0, int64_t t1, int64_t H);

}  // namespace mooncake::ep
