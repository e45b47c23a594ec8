// Argument checks of the c10d entry points (pg/entry.cpp, pg/cuda/ipc_ops.cpp). Each raises
// ValueError on this rank alone, before the op is queued, as
// "mooncake <op> (rank <r>): <what was expected>, got <what was passed>"; `op` is the
// torch.distributed name of the op ("all_reduce", "all_gather_single", ...).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "core/dtype.hpp"
#include "core/reduce.hpp"

namespace mooncake {

// dense (strided) with a dtype the data path moves
void check_dense(const at::Tensor& t, const char* op, int rank);
// The core's view of a tensor that passed check_dense (contiguous: the caller made it so).
Buffer buffer_of(const at::Tensor& t);
// defined, on the CPU, dense
void check_tensor(const at::Tensor& t, const char* op, int rank);
// an output's elements must be distinct in memory (not an expanded view)
void check_distinct(const at::Tensor& out);
// b has a's dtype; `what` names b in the message
void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, int rank, const char* what);
// exactly one tensor, passing check_tensor
void check_single(const std::vector<at::Tensor>& ts, const char* op, int rank);
void check_root(int64_t root, int size, const char* op, int rank);
// the reduction is defined for the dtype
void check_reduce(c10::ScalarType dt, RedOp rop, const char* op, int rank);
// all_gather_into_tensor: output holds world_size inputs of input's dtype
void check_gather_shapes(const at::Tensor& output, const at::Tensor& input, int size, const char* op,
                         int rank);
// reduce_scatter_tensor: input holds world_size outputs of output's dtype, and the
// reduction is supported for it; returns the reduction (premul: PREMUL_SUM's factor)
RedOp check_scatter_args(const at::Tensor& output, const at::Tensor& input,
                         const c10d::ReduceScatterOptions& opts, int size, const char* op, int rank,
                         double* premul);

}  // namespace mooncake
