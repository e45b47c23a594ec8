// Collective body of the group core (runs with the engine held, core/group.hpp):
// broadcast: the root's tensor in slot-sized pieces, one round each.
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

namespace {
constexpr size_t kHierBroadcastMinBytes = 256 << 10;
// Below that, the star (2 rounds; H - 1 copies over the root's link) against one round from
// the root (a copy for every rank outside the root's host): taken where it saves the root's
// link this many bytes. The crossover measured at 4 hosts x 2 ranks, 2 Gbit/s: one round
// is faster at 64 KiB (192 KiB saved), the star at 128 KiB (384 KiB saved; RESULTS.md,
// "Across hosts").
constexpr size_t kStarMinSavedBytes = 256 << 10;
}  // namespace

void Group::broadcast(const Buffer& t, int root, int64_t deadline_ns) {
  CollEngine* e = coll_.get();
  const int r = rank_;
  require_active_root(root, "broadcast");
  const size_t nbytes = t.count * element_size(t.dtype);
  uint8_t* data = t.bytes_ptr();
  OpHeader h{};
  h.op = OP_BROADCAST;
  h.dtype = static_cast<int32_t>(t.dtype);
  h.root = root;
  h.count = t.count;
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  HostLayout hl;
  // The chain takes H + 1 rounds at least: below a few slots one round from the root is
  // faster. It pays where the root's link would carry more than one copy: more ranks
  // outside the root's host than one.
  if (run_hierarchical(nbytes, &hl, /*uneven=*/true)) {
    int hr = 0, gr = 0;
    hl.where(root, &hr, &gr);
    const size_t outside = act_.size() - hl.hosts[hr].size();
    if (nbytes >= kHierBroadcastMinBytes && outside >= 2)
      return run_broadcast_hier(t, root, hl, h, deadline_ns, /*star=*/false);
    if ((outside - (hl.H - 1)) * nbytes >= kStarMinSavedBytes)
      return run_broadcast_hier(t, root, hl, h, deadline_ns, /*star=*/true);
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
