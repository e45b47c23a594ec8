// Round-based collective engine and point-to-point channels over shm or TCP.
//
// A collective is a sequence of rounds. In round k every rank writes into its slot
// (buffer k % 3) and header, then calls exchange(): a full barrier after which every
// peer's slot of round k may be read. Slot contents of round k stay readable during
// round k+1 and a rank may write its slot of round k+1 while still in round k (after
// exchange(k)); three buffers make both safe (a writer of round k+3 has seen every rank
// arrive at round k+2, so all reads of round k and k+1 data are done).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "transport/shm.hpp"

namespace mooncake {

struct Range {
  size_t off;
  size_t len;
};
using PeerRanges = std::vector<std::vector<Range>>;  // per peer, ranges of my slot it reads

// Direct bytes (TCP peers): after its slot ranges a frame may carry bytes that go from
// the sender's buffer straight into the receiver's, through no slot, so one round may
// move more than a slot (fewer rounds, each a barrier, and two copies fewer per byte).
struct DirectSrc {
  const uint8_t* ptr = nullptr;
  size_t len = 0;
};
struct DirectDst {
  uint8_t* ptr = nullptr;
  size_t cap = 0;
};

// Peers that died (process gone, connection lost, heartbeats stopped) or did not take part
// within the op timeout (timed_out: they may be alive). `reason` goes into the membership
// record that declares them failed.
struct PeerFailure : std::runtime_error {
  std::vector<int> ranks;
  bool timed_out;
  std::string reason;
  PeerFailure(const std::string& msg, std::vector<int> r, bool t, std::string why = "")
      : std::runtime_error(msg),
        ranks(std::move(r)),
        timed_out(t),
        reason(!why.empty() ? std::move(why)
               : t          ? "op timeout"
                            : "process died") {}
};

// A peer is already in a later membership epoch: this rank must catch up (read the
// agreed records) before it can go on.
struct EpochAhead : std::runtime_error {
  EpochAhead() : std::runtime_error("a peer moved to a later membership epoch") {}
};

// Rounds of epoch e are numbered from epoch_base(e) + 1.
constexpr int kEpochShift = 40;
inline uint64_t epoch_base(uint64_t epoch) { return epoch << kEpochShift; }

// Which of the peers waited for are known gone, and why (a short phrase, no ';').
struct PeersGone {
  std::vector<int> ranks;
  std::string reason;
  bool empty() const { return ranks.empty(); }
};
// "<engine>: rank(s) 2 3 gone (<reason>)"
std::string gone_msg(const char* engine, const PeersGone& gone);
// Returns which of `missing` are known gone while this rank waits for their part of `round`
// (epoch_base(epoch) + round within the epoch).
using LivenessProbe = std::function<PeersGone(const std::vector<int>& missing, uint64_t round)>;

// Called by exchange() with a peer whose part of the round is in (its slot of the round
// readable in full), but only once every active peer's header of the round is in
// (peer_hdr): the caller may check the headers and read that peer's slot while other
// peers' frames are still on the wire. Each peer at most once, before exchange()
// returns; peers never passed to it (engines that cannot tell, a host's peers that arrived
// after the last frame) are the caller's after that. It must not throw.
using ArrivalHook = std::function<void(int peer)>;

class CollEngine {
 public:
  CollEngine(int rank, int size, size_t slot_bytes, size_t hdr_cap)
      : rank_(rank), size_(size), slot_(slot_bytes), hdr_cap_(hdr_cap) {}
  virtual ~CollEngine() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slot_bytes() const { return slot_; }
  size_t hdr_cap() const { return hdr_cap_; }
  uint64_t next_round() const { return round_ + 1; }
  uint64_t epoch() const { return round_ >> kEpochShift; }
  // Ranks taking part (others are neither waited for nor sent to).
  virtual void set_active(const std::vector<char>& active) { active_ = active; }
  bool is_active(int r) const { return active_[r] != 0; }
  virtual void set_liveness(LivenessProbe p) { probe_ = std::move(p); }
  // Starts membership epoch `e` (rounds restart at epoch_base(e)).
  virtual void start_epoch(uint64_t e) { round_ = epoch_base(e); }

