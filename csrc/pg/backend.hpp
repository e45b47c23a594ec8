// The "mooncake" c10d backend: collectives over the round engine (core/engine.hpp), p2p over
// byte streams (core/p2p.cpp), and a membership that changes while the group runs.
//
// Two halves. MooncakeBackend (this file, the torch layer in pg/) is the c10d surface: it
// checks the caller's tensors (pg/checks.hpp), turns them into raw buffers and submits the
// collective bodies as jobs, and owns the Works and their futures, sparse all_reduce, the
// derived groups (shrink, split) and the CUDA paths. The group core (core/group.hpp, no
// torch header) does the rest of what this contract says: set-up, the op header, the
// collectives, scheduling and the threads, p2p, membership. pg/convert.hpp maps between
// the two (dtypes, ReduceOp, errors, the c10d Store as the core's ControlStore).
//
// Contract of MooncakeBackend
//
// Call order. Every active rank issues the same collectives in the same order with matching
// arguments (c10d's rule); membership calls (deactivate_ranks, recover_ranks) are
// collective too: every survivor makes them between the same two ops. A rank's own bad
// arguments raise ValueError on that rank before anything is queued (pg/checks.hpp). A
// cross-rank mismatch (op, dtype, count, root, ReduceOp, split sizes) is caught by the header
// every collective exchanges in its first round (core/op_header.hpp): ValueError
// on every rank naming the offending ranks, before any output is written; nobody is
// declared failed and the group goes on. p2p messages between two ranks arrive in the order
// they were sent; a receive must match the message's tag and size.
//
// Threads.
//   caller      runs the entry points (checks, then submit()), Work::wait, the membership
//               calls and join_group. A sync op (asyncOp false) runs inline on the caller's
//               thread when no op is queued or running; any other op is queued.
//   progress    one thread, started on the first queued op: runs queued collectives one at
//               a time in issue order. A collective holds the core's engine_mu_ while it runs (inline
//               or queued), so one runs at a time and in issue order.
//   completion  a pool, grown while every thread is busy (at most 64): completes the Works'
//               futures, i.e. runs their callbacks, off the threads that move data.
//   p2p         one thread, started on the first send/recv: advances every posted send and
//               receive without waiting on any single one.
//
// Who may block. The caller, in a sync op until it completes or its deadline passes
// (timeout_ms_: MooncakeOptions.timeout, setTimeout), and in Work::wait. The progress thread,
// in an engine round until the op's deadline. Completion threads, in user callbacks (one may
// wait on another op's future; the pool grows for it). The p2p thread never waits on one op.
// Control-store calls on the failure path are bounded by the op timeout
// (Group::bounded_store_call). shutdown() never waits for a dead peer: it aborts the engine and
// joins the threads.
//
// A dead peer. Detected through process handles of same-host peers (pidfd, else
// kill(pid, 0)), probed while a round waits, or by the op's deadline passing. The suspect is
// proposed to the control store as the record of the next membership epoch; the first
// compare-and-set wins, so every survivor agrees on the same failed ranks (agree()). A
// failure that another group of this process agreed on applies here too. Then, per
// on_failure (mooncake_pg/config.py):
//   raise   (default) the op raises RankFailure (Python: RankFailureError, a
//           DistBackendError carrying failed_ranks and epoch) on every survivor; the failed
//           ranks are deactivated (epoch + 1) and later ops run over the survivors;
//   mask    the op reruns over the survivors (in-place inputs restored first) and completes;
//   manual  the op raises RankFailure; the failed ranks stay active and every later op
//           fails fast with RankFailure until every survivor calls deactivate_ranks.
// Rooted ops whose root is inactive, and p2p with a dead peer, always raise RankFailure
// (p2p failures are not agreed through the store). A rank that its peers declared failed,
// or that lost the control store, fences itself (RankFailure with fenced set; Python:
// RankFencedError): every later op raises; it may rejoin as a recovering rank (is_recovery,
// then the survivors' recover_ranks and its join_group). Work::wait(timeout) that expires
// raises on that rank only; the op goes on and nobody is declared failed.
//
// Error messages: "MooncakeBackend::method: ..." for set-up and internal errors,
// "mooncake <op> (rank <r>): ..." (the torch.distributed name of the op) for a caller's
// arguments and cross-rank mismatches, "MooncakeBackend (rank <r>): ..." for failures of
// the group.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/group.hpp"
#include "pg/convert.hpp"
#include "pg/work.hpp"
#ifdef MOONCAKE_WITH_CUDA
#include "pg/cuda/ipc.hpp"
#include "pg/cuda/staging.hpp"
#endif

