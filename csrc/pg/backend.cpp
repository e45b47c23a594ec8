// MooncakeBackend around its group core: construction, the Works of the collectives
// (submit, deliver) and their coalescing sessions, and the p2p entry points (send, recv,
// recvAnysource).
#include "pg/backend.hpp"

#include <ATen/ATen.h>

#include "pg/checks.hpp"
#ifdef MOONCAKE_WITH_CUDA
#include "transport/cuda/cuda.hpp"
#endif

namespace mooncake {

MooncakeBackend::MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 BackendConfig cfg)
    : c10d::Backend(rank, size), store_(store) {
  group_ =
      translated([&] { return std::make_unique<Group>(control_store(store), rank, size, std::move(cfg)); });
#ifdef MOONCAKE_WITH_CUDA
  ipc_ = std::make_unique<CudaIpc>(rank_, size_, store, group_->store_ns());
#endif
}

// the core's threads end while this object is whole: their last completions call deliver()
MooncakeBackend::~MooncakeBackend() { group_->shutdown(); }

std::string MooncakeBackend::cuda_ipc_status() const {
#ifndef MOONCAKE_WITH_CUDA
  return "unavailable: this build has no CUDA (rebuild with MOONCAKE_WITH_CUDA=1)";
#else
  if (!group_->config().cuda_ipc)
    return "staging: CUDA IPC switched off (MOONCAKE_CUDA_IPC=0 or MooncakeOptions(cuda_ipc=False))";
  if (!group_->one_host())
    return "staging: the group's ranks are not all on this host (MOONCAKE_HOST_ID differs)";
  if (size_ > cuda::kMaxSources)
    return "staging: max_group_size " + std::to_string(size_) + " exceeds the " +
           std::to_string(cuda::kMaxSources) + " sources the IPC reduction kernel takes";
  return "ipc";
#endif
}

std::function<void()> MooncakeBackend::backup_for_retry(const std::vector<at::Tensor>& ts) {
  if (group_->policy() != FailurePolicy::MASK) return nullptr;
  std::vector<at::Tensor> copies;
  for (auto& t : ts) copies.push_back(t.clone());
  std::vector<at::Tensor> dst = ts;
  return [dst, copies]() mutable {
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(copies[i]);
  };
}

void MooncakeBackend::deliver(const c10::intrusive_ptr<MooncakeWork>& w, std::exception_ptr err,
                              bool inline_future) {
  if (!err && w->after) {
    try {
      w->after();
    } catch (...) {
      err = std::current_exception();
    }
  }
  w->finish(err);
  std::vector<std::function<void()>> done{[w] { w->complete_future(); }};
  if (w->parent && w->parent->child_done(err)) {
    auto parent = w->parent;
    parent->finish(parent->child_error());
    done.emplace_back([parent] { parent->complete_future(); });
  }
  group_->complete(std::move(done), inline_future);
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                         bool async_op, std::chrono::milliseconds timeout,
                                                         Job job, std::function<void()> after,
                                                         std::function<void()> before_retry) {
  auto w = c10::make_intrusive<MooncakeWork>(rank_, type, outputs);
  w->after = std::move(after);
  attach_to_coalescing(w, outputs);
  Group::Op op;
  op.job = [job = std::move(job)](int64_t deadline_ns) { as_core_job([&] { job(deadline_ns); }); };
  op.timeout = timeout;
  op.before_retry = std::move(before_retry);
  op.block_pos = coalescing_ ? ++coalesced_ops_ : 0;  // see OpHeader::batch_index
  if (group_->config().debug) op.trace_name = c10d::opTypeToString(type);
  op.done = [this, w](std::exception_ptr err, bool ran_inline) {
    deliver(w, to_torch_error(err), /*inline_future=*/ran_inline);
  };
  translated([&] { group_->submit(async_op, std::move(op)); });
  return w;
}

void MooncakeBackend::startCoalescing() {
  if (coalescing_) {
    // a previous session was never ended (torch's _coalescing_manager does not call
    // _end_coalescing when its body raised): close it so its works still complete
    endCoalescing();
  }
  coalescing_ = true;
  coalesced_ops_ = 0;
  coalesce_parent_ =
      c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::COALESCED, std::vector<at::Tensor>{});
  coalesce_parent_->add_child({});  // guard released by endCoalescing
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "MooncakeBackend::endCoalescing: not coalescing");
  coalescing_ = false;
  auto p = coalesce_parent_;
  coalesce_parent_.reset();
  if (p->child_done(nullptr)) {
    p->finish(p->child_error());
    p->complete_future();
  }
#ifdef MOONCAKE_WITH_CUDA
  if (!coalesced_cuda_.empty()) {
    auto children = std::move(coalesced_cuda_);
    coalesced_cuda_.clear();
    return cuda_coalesced(rank_, p, std::move(children));
  }
#endif
  return p;
}

