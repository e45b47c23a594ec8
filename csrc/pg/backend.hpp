// The "mooncake" c10d backend: collectives over the round engine (pg/engine.hpp), p2p over
// byte streams (pg/backend_p2p.cpp), and a membership that changes while the group runs.
//
// Contract of MooncakeBackend
//
// Call order. Every active rank issues the same collectives in the same order with matching
// arguments (c10d's rule); membership calls (deactivate_ranks, recover_ranks) are
// collective too: every survivor makes them between the same two ops. A rank's own bad
// arguments raise ValueError on that rank before anything is queued (pg/checks.hpp). A
// cross-rank mismatch (op, dtype, count, root, ReduceOp, split sizes) is caught by the header
// every collective exchanges in its first round (pg/collectives/op_header.hpp): ValueError
// on every rank naming the offending ranks, before any output is written; nobody is
// declared failed and the group goes on. p2p messages between two ranks arrive in the order
// they were sent; a receive must match the message's tag and size.
//
// Threads.
//   caller      runs the entry points (checks, then submit()), Work::wait, the membership
//               calls and join_group. A sync op (asyncOp false) runs inline on the caller's
//               thread when no op is queued or running; any other op is queued.
//   progress    one thread, started on the first queued op: runs queued collectives one at
//               a time in issue order. A collective holds engine_mu_ while it runs (inline
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
// (bounded_store_call). shutdown() never waits for a dead peer: it aborts the engine and
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

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pg/cuda_ipc.hpp"
#include "pg/cuda_staging.hpp"
#include "pg/engine.hpp"
#include "pg/reduce.hpp"
#include "pg/topology.hpp"
#include "pg/work.hpp"

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
// pinned host staging (pg/cuda_staging.hpp) and re-enters the op with CPU tensors.
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

struct OpHeader;         // pg/collectives/op_header.hpp
enum OpCode : uint32_t;  // pg/collectives/op_header.hpp

// A collective or p2p op could not complete because ranks failed (agreed through the
// control store). Surfaces in Python as mooncake_pg.RankFailureError (a
// torch.distributed.DistBackendError) with `failed_ranks` and `epoch`.
class RankFailure : public c10::DistBackendError {
 public:
  RankFailure(const std::string& msg, std::vector<int> failed, int64_t epoch, bool fenced = false)
      : c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg),
        failed_ranks(std::move(failed)),
        epoch(epoch),
        fenced(fenced) {}
  std::vector<int> failed_ranks;
  int64_t epoch;
  bool fenced;  // this rank itself was declared failed (RankFencedError)
};

enum class FailurePolicy : int { RAISE = 0, MASK = 1, MANUAL = 2 };

struct BackendConfig {
  double timeout_s = 30.0;
  std::string transport = "auto";  // auto | shm | tcp | rdma
  std::string host_id;             // ranks with equal ids share memory
  std::string listen_host = "127.0.0.1";
  // listen_host came from MooncakeOptions.host_ip or MOONCAKE_SOCKET_IFNAME: used as is
  bool listen_host_explicit = false;
  // IPv4 address of the rendezvous store's host as this rank reaches it ("" unknown); a
  // rank on the store's host (loopback) listens towards another host's view of it
  std::string rendezvous_addr;
  int64_t shm_slot_bytes = 1 << 20;
  int64_t p2p_ring_bytes = 1 << 20;
  bool debug = false;
  std::string group_name;
  std::string on_failure = "raise";  // raise | mask | manual
  std::string rdma_device;           // transport "rdma": "DEVICE[:PORT]" (empty: first active port)
  int64_t rdma_gid_index = -1;       // transport "rdma": GID index (-1: RoCE v2 IPv4 GID, or none on IB)
  // Fault injection for tests (MOONCAKE_FAULT_INJECT="OP:ROUND"): the process SIGKILLs
  // itself on the collective with sequence number OP (0-based, per group) just before it
  // arrives at that op's round ROUND (0 = the first round).
  bool is_recovery = false;  // a replacement for a failed rank: join_group() admits it
  int64_t inject_kill_op = -1;
  int64_t inject_kill_round = 0;
  std::vector<int> global_ranks;  // group rank -> default-group rank (empty: identity)
  // Seats that found the group (ascending; empty: every seat). The others are extension
  // seats: inactive until a process joins them through recover_ranks/join_group.
  std::vector<int> initial_active;
  // CUDA builds: all_reduce, broadcast, all_gather into one tensor and reduce_scatter from
  // one tensor of CUDA tensors through CUDA IPC when every rank is on this host
  // (MOONCAKE_CUDA_IPC=0 / MooncakeOptions(cuda_ipc=False): pinned host staging always).
  bool cuda_ipc = true;
  // Groups spanning hosts with the same number of ranks on each: collectives in two levels
  // (inside each host, then between hosts; pg/collectives/hierarchical.cpp). Must agree.
  bool hierarchical = true;
  // > 0: set-up waits at most this long for the other members' keys (groups derived by
  // shrink/split, whose members are alive processes already); 0: the store's own timeout.
  int64_t setup_wait_ms = 0;
};

