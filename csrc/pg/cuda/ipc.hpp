// CUDA tensors of one host's ranks: all_reduce, broadcast, all_gather into one tensor and
// reduce_scatter from one tensor through CUDA IPC (built with MOONCAKE_WITH_CUDA only; pinned host staging,
// pg/cuda/staging.hpp, serves every other case).
//
// Per group and per size class (powers of two from kMinClassBytes to kMaxClassBytes) each
// rank owns one device buffer of 2 x class bytes (two halves, "parities"), allocated on first
// use and kept; its CUDA IPC handle goes to the group's store once. Each rank also owns four
// interprocess events R0, R1 ("my copy into half p is done") and D0, D1 ("my reads of
// everybody's half p are done"), exported once. An all_reduce runs in rounds of at most one
// class (a tensor above kMaxClassBytes takes several); engine round k uses parity p = k % 2
// (rounds are numbered alike on every rank and restart with each membership epoch, whose
// first IPC op therefore starts with a barrier):
//
//   1. side stream: wait for every active peer's D[p] (its reads of my half p, two rounds
//      ago), copy my piece into my half p (PREMUL_SUM: scaled), record R[p];
//   2. the calling thread: one round of the collective engine (shared memory on one host)
//      carrying the op header: cross-rank mismatches raise ValueError, a dead peer takes the
//      group's failure path exactly as on the CPU; no wait on the GPU;
//   3. side stream: wait for every active peer's R[p], reduce all active ranks' halves p (in
//      rank order, so every rank gets the same bits) into my output piece with launch_reduce,
//      record D[p].
//   broadcast: only the root does step 1; the others copy the root's half out in step 3.
//   all_gather: step 3 copies every active rank's half into its slot of the output.
//   reduce_scatter: step 1 copies the pieces for every active seat; step 3 reduces the
//   peers' pieces for this rank into its output.
//
// Why interprocess events and not a CPU barrier after an event synchronize: the round in
// step 2 only needs peers to have *queued* their copies (every record in step 1 is issued
// before the round), so no thread waits for the GPU; a stream waiting on an imported event
// waits for the exporter's latest record of it, and nobody records R[p] or D[p] again
// before the next round, which needs every active rank. Two parities make the "buffer may
// be overwritten" handshake free: the wait in step 1 is for reads two or more rounds back,
// whose records every peer issued before it entered the round in between.
//
// Stream semantics (NCCL's): the op is ordered after the work queued on the caller's current
// stream when it was issued (an event recorded there, waited on by the group's side stream);
// Work.wait() makes the caller's current stream wait for the op's end event.
#pragma once
#ifdef MOONCAKE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/reduce.hpp"

namespace mooncake {

// One all_reduce on the IPC path: shared by the issuing thread, the job and the Work.
struct CudaIpcOp {
  CudaIpcOp(at::Tensor t, c10::Device dev, c10::cuda::CUDAStream s);
  ~CudaIpcOp();
  at::Tensor user;          // the caller's tensor (the result is written into it)
  at::Tensor work;          // contiguous tensor the rounds reduce into (user when contiguous)
  at::Tensor out_user;      // all_gather: the caller's output (undefined otherwise)
  at::Tensor out_work;      // all_gather: contiguous output the rounds write into
  bool writes_user = true;  // finish() copies `work` back into `user` when they differ
  c10::Device dev;
  c10::cuda::CUDAStream stream;    // the group's side stream on dev
  void* start = nullptr;           // recorded on the caller's current stream at issue
  void* end = nullptr;             // recorded on the side stream after the last round
  size_t cls = 0;                  // size class (bytes per parity)
  std::atomic<bool> ended{false};  // `end` was recorded
};

class CudaIpc {
 public:
  static constexpr size_t kMinClassBytes = size_t(1) << 20;
  static constexpr size_t kMaxClassBytes = size_t(64) << 20;

  // `ns`: key prefix in `store` of this incarnation of the group.
  CudaIpc(int rank, int size, c10::intrusive_ptr<c10d::Store> store, std::string ns);
  ~CudaIpc();
  CudaIpc(const CudaIpc&) = delete;
  CudaIpc& operator=(const CudaIpc&) = delete;

