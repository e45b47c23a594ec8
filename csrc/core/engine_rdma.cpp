#ifdef MOONCAKE_WITH_RDMA
#include "core/engine_rdma.hpp"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "transport/shm.hpp"

namespace mooncake {

namespace {
constexpr int kRecvDepth = 64;             // receives kept posted per queue pair
constexpr uint64_t kRecvTag = 1ull << 63;  // wr_id of receives: tag | peer; of writes: peer

std::string ranks_str(const std::vector<int>& r) {
  std::string s;
  for (int x : r) s += " " + std::to_string(x);
  return s;
}
}  // namespace

RdmaEngine::RdmaEngine(int rank, int size, size_t slot_bytes, size_t hdr_cap, const std::vector<int>& members,
                       const std::string& device_spec, int gid_index,
                       const std::function<void(const std::string&, const std::string&)>& publish,
                       const std::function<std::string(int, const std::string&)>& fetch)
    : CollEngine(rank, size, slot_bytes, hdr_cap) {
  std::string dev;
  int port = 0;
  rdma_choose(rdma_devices(), device_spec, &dev, &port);
  const int npeers = static_cast<int>(members.size()) - 1;
  ctx_ = std::make_unique<RdmaContext>(dev, port, gid_index, std::max(64, npeers * (kRecvDepth + 32)));
  in_ = std::make_unique<RdmaMemory>(
      *ctx_, static_cast<size_t>(size) * 3 * stride() + 8 * static_cast<size_t>(size));
  out_ = std::make_unique<RdmaMemory>(*ctx_, 3 * stride() + 8 * 3);
  qps_.resize(size);
  remote_addr_.assign(size, 0);
  remote_rkey_.assign(size, 0);
  seen_.assign(size, 0);
  qpn_of_.assign(size, 0);
  // 1. a queue pair per peer, receives posted before anyone can write
  std::ostringstream mine;
  mine << reinterpret_cast<uint64_t>(in_->data()) << " " << in_->rkey();
  for (int j : members) {
    if (j == rank_) continue;
    qps_[j] = std::make_unique<RdmaQp>(*ctx_, 32, kRecvDepth);
    for (int i = 0; i < kRecvDepth; ++i) qps_[j]->post_recv(kRecvTag | static_cast<uint64_t>(j));
    qpn_of_[j] = qps_[j]->qpn();
    publish("qp/" + std::to_string(rank_) + "/" + std::to_string(j), qps_[j]->info().encode());
  }
  publish("mem/" + std::to_string(rank_), mine.str());
  // 2. connect to every peer's queue pair for this rank
  for (int j : members) {
    if (j == rank_) continue;
    qps_[j]->connect(RdmaQpInfo::decode(fetch(j, "qp/" + std::to_string(j) + "/" + std::to_string(rank_))));
    std::istringstream in(fetch(j, "mem/" + std::to_string(j)));
    in >> remote_addr_[j] >> remote_rkey_[j];
  }
  // 3. nobody writes before every queue pair is ready to receive
  publish("rtr/" + std::to_string(rank_), "1");
  for (int j : members)
    if (j != rank_) fetch(j, "rtr/" + std::to_string(j));
}

RdmaEngine::~RdmaEngine() {
  qps_.clear();
  in_.reset();
  out_.reset();
  ctx_.reset();
}

void RdmaEngine::handle_completions(int* sends_left, const char* what) {
  RdmaCompletion wc[16];
  int n = rdma_poll(*ctx_, wc, 16);
  for (int i = 0; i < n; ++i) {
    const bool recv = (wc[i].wr_id & kRecvTag) != 0;
    const int j = static_cast<int>(wc[i].wr_id & ~kRecvTag);
    if (j < 0 || j >= size_) continue;
    if (wc[i].status != 0) {
      // the queue pair to j is broken (peer gone, or its NIC unreachable)
      if (std::find(failed_.begin(), failed_.end(), j) == failed_.end()) failed_.push_back(j);
      if (!recv) --*sends_left;
      continue;
    }
    if (recv) {
      const uint64_t v = *in_ctr(j);
      seen_[j] = std::max(seen_[j], v);
      qps_[j]->post_recv(kRecvTag | static_cast<uint64_t>(j));
    } else {
      --*sends_left;
    }
  }
  (void)what;
}

void RdmaEngine::exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) {
  const uint64_t k = round_ + 1;
  const uint64_t next_epoch_base = epoch_base(epoch() + 1);
  *out_ctr(k) = k;
  const uint32_t imm = static_cast<uint32_t>(k);
  int sends_left = 0;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || !active_[j] || !qps_[j]) continue;
    RdmaQp& qp = *qps_[j];
    const uint64_t dst = remote_addr_[j] + (static_cast<uint64_t>(rank_) * 3 + k % 3) * stride();
    if (hdr_len > 0) qp.post_write(my_hdr(k), hdr_len, out_->lkey(), dst, remote_rkey_[j], j, false);
    if (sends) {
      for (const Range& r : (*sends)[j])
        if (r.len > 0)
          qp.post_write(my_slot(k) + r.off, r.len, out_->lkey(), dst + hdr_cap_ + r.off, remote_rkey_[j], j,
                        false);
    } else {
      qp.post_write(my_slot(k), slot_, out_->lkey(), dst + hdr_cap_, remote_rkey_[j], j, false);
    }
    qp.post_write(out_ctr(k), 8, out_->lkey(), remote_addr_[j] + ctr_off() + 8 * static_cast<uint64_t>(rank_),
                  remote_rkey_[j], j, true, &imm);
    sends_left++;
  }
  auto missing = [&]() {
    std::vector<int> m;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && active_[j] && (seen_[j] < k || delayed(j))) m.push_back(j);
    return m;
  };
  int64_t next_probe = now_ns() + 20000000;
  int idle = 0;
  while (true) {
    handle_completions(&sends_left, "exchange");
    bool here = true;
    for (int j = 0; j < size_; ++j) {
      if (j == rank_ || !active_[j]) continue;
      if (seen_[j] >= next_epoch_base) throw EpochAhead();
      if (seen_[j] < k || delayed(j)) here = false;
    }
    if (!failed_.empty()) {
      std::vector<int> f = failed_;
      throw PeerFailure("rdma exchange: lost the queue pair to rank(s)" + ranks_str(f), f, false,
                        "connection lost");
    }
    if (here && sends_left == 0) break;
    const int64_t now = now_ns();
    if (aborted()) throw EngineAborted();
    if (probe_ && now >= next_probe) {
      next_probe = now + 20000000;
      PeersGone gone = probe_(missing(), k);
      if (!gone.empty()) throw PeerFailure(gone_msg("rdma exchange", gone), gone.ranks, false, gone.reason);
    }
    if (now >= deadline_ns) {
      std::vector<int> m = missing();
      throw PeerFailure("rdma exchange: timed out waiting for rank(s)" + ranks_str(m), m, true);
    }
    // poll hard for a moment, then back off to short sleeps (no completion channel yet)
    if (++idle > 2000) {
      timespec ts{0, 20000};
      nanosleep(&ts, nullptr);
    } else {
      cpu_relax();
    }
  }
  round_ = k;
}

}  // namespace mooncake
#endif  // MOONCAKE_WITH_RDMA
