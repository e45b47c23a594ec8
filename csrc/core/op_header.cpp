// The op header (core/op_header.hpp), the round that carries it, barrier (a collective that
// is that round alone) and the header rounds of ops whose data moves elsewhere.
#include "core/op_header.hpp"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/group.hpp"

namespace mooncake {

namespace {
const char* header_dtype_name(int32_t dt) {
  return dt >= 0 && dt < kNumDTypes ? dtype_name(static_cast<DType>(dt)) : "UNKNOWN_SCALAR";
}
}  // namespace

const char* op_name(uint32_t op) {
  switch (op) {
    case OP_ALLREDUCE:
      return "all_reduce";
    case OP_REDUCE:
      return "reduce";
    case OP_BROADCAST:
      return "broadcast";
    case OP_ALLGATHER:
      return "all_gather";
    case OP_GATHER:
      return "gather";
    case OP_REDUCE_SCATTER:
      return "reduce_scatter";
    case OP_SCATTER:
      return "scatter";
    case OP_ALLTOALL:
      return "all_to_all";
    case OP_BARRIER:
      return "barrier";
    case OP_ALLREDUCE_IPC:
      return "all_reduce";  // describe() adds "through CUDA IPC"
    case OP_BROADCAST_IPC:
      return "broadcast";
    case OP_ALLGATHER_IPC:
      return "all_gather";
    case OP_REDUCE_SCATTER_IPC:
      return "reduce_scatter";
  }
  return "unknown op";
}

std::string describe(const OpHeader& h) {
  std::ostringstream o;
  o << op_name(h.op);
  if (h.op != OP_BARRIER) {
    o << " of " << h.count << (h.op == OP_ALLTOALL ? " element(s) per row" : " element(s)") << " of dtype "
      << header_dtype_name(h.dtype);
  }
  if (h.op == OP_ALLREDUCE || h.op == OP_REDUCE || h.op == OP_REDUCE_SCATTER || h.op == OP_ALLREDUCE_IPC ||
      h.op == OP_REDUCE_SCATTER_IPC)
    o << " with ReduceOp " << red_op_name(static_cast<RedOp>(h.redop));
  if (h.op == OP_REDUCE || h.op == OP_BROADCAST || h.op == OP_GATHER || h.op == OP_SCATTER ||
      h.op == OP_BROADCAST_IPC)
    o << " (root " << h.root << ")";
  if (h.op == OP_ALLREDUCE_IPC || h.op == OP_BROADCAST_IPC || h.op == OP_ALLGATHER_IPC ||
      h.op == OP_REDUCE_SCATTER_IPC)
    o << " through CUDA IPC";
  if (h.batch_index > 0 && h.batch_size > 0)
    o << " (tensor " << h.batch_index << " of " << h.batch_size << " of one call)";
  else if (h.batch_index > 0)
    o << " (op " << h.batch_index << " of a coalescing block)";
  o << " [op #" << h.seq << "]";
  return o.str();
}

BatchPos& current_batch() {
  thread_local BatchPos pos;
  return pos;
}

void write_header(CollEngine* e, uint64_t k, OpHeader h, const std::vector<int64_t>& extra) {
  h.magic = kOpHeaderMagic;
  h.nextra = static_cast<uint32_t>(extra.size());
  h.batch_index = current_batch().index;
  h.batch_size = current_batch().size;
  std::memcpy(e->my_hdr(k), &h, sizeof(h));
  if (!extra.empty()) std::memcpy(e->my_hdr(k) + sizeof(h), extra.data(), extra.size() * 8);
}

void check_headers(CollEngine* e, uint64_t k, int ref, const std::vector<int>& act) {
  const int W = e->size();
  OpHeader r;
  std::memcpy(&r, e->peer_hdr(ref, k), sizeof(r));
  std::vector<int> bad;
  OpHeader first_bad{};
  for (int j : act) {
    OpHeader h;
    std::memcpy(&h, e->peer_hdr(j, k), sizeof(h));
    bool same = h.magic == kOpHeaderMagic && h.op == r.op && h.dtype == r.dtype && h.redop == r.redop &&
                h.root == r.root && h.count == r.count && h.seq == r.seq && h.nextra == r.nextra &&
                h.batch_index == r.batch_index && h.batch_size == r.batch_size;
    if (same && r.op != OP_ALLTOALL && h.nextra > 0)
      same = std::memcmp(e->peer_hdr(j, k) + sizeof(h), e->peer_hdr(ref, k) + sizeof(h), h.nextra * 8) == 0;
    if (!same) {
      if (bad.empty()) first_bad = h;
      bad.push_back(j);
    }
  }
  if (r.op == OP_ALLTOALL && bad.empty()) {
    // rank i's send split to j must equal rank j's receive split from i
    std::vector<char> flagged(W, 0);
    std::string detail;
    for (int i : act) {
      const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
      for (int j : act) {
        const int64_t* xj = reinterpret_cast<const int64_t*>(e->peer_hdr(j, k) + sizeof(OpHeader));
        if (xi[j] != xj[W + i]) {
          if (detail.empty())
            detail = "rank " + std::to_string(i) + " sends " + std::to_string(xi[j]) + " row(s) to rank " +
                     std::to_string(j) + " but rank " + std::to_string(j) + " expects " +
                     std::to_string(xj[W + i]) + " from it";
          if (i != ref) flagged[i] = 1;
          if (j != ref) flagged[j] = 1;
        }
      }
    }
    if (!detail.empty()) {
      std::string who;
      for (int j = 0; j < W; ++j)
        if (flagged[j]) who += (who.empty() ? "" : ", ") + std::to_string(j);
      throw GroupValueError(cat(
          "mooncake all_to_all (rank ", e->rank(), "): cross-rank mismatch of split sizes: ", detail,
          "; offending rank(s): ", who, ". The op was cancelled on every rank and no output was modified."));
    }
    return;
  }
  if (!bad.empty()) {
    std::string who;
    for (int j : bad) who += (who.empty() ? "" : ", ") + std::to_string(j);
    OpHeader mine;
    std::memcpy(&mine, e->peer_hdr(e->rank(), k), sizeof(mine));
    throw GroupValueError(cat("mooncake ", op_name(mine.op), " (rank ", e->rank(),
                              "): cross-rank mismatch: rank ", bad[0], " called ", describe(first_bad),
                              " but rank ", ref, " called ", describe(r), "; offending rank(s): ", who,
                              ". The op was cancelled on every rank and no output was modified."));
  }
}

// One engine round of the running collective (hdr_len > 0: its first round, which carries
// the header). MOONCAKE_FAULT_INJECT's SIGKILL and MOONCAKE_FAULT_DELAY's hold fire here.
void Group::exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) {
  if (hdr_len > 0) op_round_ = 0;  // the first round of every collective carries the header
  if (cfg_.inject_delay_op >= 0 && static_cast<int64_t>(seq_exec_) - 1 == cfg_.inject_delay_op &&
      op_round_ == 0 && cfg_.inject_delay_peer >= 0 && cfg_.inject_delay_peer < size_) {
    fprintf(stderr, "[mooncake] rank %d: fault injection: rank %lld's part of op %lld held back %lld ms\n",
            rank_, static_cast<long long>(cfg_.inject_delay_peer),
            static_cast<long long>(cfg_.inject_delay_op), static_cast<long long>(cfg_.inject_delay_ms));
    coll_->delay_peer(static_cast<int>(cfg_.inject_delay_peer), now_ns() + cfg_.inject_delay_ms * 1000000);
  }
  if (cfg_.inject_kill_op >= 0 && static_cast<int64_t>(seq_exec_) - 1 == cfg_.inject_kill_op &&
      static_cast<int64_t>(op_round_) == cfg_.inject_kill_round) {
    fprintf(stderr, "[mooncake] rank %d: fault injection: SIGKILL at op %lld round %lld\n", rank_,
            static_cast<long long>(cfg_.inject_kill_op), static_cast<long long>(cfg_.inject_kill_round));
    fflush(stderr);
    raise(SIGKILL);
  }
  coll_->exchange(sends, hdr_len, deadline_ns);
  op_round_++;
}

