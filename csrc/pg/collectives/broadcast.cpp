// Collective body of MooncakeBackend (runs with the engine held, pg/backend.hpp):
// broadcast: the root's tensor in slot-sized pieces, one round each.
#include <algorithm>
#include <cstring>

#include "pg/backend.hpp"
#include "pg/collectives/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

namespace {
constexpr size_t kHierBroadcastMinBytes = 256 << 10;
}  // namespace

void MooncakeBackend::run_broadcast(at::Tensor& t, int root, int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int r = rank_;
  require_active_root(root, "broadcast");
  const size_t nbytes = t.numel() * t.element_size();
  uint8_t* data = static_cast<uint8_t*>(t.data_ptr());
  OpHeader h{};
  h.op = OP_BROADCAST;
  h.dtype = static_cast<int32_t>(t.scalar_type());
  h.root = root;
  h.count = t.numel();
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  HostLayout hl;
  // The chain takes H + 1 rounds at least: below a few slots one round from the root is
  // faster. It pays where the root's link would carry more than one copy: more ranks
  // outside the root's host than one.
  if (nbytes >= kHierBroadcastMinBytes && run_hierarchical(nbytes, &hl, /*uneven=*/true)) {
    int hr = 0, gr = 0;
    hl.where(root, &hr, &gr);
    if (static_cast<int>(act_.size() - hl.hosts[hr].size()) >= 2)
      return run_broadcast_hier(t, root, hl, h, deadline_ns);
  }
  const size_t S = e->slot_bytes();
  const size_t npieces = std::max<size_t>(1, (nbytes + S - 1) / S);
  auto out_copy = nbytes >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * S, len = std::min(S, nbytes - std::min(nbytes, off));
    PeerRanges sends(size_);
    if (r == root) {
      if (len) std::memcpy(e->my_slot(k), data + off, len);
      for (int j : act_)
        if (j != r) sends[j].push_back({0, len});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, deadline_ns);
    if (p == 0) check_headers(e, k, root, act_);
    if (r != root && len) out_copy(data + off, e->peer_slot(root, k), len);
  }
}

}  // namespace mooncake