  virtual uint8_t* my_slot(uint64_t k) = 0;
  virtual uint8_t* my_hdr(uint64_t k) = 0;
  virtual const uint8_t* peer_slot(int j, uint64_t k) = 0;
  virtual const uint8_t* peer_hdr(int j, uint64_t k) = 0;
  // Completes round next_round(). `sends` (may be null: whole slot not needed by anyone)
  // lists per peer which ranges of my slot it reads; shm ignores it.
  virtual void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) = 0;
  virtual const char* name() const = 0;
  // Whether this engine moves direct bytes at all (its kind: the same on every rank of a
  // group), and to peer j.
  virtual bool direct() const { return false; }
  virtual bool direct_to(int) const { return false; }
  // Per peer: the direct bytes this rank sends it in the next exchange() (which consumes
  // them). Only for peers with direct_to().
  virtual void set_direct_src(std::vector<DirectSrc>) {}
  // Per peer: where its direct bytes land, each frame's after the last, until the next
  // call (empty: none; direct bytes then make the frame malformed). Set before the
  // exchange() whose frames carry them: a peer never runs a round ahead within an epoch.
  virtual void set_direct_dst(std::vector<DirectDst>) {}
  // The ArrivalHook of the next exchange() (which consumes it); engines that cannot tell
  // when a peer's part is in ignore it.
  virtual void set_arrival_hook(ArrivalHook) {}
  // Tests only (MOONCAKE_FAULT_DELAY): peer j's part of every round counts as not arrived
  // until now_ns() reaches until_ns, as if it were still in flight (liveness probes go on).
  virtual void delay_peer(int j, int64_t until_ns) {
    if (delay_until_.empty()) delay_until_.assign(size_, 0);
    delay_until_[j] = until_ns;
  }
  // Makes a blocked or later exchange() throw promptly (shutdown / abort).
  void request_abort() {
    abort_.store(true);
    wake();
  }
  bool aborted() const { return abort_.load(std::memory_order_relaxed); }

 protected:
  virtual void wake() {}
  int rank_, size_;
  size_t slot_, hdr_cap_;
  uint64_t round_ = 0;
  std::atomic<bool> abort_{false};
  std::vector<char> active_;
  LivenessProbe probe_;
  std::vector<int64_t> delay_until_;  // delay_peer(); empty: none
  bool delayed(int j) const { return !delay_until_.empty() && now_ns() < delay_until_[j]; }
};

// exchange() was interrupted by request_abort().
struct EngineAborted : std::runtime_error {
  EngineAborted() : std::runtime_error("the process group is shutting down") {}
};

// Point-to-point byte streams, one per ordered pair, progressed without blocking.
class P2PChannel {
 public:
  virtual ~P2PChannel() = default;
  virtual size_t write_some(int peer, const void* buf, size_t n) = 0;
  virtual size_t read_some(int peer, void* buf, size_t n) = 0;
  // Token to pass to wait(): read before scanning for progress.
  virtual uint32_t wait_token() = 0;
  // Sleeps until a peer moved data or notify() was called (or timeout). want_read[j]:
  // something waits for bytes from peer j (tcp polls only those sockets).
  virtual void wait(uint32_t token, int64_t timeout_ns, const std::vector<char>& want_read) = 0;
  virtual void notify() = 0;
};

// ---- shared memory ----------------------------------------------------------------
struct ShmLayout {
  int size;
  size_t slot, hdr_cap, ring;
  size_t coll_ctrl, coll_data, p2p_ctrl, p2p_data, total;
  ShmLayout(int size, size_t slot, size_t hdr_cap, size_t ring);
  size_t buf_stride() const { return hdr_cap + slot; }
};

