// Collective body of MooncakeBackend (runs with the engine held, pg/backend.hpp):
// all_to_all: the first round also carries every rank's split sizes, which fix the number
// of rounds. Each sender cuts its slot into one sub-slot per destination it sends bytes
// to, sized in proportion to those bytes, so a rank that sends to one peer (the stage
// inside a host of mooncake_ep's two-level route) uses its whole slot per round, and
// every pair finishes in about the same round.
#include <algorithm>
#include <cstring>

#include "pg/backend.hpp"
#include "pg/collectives/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

namespace {
// Sender's sub-slots: bytes[j] it sends to seat j (0 for itself and for seats it skips)
// -> (offset, size) of j's sub-slot in its slot of S bytes, 64-byte aligned; every seat
// with bytes gets at least 64. Falls back to equal parts when the proportional ones do
// not fit (many tiny sends).
void sub_slots(const std::vector<size_t>& bytes, size_t S, std::vector<size_t>* off, std::vector<size_t>* q) {
  const size_t W = bytes.size();
  off->assign(W, 0);
  q->assign(W, 0);
  size_t total = 0, nd = 0;
  for (size_t b : bytes) {
    total += b;
    nd += b > 0;
  }
  if (nd == 0) return;
  size_t used = 0;
  for (size_t j = 0; j < W; ++j)
    if (bytes[j]) {
      const double share =
          static_cast<double>(S) * static_cast<double>(bytes[j]) / static_cast<double>(total);
      (*q)[j] = std::max<size_t>(64, static_cast<size_t>(share) / 64 * 64);
      used += (*q)[j];
    }
  if (used > S) {
    size_t each = S / nd / 64 * 64;
    if (each == 0) each = std::max<size_t>(1, S / nd);
    for (size_t j = 0; j < W; ++j) (*q)[j] = bytes[j] ? each : 0;
  }
  size_t at = 0;
  for (size_t j = 0; j < W; ++j) {
    (*off)[j] = at;
    at += (*q)[j];
  }
}
}  // namespace

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
  // this rank's sub-slots (known before the header round), then every sender's
  std::vector<size_t> mine(W, 0);
  for (int j : act_)
    if (j != r) mine[j] = soff[j + 1] - soff[j];
  std::vector<size_t> my_off, my_q;
  sub_slots(mine, S, &my_off, &my_q);
  std::vector<size_t> from_off(W, 0), from_q(W, 0);  // where sender i puts my bytes
  size_t rounds = 1;                                 // known after round 1 (needs every rank's splits)
  auto out_copy = roff[W] >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < rounds; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(W);
    for (int j : act_) {
      if (j == r || my_q[j] == 0) continue;
      const size_t off = p * my_q[j], len = std::min(my_q[j], mine[j] - std::min(mine[j], off));
      if (len) std::memcpy(e->my_slot(k) + my_off[j], in + soff[j] + off, len);
      sends[j].push_back({my_off[j], len});
    }
    if (p == 0) write_header(e, k, h, extra);
    exchange(&sends, p == 0 ? header_len(extra) : 0, deadline_ns);
    if (p == 0) {
      check_headers(e, k, act_[0], act_);
      std::vector<size_t> bytes(W), off, q;
      for (int i : act_) {
        const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
        for (int j = 0; j < W; ++j) bytes[j] = (j != i && active_[j]) ? static_cast<size_t>(xi[j]) * R : 0;
        sub_slots(bytes, S, &off, &q);
        for (int j : act_)
          if (bytes[j]) rounds = std::max(rounds, (bytes[j] + q[j] - 1) / q[j]);
        from_off[i] = off[r];
        from_q[i] = q[r];
      }
      const size_t self = soff[r + 1] - soff[r];
      if (self) (self >= kStreamThreshold ? copy_stream : copy_plain)(out + roff[r], in + soff[r], self);
    }
    for (int i : act_) {
      if (i == r || from_q[i] == 0) continue;
      const size_t tot = roff[i + 1] - roff[i];
      const size_t off = p * from_q[i], len = std::min(from_q[i], tot - std::min(tot, off));
      if (len) out_copy(out + roff[i] + off, e->peer_slot(i, k) + from_off[i], len);
    }
  }
}

}  // namespace mooncake
