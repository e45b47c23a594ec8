// CUDA IPC glue of MooncakeBackend (pg/cuda/ipc.hpp does the device work): all_reduce,
// broadcast, all_gather into one tensor and reduce_scatter from one tensor of CUDA tensors
// when every rank is on this host, each op's rounds the group core's header rounds. Every
// other CUDA case is staged through pinned host memory (pg/cuda/staging.hpp). Built with
// MOONCAKE_WITH_CUDA only.
#include <algorithm>
#include <cstring>

#include "core/op_header.hpp"
#include "pg/backend.hpp"
#include "pg/checks.hpp"
#include "transport/cuda/cuda.hpp"

namespace mooncake {

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_ipc(at::Tensor& t,
                                                              const c10d::AllreduceOptions& opts) {
  // the rank's own argument errors raise here, before anything is queued
  const char* op = "all_reduce";
  check_dense(t, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(t.scalar_type(), rop, op, rank_);
  check_distinct(t);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(t, op);
  auto w = submit(
      c10d::OpType::ALLREDUCE, {}, opts.asyncOp, opts.timeout,
      [this, iop, rop, premul](int64_t deadline_ns) { run_allreduce_ipc(*iop, rop, premul, deadline_ns); });
  return CudaIpc::wrap(rank_, c10d::OpType::ALLREDUCE, w, iop);
}

void MooncakeBackend::ipc_check_one_host(const char* method) const {
  TORCH_CHECK(group_->one_host(), "MooncakeBackend::", method,
              ": the CUDA IPC path needs every rank on this host, and the "
              "membership now spans hosts (MOONCAKE_CUDA_IPC=0 stages through host memory instead)");
}

void MooncakeBackend::run_ipc_pieces(CudaIpcOp& op, const OpHeader& hdr, int ref, size_t n, size_t R,
                                     int64_t deadline_ns, const Group::PieceFn& before,
                                     const Group::PieceFn& after) {
  // pg/cuda/ipc.hpp: per piece of at most R elements, `before` (copies in, side stream),
  // one engine round with the header (the handshake: peers' copies are queued; failures
  // and mismatches as on the CPU path), `after` (reads peers' buffers, side stream). The
  // calling thread never waits for the GPU.
  group_->header_rounds(hdr, ref, n, R, &ipc_epoch_, deadline_ns, before, after);
  ipc_->finish(op);
}

void MooncakeBackend::run_allreduce_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t deadline_ns) {
  // every rank copies its piece into its buffer, the round is the handshake, every rank
  // reduces every active rank's piece into its output
  ipc_check_one_host("allreduce");
  const size_t n = static_cast<size_t>(op.user.numel());
  const size_t R = ipc_->round_elems(op);
  // a rerun over survivors (mask) must find the input as it was: reduce into a copy
  ipc_->prepare(op, group_->policy() == FailurePolicy::MASK && n > R);
  OpHeader h{};
  h.op = OP_ALLREDUCE_IPC;
  h.dtype = static_cast<int32_t>(*to_dtype(op.user.scalar_type()));
  h.redop = static_cast<int32_t>(rop);
  h.root = -1;
  run_ipc_pieces(
      op, h, group_->active_list()[0], n, R, deadline_ns,
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->stage(op, parity, off, len, group_->active_list(), group_->peer_pids(), rop, premul);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->reduce(op, parity, off, len, group_->active_list(), group_->peer_pids(), rop);
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast_ipc(at::Tensor& t,
                                                              const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  check_dense(t, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  if (rank_ != root) check_distinct(t);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(t, op);
  auto w = submit(c10d::OpType::BROADCAST, {}, opts.asyncOp, opts.timeout,
                  [this, iop, root](int64_t deadline_ns) { run_broadcast_ipc(*iop, root, deadline_ns); });
  return CudaIpc::wrap(rank_, c10d::OpType::BROADCAST, w, iop);
}

void MooncakeBackend::run_broadcast_ipc(CudaIpcOp& op, int root, int64_t deadline_ns) {
  // the root copies each piece into its buffer, the round is the handshake, the others
  // copy the piece out of the root's buffer
  ipc_check_one_host("broadcast");
  group_->require_active_root(root, "broadcast");
  const size_t n = static_cast<size_t>(op.user.numel());
  ipc_->prepare(op, false);  // a rerun rewrites every piece; the root's tensor is only read
  OpHeader h{};
  h.op = OP_BROADCAST_IPC;
  h.dtype = static_cast<int32_t>(*to_dtype(op.user.scalar_type()));
  h.root = root;
  run_ipc_pieces(
      op, h, root, n, ipc_->round_elems(op), deadline_ns,
      [&](int parity, size_t off, size_t len) {
        if (rank_ == root && len)
          ipc_->stage(op, parity, off, len, group_->active_list(), group_->peer_pids(), RedOp::SUM, 1.0);
        else
          ipc_->publish_events();  // the root waits for my reads before it overwrites its buffer
      },
      [&](int parity, size_t off, size_t len) {
        if (rank_ != root && len) ipc_->copy_from(op, parity, root, off, len, group_->peer_pids());
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_base_ipc(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_single";
  check_dense(input, op, rank_);
  check_dense(output, op, rank_);
  check_gather_shapes(output, input, size_, op, rank_);
  check_distinct(output);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(input, op, output);
  iop->writes_user = false;  // the input is only read
  auto w = submit(c10d::OpType::_ALLGATHER_BASE, {}, opts.asyncOp, opts.timeout,
                  [this, iop](int64_t deadline_ns) { run_allgather_ipc(*iop, deadline_ns); });
  return CudaIpc::wrap(rank_, c10d::OpType::_ALLGATHER_BASE, w, iop);
}

void MooncakeBackend::run_allgather_ipc(CudaIpcOp& op, int64_t deadline_ns) {
  // every rank copies its piece into its buffer, the round is the handshake, every rank
  // copies every active rank's piece into its slot of the output (slots of inactive seats
  // are left untouched)
  ipc_check_one_host("_allgather_base");
  const size_t n = static_cast<size_t>(op.user.numel());
  const size_t R = ipc_->round_elems(op);
  // a rerun over survivors (mask) must find the slot of a rank that died mid-op untouched
  ipc_->prepare(op, group_->policy() == FailurePolicy::MASK && n > R);
  OpHeader h{};
  h.op = OP_ALLGATHER_IPC;
  h.dtype = static_cast<int32_t>(*to_dtype(op.user.scalar_type()));
  h.root = -1;
  run_ipc_pieces(
      op, h, group_->active_list()[0], n, R, deadline_ns,
      [&](int parity, size_t off, size_t len) {
        if (len)
          ipc_->stage(op, parity, off, len, group_->active_list(), group_->peer_pids(), RedOp::SUM, 1.0);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->gather_into(op, parity, off, len, n, group_->active_list(), group_->peer_pids());
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_base_ipc(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_single";
  check_dense(input, op, rank_);
  check_dense(output, op, rank_);
  double premul;
  const RedOp rop = check_scatter_args(output, input, opts, size_, op, rank_, &premul);
  check_distinct(output);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(input, op, output);
  iop->writes_user = false;  // the input is only read
  auto w = submit(c10d::OpType::_REDUCE_SCATTER_BASE, {}, opts.asyncOp, opts.timeout,
                  [this, iop, rop, premul](int64_t deadline_ns) {
                    run_reduce_scatter_ipc(*iop, rop, premul, deadline_ns);
                  });
  return CudaIpc::wrap(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, w, iop);
}

void MooncakeBackend::run_reduce_scatter_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t deadline_ns) {
  // every rank copies its pieces for every active seat into its buffer, the round is the
  // handshake, every rank reduces the active ranks' pieces for it
  ipc_check_one_host("_reduce_scatter_base");
  const size_t n = static_cast<size_t>(op.out_user.numel());  // elements per seat
  ipc_->prepare(op, false);  // a rerun rewrites every piece of the output; the input is only read
  OpHeader h{};
  h.op = OP_REDUCE_SCATTER_IPC;
  h.dtype = static_cast<int32_t>(*to_dtype(op.user.scalar_type()));
  h.redop = static_cast<int32_t>(rop);
  h.root = -1;
  run_ipc_pieces(
      op, h, group_->active_list()[0], n, ipc_->scatter_round_elems(op), deadline_ns,
      [&](int parity, size_t off, size_t len) {
        if (len)
          ipc_->stage_scatter(op, parity, off, len, n, group_->active_list(), group_->peer_pids(), rop,
                              premul);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->reduce_scatter(op, parity, off, len, group_->active_list(), group_->peer_pids(), rop);
      });
}

bool MooncakeBackend::ipc_eligible(const std::vector<at::Tensor>& ts) const {
  // one host, one CUDA tensor: CUDA IPC (cuda_ipc_status() says why not otherwise)
  return ts.size() == 1 && ts[0].defined() && ts[0].is_cuda() && !coalescing_ && group_->config().cuda_ipc &&
         group_->one_host() && size_ <= cuda::kMaxSources;
}

}  // namespace mooncake
