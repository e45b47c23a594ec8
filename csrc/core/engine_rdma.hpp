// Round engine over RDMA (RC queue pairs, one per peer). Built only with
// MOONCAKE_WITH_RDMA. Point-to-point byte streams stay on TCP (TcpP2P).
//
// Memory: `in_` holds, per peer j, three round buffers (header + slot, like TcpEngine's
// peers_) that j writes into with RDMA writes, and one 8-byte arrival counter per peer
// at its end. `out_` holds this rank's three round buffers and three counter sources.
// Round k: for every active peer, RDMA-write the header and the ranges it reads into its
// buffer (k % 3) for this rank, then an 8-byte write with immediate of k into this rank's
// counter there; on an RC queue pair the receive completion of that last write means every
// earlier write of the round has landed. exchange() returns when every peer's counter
// reached k and this rank's own writes completed (so its buffer may be rewritten).
#pragma once
#ifdef MOONCAKE_WITH_RDMA
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/engine.hpp"
#include "transport/rdma/verbs.hpp"

namespace mooncake {

class RdmaEngine : public CollEngine {
 public:
  // Builds queue pairs to `members` (ascending, this rank among them) and connects them,
  // exchanging queue pair numbers and buffer addresses through `publish`/`fetch` (the
  // rendezvous store: publish(key, value), fetch(rank, key) blocks until rank published).
  RdmaEngine(int rank, int size, size_t slot_bytes, size_t hdr_cap, const std::vector<int>& members,
             const std::string& device_spec, int gid_index,
             const std::function<void(const std::string&, const std::string&)>& publish,
             const std::function<std::string(int, const std::string&)>& fetch);
  ~RdmaEngine() override;
  uint8_t* my_slot(uint64_t k) override { return my_hdr(k) + hdr_cap_; }
  uint8_t* my_hdr(uint64_t k) override { return out_->data() + (k % 3) * stride(); }
  const uint8_t* peer_slot(int j, uint64_t k) override { return peer_hdr(j, k) + hdr_cap_; }
  const uint8_t* peer_hdr(int j, uint64_t k) override {
    return j == rank_ ? my_hdr(k) : in_->data() + (static_cast<size_t>(j) * 3 + k % 3) * stride();
  }
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) override;
  const char* name() const override { return "rdma"; }
  const std::string& device() const { return ctx_->device(); }

 private:
  size_t stride() const { return hdr_cap_ + slot_; }
  size_t ctr_off() const { return static_cast<size_t>(size_) * 3 * stride(); }
  volatile uint64_t* in_ctr(int j) {
    return reinterpret_cast<volatile uint64_t*>(in_->data() + ctr_off() + 8 * j);
  }
  uint64_t* out_ctr(uint64_t k) {
    return reinterpret_cast<uint64_t*>(out_->data() + 3 * stride() + 8 * (k % 3));
  }
  void handle_completions(int* sends_left, const char* what);

  std::unique_ptr<RdmaContext> ctx_;
  std::unique_ptr<RdmaMemory> in_, out_;
  std::vector<std::unique_ptr<RdmaQp>> qps_;  // per peer (null for self and non-members)
  std::vector<uint64_t> remote_addr_;         // base of peer j's in_ area
  std::vector<uint32_t> remote_rkey_;
  std::vector<uint64_t> seen_;  // highest round counter seen from peer j
  std::vector<uint32_t> qpn_of_;
  std::vector<int> failed_;  // peers whose queue pair broke
};

}  // namespace mooncake
#endif  // MOONCAKE_WITH_RDMA
