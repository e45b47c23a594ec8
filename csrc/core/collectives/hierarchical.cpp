// Collective bodies of the group core (run with the engine held, core/group.hpp) for
// groups that span hosts with the same number G of active ranks on each of H >= 2 hosts
// (core/topology.hpp). The rank with local index g on host h is "(h, g)".
//
// Each op moves every byte across a host's link as few times as the op needs (the link
// bound of benchmarks/multihost_bench.py): ranks of one host first combine or share what
// they hold, and only then does one rank per local index talk to its counterparts on the
// other hosts. The schemes are the two-level ones of Open MPI's HAN and of NCCL's
// hierarchical rings (all_reduce: intra-host reduce-scatter, inter-host all_reduce of
// each stripe among the ranks with the same local index, intra-host all_gather; Thakur,
// Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
// MPICH", 2005, for the reduce-scatter/all-gather decomposition), and broadcast a
// pipelined chain across hosts (each host's link carries the tensor once) or, for one
// mid-sized piece, a star from the root to one rank per stripe on every other host.
//
// Every op runs in slot-sized pieces over the engine's rounds (core/engine.hpp) with its
// stages pipelined: in round t, stage s works on piece t - s, so the transfers inside a
// host and between hosts overlap. A stage's data is written into the next round's slot
// right after the exchange that delivered its input (allowed by the engine's contract).
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

namespace {
// Messages from this size take the two-level path (smaller ones: one round, latency).
constexpr size_t kHierMinBytes = 16 << 10;

size_t up64(size_t x) { return (x + 63) / 64 * 64; }

// Part i of `parts` of [0, L): [*off, *off + *len).
void part(size_t L, int parts, int i, size_t* off, size_t* len) {
  const size_t c = (L + parts - 1) / parts;
  const size_t b = std::min(L, c * i), e = std::min(L, c * (i + 1));
  *off = b;
  *len = e - b;
}
}  // namespace

bool Group::run_hierarchical(size_t nbytes, HostLayout* hl, bool uneven) const {
  if (!cfg_.hierarchical || one_host_ || nbytes < kHierMinBytes) return false;
  *hl = host_layout(act_, host_of_, rank_);
  // every scheme's slot layout needs at least 64 bytes per (host, local index + 1)
  const int G = hl->uniform ? hl->G : hl->min_G;
  return (hl->uniform || uneven) && hl->H >= 2 &&
         static_cast<size_t>(hl->H) * (G + 1) * 64 <= coll_->slot_bytes();
}