namespace mooncake {
// Pointers to the tensors of an op's arguments (for CUDA staging).
inline void tensor_ptrs_add(std::vector<at::Tensor*>& v, at::Tensor& t) { v.push_back(&t); }
inline void tensor_ptrs_add(std::vector<at::Tensor*>& v, std::vector<at::Tensor>& ts) {
  for (auto& t : ts) v.push_back(&t);
}
inline void tensor_ptrs_add(std::vector<at::Tensor*>& v, std::vector<std::vector<at::Tensor>>& ts) {
  for (auto& l : ts)
    for (auto& t : l) v.push_back(&t);
}
template <typename... A>
std::vector<at::Tensor*> tensor_ptrs(A&... a) {
  std::vector<at::Tensor*> v;
  (tensor_ptrs_add(v, a), ...);
  return v;
}
}  // namespace mooncake

// OpTypes newer than torch 2.11 (the GPU machine's torch)
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
#define MOONCAKE_OP_AG_COALESCED ALLGATHER_INTO_TENSOR_COALESCED
#define MOONCAKE_OP_RS_COALESCED REDUCE_SCATTER_TENSOR_COALESCED
#else
#define MOONCAKE_OP_AG_COALESCED COALESCED
#define MOONCAKE_OP_RS_COALESCED COALESCED
#endif

// First line of every op taking tensors: with CUDA, an op on CUDA tensors goes through
// pinned host staging (pg/cuda/staging.hpp) and re-enters the op with CPU tensors.
#ifdef MOONCAKE_WITH_CUDA
#define MOONCAKE_CUDA_STAGED(TYPE, NAME, INS, OUTS, ...)                                                  \
  do {                                                                                                    \
    auto mc_ins_ = INS;                                                                                   \
    auto mc_outs_ = OUTS;                                                                                 \
    if (::mooncake::any_cuda(mc_ins_) || ::mooncake::any_cuda(mc_outs_))                                  \
      return ::mooncake::cuda_staged(                                                                     \
          rank_, c10d::OpType::TYPE, NAME, mc_ins_, mc_outs_, [&]() { return __VA_ARGS__; }, coalescing_, \
          &coalesced_cuda_);                                                                              \
  } while (0)
#else
#define MOONCAKE_CUDA_STAGED(TYPE, NAME, INS, OUTS, ...) \
  do {                                                   \
  } while (0)
#endif

namespace mooncake {

class MooncakeBackend : public c10d::Backend {
 public:
  MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, BackendConfig cfg);
  ~MooncakeBackend() override;

  const std::string getBackendName() const override { return "mooncake"; }
  bool supportsCoalescing() const override { return true; }
  // what ProcessGroup::splitGroup copies to a split's backend: the op timeout (the rest
  // of this group's settings travel through split() itself)
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    return c10::make_intrusive<c10d::Backend::Options>("mooncake", group_->timeout());
  }
  // dist.shrink_group and split_group (subgroups.cpp): a new backend of the remaining (or
  // the listed) ranks, renumbered, set up over this group's store under a key prefix of
  // its own (no new init_process_group); the members' transports are built anew.
  bool supportsShrinking() const override { return true; }
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void shutdown() override { group_->shutdown(); }
  void abort() override { shutdown(); }
  void setTimeout(std::chrono::milliseconds timeout) override { group_->set_timeout(timeout); }
  // c10d sequence numbers: collectives issued on this group since its member set formed
  // (construction, or the last rejoin), counted when issued, so equal on every member
  // between two collectives. They start at 0 everywhere, so there is nothing to agree on.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return group_->seq_group(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // sparse COO tensors, ReduceOp.SUM (pg/sparse.cpp); allreduce() routes them here
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Introspection for tests and benchmarks.
  std::string transport_name() const { return group_->transport_name(); }
  uint64_t ops_issued() const { return group_->ops_issued(); }
  // How all_reduce, broadcast, all_gather_single and reduce_scatter_single move CUDA tensors
  // in this group: "ipc", or "staging: <why>" (or "unavailable: <why>" on a build without
  // CUDA).
  std::string cuda_ipc_status() const;

  // The group core: membership (docs/design.md "Membership and fault tolerance": rank_hosts,
  // active_ranks, epoch, failed_ranks, pending_failed, deactivate_ranks, pending_ranks,
  // recover_ranks, join_group, joining, last_joined). Its errors are the core's: call it
  // through translated() (pg/convert.hpp).
  Group& group() { return *group_; }

 private:
  std::unique_ptr<Group> group_;
  c10::intrusive_ptr<c10d::Store>
      store_;  // the c10d Store under group_'s ControlStore (derived groups' prefix)