class ShmEngine : public CollEngine {
 public:
  // `seg` is mapped by every local rank; `spin` enables brief spinning before sleeping.
  ShmEngine(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout, bool spin);
  uint8_t* my_slot(uint64_t k) override { return slot_ptr(rank_, k); }
  uint8_t* my_hdr(uint64_t k) override { return hdr_ptr(rank_, k); }
  const uint8_t* peer_slot(int j, uint64_t k) override { return slot_ptr(j, k); }
  const uint8_t* peer_hdr(int j, uint64_t k) override { return hdr_ptr(j, k); }
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) override;
  const char* name() const override { return "shm"; }
  void start_epoch(uint64_t e) override;
  // exchange() in two halves (HybridEngine): tell the peers this rank arrived at
  // next_round(), then wait until they all did (and complete the round).
  void arrive();
  void wait_arrived(int64_t deadline_ns);
  // Whether every active peer has arrived at the round after the last completed one
  // (never blocks or throws; wait_arrived() reports a peer ahead in epoch).
  bool arrived_now();

 protected:
  void wake() override { futex_wake_all(bell()); }

 private:
  uint8_t* hdr_ptr(int r, uint64_t k) {
    return base_ + layout_.coll_data + ((k % 3) * size_ + r) * layout_.buf_stride();
  }
  uint8_t* slot_ptr(int r, uint64_t k) { return hdr_ptr(r, k) + layout_.hdr_cap; }
  std::atomic<uint64_t>* arrived(int r) {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + layout_.coll_ctrl + 64 * (r + 1));
  }
  std::atomic<uint32_t>* bell() {
    return reinterpret_cast<std::atomic<uint32_t>*>(base_ + layout_.coll_ctrl);
  }
  std::atomic<uint32_t>* sleepers() { return bell() + 1; }

  std::shared_ptr<ShmSegment> seg_;
  ShmLayout layout_;
  uint8_t* base_;
  bool spin_;
  // How long wait_arrived() spins before it sleeps; adapts to the waits seen (engine.cpp).
  static constexpr int64_t kSpinMaxNs = 2000000, kSpinMinNs = 5000;
  int64_t spin_ns_ = kSpinMaxNs;
};

class ShmP2P : public P2PChannel {
 public:
  ShmP2P(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout);
  size_t write_some(int peer, const void* buf, size_t n) override;
  size_t read_some(int peer, void* buf, size_t n) override;
  uint32_t wait_token() override { return bell(rank_)->load(std::memory_order_acquire); }
  void wait(uint32_t token, int64_t timeout_ns, const std::vector<char>& want_read) override;
  void notify() override { ring_bell(rank_); }

 private:
  struct Ring {
    std::atomic<uint64_t>* head;  // bytes written (producer)
    std::atomic<uint64_t>* tail;  // bytes read (consumer)
    uint8_t* data;
  };
  Ring ring(int src, int dst);
  std::atomic<uint32_t>* bell(int r);
  std::atomic<uint32_t>* sleeping(int r) { return bell(r) + 1; }
  void ring_bell(int r);

  int rank_, size_;
  std::shared_ptr<ShmSegment> seg_;
  ShmLayout layout_;
  uint8_t* base_;
};

// ---- TCP ----------------------------------------------------------------------------
class TcpEngine : public CollEngine {
 public:
  // fds[j]: connected socket to peer j (fds[rank] unused, -1: no peer); takes ownership.
  // mine: this rank's 3 buffers (header then slot each) when they live elsewhere (the
  // shared segment of a HybridEngine); empty: its own.
  TcpEngine(int rank, int size, size_t slot_bytes, size_t hdr_cap, std::vector<int> fds,
            std::vector<uint8_t*> mine = {});
  ~TcpEngine() override;
  uint8_t* my_slot(uint64_t k) override { return mine_ptr_[k % 3] + hdr_cap_; }
  uint8_t* my_hdr(uint64_t k) override { return mine_ptr_[k % 3]; }
  const uint8_t* peer_slot(int j, uint64_t k) override {
    return j == rank_ ? my_slot(k) : peers_[j][k % 3].data() + hdr_cap_;
  }
  const uint8_t* peer_hdr(int j, uint64_t k) override {
    return j == rank_ ? my_hdr(k) : peers_[j][k % 3].data();
  }
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) override;
  const char* name() const override { return "tcp"; }
  bool direct() const override { return true; }
  bool direct_to(int j) const override { return j != rank_; }
  void set_direct_src(std::vector<DirectSrc> src) override { direct_src_ = std::move(src); }
  void set_direct_dst(std::vector<DirectDst> dst) override {
    direct_dst_ = std::move(dst);
    direct_at_.assign(size_, 0);
  }
  void set_arrival_hook(ArrivalHook hook) override { set_arrival_hook(std::move(hook), nullptr, {}); }
  // others (ranks this engine does not carry, HybridEngine's local peers): passed to the
  // hook first, once others_in() says they are all in as well.
  void set_arrival_hook(ArrivalHook hook, std::function<bool()> others_in, std::vector<int> others) {
    hook_ = std::move(hook);
    hook_others_in_ = std::move(others_in);
    hook_others_ = std::move(others);
  }

 private:
  struct In;
  ArrivalHook hook_;  // for the next exchange()
  std::function<bool()> hook_others_in_;
  std::vector<int> hook_others_;
  std::vector<DirectSrc> direct_src_;  // for the next exchange()
  std::vector<DirectDst> direct_dst_;
  std::vector<size_t> direct_at_;  // per peer: direct bytes received since set_direct_dst()
  std::vector<size_t> owe_;        // per peer: bytes of a half-sent frame still to send (as zeros)
  // Sends owe_'s zeros while the peers read them (a peer still in that round waits for
  // them); stops when none moved for a while and leaves the rest to the next exchange().
  void flush_owed();
  std::vector<std::unique_ptr<In>> in_;  // per peer, kept across rounds (frames may run ahead)
  std::vector<int> fds_;
  std::vector<std::vector<uint8_t>> mine_;                // 3 buffers (when not given)
  std::vector<uint8_t*> mine_ptr_;                        // the 3 buffers in use
  std::vector<std::vector<std::vector<uint8_t>>> peers_;  // [peer][3]
};

