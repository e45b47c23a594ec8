// The c10d entry points of MooncakeBackend's collectives (allreduce, broadcast, allgather,
// _allgather_base, ...): each checks its own arguments (ValueError on this rank, before
// anything is queued, pg/checks.hpp), makes contiguous working tensors (copied back into
// non-contiguous user tensors when the op succeeds) and submits the group core's collective
// body over their buffers (core/collectives/). CUDA tensors take CUDA IPC
// (pg/cuda/ipc_ops.cpp) or pinned host staging (MOONCAKE_CUDA_STAGED) first.
#include <ATen/ATen.h>

#include "pg/backend.hpp"
#include "pg/checks.hpp"
#include "core/op_header.hpp"

namespace mooncake {

namespace {

// A contiguous tensor to work on; copies back into `user` afterwards when they differ.
at::Tensor contiguous_out(const at::Tensor& user, std::vector<std::function<void()>>& backs) {
  check_distinct(user);
  if (user.is_contiguous()) return user;
  at::Tensor tmp = user.contiguous();
  backs.push_back([user, tmp]() mutable { user.copy_(tmp); });
  return tmp;
}

std::function<void()> join_backs(std::vector<std::function<void()>> backs) {
  if (backs.empty()) return nullptr;
  return [backs]() {
    for (auto& b : backs) b();
  };
}

std::vector<at::Tensor> flat_outputs(std::vector<std::vector<at::Tensor>>& outs) {
  std::vector<at::Tensor> v;
  for (auto& l : outs)
    for (auto& t : l) v.push_back(t);
  return v;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == c10::kSparse)
    return allreduce_sparse(tensors, opts);
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible(tensors)) return allreduce_ipc(tensors[0], opts);
#endif
  MOONCAKE_CUDA_STAGED(ALLREDUCE, "allreduce", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       allreduce(tensors, opts));
  const char* op = "all_reduce";
  check_single(tensors, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(tensors[0].scalar_type(), rop, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  return submit(
      c10d::OpType::ALLREDUCE, tensors, opts.asyncOp, opts.timeout,
      [this, t, rop, premul](int64_t deadline_ns) mutable {
        group_->allreduce(buffer_of(t), rop, premul, deadline_ns);
      },
      join_backs(backs), backup_for_retry({t}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLREDUCE_COALESCED, "allreduce_coalesced", (tensor_ptrs(tensors)),
                       (tensor_ptrs(tensors)), allreduce_coalesced(tensors, opts));
  const char* op = "all_reduce_coalesced";
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> work;
  for (auto& t : tensors) {
    check_tensor(t, op, rank_);
    check_reduce(t.scalar_type(), rop, op, rank_);
    work.push_back(contiguous_out(t, backs));
  }
  return submit(
      c10d::OpType::ALLREDUCE_COALESCED, tensors, opts.asyncOp, opts.timeout,
      [this, work, rop, premul](int64_t deadline_ns) mutable {
        for (size_t i = 0; i < work.size(); ++i) {
          BatchScope pos(static_cast<uint32_t>(i + 1), static_cast<uint32_t>(work.size()));
          group_->allreduce(buffer_of(work[i]), rop, premul, deadline_ns);
        }
      },
      join_backs(backs), backup_for_retry(work));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  MOONCAKE_CUDA_STAGED(REDUCE, "reduce", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       reduce(tensors, opts));
  const char* op = "reduce";
  check_single(tensors, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(tensors[0].scalar_type(), rop, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  int root = static_cast<int>(opts.rootRank);
  return submit(
      c10d::OpType::REDUCE, tensors, opts.asyncOp, opts.timeout,
      [this, t, rop, premul, root](int64_t deadline_ns) mutable {
        group_->reduce(buffer_of(t), rop, premul, root, deadline_ns);
      },
      join_backs(backs), rank_ == root ? backup_for_retry({t}) : nullptr);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible(tensors)) return broadcast_ipc(tensors[0], opts);
#endif
  MOONCAKE_CUDA_STAGED(BROADCAST, "broadcast", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       broadcast(tensors, opts));
  const char* op = "broadcast";
  check_single(tensors, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) backs.clear();  // the root's tensor is only read
  return submit(
      c10d::OpType::BROADCAST, tensors, opts.asyncOp, opts.timeout,
      [this, t, root](int64_t deadline_ns) mutable { group_->broadcast(buffer_of(t), root, deadline_ns); },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLGATHER, "allgather", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       allgather(outputs, inputs, opts));
  const char* op = "all_gather";
  check_single(inputs, op, rank_);
  TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "mooncake ", op,
                    " (rank ", rank_, "): expected one list of ", size_, " output tensors, got ",
                    outputs.size() == 1 ? outputs[0].size() : outputs.size());
  at::Tensor in = inputs[0].contiguous();
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> outs;
  std::vector<uint8_t*> ptrs;
  for (auto& o : outputs[0]) {
    check_tensor(o, op, rank_);
    check_same(in, o, op, rank_, "an output tensor");
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "mooncake ", op, " (rank ", rank_,
                      "): each output tensor must have ", in.numel(), " element(s) like the input, got ",
                      o.numel());
    outs.push_back(contiguous_out(o, backs));
    ptrs.push_back(static_cast<uint8_t*>(outs.back().data_ptr()));
  }
  return submit(
      c10d::OpType::ALLGATHER, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, in, outs, ptrs](int64_t deadline_ns) { group_->allgather(buffer_of(in), ptrs, deadline_ns); },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible({input}) && output.defined() && output.is_cuda())
    return allgather_base_ipc(output, input, opts);
#endif
  MOONCAKE_CUDA_STAGED(_ALLGATHER_BASE, "_allgather_base", (tensor_ptrs(input)), (tensor_ptrs(output)),
                       _allgather_base(output, input, opts));
  const char* op = "all_gather_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  check_gather_shapes(output, input, size_, op, rank_);
  at::Tensor in = input.contiguous();
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  std::vector<uint8_t*> ptrs;
  const size_t nb = in.numel() * in.element_size();
  for (int j = 0; j < size_; ++j) ptrs.push_back(static_cast<uint8_t*>(out.data_ptr()) + j * nb);
  return submit(
      c10d::OpType::_ALLGATHER_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, out, ptrs](int64_t deadline_ns) { group_->allgather(buffer_of(in), ptrs, deadline_ns); },
      join_backs(backs), backup_for_retry({out}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLGATHER_COALESCED, "allgather_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), allgather_coalesced(outputs, inputs, opts));
  const char* op = "all_gather_coalesced";
  // torch's layout: outputs[r][i] receives rank r's inputs[i] (one output list per rank)
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "mooncake ", op, " (rank ", rank_,
                    "): expected one output list per rank (", size_, "), got ", outputs.size());
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins;
  std::vector<std::vector<uint8_t*>> ptrs(inputs.size(), std::vector<uint8_t*>(size_, nullptr));
  std::vector<at::Tensor> keep;
  for (int r = 0; r < size_; ++r)
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                      "): output list ", r, " holds ", outputs[r].size(),
                      " tensors, expected one per input (", inputs.size(), ")");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    ins.push_back(inputs[i].contiguous());
    for (int r = 0; r < size_; ++r) {
      auto& o = outputs[r][i];
      check_tensor(o, op, rank_);
      check_same(inputs[i], o, op, rank_, "an output tensor");
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), "mooncake ", op, " (rank ", rank_,
                        "): output tensor [", r, "][", i, "] has ", o.numel(), " elements, input ", i,
                        " has ", inputs[i].numel());
      keep.push_back(contiguous_out(o, backs));
      ptrs[i][r] = static_cast<uint8_t*>(keep.back().data_ptr());
    }
  }
  return submit(
      c10d::OpType::ALLGATHER_COALESCED, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, ins, ptrs, keep](int64_t deadline_ns) {
        for (size_t i = 0; i < ins.size(); ++i) {
          BatchScope pos(static_cast<uint32_t>(i + 1), static_cast<uint32_t>(ins.size()));
          group_->allgather(buffer_of(ins[i]), ptrs[i], deadline_ns);
        }
      },
      join_backs(backs), backup_for_retry(keep));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(MOONCAKE_OP_AG_COALESCED, "allgather_into_tensor_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), allgather_into_tensor_coalesced(outputs, inputs, opts));
  const char* op = "all_gather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                    "): expected as many outputs as inputs, got ", outputs.size(), " and ", inputs.size());
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins, outs;
  std::vector<std::vector<uint8_t*>> ptrs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    check_tensor(outputs[i], op, rank_);
    check_same(inputs[i], outputs[i], op, rank_, "an output");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "mooncake ", op, " (rank ", rank_,
                      "): output ", i, " must have ", inputs[i].numel() * size_, " element(s), got ",
                      outputs[i].numel());
    ins.push_back(inputs[i].contiguous());
    outs.push_back(contiguous_out(outputs[i], backs));
    ptrs.emplace_back();
    const size_t nb = ins.back().numel() * ins.back().element_size();
    for (int j = 0; j < size_; ++j)
      ptrs.back().push_back(static_cast<uint8_t*>(outs.back().data_ptr()) + j * nb);
  }
  return submit(
      c10d::OpType::COALESCED, outputs, opts.asyncOp, opts.timeout,
      [this, ins, outs, ptrs](int64_t deadline_ns) {
        for (size_t i = 0; i < ins.size(); ++i) {
          BatchScope pos(static_cast<uint32_t>(i + 1), static_cast<uint32_t>(ins.size()));
          group_->allgather(buffer_of(ins[i]), ptrs[i], deadline_ns);
        }
      },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(GATHER, "gather", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       gather(outputs, inputs, opts));
  const char* op = "gather";
  check_single(inputs, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor in = inputs[0].contiguous();
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> outs;
  std::vector<uint8_t*> ptrs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "mooncake ", op,
                      " (rank ", rank_, "): the root needs one list of ", size_, " output tensors");
    for (auto& o : outputs[0]) {
      check_tensor(o, op, rank_);
      check_same(in, o, op, rank_, "an output tensor");
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "mooncake ", op, " (rank ", rank_,
                        "): each output tensor must have ", in.numel(), " element(s), got ", o.numel());
      outs.push_back(contiguous_out(o, backs));
      ptrs.push_back(static_cast<uint8_t*>(outs.back().data_ptr()));
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "mooncake ", op, " (rank ", rank_,
                      "): only the root (rank ", root, ") passes output tensors");
  }
  return submit(
      c10d::OpType::GATHER, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, in, outs, ptrs, root](int64_t deadline_ns) {
        group_->gather(buffer_of(in), ptrs, root, deadline_ns);
      },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(SCATTER, "scatter", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       scatter(outputs, inputs, opts));
  const char* op = "scatter";
  check_single(outputs, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(outputs[0], backs);
  std::vector<at::Tensor> ins;
  std::vector<const uint8_t*> ptrs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "mooncake ", op,
                      " (rank ", rank_, "): the root needs one list of ", size_, " input tensors");
    for (auto& i : inputs[0]) {
      check_tensor(i, op, rank_);
      check_same(out, i, op, rank_, "an input tensor");
      TORCH_CHECK_VALUE(i.numel() == out.numel(), "mooncake ", op, " (rank ", rank_,
                        "): each input tensor must have ", out.numel(), " element(s) like the output, got ",
                        i.numel());
      ins.push_back(i.contiguous());
      ptrs.push_back(static_cast<const uint8_t*>(ins.back().data_ptr()));
    }
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "mooncake ", op, " (rank ", rank_,
                      "): only the root (rank ", root, ") passes input tensors");
  }
  return submit(
      c10d::OpType::SCATTER, outputs, opts.asyncOp, opts.timeout,
      [this, ins, ptrs, out, root](int64_t deadline_ns) mutable {
        group_->scatter(ptrs, buffer_of(out), root, deadline_ns);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(REDUCE_SCATTER, "reduce_scatter", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       reduce_scatter(outputs, inputs, opts));
  const char* op = "reduce_scatter";
  check_single(outputs, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(outputs[0].scalar_type(), rop, op, rank_);
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "mooncake ", op,
                    " (rank ", rank_, "): expected one list of ", size_, " input tensors");
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(outputs[0], backs);
  std::vector<at::Tensor> ins;
  std::vector<const uint8_t*> ptrs;
  for (auto& i : inputs[0]) {
    check_tensor(i, op, rank_);
    check_same(out, i, op, rank_, "an input tensor");
    TORCH_CHECK_VALUE(i.numel() == out.numel(), "mooncake ", op, " (rank ", rank_,
                      "): each input tensor must have ", out.numel(), " element(s) like the output, got ",
                      i.numel());
    ins.push_back(i.contiguous());
    ptrs.push_back(static_cast<const uint8_t*>(ins.back().data_ptr()));
  }
  return submit(
      c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp, opts.timeout,
      [this, ins, ptrs, out, rop, premul](int64_t deadline_ns) mutable {
        group_->reduce_scatter(ptrs, buffer_of(out), rop, premul, deadline_ns);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible({input}) && output.defined() && output.is_cuda())
    return reduce_scatter_base_ipc(output, input, opts);
#endif
  MOONCAKE_CUDA_STAGED(_REDUCE_SCATTER_BASE, "_reduce_scatter_base", (tensor_ptrs(input)),
                       (tensor_ptrs(output)), _reduce_scatter_base(output, input, opts));
  const char* op = "reduce_scatter_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  double premul;
  const RedOp rop = check_scatter_args(output, input, opts, size_, op, rank_, &premul);
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  at::Tensor in = input.contiguous();
  std::vector<const uint8_t*> ptrs;
  const size_t nb = out.numel() * out.element_size();
  for (int j = 0; j < size_; ++j) ptrs.push_back(static_cast<const uint8_t*>(in.data_ptr()) + j * nb);
  return submit(
      c10d::OpType::_REDUCE_SCATTER_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, ptrs, out, rop, premul](int64_t deadline_ns) mutable {
        group_->reduce_scatter(ptrs, buffer_of(out), rop, premul, deadline_ns);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(MOONCAKE_OP_RS_COALESCED, "reduce_scatter_tensor_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  const char* op = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                    "): expected as many outputs as inputs");
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins, outs;
  std::vector<std::vector<const uint8_t*>> ptrs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    check_tensor(outputs[i], op, rank_);
    check_same(outputs[i], inputs[i], op, rank_, "an input");
    check_reduce(outputs[i].scalar_type(), rop, op, rank_);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "mooncake ", op, " (rank ", rank_,
                      "): input ", i, " must have ", outputs[i].numel() * size_, " element(s), got ",
                      inputs[i].numel());
    ins.push_back(inputs[i].contiguous());
    outs.push_back(contiguous_out(outputs[i], backs));
    ptrs.emplace_back();
    const size_t nb = outs.back().numel() * outs.back().element_size();
    for (int j = 0; j < size_; ++j)
      ptrs.back().push_back(static_cast<const uint8_t*>(ins.back().data_ptr()) + j * nb);
  }
  return submit(
      c10d::OpType::COALESCED, outputs, opts.asyncOp, opts.timeout,
      [this, ins, outs, ptrs, rop, premul](int64_t deadline_ns) mutable {
        for (size_t i = 0; i < outs.size(); ++i) {
          BatchScope pos(static_cast<uint32_t>(i + 1), static_cast<uint32_t>(outs.size()));
          group_->reduce_scatter(ptrs[i], buffer_of(outs[i]), rop, premul, deadline_ns);
        }
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_split_sizes,
                                                              std::vector<int64_t>& input_split_sizes,
                                                              const c10d::AllToAllOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLTOALL_BASE, "alltoall_base", (tensor_ptrs(input)), (tensor_ptrs(output)),
                       alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
  const char* op = "all_to_all_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  check_same(input, output, op, rank_, "the output");
  const int W = size_;
  auto splits = [&](const at::Tensor& t, const std::vector<int64_t>& s, const char* which) {
    std::vector<int64_t> rows;
    const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
    if (s.empty()) {
      TORCH_CHECK_VALUE(dim0 % W == 0, "mooncake ", op, " (rank ", rank_, "): ", which, ".size(0) = ", dim0,
                        " is not divisible by world_size ", W, " (pass split sizes for uneven splits)");
      rows.assign(W, dim0 / W);
    } else {
      TORCH_CHECK_VALUE(static_cast<int>(s.size()) == W, "mooncake ", op, " (rank ", rank_, "): ", which,
                        " split sizes have ", s.size(), " entries, expected world_size = ", W);
      int64_t sum = 0;
      for (int64_t v : s) {
        TORCH_CHECK_VALUE(v >= 0, "mooncake ", op, " (rank ", rank_, "): negative ", which, " split size ",
                          v);
        sum += v;
      }
      TORCH_CHECK_VALUE(sum == dim0, "mooncake ", op, " (rank ", rank_, "): ", which, " split sizes sum to ",
                        sum, " but ", which, ".size(0) is ", dim0);
      rows = s;
    }
    return rows;
  };
  std::vector<int64_t> in_rows = splits(input, input_split_sizes, "input");
  std::vector<int64_t> out_rows = splits(output, output_split_sizes, "output");
  const int64_t in_dim0 = input.dim() == 0 ? 1 : input.size(0);
  const int64_t out_dim0 = output.dim() == 0 ? 1 : output.size(0);
  const int64_t row_in = in_dim0 ? input.numel() / in_dim0 : (input.dim() ? input.numel() : 1);
  int64_t row_elems = 1;
  for (int64_t d = 1; d < input.dim(); ++d) row_elems *= input.size(d);
  int64_t row_out = 1;
  for (int64_t d = 1; d < output.dim(); ++d) row_out *= output.size(d);
  (void)row_in;
  (void)out_dim0;
  TORCH_CHECK_VALUE(row_elems == row_out, "mooncake ", op, " (rank ", rank_, "): input rows have ", row_elems,
                    " element(s) but output rows have ", row_out);
  at::Tensor in = input.contiguous();
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  const DType dt = *to_dtype(input.scalar_type());
  return submit(
      c10d::OpType::ALLTOALL_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, out, dt, row_elems, in_rows, out_rows](int64_t deadline_ns) mutable {
        group_->alltoall(static_cast<const uint8_t*>(in.data_ptr()), static_cast<uint8_t*>(out.data_ptr()),
                         dt, row_elems, in_rows, out_rows, deadline_ns);
      },
      join_backs(backs), backup_for_retry({out}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLTOALL, "alltoall", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       alltoall(outputs, inputs, opts));
  const char* op = "all_to_all";
  const int W = size_;
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == W && static_cast<int>(outputs.size()) == W,
                    "mooncake ", op, " (rank ", rank_, "): expected ", W, " input and ", W,
                    " output tensors, got ", inputs.size(), " and ", outputs.size());
  for (auto& t : inputs) check_tensor(t, op, rank_);
  for (auto& t : outputs) {
    check_tensor(t, op, rank_);
    check_same(inputs[0], t, op, rank_, "an output tensor");
  }
  for (auto& t : inputs) check_same(inputs[0], t, op, rank_, "an input tensor");
  std::vector<int64_t> in_rows, out_rows;
  std::vector<at::Tensor> flat_in;
  for (auto& t : inputs) {
    in_rows.push_back(t.numel());
    flat_in.push_back(t.contiguous().view(-1));
  }
  for (auto& t : outputs) out_rows.push_back(t.numel());
  at::Tensor in = at::cat(flat_in);
  int64_t total_out = 0;
  for (auto v : out_rows) total_out += v;
  at::Tensor out = at::empty({total_out}, inputs[0].options());
  std::vector<at::Tensor> outs = outputs;
  auto back = [this, outs, out, out_rows]() mutable {
    std::vector<int32_t> active = group_->active_ranks();  // inactive seats' outputs stay untouched
    int64_t off = 0;
    for (size_t j = 0; j < outs.size(); ++j) {
      if (active[j]) outs[j].copy_(out.narrow(0, off, out_rows[j]).view(outs[j].sizes()));
      off += out_rows[j];
    }
  };
  const DType dt = *to_dtype(inputs[0].scalar_type());
  return submit(
      c10d::OpType::ALLTOALL, outputs, opts.asyncOp, opts.timeout,
      [this, in, out, dt, in_rows, out_rows](int64_t deadline_ns) mutable {
        group_->alltoall(static_cast<const uint8_t*>(in.data_ptr()), static_cast<uint8_t*>(out.data_ptr()),
                         dt, 1, in_rows, out_rows, deadline_ns);
      },
      back);
}

}  // namespace mooncake