// Default-group ranks agreed failed by any group of this process (docs/design.md: an agreed
// failure applies to every group that contains the rank).
std::vector<int> known_failed_global_ranks();
// After the default group was shrunk, default-group rank new_rank is old_of_new[new_rank]:
// the record of agreed failures is renumbered (ranks not kept are dropped).
void renumber_failed_global_ranks(const std::vector<int>& old_of_new);

class MooncakeBackend : public c10d::Backend {
 public:
  MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, BackendConfig cfg);
  ~MooncakeBackend() override;

  const std::string getBackendName() const override { return "mooncake"; }
  bool supportsCoalescing() const override { return true; }
  // dist.shrink_group and split_group (subgroups.cpp): a new backend of the remaining (or
  // the listed) ranks, renumbered, set up over this group's store under a key prefix of
  // its own (no new init_process_group); the members' transports are built anew.
  // what ProcessGroup::splitGroup copies to a split's backend: the op timeout (the rest
  // of this group's settings travel through split() itself)
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    return c10::make_intrusive<c10d::Backend::Options>("mooncake", timeout_ms_);
  }
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
  void shutdown() override;
  void abort() override { shutdown(); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  // c10d sequence numbers: collectives issued on this group since its member set formed
  // (construction, or the last rejoin), counted when issued, so equal on every member
  // between two collectives. They start at 0 everywhere, so there is nothing to agree on.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_group_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // sparse COO tensors, ReduceOp.SUM (collectives/sparse.cpp); allreduce() routes them here
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
  std::string transport_name() const { return coll_ ? coll_->name() : "none"; }
  uint64_t ops_issued() const { return seq_; }
  // How all_reduce, broadcast, all_gather_single and reduce_scatter_single move CUDA tensors
  // in this group: "ipc", or "staging: <why>" (or "unavailable: <why>" on a build without
  // CUDA).
  std::string cuda_ipc_status() const;

  // Host of each seat (equal = one host; hosts numbered in the order of their lowest
  // active member, an inactive seat counts as a host of its own). Rebuilt with the
  // transport at every membership change.
  std::vector<int> rank_hosts();

  // Membership (docs/design.md "Membership and fault tolerance").
  std::vector<int32_t> active_ranks();
  int64_t epoch();
  std::vector<int> failed_ranks();    // every rank agreed failed so far
  std::vector<int> pending_failed();  // manual policy: agreed failed, not yet deactivated
  // Deactivates `ranks` on this rank (agreed through the control store; every survivor
  // calls it with the same ranks).
  void deactivate_ranks(const std::vector<int>& ranks);
  // Rejoin (docs/design.md): seats whose replacement asked to join and is not admitted yet.
  std::vector<int> pending_ranks();
  // Survivors, all of them, between the same two ops: admit `ranks` (the union over the
  // survivors' arguments is admitted; a no-op when it is empty).
  void recover_ranks(const std::vector<int>& ranks);
  // The replacement: blocks until the survivors admitted it (or raises after timeout_s).
  void join_group(double timeout_s);
  bool joining() const { return joining_; }
  std::vector<int> last_joined();  // ranks admitted by the latest recovery

 private:
  std::atomic<bool> one_host_{false};  // every member of the current transport shares this host
#ifdef MOONCAKE_WITH_CUDA
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_cuda_;  // staged works of the open coalescing session
  std::unique_ptr<CudaIpc> ipc_;  // the CUDA IPC path (pg/cuda_ipc.hpp, pg/cuda_ipc_ops.cpp)
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
  // the first IPC op of a membership epoch starts with a header-only round
  void ipc_epoch_start(const OpHeader& h, int ref, int64_t deadline_ns);
  using IpcPieceFn = std::function<void(int parity, size_t off, size_t len)>;
  void run_ipc_pieces(CudaIpcOp& op, const OpHeader& hdr, int ref, size_t n, size_t R, int64_t deadline_ns,
                      const IpcPieceFn& before, const IpcPieceFn& after);
  void ipc_check_one_host(const char* method) const;
  uint64_t ipc_epoch_ = ~uint64_t(0);  // engine epoch of the latest IPC op
#endif
  using Job = std::function<void(int64_t deadline_ns)>;
  // Sync ops (async_op false) run on the caller's thread when nothing is queued; async
  // ops run on the progress thread in issue order.
  c10::intrusive_ptr<MooncakeWork> submit(c10d::OpType type, std::vector<at::Tensor> outputs, bool async_op,
                                          std::chrono::milliseconds timeout, Job job,
                                          std::function<void()> after = nullptr,
                                          std::function<void()> before_retry = nullptr);
  void progress_loop();
  void completion_loop();
  void p2p_loop();
  void deliver(const c10::intrusive_ptr<MooncakeWork>& w, std::exception_ptr err, bool inline_future);
  void ensure_threads(bool p2p);
  // now + t (t == 0: the group timeout), in ns of now_ns()
  int64_t deadline_ns_for(std::chrono::milliseconds t) const;

  void setup(const c10::intrusive_ptr<c10d::Store>& store);
  // before_last_sync: this rank's last store writes of the build (the founders' group
  // record); it runs before the step that holds the lowest member back until every member has
  // reached it, so that no member still talks to the store when that one (usually the store's
  // host) may return and exit.
  void build_transport(const std::string& ns, const std::vector<int>& members, int64_t wait_ms = 0,
                       const std::function<void()>& before_last_sync = {});
  // A recovering process that finds no group yet: waits for one, raising ValueError when
  // its founders count its seat as one of theirs.
  void await_group(const c10::intrusive_ptr<c10d::Store>& store);
  void stop_p2p_thread();
  struct Record {
    bool join = false;
    std::vector<int> ranks;   // failed (or joining) ranks
    std::vector<int> active;  // join records: the active set afterwards
    std::string pids;         // join records: the admitted processes (one pid per rank)
    std::string raw;
  };
  bool read_record_full(uint64_t epoch, Record* rec);
  static Record parse_record(const std::string& raw);
  std::string group_cfg_string() const;
  std::vector<int> joinable_members(std::string* ns, uint64_t* epoch);
  bool members_all_dead(const std::string& ns, const std::vector<int>& members);
  std::vector<int> members_cache_;
  // A control-store call bounded by the op timeout (TCPStore calls block without bound
  // when the store's host is cut off: no RST, no keepalive); throws StoreTimeout.
  // limit_ms > 0: that bound instead of the op timeout
  template <class T>
  T bounded_store_call(const char* what, std::function<T(c10d::Store&)> fn, int64_t limit_ms = 0);
  // Heartbeats, in groups that span hosts: a detached thread adds 1 to "hb/<rank>" in the
  // control store every kHeartbeatPeriodMs (through its own clone of the store); a rank
  // blocked on peers of other hosts reads their counts and takes a peer whose count has not
  // moved for kHeartbeatLostMs for dead. A cut link or a frozen host sends no RST or FIN,
  // so without this only the op timeout would end the wait; a live rank that is busy
  // between ops keeps beating (the thread does not need the GIL or the op).
  // The thread also looks for a membership record newer than `epoch` (the agreed epoch as
  // of this rank's last op) and notes its epoch in `newer` (see fence_if_declared_failed).
  static constexpr int64_t kHeartbeatPeriodMs = 200;
  static constexpr int64_t kHeartbeatLostMs = 2000;
  struct Heartbeat {
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> epoch{0};
    std::atomic<uint64_t> newer{0};
    // the text of record `newer` as the thread read it (records never change once written),
    // for an op that finds the store gone by the time it checks the record
    std::mutex mu;
    uint64_t seen_epoch = 0;
    std::string seen_record;
  };
  std::shared_ptr<Heartbeat> heartbeat_;
  std::vector<int64_t> hb_count_, hb_changed_ns_;
  int64_t next_hb_check_ns_ = 0;
  // st: the connection the beats use (a clone of the store made while set-up still talks to it)
  void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& st);
  std::vector<int> heartbeat_lost(const std::vector<int>& ranks);
  // After an op that succeeded here: raises RankFencedError when the others have declared
  // this rank failed meanwhile (a rank late to an op by more than the timeout can still
  // find every frame it needs, sent before the others gave up on it, in its sockets).
  void fence_if_declared_failed();
  // This rank fences itself: broken_ = why, and raises RankFailure with fenced set
  // (RankFencedError) for membership epoch `epoch`.
  [[noreturn]] void fence(const std::string& why, int64_t epoch);
  void apply_join(const Record& rec, uint64_t epoch);

  // collective bodies (run with the engine held)
  void run_allreduce(at::Tensor& t, RedOp rop, double premul, int root, int64_t deadline_ns);
  void run_allreduce_sparse(at::Tensor& t, int64_t deadline_ns);
  void run_broadcast(at::Tensor& t, int root, int64_t deadline_ns);
  void run_allgather(const at::Tensor& in, const std::vector<uint8_t*>& outs, OpCode opcode, int root,
                     int64_t deadline_ns);
  void run_reduce_scatter(const std::vector<const uint8_t*>& ins, at::Tensor& out, RedOp rop, double premul,
                          int64_t deadline_ns);
  void run_scatter(const std::vector<const uint8_t*>& ins, at::Tensor& out, int root, int64_t deadline_ns);
  void run_alltoall(const uint8_t* in, uint8_t* out, c10::ScalarType dt, int64_t row_elems,
                    const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows,
                    int64_t deadline_ns);
  void run_barrier(int64_t deadline_ns);
  // Two-level versions (pg/collectives/hierarchical.cpp): H >= 2 hosts, uniform except for
  // broadcast; `h` the op's header (seq taken). run_hierarchical() gives the layout when
  // they apply (uneven: hosts of any sizes allowed).
  bool run_hierarchical(size_t nbytes, HostLayout* hl, bool uneven = false) const;
  void run_allreduce_hier(at::Tensor& t, RedOp rop, double premul, int root, const HostLayout& hl,
                          const OpHeader& h, int64_t deadline_ns);
  void run_broadcast_hier(at::Tensor& t, int root, const HostLayout& hl, const OpHeader& h,
                          int64_t deadline_ns);
  void run_allgather_hier(const at::Tensor& in, const std::vector<uint8_t*>& outs, const HostLayout& hl,
                          const OpHeader& h, int64_t deadline_ns);
  void run_reduce_scatter_hier(const std::vector<const uint8_t*>& ins, at::Tensor& out, RedOp rop,
                               double premul, const HostLayout& hl, const OpHeader& h, int64_t deadline_ns);
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns);

  // Inside start/endCoalescing: the batch's Work completes when `w` (and its peers) do.
  void attach_to_coalescing(const c10::intrusive_ptr<MooncakeWork>& w,
                            const std::vector<at::Tensor>& outputs);
  struct P2POp;
  void post_p2p(std::shared_ptr<P2POp> op);
  void check_peer_active(int peer, bool is_send);
  c10::intrusive_ptr<MooncakeWork> send_impl(std::vector<at::Tensor>& tensors, int dst, int tag);
  c10::intrusive_ptr<MooncakeWork> recv_impl(std::vector<at::Tensor>& tensors, int src, int tag);
  c10::intrusive_ptr<c10d::Work> failed_work(c10d::OpType type, std::vector<at::Tensor> outputs,
                                             std::exception_ptr err);

  // membership
  void require_active_root(int root, const char* op);
  std::function<void()> backup_for_retry(const std::vector<at::Tensor>& ts);
  PeersGone probe_dead(const std::vector<int>& ranks);
  // deactivate_ranks of this rank itself: agreed like a failure, marked as a leave
  void leave();
  // every rank of `ranks` (non-empty) left the group of its own accord (a leave record)
  bool only_leaves(const std::vector<int>& ranks) const;
  int64_t next_record_check_ns_ = 0;  // probe_dead: next look for a newer membership record
  // Reads every agreed record after agreed_epoch_; returns the ranks they add.
  std::vector<int> catch_up(bool stop_at_join = false);
  // Proposes `suspects` as failed for the next epoch (the first compare-and-set wins),
  // catches up and applies per policy; returns the ranks newly agreed failed.
  std::vector<int> agree(const std::vector<int>& suspects, const std::string& reason);
  void apply_agreed();  // active_ -= agreed failures; epoch_ = agreed_epoch_
  void refresh_active_list();
  [[noreturn]] void throw_failure(const std::string& what, const std::vector<int>& newly);
  void log_membership(const std::string& msg);
  int global_rank(int r) const;
  // Group ranks that another group of this process has agreed failed.
  std::vector<int> failed_elsewhere();
  uint64_t registry_seen_ = 0;
  bool joining_ = false;
  int64_t shrinks_ = 0;  // shrink() calls so far: each derived group's store keys are its own
  // a backend of `members` (this group's ranks, ascending; this rank among them) on `store`
  c10::intrusive_ptr<MooncakeBackend> derive(const c10::intrusive_ptr<c10d::Store>& store,
                                             const std::vector<int>& members, const char* op) const;
  bool p2p_restart_ = false;
  std::vector<int> last_joined_;

  c10::intrusive_ptr<c10d::Store> store_;
  std::string store_ns_;     // key prefix of this incarnation of the group in the store
  std::string setup_error_;  // why this rank cannot set up its transport (told to the founders, then raised)
  // While founders build a new incarnation: the count of "mc/setups" adds before its own.
  // A recovering process that recorded a count at least this waits for this incarnation.
  int64_t founding_adds_ = -1;
  FailurePolicy policy_ = FailurePolicy::RAISE;
  std::vector<char> active_;
  std::vector<int> act_;       // active ranks, ascending
  int my_index_ = 0;           // position of rank_ in act_
  uint64_t epoch_ = 0;         // applied membership epoch
  uint64_t agreed_epoch_ = 0;  // last agreed record read from the store
  std::vector<char> agreed_failed_;
  std::vector<char> left_;       // agreed out by their own leave record (no data of theirs is missing)
  std::mutex mem_mu_;            // guards copies read from Python threads
  std::vector<int> peer_pidfd_;  // same-host peers: pidfd (or -1)
  std::vector<int64_t> peer_pid_;
  std::vector<int> host_of_;  // per rank of the transport: index of its host (setup; written under mem_mu_)

  BackendConfig cfg_;
  std::chrono::milliseconds timeout_ms_;  // op timeout (MooncakeOptions.timeout, setTimeout)
  std::unique_ptr<CollEngine> coll_;
  std::unique_ptr<P2PChannel> p2p_;
  std::string broken_;   // non-empty: the group is unusable (fenced, store lost, shut down)
  bool fenced_ = false;  // broken_ because this rank fenced itself: every later op raises RankFencedError

  std::mutex engine_mu_;
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::function<void()>> queue_;
  int inflight_ = 0;
  bool stop_ = false;
  std::thread progress_thread_, p2p_thread_;
  // Futures are completed (callbacks run) on a small pool that grows when every thread
  // is busy in a callback: a callback may wait on the future of an op it issued.
  std::vector<std::thread> completion_threads_;
  int completion_idle_ = 0;
  std::deque<c10::intrusive_ptr<MooncakeWork>> completions_;
  std::condition_variable ccv_;

  // p2p state (owned by the p2p thread after posting)
  std::mutex p2p_mu_;
  std::deque<std::shared_ptr<P2POp>> p2p_posted_;

  bool coalescing_ = false;
  uint32_t coalesced_ops_ = 0;          // collectives issued in the open coalescing block
  std::atomic<bool> left_self_{false};  // this rank left the group (leave): p2p raises too
  c10::intrusive_ptr<MooncakeWork> coalesce_parent_;
  std::deque<std::string> trace_;  // MOONCAKE_DEBUG: recent ops, dumped on timeout
  std::mutex trace_mu_;
  void trace(const std::string& what);
  std::string dump_trace();
  uint64_t seq_ = 0;                    // ops issued
  std::atomic<uint64_t> seq_group_{0};  // collectives issued since the member set formed
  uint64_t seq_exec_ = 0;               // collectives executed (in the op header; equal on all ranks)
  uint64_t op_round_ = 0;               // rounds completed by the current collective
};

}  // namespace mooncake
