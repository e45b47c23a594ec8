// all_reduce of a sparse COO tensor (SUM) in MooncakeBackend, as gloo does it: every rank's coalesced
// indices and values are all-gathered (padded to the largest nnz), concatenated and
// coalesced, which sums the values of equal indices. Three all_gathers in one op: the
// metadata (nnz and the tensor's layout, checked to agree on every rank), the indices,
// the values, run by the group core in one job.
#include <algorithm>

#include "pg/backend.hpp"
#include "pg/checks.hpp"

namespace mooncake {

namespace {

constexpr int kMaxSparseDims = 32;
// metadata per rank: [1 (2: an index out of bounds), nnz, sparse_dim, dense_dim, dtype,
// ndim, sizes...]
constexpr int kMetaLen = 6 + kMaxSparseDims;

std::vector<uint8_t*> slot_ptrs(std::vector<at::Tensor>& ts) {
  std::vector<uint8_t*> v;
  for (auto& t : ts) v.push_back(static_cast<uint8_t*>(t.data_ptr()));
  return v;
}

// The sparse all_reduce's body: gathers, then sums (a job of the group core).
void run_allreduce_sparse(Group& g, at::Tensor& t, int64_t deadline_ns);

}  // namespace

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce (sparse)";
  TORCH_CHECK_VALUE(tensors.size() == 1, "mooncake ", op, " (rank ", rank_,
                    "): expected exactly one tensor, got ", tensors.size());
  at::Tensor t = tensors[0];
  TORCH_CHECK_VALUE(t.defined() && t.layout() == c10::kSparse, "mooncake ", op, " (rank ", rank_,
                    "): expected a sparse COO tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.device().is_cpu(), "mooncake ", op, " (rank ", rank_,
                    "): expected a CPU tensor, got one on ", t.device());
  if (opts.reduceOp != c10d::ReduceOp::SUM) {
    double premul = 1.0;
    TORCH_CHECK_VALUE(false, "mooncake ", op, " (rank ", rank_,
                      "): sparse tensors are reduced with ReduceOp.SUM only (as in gloo), got ReduceOp.",
                      red_op_name(to_redop(opts.reduceOp, &premul)));
  }
  TORCH_CHECK_VALUE(t.dim() <= kMaxSparseDims, "mooncake ", op, " (rank ", rank_, "): at most ",
                    kMaxSparseDims, " dimensions, got ", t.dim());
  check_dense(t._values(), op, rank_);
  return submit(
      c10d::OpType::ALLREDUCE, tensors, opts.asyncOp, opts.timeout,
      [this, t](int64_t deadline_ns) mutable { run_allreduce_sparse(*group_, t, deadline_ns); }, nullptr,
      nullptr);
}

namespace {

void run_allreduce_sparse(Group& g, at::Tensor& t, int64_t deadline_ns) {
  const char* op = "all_reduce (sparse)";
  const int rank = g.rank(), size = g.size();
  const std::vector<int>& act = g.active_list();
  // torch does not check a sparse tensor's indices by default, and coalesce() of one with
  // an index outside its sizes corrupts memory: each rank checks its own and says so in
  // its metadata, so that every rank raises naming it before anything else is sent
  bool in_bounds = true;
  {
    const at::Tensor ix = t._indices();
    for (int64_t d = 0; d < t.sparse_dim() && in_bounds && ix.size(1) > 0; ++d) {
      const at::Tensor row = ix.select(0, d);
      in_bounds = row.min().item<int64_t>() >= 0 && row.max().item<int64_t>() < t.size(d);
    }
  }
  const at::Tensor in = in_bounds ? t.coalesce() : at::sparse_coo_tensor(t.sizes(), t.options());
  const int64_t nnz = in._nnz();
  const int64_t sdim = in.sparse_dim(), ddim = in.dense_dim();
  at::Tensor meta = at::zeros({kMetaLen}, at::kLong);
  auto m = meta.accessor<int64_t, 1>();
  m[0] = in_bounds ? 1 : 2;
  m[1] = nnz;
  m[2] = sdim;
  m[3] = ddim;
  m[4] = static_cast<int64_t>(in.scalar_type());
  m[5] = in.dim();
  for (int64_t d = 0; d < in.dim(); ++d) m[6 + d] = in.size(d);
  std::vector<at::Tensor> metas;
  for (int j = 0; j < size; ++j) metas.push_back(at::zeros({kMetaLen}, at::kLong));
  g.allgather(buffer_of(meta), slot_ptrs(metas), deadline_ns);
  // every rank sees every rank's metadata, so every rank takes the same decision here
  int64_t max_nnz = 0;
  for (int j : act)
    TORCH_CHECK_VALUE(metas[j][0].item<int64_t>() != 2, "mooncake ", op, " (rank ", rank, "): rank ", j,
                      " passed a sparse tensor with an index outside its sizes (negative or >= the size "
                      "of its dimension); no output was modified");
  for (int j : act) {
    const at::Tensor mj = metas[j].narrow(0, 2, kMetaLen - 2);
    TORCH_CHECK_VALUE(at::equal(mj, meta.narrow(0, 2, kMetaLen - 2)), "mooncake ", op, " (rank ", rank,
                      "): rank ", j,
                      " passed a sparse tensor of another shape, dtype or sparse/dense split (",
                      "sizes, sparse_dim, dense_dim and dtype must agree on every rank)");
    max_nnz = std::max(max_nnz, metas[j][1].item<int64_t>());
  }
  std::vector<int64_t> vshape{max_nnz};
  for (int64_t d = sdim; d < in.dim(); ++d) vshape.push_back(in.size(d));
  std::vector<at::Tensor> idx_parts, val_parts;
  if (max_nnz > 0) {
    at::Tensor idx = at::zeros({sdim, max_nnz}, at::kLong);
    at::Tensor val = at::zeros(vshape, in._values().options());
    if (nnz > 0) {
      idx.narrow(1, 0, nnz).copy_(in._indices());
      val.narrow(0, 0, nnz).copy_(in._values());
    }
    std::vector<at::Tensor> idxs, vals;
    for (int j = 0; j < size; ++j) {
      idxs.push_back(at::empty_like(idx));
      vals.push_back(at::empty_like(val));
    }
    g.allgather(buffer_of(idx), slot_ptrs(idxs), deadline_ns);
    g.allgather(buffer_of(val), slot_ptrs(vals), deadline_ns);
    for (int j : act) {
      const int64_t n = metas[j][1].item<int64_t>();
      idx_parts.push_back(idxs[j].narrow(1, 0, n));
      val_parts.push_back(vals[j].narrow(0, 0, n));
    }
  } else {
    idx_parts.push_back(at::zeros({sdim, 0}, at::kLong));
    vshape[0] = 0;
    val_parts.push_back(at::zeros(vshape, in._values().options()));
  }
  at::Tensor sum = at::sparse_coo_tensor(at::cat(idx_parts, 1), at::cat(val_parts, 0), in.sizes()).coalesce();
  t.copy_(sum);
}

}  // namespace

}  // namespace mooncake
