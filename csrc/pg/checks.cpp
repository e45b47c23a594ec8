// Argument checks of the c10d entry points (pg/checks.hpp).
#include "pg/checks.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include "pg/convert.hpp"

namespace mooncake {

// dense (strided) with a dtype the data path moves
void check_dense(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "mooncake ", op, " (rank ", rank,
                    "): expected a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(to_dtype(t.scalar_type()).has_value(), "mooncake ", op, " (rank ", rank,
                    "): unsupported dtype ", t.scalar_type());
}

Buffer buffer_of(const at::Tensor& t) {
  return Buffer{t.data_ptr(), static_cast<size_t>(t.numel()), *to_dtype(t.scalar_type())};
}

void check_tensor(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined(), "mooncake ", op, " (rank ", rank, "): undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "mooncake ", op, " (rank ", rank,
                    "): expected a CPU tensor, got one on ", t.device(),
                    " (CUDA tensors need a build with CUDA)");
  check_dense(t, op, rank);
}

// an output's elements must be distinct in memory (not an expanded view)
void check_distinct(const at::Tensor& out) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(out) != at::MemOverlap::Yes,
                    "MooncakeBackend::check_distinct: an output tensor has overlapping elements (e.g. an "
                    "expanded view with stride 0); "
                    "pass a tensor whose elements are distinct in memory");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, int rank, const char* what) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "mooncake ", op, " (rank ", rank, "): ", what,
                    " has dtype ", b.scalar_type(), ", expected ", a.scalar_type());
}

void check_single(const std::vector<at::Tensor>& ts, const char* op, int rank) {
  TORCH_CHECK_VALUE(ts.size() == 1, "mooncake ", op, " (rank ", rank, "): expected exactly one tensor, got ",
                    ts.size());
  check_tensor(ts[0], op, rank);
}

void check_root(int64_t root, int size, const char* op, int rank) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "mooncake ", op, " (rank ", rank, "): root ", root,
                    " is out of range [0, ", size, ")");
}

void check_reduce(c10::ScalarType dt, RedOp rop, const char* op, int rank) {
  std::string why = check_reduce_supported(dt, rop);
  TORCH_CHECK_VALUE(why.empty(), "mooncake ", op, " (rank ", rank, "): ", why);
}

// all_gather_into_tensor: output holds world_size inputs of input's dtype
void check_gather_shapes(const at::Tensor& output, const at::Tensor& input, int size, const char* op,
                         int rank) {
  check_same(input, output, op, rank, "the output");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size, "mooncake ", op, " (rank ", rank,
                    "): output must have world_size * input.numel() = ", input.numel() * size,
                    " element(s), got ", output.numel());
}

// reduce_scatter_tensor: input holds world_size outputs of output's dtype, and the
// reduction is supported for it; returns the reduction (premul: PREMUL_SUM's factor)
RedOp check_scatter_args(const at::Tensor& output, const at::Tensor& input,
                         const c10d::ReduceScatterOptions& opts, int size, const char* op, int rank,
                         double* premul) {
  check_same(output, input, op, rank, "the input");
  const RedOp rop = to_redop(opts.reduceOp, premul);
  check_reduce(output.scalar_type(), rop, op, rank);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, "mooncake ", op, " (rank ", rank,
                    "): input must have world_size * output.numel() = ", output.numel() * size,
                    " element(s), got ", input.numel());
  return rop;
}

}  // namespace mooncake