void Group::require_active_root(int root, const char* op) {
  if (!active_[root]) {
    std::vector<int> failed{root};
    throw RankFailure(std::string("mooncake ") + op + " (rank " + std::to_string(rank_) + "): root rank " +
                          std::to_string(root) +
                          " is not active (failed or not joined); rooted ops whose root died always raise",
                      failed, static_cast<int64_t>(epoch_));
  }
}

void Group::barrier(int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  OpHeader h{};
  h.op = OP_BARRIER;
  h.root = -1;
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const uint64_t k = e->next_round();
  write_header(e, k, h, noextra);
  PeerRanges sends(size_);
  exchange(&sends, header_len(noextra), deadline_ns);
  check_headers(e, k, act_[0], act_);
}

void Group::header_rounds(const OpHeader& hdr, int ref, size_t n, size_t R, uint64_t* epoch_seen,
                          int64_t deadline_ns, const PieceFn& before, const PieceFn& after) {
  // The calling thread never waits for the data here: `before` queues the copies in, the
  // round tells every rank that its peers' copies are queued (failures and mismatches as on
  // the CPU path), `after` queues the reads of the peers' data (pg/cuda/ipc.hpp).
  CollEngine* e = coll_.get();
  const size_t pieces = std::max<size_t>(1, (n + R - 1) / R);
  const std::vector<int64_t> noextra;
  OpHeader h = hdr;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;  // once per op, as on the CPU path
  if (*epoch_seen != e->epoch()) {
    // Rounds restart with each membership epoch, so whatever a piece's round proves about
    // the rounds before it holds only within an epoch: the first such op of an epoch starts
    // with a round of its own (carrying the header, so a mismatch is caught there too), after
    // which every active rank has left its previous op.
    const uint64_t k = e->next_round();
    write_header(e, k, h, noextra);
    PeerRanges sends(size_);
    exchange(&sends, header_len(noextra), deadline_ns);
    check_headers(e, k, ref, act_);
    *epoch_seen = e->epoch();
  }
  for (size_t s = 0; s < pieces; ++s) {
    const uint64_t k = e->next_round();
    const int parity = static_cast<int>(k & 1);  // alternates; equal on every rank (engine.hpp)
    const size_t off = s * R, len = std::min(R, n - std::min(n, off));
    before(parity, off, len);
    write_header(e, k, h, noextra);
    PeerRanges sends(size_);
    exchange(&sends, header_len(noextra), deadline_ns);
    check_headers(e, k, ref, act_);
    after(parity, off, len);
  }
}
}  // namespace mooncake