  // Caller's thread: records the start event on the current stream of t's device. The
  // group's IPC state is bound to the device of its first CUDA op (ValueError otherwise).
  // `out`: all_gather's output (same device), undefined otherwise.
  std::shared_ptr<CudaIpcOp> begin(const at::Tensor& t, const char* opname,
                                   const at::Tensor& out = at::Tensor());
  // In the job, in this order: prepare; per round stage, (engine round), reduce; finish.
  size_t round_elems(const CudaIpcOp& op) const { return op.cls / op.user.element_size(); }
  // `separate`: reduce into a copy and write the caller's tensor only in finish() (a rerun
  // over survivors, on_failure="mask", needs the input intact).
  void prepare(CudaIpcOp& op, bool separate);
  // `act`: the active ranks (ascending, this rank among them); `pids`: each rank's process
  // id as the backend knows it (a changed id: a new incarnation, its mappings are redone).
  void stage(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
             const std::vector<int64_t>& pids, RedOp rop, double premul);
  void reduce(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
              const std::vector<int64_t>& pids, RedOp rop);
  // reduce_scatter (input: `user`, W x n elements; output: `out_user`, n): per active seat d
  // the piece [d*n + off, +len) of my input goes to offset d*len of my half; after the round
  // every active rank's half at offset rank*len is reduced into out_work[off, off+len).
  size_t scatter_round_elems(const CudaIpcOp& op) const { return op.cls / (op.user.element_size() * size_); }
  void stage_scatter(CudaIpcOp& op, int parity, size_t off, size_t len, size_t n, const std::vector<int>& act,
                     const std::vector<int64_t>& pids, RedOp rop, double premul);
  void reduce_scatter(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
                      const std::vector<int64_t>& pids, RedOp rop);
  // broadcast: the root stage()s; the others publish_events() before the round and
  // copy_from() the root after it (then record their "done reading").
  void publish_events();
  // all_gather: after the round, every active rank j's half `parity` (its piece [off, off+len)
  // of n elements) goes to out_work[j*n + off ...] (then "done reading" is recorded).
  void gather_into(CudaIpcOp& op, int parity, size_t off, size_t len, size_t n, const std::vector<int>& act,
                   const std::vector<int64_t>& pids);
  void copy_from(CudaIpcOp& op, int parity, int src, size_t off, size_t len,
                 const std::vector<int64_t>& pids);
  void finish(CudaIpcOp& op);
  // The Work returned to the caller: completes with `inner` (the engine side), wait() makes
  // the current stream wait for the op's end event.
  static c10::intrusive_ptr<c10d::Work> wrap(int rank, c10d::OpType type,
                                             c10::intrusive_ptr<c10d::Work> inner,
                                             std::shared_ptr<CudaIpcOp> op);

 private:
  struct Peer {
    int64_t pid = -1;
    void* ev[4] = {nullptr, nullptr, nullptr, nullptr};  // R0, R1, D0, D1 (imported)
    std::map<size_t, void*> bufs;                        // size class -> imported base
  };
  void ensure_own(size_t cls);  // my events and my buffer of class `cls`, published
  // (src offset in work, dst offset in my half), elements; `len` elements each
  void stage_segments(CudaIpcOp& op, int parity, const std::vector<std::pair<size_t, size_t>>& segs,
                      size_t len, const std::vector<int>& act, const std::vector<int64_t>& pids, RedOp rop,
                      double premul);
  void reduce_at(CudaIpcOp& op, int parity, size_t half_off, void* out, size_t len,
                 const std::vector<int>& act, const std::vector<int64_t>& pids, RedOp rop);
  // Rank j's events (required: they must be published by incarnation `pid`; else false
  // when they are not, or only by an earlier incarnation).
  bool open_events(int j, int64_t pid, bool required);
  Peer& peer(int j, int64_t pid, size_t cls);  // events and buffer of class `cls` (required)
  void drop_peer(Peer& p);
  bool get_key(const std::string& k, int j, int64_t pid, bool required, std::string* out);

  int rank_, size_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string ns_;
  std::mutex mu_;  // begin() (caller threads) vs the job
  std::optional<c10::Device> dev_;
  std::optional<c10::cuda::CUDAStream> stream_;
  void* ev_[4] = {nullptr, nullptr, nullptr, nullptr};  // own R0, R1, D0, D1
  bool ev_published_ = false;
  std::map<size_t, void*> bufs_;  // own buffers per size class (2 x class bytes)
  std::vector<Peer> peers_;
};

}  // namespace mooncake
#endif  // MOONCAKE_WITH_CUDA
