// Collective body of MooncakeBackend (runs with the engine held, pg/backend.hpp):
// all_to_all: one sub-slot per seat; the first round also carries every rank's split
// sizes, which fix the number of rounds.
#include <algorithm>
#include <cstring>

#include "pg/backend.hpp"
#include "pg/collectives/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

void MooncakeBackend::run_alltoall(const uint8_t* in, uint8_t* out, c10::ScalarType dt, int64_t row_elems,
                                   const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows,
                                   int64_t deadline_ns) {
  // Rows to or from inactive seats are not moved (their output rows stay untouched).
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  const size_t R = static_cast<size_t>(row_elems) * c10::elementSize(dt);
  std::vector<size_t> soff(W + 1, 0), roff(W + 1, 0);
  for (int j = 0; j < W; ++j) {
    soff[j + 1] = soff[j] + in_rows[j] * R;
    roff[j + 1] = roff[j] + out_rows[j] * R;
  }
  std::vector<int64_t> extra(in_rows);
  extra.insert(extra.end(), out_rows.begin(), out_rows.end());
  OpHeader h{};
  h.op = OP_ALLTOALL;
  h.dtype = static_cast<int32_t>(dt);
  h.root = -1;
  h.count = row_elems;
  h.seq = seq_exec_++;
  const size_t S = e->slot_bytes();
  size_t Q = S / W / 64 * 64;
  if (Q == 0) Q = std::max<size_t>(1, S / W);
  size_t rounds = 1;  // known after round 1 (needs every rank's splits)
  auto out_copy = roff[W] >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < rounds; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(W);
    for (int j : act_) {
      if (j == r) continue;
      const size_t tot = soff[j + 1] - soff[j];
      const size_t off = p * Q, len = std::min(Q, tot - std::min(tot, off));
      if (len) std::memcpy(e->my_slot(k) + j * Q, in + soff[j] + off, len);
      sends[j].push_back({j * Q, len});
    }
    if (p == 0) write_header(e, k, h, extra);
    exchange(&sends, p == 0 ? header_len(extra) : 0, deadline_ns);
    if (p == 0) {
      check_headers(e, k, act_[0], act_);
      size_t maxb = 0;
      for (int i : act_) {
        const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
        for (int j : act_)
          if (i != j) maxb = std::max(maxb, static_cast<size_t>(xi[j]) * R);
      }
      rounds = std::max<size_t>(1, (maxb + Q - 1) / Q);
      const size_t self = soff[r + 1] - soff[r];
      if (self) (self >= kStreamThreshold ? copy_stream : copy_plain)(out + roff[r], in + soff[r], self);
    }
    for (int i : act_) {
      if (i == r) continue;
      const size_t tot = roff[i + 1] - roff[i];
      const size_t off = p * Q, len = std::min(Q, tot - std::min(tot, off));
      if (len) out_copy(out + roff[i] + off, e->peer_slot(i, k) + r * Q, len);
    }
  }
}

}  // namespace mooncake