// all_reduce (root < 0) and reduce. A piece of P elements is cut into G stripes; stripe g
// into H sub-stripes. Stages: 0 local peers send (h, g) their parts of stripe g, which it
// reduces into the host's partial; 1 (h, g) sends sub-stripe h' of that partial to
// (h', g), which reduces the H partials of its sub-stripe; 2 (h, g) sends the reduced
// sub-stripe to (h', g) for every h'; 3 (h, g) sends the whole reduced stripe to its local
// peers. Every element is reduced by one rank, so all ranks end bit-identical. For reduce,
// stages 2 and 3 go to the root's host and the root only.
void Group::run_allreduce_hier(const Buffer& t, RedOp rop, double premul, int root, const HostLayout& hl,
                               const OpHeader& h, int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int H = hl.H, G = hl.G, hm = hl.h, gm = hl.g;
  const auto dt = t.dtype;
  const size_t E = element_size(t.dtype);
  const size_t n = t.count;
  uint8_t* data = t.bytes_ptr();
  const bool all = root < 0;
  int hr = hm, gr = gm;
  if (!all) hl.where(root, &hr, &gr);
  const bool on_root_host = all || hm == hr;
  const bool writes_out = all || rank_ == root;
  const bool scaled = rop == RedOp::PREMUL_SUM && premul != 1.0;
  const RedOp first = rop == RedOp::AVG ? RedOp::SUM : rop;  // AVG divides once, by every contributor
  const int contributors = H * G;
  const std::vector<int64_t> noextra;

  // slot: [A: my piece | B: host partial of my stripe | C: my reduced sub-stripe | D: my reduced stripe]
  const size_t S = e->slot_bytes();
  auto layout = [&](size_t P, size_t* oB, size_t* oC, size_t* oD) {
    const size_t st = (P + G - 1) / G, ss = (st + H - 1) / H;
    *oB = up64(P * E);
    *oC = *oB + up64(st * E);
    *oD = *oC + up64(ss * E);
    return *oD + up64(st * E);
  };
  size_t oB, oC, oD;
  size_t P = S / E * G * H / (G * H + 2 * H + 1);
  while (P > 1 && layout(P, &oB, &oC, &oD) > S) P -= std::max<size_t>(1, P / 64);
  layout(P, &oB, &oC, &oD);
  const size_t npieces = (n + P - 1) / P;
  auto piece_len = [&](size_t p) { return std::min(P, n - p * P); };
  auto valid = [&](int64_t p) { return p >= 0 && p < static_cast<int64_t>(npieces); };
  auto stripe = [&](size_t p, int g, size_t* off, size_t* len) { part(piece_len(p), G, g, off, len); };
  auto out_copy = n * E >= kStreamThreshold ? copy_stream : copy_plain;
  std::vector<const void*> srcs(std::max(G, H));

  for (int64_t tt = 0; tt < static_cast<int64_t>(npieces) + 3; ++tt) {
    const uint64_t k = e->next_round();
    uint8_t* slot = e->my_slot(k);
    PeerRanges sends(size_);
    const int64_t p0 = tt, p1 = tt - 1, p2 = tt - 2, p3 = tt - 3;
    if (valid(p0)) {
      for (int g = 0; g < G; ++g) {
        size_t so, sl;
        stripe(p0, g, &so, &sl);
        if (g != gm || scaled) copy_in(slot + so * E, data + (p0 * P + so) * E, sl, E, dt, rop, premul);
        if (g != gm) sends[hl.at(hm, g)].push_back({so * E, sl * E});
      }
    }
    if (valid(p1)) {
      size_t so, sl;
      stripe(p1, gm, &so, &sl);
      for (int x = 0; x < H; ++x) {
        if (x == hm) continue;
        size_t o, l;
        part(sl, H, x, &o, &l);
        sends[hl.at(x, gm)].push_back({oB + o * E, l * E});
      }
    }
    if (valid(p2)) {
      size_t so, sl, o, l;
      stripe(p2, gm, &so, &sl);
      part(sl, H, hm, &o, &l);
      for (int x = 0; x < H; ++x)
        if (x != hm && (all || x == hr)) sends[hl.at(x, gm)].push_back({oC, l * E});
    }
    if (valid(p3) && on_root_host) {
      size_t so, sl;
      stripe(p3, gm, &so, &sl);
      for (int g = 0; g < G; ++g)
        if (g != gm && (all || hl.at(hm, g) == root)) sends[hl.at(hm, g)].push_back({oD, sl * E});
    }
    if (tt == 0) write_header(e, k, h, noextra);
    exchange(&sends, tt == 0 ? header_len(noextra) : 0, deadline_ns);
    if (tt == 0) check_headers(e, k, all ? act_[0] : root, act_);
    uint8_t* next = e->my_slot(k + 1);  // the next round's slot (see engine.hpp)

    if (valid(p3) && writes_out) {  // stage 3: the other stripes, from local peers
      for (int g = 0; g < G; ++g) {
        if (g == gm) continue;
        size_t so, sl;
        stripe(p3, g, &so, &sl);
        if (sl) out_copy(data + (p3 * P + so) * E, e->peer_slot(hl.at(hm, g), k) + oD, sl * E);
      }
    }
    if (valid(p2) && on_root_host) {  // stage 2: my stripe, reduced, from its H owners
      size_t so, sl;
      stripe(p2, gm, &so, &sl);
      for (int x = 0; x < H; ++x) {
        size_t o, l;
        part(sl, H, x, &o, &l);
        if (!l) continue;
        const uint8_t* src = (x == hm ? slot : e->peer_slot(hl.at(x, gm), k)) + oC;
        std::memcpy(next + oD + o * E, src, l * E);
      }
      if (writes_out && sl) out_copy(data + (p2 * P + so) * E, next + oD, sl * E);
    }
    if (valid(p1)) {  // stage 1: reduce my sub-stripe over the hosts' partials
      size_t so, sl, o, l;
      stripe(p1, gm, &so, &sl);
      part(sl, H, hm, &o, &l);
      if (l) {
        for (int x = 0; x < H; ++x) srcs[x] = (x == hm ? slot : e->peer_slot(hl.at(x, gm), k)) + oB + o * E;
        reduce_buffers(next + oC, srcs.data(), H, l, dt, rop, nullptr, contributors);
      }
    }
    if (valid(p0)) {  // stage 0: reduce my stripe over the host's ranks
      size_t so, sl;
      stripe(p0, gm, &so, &sl);
      if (sl) {
        for (int g = 0; g < G; ++g)
          srcs[g] = g == gm ? (scaled ? slot + so * E : data + (p0 * P + so) * E)
                            : e->peer_slot(hl.at(hm, g), k) + so * E;
        reduce_buffers(next + oB, srcs.data(), G, sl, dt, first);
      }
    }
  }
}