#ifdef MOONCAKE_WITH_CUDA
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_cuda_;  // staged works of the open coalescing session
  std::unique_ptr<CudaIpc> ipc_;  // the CUDA IPC path (pg/cuda/ipc.hpp, pg/cuda/ipc_ops.cpp)
  c10::intrusive_ptr<c10d::Work> allreduce_ipc(at::Tensor& t, const c10d::AllreduceOptions& opts);
  void run_allreduce_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t deadline_ns);
  c10::intrusive_ptr<c10d::Work> broadcast_ipc(at::Tensor& t, const c10d::BroadcastOptions& opts);
  void run_broadcast_ipc(CudaIpcOp& op, int root, int64_t deadline_ns);
  c10::intrusive_ptr<c10d::Work> allgather_base_ipc(at::Tensor& output, at::Tensor& input,
                                                    const c10d::AllgatherOptions& opts);
  void run_allgather_ipc(CudaIpcOp& op, int64_t deadline_ns);
  bool ipc_eligible(const std::vector<at::Tensor>& ts) const;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_base_ipc(at::Tensor& output, at::Tensor& input,
                                                         const c10d::ReduceScatterOptions& opts);
  void run_reduce_scatter_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t deadline_ns);
  // per piece of n elements, at most R per round: the group core's header rounds
  void run_ipc_pieces(CudaIpcOp& op, const OpHeader& hdr, int ref, size_t n, size_t R, int64_t deadline_ns,
                      const Group::PieceFn& before, const Group::PieceFn& after);
  void ipc_check_one_host(const char* method) const;
  uint64_t ipc_epoch_ = ~uint64_t(0);  // engine epoch of the latest IPC op
#endif
  using Job = Group::Job;
  // Runs `job` as the group's next collective (Group::submit) and returns its Work, which
  // completes with `outputs` (after `after` copies results back into the caller's tensors).
  c10::intrusive_ptr<MooncakeWork> submit(c10d::OpType type, std::vector<at::Tensor> outputs, bool async_op,
                                          std::chrono::milliseconds timeout, Job job,
                                          std::function<void()> after = nullptr,
                                          std::function<void()> before_retry = nullptr);
  // Completes `w` with the op's outcome (a c10 error or null): its `after`, its coalescing
  // parent, then its future (here when inline_future, else on a completion thread).
  void deliver(const c10::intrusive_ptr<MooncakeWork>& w, std::exception_ptr err, bool inline_future);

  // a backend of `members` (this group's ranks, ascending; this rank among them) on `store`
  c10::intrusive_ptr<MooncakeBackend> derive(const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::vector<int>& members, const char* op) const;
  int64_t shrinks_ = 0;  // shrink() calls so far: each derived group's store keys are its own

  // Inside start/endCoalescing: the batch's Work completes when `w` (and its peers) do.
  void attach_to_coalescing(const c10::intrusive_ptr<MooncakeWork>& w,
                            const std::vector<at::Tensor>& outputs);
  c10::intrusive_ptr<MooncakeWork> send_impl(std::vector<at::Tensor>& tensors, int dst, int tag);
  c10::intrusive_ptr<MooncakeWork> recv_impl(std::vector<at::Tensor>& tensors, int src, int tag);
  // posts a p2p op of `buf` (contiguous) whose outcome completes `w`
  void post_p2p(bool is_send, int peer, int tag, const at::Tensor& buf,
                const c10::intrusive_ptr<MooncakeWork>& w);
  c10::intrusive_ptr<c10d::Work> failed_work(c10d::OpType type, std::vector<at::Tensor> outputs,
                                             std::exception_ptr err);
  // on_failure="mask" reruns an op over the survivors: in-place ops need their input back
  std::function<void()> backup_for_retry(const std::vector<at::Tensor>& ts);

  bool coalescing_ = false;
  uint32_t coalesced_ops_ = 0;  // collectives issued in the open coalescing block
  c10::intrusive_ptr<MooncakeWork> coalesce_parent_;
};

}  // namespace mooncake
