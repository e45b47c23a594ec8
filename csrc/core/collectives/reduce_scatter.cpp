// Collective body of the group core (runs with the engine held, core/group.hpp):
// reduce_scatter: one sub-slot per seat, one round per piece; each rank
// reduces the pieces addressed to it.
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

void Group::reduce_scatter(const std::vector<const uint8_t*>& ins, const Buffer& out, RedOp rop,
                           double premul, int64_t deadline_ns) {
  // Chunk j of every active rank's input is reduced into active rank j's output; chunks of
  // inactive seats are not computed.
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  const auto dt = out.dtype;
  const size_t E = element_size(out.dtype);
  const size_t n = out.count;
  uint8_t* data = out.bytes_ptr();
  OpHeader h{};
  h.op = OP_REDUCE_SCATTER;
  h.dtype = static_cast<int32_t>(dt);
  h.redop = static_cast<int32_t>(rop);
  h.root = -1;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  HostLayout hl;
  if (run_hierarchical(n * E * act_.size(), &hl) && hl.G >= 2)
    return run_reduce_scatter_hier(ins, out, rop, premul, hl, h, deadline_ns);
  const size_t S = e->slot_bytes();
  size_t q = S / W / 64 * 64 / E;  // elements per sub-slot (one per seat)
  if (q == 0) q = std::max<size_t>(1, S / W / E);
  const size_t npieces = std::max<size_t>(1, (n + q - 1) / q);
  const int A = static_cast<int>(act_.size());
  std::vector<const void*> srcs(A);
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * q, len = std::min(q, n - std::min(n, off));
    PeerRanges sends(W);
    for (int j : act_) {
      if (len) copy_in(e->my_slot(k) + j * q * E, ins[j] + off * E, len, E, dt, rop, premul);
      if (j != r) sends[j].push_back({j * q * E, len * E});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, deadline_ns);
    if (p == 0) check_headers(e, k, act_[0], act_);
    if (len) {
      for (int i = 0; i < A; ++i) srcs[i] = e->peer_slot(act_[i], k) + r * q * E;
      reduce_buffers(data + off * E, srcs.data(), A, len, dt, rop);
    }
  }
}

}  // namespace mooncake