// reduce_scatter: chunk j of every rank's input is reduced into rank j's output. Stage 0:
// (h, g) receives from its local peers their chunks for ranks (x, g), every x, and reduces
// them into the host's partials; stage 1: it sends the partial for (x, g) to (x, g), which
// reduces the H partials into its output.
void Group::run_reduce_scatter_hier(const std::vector<const uint8_t*>& ins, const Buffer& out, RedOp rop,
                                    double premul, const HostLayout& hl, const OpHeader& h,
                                    int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int H = hl.H, G = hl.G, hm = hl.h, gm = hl.g;
  const auto dt = out.dtype;
  const size_t E = element_size(out.dtype);
  const size_t n = out.count;
  uint8_t* data = out.bytes_ptr();
  const bool scaled = rop == RedOp::PREMUL_SUM && premul != 1.0;
  const RedOp first = rop == RedOp::AVG ? RedOp::SUM : rop;
  const std::vector<int64_t> noextra;
  // slot, for a piece of len elements per chunk: [A: my chunks for (x, g) at (g * H + x) * len |
  // B: the host's partials for (x, gm) at x * len] (one contiguous range per peer and stage)
  const size_t S = e->slot_bytes();
  // >= 4: run_hierarchical() asks for 64 bytes per (host, local index + 1), E <= 16
  const size_t q = S / (static_cast<size_t>(H) * (G + 1)) / 64 * 64 / E;
  const size_t npieces = (n + q - 1) / q;
  auto valid = [&](int64_t p) { return p >= 0 && p < static_cast<int64_t>(npieces); };
  auto len_of = [&](int64_t p) { return std::min(q, n - p * q); };
  auto oB = [&](size_t len) { return static_cast<size_t>(G) * H * len * E; };
  std::vector<const void*> srcs(std::max(G, H));
  for (int64_t tt = 0; tt < static_cast<int64_t>(npieces) + 1; ++tt) {
    const uint64_t k = e->next_round();
    uint8_t* slot = e->my_slot(k);
    PeerRanges sends(size_);
    const int64_t p0 = tt, p1 = tt - 1;
    if (valid(p0)) {
      const size_t off = p0 * q, len = len_of(p0);
      for (int g = 0; g < G; ++g) {
        if (g == gm && !scaled) continue;
        for (int x = 0; x < H; ++x)
          copy_in(slot + (g * H + x) * len * E, ins[hl.at(x, g)] + off * E, len, E, dt, rop, premul);
        if (g != gm) sends[hl.at(hm, g)].push_back({g * H * len * E, H * len * E});
      }
    }
    if (valid(p1)) {
      const size_t len = len_of(p1);
      for (int x = 0; x < H; ++x)
        if (x != hm) sends[hl.at(x, gm)].push_back({oB(len) + x * len * E, len * E});
    }
    if (tt == 0) write_header(e, k, h, noextra);
    exchange(&sends, tt == 0 ? header_len(noextra) : 0, deadline_ns);
    if (tt == 0) check_headers(e, k, act_[0], act_);
    if (valid(p1)) {
      const size_t len = len_of(p1);
      for (int x = 0; x < H; ++x)
        srcs[x] = (x == hm ? slot : e->peer_slot(hl.at(x, gm), k)) + oB(len) + hm * len * E;
      reduce_buffers(data + p1 * q * E, srcs.data(), H, len, dt, rop, nullptr, H * G);
    }
    if (valid(p0)) {
      const size_t off = p0 * q, len = len_of(p0);
      uint8_t* next = e->my_slot(k + 1);
      for (int x = 0; x < H; ++x) {
        for (int g = 0; g < G; ++g)
          srcs[g] = g == gm ? (scaled ? slot + (g * H + x) * len * E : ins[hl.at(x, gm)] + off * E)
                            : e->peer_slot(hl.at(hm, g), k) + (gm * H + x) * len * E;
        reduce_buffers(next + oB(len) + x * len * E, srcs.data(), G, len, dt, first);
      }
    }
  }
}