void MooncakeBackend::attach_to_coalescing(const c10::intrusive_ptr<MooncakeWork>& w,
                                           const std::vector<at::Tensor>& outputs) {
  if (!coalescing_) return;
  w->parent = coalesce_parent_;
  coalesce_parent_->add_child(outputs);
}

// ---- point to point: the checks here, the messages in the core (core/p2p.cpp) ----

namespace {
void check_p2p(std::vector<at::Tensor>& tensors, int peer, int size, int rank, const char* op, bool any) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "mooncake ", op, " (rank ", rank, "): expected one tensor, got ",
                    tensors.size());
  const at::Tensor& t = tensors[0];
  TORCH_CHECK_VALUE(t.device().is_cpu(), "mooncake ", op, " (rank ", rank,
                    "): expected a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "mooncake ", op, " (rank ", rank,
                    "): expected a dense tensor");
  if (!any) {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size, "mooncake ", op, " (rank ", rank, "): peer rank ", peer,
                      " is out of range [0, ", size, ")");
    TORCH_CHECK_VALUE(peer != rank, "mooncake ", op, " (rank ", rank, "): cannot ", op, " to/from itself");
  }
}
}  // namespace

c10::intrusive_ptr<c10d::Work> MooncakeBackend::failed_work(c10d::OpType type,
                                                            std::vector<at::Tensor> outputs,
                                                            std::exception_ptr err) {
  auto w = c10::make_intrusive<MooncakeWork>(rank_, type, std::move(outputs));
  attach_to_coalescing(w, {});
  deliver(w, err, true);
  return w;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  MOONCAKE_CUDA_STAGED(SEND, "send", (tensor_ptrs(tensors)), (std::vector<at::Tensor*>{}),
                       send(tensors, dstRank, tag));
  if (coalescing_) {
    // inside batch_isend_irecv: report bad arguments through the batch's Work
    try {
      return send_impl(tensors, dstRank, tag);
    } catch (...) {
      return failed_work(c10d::OpType::SEND, tensors, std::current_exception());
    }
  }
  return send_impl(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  MOONCAKE_CUDA_STAGED(RECV, "recv", (std::vector<at::Tensor*>{}), (tensor_ptrs(tensors)),
                       recv(tensors, srcRank, tag));
  if (coalescing_) {
    try {
      return recv_impl(tensors, srcRank, tag);
    } catch (...) {
      return failed_work(c10d::OpType::RECV, tensors, std::current_exception());
    }
  }
  return recv_impl(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recv(tensors, -1, tag);
}

void MooncakeBackend::post_p2p(bool is_send, int peer, int tag, const at::Tensor& buf,
                               const c10::intrusive_ptr<MooncakeWork>& w) {
  auto req = std::make_shared<P2PRequest>();
  req->is_send = is_send;
  req->peer = peer;
  req->tag = tag;
  req->data = buf.data_ptr();
  req->nbytes = static_cast<size_t>(buf.numel()) * buf.element_size();
  req->dtype = static_cast<int32_t>(buf.scalar_type());
  req->dtype_name = &scalar_type_name;
  req->deadline_ns = now_ns() + static_cast<int64_t>(group_->timeout().count()) * 1000000LL;
  // the request keeps the buffer alive until its outcome
  req->done = [this, w, buf, any = peer < 0](std::exception_ptr err, int source) {
    if (any) w->source_rank = source;
    deliver(w, to_torch_error(err), false);
  };
  translated([&] { group_->post_p2p(std::move(req)); });
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::send_impl(std::vector<at::Tensor>& tensors, int dstRank,
                                                            int tag) {
  check_p2p(tensors, dstRank, size_, rank_, "send", false);
  translated([&] { group_->check_peer_active(dstRank, true); });
  auto w = c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::SEND, tensors);
  attach_to_coalescing(w, tensors);
  post_p2p(true, dstRank, tag, tensors[0].contiguous(), w);
  return w;
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::recv_impl(std::vector<at::Tensor>& tensors, int srcRank,
                                                            int tag) {
  check_p2p(tensors, srcRank, size_, rank_, "recv", srcRank < 0);
  translated([&] { group_->check_peer_active(srcRank, false); });
  const at::Tensor& user = tensors[0];
  at::Tensor buf = user.is_contiguous() ? user : at::empty_like(user, at::MemoryFormat::Contiguous);
  auto w = c10::make_intrusive<MooncakeWork>(
      rank_, srcRank < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensors);
  if (!user.is_contiguous()) {
    at::Tensor u = user, b = buf;
    w->after = [u, b]() mutable { u.copy_(b); };
  }
  attach_to_coalescing(w, tensors);
  post_p2p(false, srcRank, tag, buf, w);
  return w;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::barrier(const c10d::BarrierOptions& opts) {
  return submit(c10d::OpType::BARRIER, {}, opts.asyncOp, opts.timeout,
                [this](int64_t deadline_ns) { group_->barrier(deadline_ns); });
}

}  // namespace mooncake
