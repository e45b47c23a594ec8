// Collective body of the group core (runs with the engine held, core/group.hpp):
// all_gather and gather: every rank's input in slot-sized pieces, one round each.
#include <algorithm>
#include <cstring>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/copy.hpp"

namespace mooncake {

void Group::allgather(const Buffer& in, const std::vector<uint8_t*>& outs, int64_t deadline_ns) {
  run_allgather(in, outs, OP_ALLGATHER, -1, deadline_ns);
}

void Group::gather(const Buffer& in, const std::vector<uint8_t*>& outs, int root, int64_t deadline_ns) {
  run_allgather(in, outs, OP_GATHER, root, deadline_ns);
}

void Group::run_allgather(const Buffer& in, const std::vector<uint8_t*>& outs, OpCode opcode, int root,
                          int64_t deadline_ns) {
  // opcode OP_ALLGATHER: outs[j] for every seat j; OP_GATHER: outs only on root.
  // Output slots of inactive seats are left untouched.
  CollEngine* e = coll_.get();
  const int r = rank_;
  if (opcode == OP_GATHER) require_active_root(root, "gather");
  const size_t nbytes = in.count * element_size(in.dtype);
  const uint8_t* data = in.bytes_ptr();
  OpHeader h{};
  h.op = opcode;
  h.dtype = static_cast<int32_t>(in.dtype);
  h.root = opcode == OP_GATHER ? root : -1;
  h.count = in.count;
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  HostLayout hl;
  if (opcode == OP_ALLGATHER && run_hierarchical(nbytes * act_.size(), &hl) && hl.G >= 2)
    return run_allgather_hier(in, outs, hl, h, deadline_ns);
  const size_t S = e->slot_bytes();
  const size_t npieces = std::max<size_t>(1, (nbytes + S - 1) / S);
  const bool receiver = opcode == OP_ALLGATHER || r == root;
  auto out_copy = nbytes * act_.size() >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * S, len = std::min(S, nbytes - std::min(nbytes, off));
    if (len) std::memcpy(e->my_slot(k), data + off, len);
    PeerRanges sends(size_);
    for (int j : act_)
      if (j != r && (opcode == OP_ALLGATHER || j == root)) sends[j].push_back({0, len});
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, deadline_ns);
    if (p == 0) check_headers(e, k, opcode == OP_GATHER ? root : act_[0], act_);
    if (receiver && len)
      for (int j : act_) out_copy(outs[j] + off, e->peer_slot(j, k), len);
  }
}

}  // namespace mooncake