// all_gather: stage 0, (h, g) sends its piece to its local peers and to (x, g) on every
// other host; stage 1, it passes the pieces of (x, g) it received on to its local peers.
void Group::run_allgather_hier(const Buffer& in, const std::vector<uint8_t*>& outs, const HostLayout& hl,
                               const OpHeader& h, int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int H = hl.H, G = hl.G, hm = hl.h, gm = hl.g;
  const size_t nbytes = in.count * element_size(in.dtype);
  const uint8_t* data = in.bytes_ptr();
  const std::vector<int64_t> noextra;
  // slot, for a piece of len bytes: [A: my piece | B: the pieces of (x, gm), x != hm, in host
  // order, at len * (1 + index)] (one contiguous range per local peer in stage 1)
  const size_t S = e->slot_bytes();
  const size_t P = std::max<size_t>(64, S / H / 64 * 64);
  auto oB = [&](int x, size_t len) { return len * (1 + (x < hm ? x : x - 1)); };
  const size_t npieces = std::max<size_t>(1, (nbytes + P - 1) / P);
  auto valid = [&](int64_t p) { return p >= 0 && p < static_cast<int64_t>(npieces); };
  auto len_of = [&](int64_t p) { return std::min(P, nbytes - std::min(nbytes, static_cast<size_t>(p) * P)); };
  auto out_copy = nbytes * act_.size() >= kStreamThreshold ? copy_stream : copy_plain;
  for (int64_t tt = 0; tt < static_cast<int64_t>(npieces) + 1; ++tt) {
    const uint64_t k = e->next_round();
    uint8_t* slot = e->my_slot(k);
    PeerRanges sends(size_);
    const int64_t p0 = tt, p1 = tt - 1;
    if (valid(p0)) {
      const size_t len = len_of(p0);
      if (len) std::memcpy(slot, data + p0 * P, len);
      for (int g = 0; g < G; ++g)
        if (g != gm) sends[hl.at(hm, g)].push_back({0, len});
      for (int x = 0; x < H; ++x)
        if (x != hm) sends[hl.at(x, gm)].push_back({0, len});
    }
    if (valid(p1)) {
      const size_t len = len_of(p1);
      for (int g = 0; g < G; ++g)
        if (g != gm) sends[hl.at(hm, g)].push_back({len, (H - 1) * len});
    }
    if (tt == 0) write_header(e, k, h, noextra);
    exchange(&sends, tt == 0 ? header_len(noextra) : 0, deadline_ns);
    if (tt == 0) check_headers(e, k, act_[0], act_);
    if (valid(p1)) {
      const size_t off = p1 * P, len = len_of(p1);
      for (int g = 0; g < G; ++g) {
        if (g == gm || !len) continue;
        for (int x = 0; x < H; ++x)
          if (x != hm) out_copy(outs[hl.at(x, g)] + off, e->peer_slot(hl.at(hm, g), k) + oB(x, len), len);
      }
    }
    if (valid(p0)) {
      const size_t off = p0 * P, len = len_of(p0);
      if (!len) continue;
      uint8_t* next = e->my_slot(k + 1);
      for (int g = 0; g < G; ++g) out_copy(outs[hl.at(hm, g)] + off, e->peer_slot(hl.at(hm, g), k), len);
      for (int x = 0; x < H; ++x) {
        if (x == hm) continue;
        const uint8_t* src = e->peer_slot(hl.at(x, gm), k);
        out_copy(outs[hl.at(x, gm)] + off, src, len);
        if (G > 1) std::memcpy(next + oB(x, len), src, len);
      }
    }
  }
}

