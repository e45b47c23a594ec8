// Collective body of the group core (runs with the engine held, core/group.hpp):
// all_to_all: the first round also carries every rank's split sizes, which fix the number
// of rounds. Each sender cuts its slot into one sub-slot per destination it sends bytes
// to, sized in proportion to those bytes, so a rank that sends to one peer (the stage
// inside a host of mooncake_ep's two-level route) uses its whole slot per round, and
// every pair finishes in about the same round. Across hosts, bytes for another host's
// ranks go as direct bytes after the first round, and the first round's bytes are copied
// out per sender while later frames are still on the wire (see Group::alltoall).
#include <algorithm>
#include <cstring>
#include <exception>

#include "core/group.hpp"
#include "core/op_header.hpp"
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

void Group::alltoall(const uint8_t* in, uint8_t* out, DType dt, int64_t row_elems,
                     const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows,
                     int64_t deadline_ns) {
  // Rows to or from inactive seats are not moved (their output rows stay untouched).
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  const size_t R = static_cast<size_t>(row_elems) * element_size(dt);
  std::vector<size_t> soff(W + 1, 0), roff(W + 1, 0);
  for (int j = 0; j < W; ++j) {
    soff[j + 1] = soff[j] + in_rows[j] * R;
    roff[j + 1] = roff[j] + out_rows[j] * R;
  }
  // With direct bytes (peers on other hosts over TCP), round 1 on carries a peer's rest
  // straight from `in` into its `out`, spread over the rounds that the slots need for
  // this host's peers (at least one): slots then carry only this host's bytes, and a
  // large op takes a few rounds, each a barrier, rather than one per slot of bytes.
  // Round 0 moves everything through slots: no output is written before the headers
  // agree.
  const bool direct = e->direct();
  // sender i's bytes after round 0 that go by slot (to this host's ranks, from i's
  // splits `bytes` and round-0 sub-slots `q`): i and every rank of its host compute it
  auto slot_rest = [&](int i, const std::vector<size_t>& bytes, const std::vector<size_t>& q) {
    std::vector<size_t> rest(W, 0);
    for (int j = 0; j < W; ++j)
      if (j != i && !e->direct_to(j) && bytes[j] > q[j]) rest[j] = bytes[j] - q[j];
    return rest;
  };
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
  // direct: the rest after round 0 by slot (this host's peers) and how many rounds it takes
  std::vector<size_t> my_rest_off, my_rest_q;
  if (direct) {
    int64_t need = 0;
    for (int j = 0; j < W; ++j)
      if (e->direct_to(j) && mine[j] > my_q[j]) need = 1;
    const std::vector<size_t> rest = slot_rest(r, mine, my_q);
    sub_slots(rest, S, &my_rest_off, &my_rest_q);
    for (int j = 0; j < W; ++j)
      if (rest[j])
        need = std::max<int64_t>(need, static_cast<int64_t>((rest[j] + my_rest_q[j] - 1) / my_rest_q[j]));
    extra.push_back(need);
  }
  std::vector<size_t> from_off(W, 0), from_q(W, 0);  // where sender i puts my bytes
  std::vector<size_t> rest_off(W, 0), rest_q(W, 0);  // the same from round 1 on (direct)
  std::vector<size_t> chunk(W, 0);                   // direct bytes per round to each peer
  size_t rounds = 1;                                 // known after round 1 (needs every rank's splits)
  auto out_copy = roff[W] >= kStreamThreshold ? copy_stream : copy_plain;
  struct DirectReset {  // the engine forgets `out` and the hook when the op ends, also by an exception
    CollEngine* e;
    ~DirectReset() {
      e->set_direct_dst({});
      e->set_arrival_hook({});
    }
  } reset{e};
  // Round 0's headers (every rank's splits): checked, then where each sender's bytes for
  // me lie and how many rounds the op takes. Nothing is written to `out` before this.
  auto read_headers = [&](uint64_t k) {
    check_headers(e, k, act_[0], act_);
    std::vector<size_t> bytes(W), off, q;
    for (int i : act_) {
      const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
      for (int j = 0; j < W; ++j) bytes[j] = (j != i && active_[j]) ? static_cast<size_t>(xi[j]) * R : 0;
      sub_slots(bytes, S, &off, &q);
      if (direct) {
        rounds = std::max(rounds, 1 + static_cast<size_t>(xi[2 * W]));
        if (i != r && !e->direct_to(i)) {  // i's rest by slot, to this host's ranks
          std::vector<size_t> ro, rq;
          sub_slots(slot_rest(i, bytes, q), S, &ro, &rq);
          rest_off[i] = ro[r];
          rest_q[i] = rq[r];
        }
      } else {
        for (int j : act_)
          if (bytes[j]) rounds = std::max(rounds, (bytes[j] + q[j] - 1) / q[j]);
      }
      from_off[i] = off[r];
      from_q[i] = q[r];
    }
    const size_t self = soff[r + 1] - soff[r];
    if (self) (self >= kStreamThreshold ? copy_stream : copy_plain)(out + roff[r], in + soff[r], self);
  };
  // sender i's round-0 bytes for me, from its slot
  auto copy_round0 = [&](int i, uint64_t k) {
    if (from_q[i] == 0) return;
    const size_t len = std::min(from_q[i], roff[i + 1] - roff[i]);
    if (len) out_copy(out + roff[i], e->peer_slot(i, k) + from_off[i], len);
  };
  for (size_t p = 0; p < rounds; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(W);
    std::vector<DirectSrc> dsrc;
    for (int j : act_) {
      if (j == r) continue;
      if (p > 0 && direct && e->direct_to(j)) {
        const size_t at = std::min(mine[j], my_q[j] + (p - 1) * chunk[j]);
        const size_t len = std::min(chunk[j], mine[j] - at);
        if (len) {
          if (dsrc.empty()) dsrc.resize(W);
          dsrc[j] = DirectSrc{in + soff[j] + at, len};
        }
        continue;
      }
      const bool later = p > 0 && direct;  // slot bytes of this host after round 0
      const size_t q = later ? my_rest_q[j] : my_q[j];
      if (q == 0) continue;
      const size_t so = later ? my_rest_off[j] : my_off[j];
      const size_t off = later ? my_q[j] + (p - 1) * q : p * my_q[j];
      const size_t len = std::min(q, mine[j] - std::min(mine[j], off));
      if (len) std::memcpy(e->my_slot(k) + so, in + soff[j] + off, len);
      sends[j].push_back({so, len});
    }
    if (!dsrc.empty()) e->set_direct_src(std::move(dsrc));
    // Round 0: each sender's bytes are copied out as its part arrives, once every header
    // is in and checked, while the other parts are still on the wire (the engine's
    // ArrivalHook; a header error is kept and raised after the exchange, as without it).
    std::vector<char> copied(W, 0);
    bool headers_read = false;
    std::exception_ptr header_error;
    if (p == 0)
      e->set_arrival_hook([&](int i) {
        if (header_error) return;
        if (!headers_read) {
          try {
            read_headers(k);
          } catch (...) {
            header_error = std::current_exception();
            return;
          }
          headers_read = true;
        }
        copy_round0(i, k);
        copied[i] = 1;
      });
    if (p == 0) write_header(e, k, h, extra);
    exchange(&sends, p == 0 ? header_len(extra) : 0, deadline_ns);
    if (p == 0) {
      if (header_error) std::rethrow_exception(header_error);
      if (!headers_read) read_headers(k);
      if (direct && rounds > 1) {
        std::vector<DirectDst> ddst(W);
        for (int j : act_) {
          if (j == r || !e->direct_to(j)) continue;
          const size_t sent0 = std::min(mine[j], my_q[j]);
          chunk[j] = (mine[j] - sent0 + rounds - 2) / (rounds - 1);
          const size_t got0 = std::min(roff[j + 1] - roff[j], from_q[j]);
          ddst[j] = DirectDst{out + roff[j] + got0, roff[j + 1] - roff[j] - got0};
        }
        e->set_direct_dst(std::move(ddst));
      }
    }
    for (int i : act_) {
      if (i == r) continue;
      if (p > 0 && direct) {
        if (e->direct_to(i) || rest_q[i] == 0) continue;  // direct bytes are in place
        const size_t tot = roff[i + 1] - roff[i];
        const size_t off = std::min(tot, from_q[i] + (p - 1) * rest_q[i]);
        const size_t len = std::min(rest_q[i], tot - off);
        if (len) out_copy(out + roff[i] + off, e->peer_slot(i, k) + rest_off[i], len);
        continue;
      }
      if (p == 0) {
        if (!copied[i]) copy_round0(i, k);
        continue;
      }
      if (from_q[i] == 0) continue;
      const size_t tot = roff[i + 1] - roff[i];
      const size_t off = p * from_q[i], len = std::min(from_q[i], tot - std::min(tot, off));
      if (len) out_copy(out + roff[i] + off, e->peer_slot(i, k) + from_off[i], len);
    }
  }
}

}  // namespace mooncake
