// Element-wise reductions over raw buffers, for every dtype of docs/design.md.
#pragma once
#include <cstddef>
#include <string>

#include "core/dtype.hpp"

namespace mooncake {

// The core's reduction ops (the torch layer maps c10d::ReduceOp onto them, pg/convert.cpp);
// same order as the CUDA kernels' cuda::Op.
enum class RedOp : int { SUM = 0, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM };

const char* red_op_name(RedOp op);

// Empty string if `op` is defined for `dt`, else the reason (used for argument checks).
std::string check_reduce_supported(DType dt, RedOp op);

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... in that order, n elements of dtype dt.
// 16-bit and 8-bit floats accumulate in float and round once. AVG divides the sum by
// nsrc (integers: truncated toward zero). PREMUL_SUM is a SUM here (inputs are scaled
// beforehand with scale_copy). dst may alias srcs[k].
// dst2, when not null, receives the same result (it may alias a source too).
// avg_div > 0: AVG divides by avg_div instead (the last level of a two-level reduction,
// whose sources are sums of several ranks).
void reduce_buffers(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, RedOp op,
                    void* dst2 = nullptr, int avg_div = 0);

// dst = src * factor (PREMUL_SUM's pre-multiplication), n elements.
void scale_copy(void* dst, const void* src, size_t n, DType dt, double factor);

}  // namespace mooncake