// broadcast: the root (hr, gr) sends each piece to its local peers; then stripe g of the
// piece travels along the hosts hr, hr + 1, ... (mod H) through the ranks (., g), each of
// which also hands it to its local peers. Host i of the chain holds piece p after round
// p + i; the last one shares it in round p + H. Hosts of different sizes: as many stripes
// as the smallest host has ranks (a trainer host of 1 rank and rollout hosts of 8: one
// stripe, carried by local index 0, read in place by the other 7). With `star` and one
// piece: the star below instead (the caller picks it, core/collectives/broadcast.cpp).
void Group::run_broadcast_hier(const Buffer& t, int root, const HostLayout& hl, const OpHeader& h,
                               int64_t deadline_ns, bool star) {
  CollEngine* e = coll_.get();
  const int H = hl.H, hm = hl.h, gm = hl.g;
  const int Gs = hl.min_G;                               // stripes, carried by local indices < Gs
  const int Gh = static_cast<int>(hl.hosts[hm].size());  // ranks on my host
  const bool carrier = gm < Gs;
  int hr = 0, gr = 0;
  hl.where(root, &hr, &gr);
  const int pos = (hm - hr + H) % H;  // my host's place in the chain
  auto host_at = [&](int i) { return (hr + i) % H; };
  const size_t nbytes = t.count * element_size(t.dtype);
  uint8_t* data = t.bytes_ptr();
  const std::vector<int64_t> noextra;
  // slot: [A: the root's piece | F: my stripe of the piece I pass on (carriers)]
  const size_t S = e->slot_bytes();
  const size_t P = std::max<size_t>(64, S * Gs / (Gs + 1) / 64 * 64 - 64 * Gs);
  const size_t oF = P;
  const size_t npieces = std::max<size_t>(1, (nbytes + P - 1) / P);
  auto valid = [&](int64_t p) { return p >= 0 && p < static_cast<int64_t>(npieces); };
  auto len_of = [&](int64_t p) { return std::min(P, nbytes - std::min(nbytes, static_cast<size_t>(p) * P)); };
  auto stripe = [&](int64_t p, int g, size_t* off, size_t* len) {
    const size_t L = len_of(p), c = up64((L + Gs - 1) / Gs);
    *off = std::min(L, c * g);
    *len = std::min(L, c * (g + 1)) - *off;
  };
  auto out_copy = nbytes >= kStreamThreshold ? copy_stream : copy_plain;
  if (star && npieces == 1) {
    // The star, for one piece: the root sends stripe g straight to (h, g) on every other
    // host, which hands it to its local peers: 2 rounds and H - 1 copies over the root's
    // link (the chain: H + 1 rounds, one copy per link).
    const uint64_t k = e->next_round();
    PeerRanges sends(size_);
    if (rank_ == root) {
      if (nbytes) std::memcpy(e->my_slot(k), data, nbytes);
      for (int g = 0; g < Gh; ++g)
        if (g != gm) sends[hl.at(hm, g)].push_back({0, nbytes});
      for (int hh = 0; hh < H; ++hh) {
        if (hh == hm) continue;
        for (int g = 0; g < Gs; ++g) {
          size_t so, sl;
          stripe(0, g, &so, &sl);
          sends[hl.at(hh, g)].push_back({so, sl});
        }
      }
    }
    write_header(e, k, h, noextra);
    exchange(&sends, header_len(noextra), deadline_ns);
    check_headers(e, k, root, act_);
    // round 2: on the other hosts a carrier hands its stripe to its local peers
    size_t so = 0, sl = 0;
    if (hm == hr) {
      if (rank_ != root && nbytes) out_copy(data, e->peer_slot(root, k), nbytes);
    } else if (carrier) {
      stripe(0, gm, &so, &sl);
      if (sl) {
        const uint8_t* src = e->peer_slot(root, k) + so;
        std::memcpy(e->my_slot(k + 1) + oF, src, sl);
        out_copy(data + so, src, sl);
      }
    }
    const uint64_t k1 = e->next_round();
    PeerRanges shares(size_);
    if (sl)
      for (int g = 0; g < Gh; ++g)
        if (g != gm) shares[hl.at(hm, g)].push_back({oF, sl});
    exchange(&shares, 0, deadline_ns);
    if (hm != hr)
      for (int g = 0; g < Gs; ++g) {
        if (g == gm) continue;
        stripe(0, g, &so, &sl);
        if (sl) out_copy(data + so, e->peer_slot(hl.at(hm, g), k1) + oF, sl);
      }
    return;
  }
  for (int64_t tt = 0; tt < static_cast<int64_t>(npieces) + H; ++tt) {
    const uint64_t k = e->next_round();
    uint8_t* slot = e->my_slot(k);
    PeerRanges sends(size_);
    const int64_t pa = tt;            // the root's piece this round
    const int64_t pf = tt - pos - 1;  // the piece my host's carriers' F hold this round
    if (rank_ == root && valid(pa)) {
      const size_t len = len_of(pa);
      if (len) std::memcpy(slot, data + pa * P, len);
      for (int g = 0; g < Gh; ++g)
        if (g != gm) sends[hl.at(hm, g)].push_back({0, len});
    }
    if (carrier && valid(pf)) {
      size_t so, sl;
      stripe(pf, gm, &so, &sl);
      if (pos + 1 < H) sends[hl.at(host_at(pos + 1), gm)].push_back({oF, sl});
      if (pos > 0)
        for (int g = 0; g < Gh; ++g)
          if (g != gm) sends[hl.at(hm, g)].push_back({oF, sl});
    }
    if (tt == 0) write_header(e, k, h, noextra);
    exchange(&sends, tt == 0 ? header_len(noextra) : 0, deadline_ns);
    if (tt == 0) check_headers(e, k, root, act_);
    uint8_t* next = e->my_slot(k + 1);
    if (pos > 0 && valid(pf)) {  // the stripes of piece pf that my host's other carriers hold
      for (int g = 0; g < Gs; ++g) {
        if (g == gm) continue;
        size_t so, sl;
        stripe(pf, g, &so, &sl);
        if (sl) out_copy(data + pf * P + so, e->peer_slot(hl.at(hm, g), k) + oF, sl);
      }
    }
    // the piece that reached my host this round: a carrier's stripe goes into the next
    // round's F
    const int64_t pin = tt - pos;
    if (!valid(pin)) continue;
    size_t so = 0, sl = 0;
    if (carrier) stripe(pin, gm, &so, &sl);
    if (pos == 0) {
      if (rank_ != root) {
        const size_t len = len_of(pin);
        if (len) out_copy(data + pin * P, e->peer_slot(root, k), len);
      }
      if (sl) std::memcpy(next + oF, data + pin * P + so, sl);
    } else if (sl) {
      const uint8_t* src = e->peer_slot(hl.at(host_at(pos - 1), gm), k) + oF;
      std::memcpy(next + oF, src, sl);
      out_copy(data + pin * P + so, src, sl);
    }
  }
}

}  // namespace mooncake
