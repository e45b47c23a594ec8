// Collective body of the group core (runs with the engine held, core/group.hpp):
// all_reduce and reduce: one round for small tensors, else a pipelined
// reduce-scatter + all-gather over the engine's slots.
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

namespace {
// Tensors up to this size (and one slot) take the one-round path.
constexpr size_t kSmallAllreduce = 16 << 10;
}  // namespace

void Group::allreduce(const Buffer& t, RedOp rop, double premul, int64_t deadline_ns) {
  run_allreduce(t, rop, premul, -1, deadline_ns);
}

void Group::reduce(const Buffer& t, RedOp rop, double premul, int root, int64_t deadline_ns) {
  run_allreduce(t, rop, premul, root, deadline_ns);
}

void Group::run_allreduce(const Buffer& t, RedOp rop, double premul, int root, int64_t deadline_ns) {
  // root < 0: all_reduce; else reduce to `root` (other ranks' tensors stay untouched).
  // Contributors are the active ranks (act_); AVG divides by their number.
  CollEngine* e = coll_.get();
  const std::vector<int>& act = act_;
  const int A = static_cast<int>(act.size()), r = rank_;
  const int me = my_index_;
  const auto dt = t.dtype;
  const size_t E = element_size(t.dtype);
  const size_t n = t.count;
  uint8_t* data = t.bytes_ptr();
  const bool all = root < 0;
  if (!all) require_active_root(root, "reduce");
  OpHeader h{};
  h.op = all ? OP_ALLREDUCE : OP_REDUCE;
  h.dtype = static_cast<int32_t>(dt);
  h.redop = static_cast<int32_t>(rop);
  h.root = all ? -1 : root;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  const int ref = all ? act[0] : root;
  const bool writes_out = all || r == root;
  std::vector<const void*> srcs(A);

  HostLayout hl;
  if (n * E > std::min(kSmallAllreduce, S) && run_hierarchical(n * E, &hl) && hl.G >= 2)
    return run_allreduce_hier(t, rop, premul, root, hl, h, deadline_ns);
  if (n * E <= std::min(kSmallAllreduce, S)) {
    // one round: every rank reduces the whole (small) tensor in rank order
    const uint64_t k = e->next_round();
    copy_in(e->my_slot(k), data, n, E, dt, rop, premul);
    write_header(e, k, h, noextra);
    PeerRanges sends(size_);
    for (int j : act)
      if (j != r && (all || j == root)) sends[j].push_back({0, n * E});
    exchange(&sends, header_len(noextra), deadline_ns);
    check_headers(e, k, ref, act);
    if (n == 0 || !writes_out) return;
    for (int i = 0; i < A; ++i) srcs[i] = e->peer_slot(act[i], k);
    reduce_buffers(data, srcs.data(), A, n, dt, rop);
    return;
  }

  // Pipelined reduce-scatter + all-gather. Slot = [A: the parts of my input piece that
  // peers reduce | B: my reduced sub-chunk]. Active rank i reduces sub-chunk i of each
  // piece, reading its own part straight from its tensor, and publishes the result in B
  // of the next round, which peers copy out while the next piece is being reduced.
  const size_t half = S / 2 / 64 * 64;
  size_t P = half / (A * E) * A;  // elements per piece
  if (P == 0) P = A;
  const size_t npieces = (n + P - 1) / P;
  const bool scaled = rop == RedOp::PREMUL_SUM && premul != 1.0;
  auto piece_len = [&](size_t p) { return std::min(P, n - p * P); };
  auto sub = [&](size_t L, int i, size_t* off, size_t* len) {
    size_t c = (L + A - 1) / A;
    size_t b = std::min(L, c * i), en = std::min(L, c * (i + 1));
    *off = b;
    *len = en - b;
  };
  auto out_copy = n * E >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p <= npieces; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(size_);
    if (p < npieces) {
      const size_t L = piece_len(p);
      for (int i = 0; i < A; ++i) {
        size_t o, l;
        sub(L, i, &o, &l);
        if (i != me || scaled) copy_in(e->my_slot(k) + o * E, data + (p * P + o) * E, l, E, dt, rop, premul);
        if (i != me) sends[act[i]].push_back({o * E, l * E});
      }
    }
    if (p > 0) {
      size_t o, l;
      sub(piece_len(p - 1), me, &o, &l);
      for (int j : act)
        if (j != r && (all || j == root)) sends[j].push_back({half, l * E});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, deadline_ns);
    if (p == 0) check_headers(e, k, ref, act);
    if (p > 0 && writes_out) {
      const size_t L = piece_len(p - 1);
      for (int i = 0; i < A; ++i) {
        if (i == me) continue;
        size_t o, l;
        sub(L, i, &o, &l);
        if (l) out_copy(data + ((p - 1) * P + o) * E, e->peer_slot(act[i], k) + half, l * E);
      }
    }
    if (p < npieces) {
      const size_t L = piece_len(p);
      size_t o, l;
      sub(L, me, &o, &l);
      if (l) {
        uint8_t* mine = data + (p * P + o) * E;
        for (int i = 0; i < A; ++i) srcs[i] = (i == me && !scaled) ? mine : e->peer_slot(act[i], k) + o * E;
        uint8_t* red = e->my_slot(k + 1) + half;  // next round's slot (see engine.hpp)
        reduce_buffers(red, srcs.data(), A, l, dt, rop, writes_out ? mine : nullptr);
      }
    }
  }
}

}  // namespace mooncake