// ---- shared memory inside a host, TCP between hosts ------------------------------------
// A group that spans hosts: each rank's slots live in its host's shared segment, so the
// ranks of a host read each other's slots in place (no socket, no copy), and a TCP frame
// carries to a rank of another host the ranges it reads. A round is complete when every
// active peer of this host arrived (shm) and every active peer elsewhere's frame is in.
class HybridEngine : public CollEngine {
 public:
  // local[j]: rank j shares this host (and `seg`); fds[j]: socket to rank j (other hosts).
  HybridEngine(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout, bool spin,
               std::vector<char> local, std::vector<int> fds);
  uint8_t* my_slot(uint64_t k) override { return shm_.my_slot(k); }
  uint8_t* my_hdr(uint64_t k) override { return shm_.my_hdr(k); }
  const uint8_t* peer_slot(int j, uint64_t k) override {
    return local_[j] ? shm_.peer_slot(j, k) : tcp_->peer_slot(j, k);
  }
  const uint8_t* peer_hdr(int j, uint64_t k) override {
    return local_[j] ? shm_.peer_hdr(j, k) : tcp_->peer_hdr(j, k);
  }
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) override;
  const char* name() const override { return "shm+tcp"; }
  bool direct() const override { return true; }
  bool direct_to(int j) const override { return j != rank_ && !local_[j]; }
  void set_direct_src(std::vector<DirectSrc> src) override { tcp_->set_direct_src(std::move(src)); }
  void set_direct_dst(std::vector<DirectDst> dst) override { tcp_->set_direct_dst(std::move(dst)); }
  void set_arrival_hook(ArrivalHook hook) override { hook_ = std::move(hook); }
  void start_epoch(uint64_t e) override;
  void set_active(const std::vector<char>& active) override;
  void set_liveness(LivenessProbe p) override;
  void delay_peer(int j, int64_t until_ns) override {
    shm_.delay_peer(j, until_ns);
    tcp_->delay_peer(j, until_ns);
  }

 protected:
  void wake() override {
    shm_.request_abort();
    tcp_->request_abort();
  }

 private:
  ShmEngine shm_;
  std::vector<char> local_;
  std::unique_ptr<TcpEngine> tcp_;
  ArrivalHook hook_;  // for the next exchange()
};

class TcpP2P : public P2PChannel {
 public:
  TcpP2P(int rank, int size, std::vector<int> fds);
  ~TcpP2P() override;
  size_t write_some(int peer, const void* buf, size_t n) override;
  size_t read_some(int peer, void* buf, size_t n) override;
  uint32_t wait_token() override { return 0; }
  void wait(uint32_t token, int64_t timeout_ns, const std::vector<char>& want_read) override;
  void notify() override;

 private:
  int rank_, size_;
  std::vector<int> fds_;
  std::vector<char> want_write_;
  int wake_fd_ = -1;
};

}  // namespace mooncake
