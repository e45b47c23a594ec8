// Collective body of the group core (runs with the engine held, core/group.hpp):
// scatter: the root's inputs in one sub-slot per seat, one round per piece.
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

void Group::scatter(const std::vector<const uint8_t*>& ins, const Buffer& out, int root,
                    int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  require_active_root(root, "scatter");
  const size_t E = element_size(out.dtype);
  const size_t n = out.count;
  uint8_t* data = out.bytes_ptr();
  OpHeader h{};
  h.op = OP_SCATTER;
  h.dtype = static_cast<int32_t>(out.dtype);
  h.root = root;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  size_t q = S / W / 64 * 64 / E;
  if (q == 0) q = std::max<size_t>(1, S / W / E);
  const size_t npieces = std::max<size_t>(1, (n + q - 1) / q);
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * q, len = std::min(q, n - std::min(n, off));
    PeerRanges sends(W);
    if (r == root) {
      for (int j : act_) {
        if (len) std::memcpy(e->my_slot(k) + j * q * E, ins[j] + off * E, len * E);
        if (j != r) sends[j].push_back({j * q * E, len * E});
      }
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, deadline_ns);
    if (p == 0) check_headers(e, k, root, act_);
    if (len) std::memcpy(data + off * E, e->peer_slot(root, k) + r * q * E, len * E);
  }
}

}  // namespace mooncake
