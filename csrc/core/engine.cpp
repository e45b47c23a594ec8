#include "core/engine.hpp"

#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "transport/tcp.hpp"

namespace mooncake {

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

ShmLayout::ShmLayout(int size_, size_t slot_, size_t hdr_cap_, size_t ring_)
    : size(size_), slot(slot_), hdr_cap(hdr_cap_), ring(ring_) {
  coll_ctrl = 0;  // line 0: bell + sleepers; line r+1: arrived[r]
  coll_data = align_up(64 * (size + 1), 4096);
  p2p_ctrl = align_up(coll_data + 3 * size * buf_stride(), 4096);
  // per rank: a bell line; per ordered pair: head line + tail line
  p2p_data = align_up(p2p_ctrl + 64 * size + 128 * size * size, 4096);
  total = align_up(p2p_data + ring * size * size, 4096);
}

static std::string missing_msg(const char* what, const std::vector<int>& missing) {
  std::string w(what);
  std::string s =
      w.back() == ':' ? w.substr(0, w.size() - 1) + " rank(s)" : w + ": timed out waiting for rank(s)";
  for (int r : missing) s += " " + std::to_string(r);
  return s;
}

std::string gone_msg(const char* engine, const PeersGone& gone) {
  std::string s = std::string(engine) + ": rank(s)";
  for (int r : gone.ranks) s += " " + std::to_string(r);
  return s + " gone (" + gone.reason + ")";
}

// ---- ShmEngine ---------------------------------------------------------------------
ShmEngine::ShmEngine(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout, bool spin)
    : CollEngine(rank, size, layout.slot, layout.hdr_cap),
      seg_(std::move(seg)),
      layout_(layout),
      base_(seg_->data()),
      spin_(spin) {
  round_ = arrived(rank)->load();
}

void ShmEngine::start_epoch(uint64_t e) {
  CollEngine::start_epoch(e);
  arrived(rank_)->store(round_, std::memory_order_seq_cst);
  bell()->fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(bell());
}

void ShmEngine::exchange(const PeerRanges*, size_t, int64_t deadline_ns) {
  arrive();
  wait_arrived(deadline_ns);
}

void ShmEngine::arrive() {
  arrived(rank_)->store(round_ + 1, std::memory_order_seq_cst);
  bell()->fetch_add(1, std::memory_order_seq_cst);
  if (sleepers()->load(std::memory_order_seq_cst) > 0) futex_wake_all(bell());
}

bool ShmEngine::arrived_now() {
  const uint64_t k = round_ + 1;
  const uint64_t next_epoch_base = epoch_base(epoch() + 1);
  for (int j = 0; j < size_; ++j) {
    if (!active_[j]) continue;
    const uint64_t a = arrived(j)->load(std::memory_order_acquire);
    if (a < k || a >= next_epoch_base || delayed(j)) return false;
  }
  return true;
}

void ShmEngine::wait_arrived(int64_t deadline_ns) {
  const uint64_t k = round_ + 1;

  // A peer's counter in a later epoch means it agreed on a membership change we have
  // not seen yet.
  const uint64_t next_epoch_base = epoch_base(epoch() + 1);
  auto all_here = [&]() {
    for (int j = 0; j < size_; ++j) {
      if (!active_[j]) continue;
      uint64_t a = arrived(j)->load(std::memory_order_acquire);
      if (a < k || delayed(j)) return false;
      if (a >= next_epoch_base) throw EpochAhead();  // base(e+1) itself marks a new epoch
    }
    return true;
  };
  auto missing = [&]() {
    std::vector<int> m;
    for (int j = 0; j < size_; ++j)
      if (active_[j] && (arrived(j)->load() < k || delayed(j))) m.push_back(j);
    return m;
  };
  if (!all_here()) {
    const int64_t start = now_ns();
    if (spin_ && spin_ns_ > 0) {
      // Waking a futex sleeper costs ~150 us on small VMs: spin first when every local
      // rank has a CPU of its own, giving the CPU away every 20 us in case the rank we
      // wait for (or anything else) is queued behind us on it.
      const int64_t spin_until = start + spin_ns_;
      int64_t next_yield = start + 20000;
      for (int i = 1; !all_here(); ++i) {
        cpu_relax();
        if ((i & 255) == 0) {
          const int64_t t = now_ns();
          if (t > spin_until) break;
          if (t > next_yield) {
            sched_yield();
            next_yield = t + 20000;
          }
        }
      }
    }
    // The spin adapts to the waits this rank sees: a wait that a longer spin would have
    // caught (shorter than kSpinMaxNs) sets the spin to twice its length; a longer one halves
    // it, down to kSpinMinNs. Where peers arrive together (ranks <= cores) it stays at the
    // cap; where they arrive late (more ranks than cores, a peer still computing) it
    // drops to a few microseconds per wait within a dozen waits, and the rank sleeps.
    struct Adapt {
      ShmEngine* e;
      int64_t start;
      ~Adapt() {
        if (!e->spin_) return;
        const int64_t w = now_ns() - start;
        e->spin_ns_ = w < kSpinMaxNs ? std::max(e->spin_ns_, std::min(kSpinMaxNs, 2 * w))
                                     : std::max(kSpinMinNs, e->spin_ns_ / 2);
      }
    } adapt{this, start};
    int64_t next_probe = now_ns() + 20000000;  // liveness of missing peers every 20 ms
    while (!all_here()) {
      sleepers()->fetch_add(1, std::memory_order_seq_cst);
      uint32_t b = bell()->load(std::memory_order_seq_cst);
      bool here;
      try {
        here = all_here();
      } catch (...) {
        sleepers()->fetch_sub(1);
        throw;
      }
      if (here) {
        sleepers()->fetch_sub(1);
        break;
      }
      const int64_t now = now_ns();
      int64_t left = deadline_ns - now;
      if (aborted()) {
        sleepers()->fetch_sub(1);
        throw EngineAborted();
      }
      if (probe_ && now >= next_probe) {
        next_probe = now + 20000000;
        PeersGone gone = probe_(missing(), k);
        if (!gone.empty()) {
          sleepers()->fetch_sub(1);
          throw PeerFailure(gone_msg("shm exchange", gone), gone.ranks, false, gone.reason);
        }
      }
      if (left <= 0) {
        sleepers()->fetch_sub(1);
        std::vector<int> m = missing();
        throw PeerFailure(missing_msg("shm exchange", m), m, true);
      }
      futex_wait(bell(), b, std::min<int64_t>(left, 20000000));
      sleepers()->fetch_sub(1);
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  round_ = k;
}

// ---- ShmP2P ------------------------------------------------------------------------
ShmP2P::ShmP2P(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout)
    : rank_(rank), size_(size), seg_(std::move(seg)), layout_(layout), base_(seg_->data()) {}

std::atomic<uint32_t>* ShmP2P::bell(int r) {
  return reinterpret_cast<std::atomic<uint32_t>*>(base_ + layout_.p2p_ctrl + 64 * r);
}

ShmP2P::Ring ShmP2P::ring(int src, int dst) {
  size_t pair = static_cast<size_t>(src) * size_ + dst;
  uint8_t* ctrl = base_ + layout_.p2p_ctrl + 64 * size_ + 128 * pair;
  return Ring{reinterpret_cast<std::atomic<uint64_t>*>(ctrl),
              reinterpret_cast<std::atomic<uint64_t>*>(ctrl + 64),
              base_ + layout_.p2p_data + layout_.ring * pair};
}

void ShmP2P::ring_bell(int r) {
  bell(r)->fetch_add(1, std::memory_order_seq_cst);
  if (sleeping(r)->load(std::memory_order_seq_cst)) futex_wake_all(bell(r));
}

size_t ShmP2P::write_some(int peer, const void* buf, size_t n) {
  Ring rg = ring(rank_, peer);
  uint64_t head = rg.head->load(std::memory_order_relaxed);
  uint64_t tail = rg.tail->load(std::memory_order_acquire);
  size_t space = layout_.ring - static_cast<size_t>(head - tail);
  size_t m = std::min(space, n);
  if (m == 0) return 0;
  size_t pos = head % layout_.ring;
  size_t first = std::min(m, layout_.ring - pos);
  std::memcpy(rg.data + pos, buf, first);
  if (m > first) std::memcpy(rg.data, static_cast<const uint8_t*>(buf) + first, m - first);
  rg.head->store(head + m, std::memory_order_release);
  ring_bell(peer);
  return m;
}

size_t ShmP2P::read_some(int peer, void* buf, size_t n) {
  Ring rg = ring(peer, rank_);
  uint64_t tail = rg.tail->load(std::memory_order_relaxed);
  uint64_t head = rg.head->load(std::memory_order_acquire);
  size_t m = std::min(static_cast<size_t>(head - tail), n);
  if (m == 0) return 0;
  size_t pos = tail % layout_.ring;
  size_t first = std::min(m, layout_.ring - pos);
  std::memcpy(buf, rg.data + pos, first);
  if (m > first) std::memcpy(static_cast<uint8_t*>(buf) + first, rg.data, m - first);
  rg.tail->store(tail + m, std::memory_order_release);
  ring_bell(peer);
  return m;
}

void ShmP2P::wait(uint32_t token, int64_t timeout_ns, const std::vector<char>&) {
  sleeping(rank_)->store(1, std::memory_order_seq_cst);
  if (bell(rank_)->load(std::memory_order_seq_cst) == token) futex_wait(bell(rank_), token, timeout_ns);
  sleeping(rank_)->store(0, std::memory_order_seq_cst);
}

// ---- TcpEngine ---------------------------------------------------------------------
namespace {
const uint8_t kZeros[64 << 10] = {};  // what finishes a half-sent frame (owe_)
struct FrameHead {
  uint64_t round;  // epoch_base(epoch) + round within the epoch
  uint32_t hdr_len;
  uint32_t nranges;
  uint64_t direct_len;  // direct bytes after the ranges' (CollEngine::set_direct_src)
};
constexpr int kMaxRanges = 4;
}  // namespace

// Receive state of one peer's frame; kept across exchange() calls because a peer in a
// later epoch may already have sent the frame of a round this rank has not reached.
struct TcpEngine::In {
  uint8_t fixed[sizeof(FrameHead) + kMaxRanges * sizeof(Range)];
  // 0 head, 1 ranges, 2 header, 3.. data ranges, then direct bytes, then the trailer;
  // 100: discarding a stale frame
  int stage = 0;
  uint64_t trailer = 0;
  size_t done = 0;
  FrameHead fh{};
  Range rg[kMaxRanges];
  size_t discard_left = 0;
  bool complete = false;  // the frame of round fh.round is fully received
};

TcpEngine::TcpEngine(int rank, int size, size_t slot_bytes, size_t hdr_cap, std::vector<int> fds,
                     std::vector<uint8_t*> mine)
    : CollEngine(rank, size, slot_bytes, hdr_cap), fds_(std::move(fds)), mine_ptr_(std::move(mine)) {
  if (mine_ptr_.empty()) {
    mine_.assign(3, std::vector<uint8_t>(hdr_cap + slot_bytes));
    for (auto& m : mine_) mine_ptr_.push_back(m.data());
  }
  peers_.resize(size);
  in_.resize(size);
  direct_at_.assign(size, 0);
  owe_.assign(size, 0);
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    in_[j] = std::make_unique<In>();
    if (fds_[j] < 0) continue;  // a seat that is not a member
    peers_[j].assign(3, std::vector<uint8_t>(hdr_cap + slot_bytes));
    set_nonblocking(fds_[j]);
  }
}

TcpEngine::~TcpEngine() {
  for (int j = 0; j < size_; ++j)
    if (j != rank_ && fds_[j] >= 0) close(fds_[j]);
}

void TcpEngine::exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) {
  const uint64_t k = round_ + 1;
  const int b = static_cast<int>(k % 3);
  const uint64_t next_epoch_base = epoch_base(epoch() + 1);
  struct Out {
    std::vector<uint8_t> meta;  // FrameHead + ranges + header
    std::vector<Range> ranges;
    DirectSrc direct;
    uint64_t trailer = 0;  // the frame's round: a frame finished with zeros has 0
    // meta, the ranges' bytes, the direct bytes, the trailer (empty pieces left out)
    std::vector<ConstBytes> pieces;
    size_t total = 0, sent = 0;  // the frame's bytes, and those sent so far
    bool finished = false;
  };
  std::vector<Out> out(size_);
  std::vector<DirectSrc> direct_src;
  direct_src.swap(direct_src_);  // this round's only
  ArrivalHook hook;
  hook.swap(hook_);
  std::function<bool()> others_in;
  others_in.swap(hook_others_in_);
  std::vector<int> others;
  others.swap(hook_others_);
  bool headers_in = false;  // every peer's header of round k is in: the hook may run
  std::vector<char> told;   // peers passed to the hook
  if (hook) told.assign(size_, 0);
  // A frame left half-sent by an exception (a peer died mid-round) is finished with zeros
  // (owe_) at once while the peer reads, else by the next exchange(), so the stream to a
  // live peer stays aligned on frames: that peer drops the frame, as stale when it is in
  // a later epoch by then, or by its zero trailer when it is still in that round (and
  // catches up with the epoch). The zeros do not come from the caller's buffers, which
  // may be gone.
  struct Owe {
    TcpEngine* t;
    std::vector<Out>& out;
    bool ok = false;
    ~Owe() {
      if (ok) return;
      for (size_t j = 0; j < out.size(); ++j)
        if (out[j].sent > 0) t->owe_[j] += out[j].total - out[j].sent;
      try {
        t->flush_owed();
      } catch (...) {  // the next exchange() sends what is left
      }
    }
  } owe_guard{this, out};
  std::vector<uint8_t> scratch;
  int64_t next_probe = now_ns() + 20000000;  // liveness of missing peers every 20 ms
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || !active_[j]) continue;
    Out& o = out[j];
    if (sends) {
      for (const Range& r : (*sends)[j])
        if (r.len > 0) o.ranges.push_back(r);
    } else {
      o.ranges.push_back(Range{0, slot_});
    }
    if (o.ranges.size() > kMaxRanges) throw std::logic_error("TcpEngine: too many ranges");
    if (j < static_cast<int>(direct_src.size())) o.direct = direct_src[j];
    FrameHead fh{k, static_cast<uint32_t>(hdr_len), static_cast<uint32_t>(o.ranges.size()), o.direct.len};
    o.meta.resize(sizeof(fh) + o.ranges.size() * sizeof(Range) + hdr_len);
    std::memcpy(o.meta.data(), &fh, sizeof(fh));
    if (!o.ranges.empty())
      std::memcpy(o.meta.data() + sizeof(fh), o.ranges.data(), o.ranges.size() * sizeof(Range));
    std::memcpy(o.meta.data() + sizeof(fh) + o.ranges.size() * sizeof(Range), mine_ptr_[b], hdr_len);
    o.trailer = k;
    o.pieces.push_back(ConstBytes{o.meta.data(), o.meta.size()});
    for (const Range& r : o.ranges) o.pieces.push_back(ConstBytes{mine_ptr_[b] + hdr_cap_ + r.off, r.len});
    if (o.direct.len > 0) o.pieces.push_back(ConstBytes{o.direct.ptr, o.direct.len});
    o.pieces.push_back(ConstBytes{&o.trailer, sizeof(o.trailer)});
    for (const ConstBytes& pc : o.pieces) o.total += pc.len;
  }
  while (true) {
    bool progress = false, all_done = true;
    std::vector<int> rd, wr, dead;
    // peers in the order rank+1, rank+2, ...: frames queue in the kernel in this order, so
    // at the start of a round each host sends towards a different host instead of every
    // host towards the lowest ranks' (whose incoming link would then set the pace)
    for (int step = 1; step < size_; ++step) {
      const int j = (rank_ + step) % size_;
      if (!active_[j]) continue;
      try {
        // send side: the frame's pieces go out gathered, so a frame that fits the socket
        // buffer leaves in one system call (and a small one as one packet)
        Out& o = out[j];
        while (!o.finished) {
          if (owe_[j] > 0) {  // the rest of a frame an earlier exchange() left half-sent
            const size_t m = send_some(fds_[j], kZeros, std::min(owe_[j], sizeof(kZeros)));
            if (m > 0) progress = true;
            owe_[j] -= m;
            if (owe_[j] > 0) break;
            continue;
          }
          ConstBytes rest[kMaxRanges + 3];
          size_t nrest = 0, skip = o.sent;
          for (const ConstBytes& pc : o.pieces) {
            if (skip >= pc.len) {
              skip -= pc.len;
              continue;
            }
            rest[nrest++] = ConstBytes{static_cast<const uint8_t*>(pc.ptr) + skip, pc.len - skip};
            skip = 0;
          }
          const size_t m = send_some_v(fds_[j], rest, nrest);
          if (m > 0) progress = true;
          o.sent += m;
          if (o.sent == o.total) o.finished = true;
          if (m == 0) break;
        }
        if (!o.finished) wr.push_back(fds_[j]);
        // receive side
        In& i = *in_[j];
        const bool held = delayed(j);
        while (!held && !(i.complete && i.fh.round == k)) {
          if (i.complete) {
            if (i.fh.round > next_epoch_base) throw EpochAhead();
            if (i.fh.round < k) {  // stale (an earlier epoch): drop it
              i = In{};
              continue;
            }
            break;  // a later round of this epoch cannot arrive before we complete k
          }
          uint8_t* dst;
          size_t len;
          if (i.stage == 0) {
            dst = i.fixed;
            len = sizeof(FrameHead);
          } else if (i.stage == 1) {
            dst = i.fixed + sizeof(FrameHead);
            len = i.fh.nranges * sizeof(Range);
          } else if (i.stage == 100) {
            scratch.resize(64 << 10);
            dst = scratch.data();
            len = std::min(i.discard_left, scratch.size());
          } else if (i.stage == 2) {
            dst = peers_[j][i.fh.round % 3].data();
            len = i.fh.hdr_len;
          } else if (i.stage < 3 + static_cast<int>(i.fh.nranges)) {
            const Range& r = i.rg[i.stage - 3];
            dst = peers_[j][i.fh.round % 3].data() + hdr_cap_ + r.off;
            len = r.len;
          } else if (i.stage > 3 + static_cast<int>(i.fh.nranges) || i.fh.direct_len == 0) {
            dst = reinterpret_cast<uint8_t*>(&i.trailer);
            len = sizeof(i.trailer);
          } else {
            // direct bytes: for the caller's buffer of this round only (a frame of a later
            // epoch waits here until this rank gets there and sets its buffer)
            if (i.fh.round < k) {  // begun in an earlier epoch's round: stale, dropped
              i.stage = 100;
              i.discard_left = i.fh.direct_len - i.done + sizeof(i.trailer);
              i.done = 0;
              if (i.discard_left == 0) i = In{};
              continue;
            }
            if (i.fh.round > k) {
              if (i.fh.round > next_epoch_base) throw EpochAhead();
              throw std::runtime_error("TcpEngine: direct bytes of a later round from rank " +
                                       std::to_string(j));
            }
            const size_t at = j < static_cast<int>(direct_dst_.size()) ? direct_at_[j] : 0;
            if (j >= static_cast<int>(direct_dst_.size()) || direct_dst_[j].ptr == nullptr ||
                i.fh.direct_len > direct_dst_[j].cap - std::min(direct_dst_[j].cap, at))
              throw std::runtime_error("TcpEngine: " + std::to_string(i.fh.direct_len) +
                                       " unexpected direct bytes from rank " + std::to_string(j));
            dst = direct_dst_[j].ptr + at;
            len = i.fh.direct_len;
          }
          size_t m =
              recv_some(fds_[j], dst + (i.stage == 100 ? 0 : i.done), len - (i.stage == 100 ? 0 : i.done));
          if (m > 0) progress = true;
          if (i.stage == 100) {
            i.discard_left -= m;
            if (i.discard_left == 0) i = In{};
            if (m == 0) break;
            continue;
          }
          i.done += m;
          if (i.done < len) break;
          i.done = 0;
          if (i.stage == 0) {
            std::memcpy(&i.fh, i.fixed, sizeof(FrameHead));
            if (i.fh.nranges > kMaxRanges || i.fh.hdr_len > hdr_cap_)
              throw std::runtime_error("TcpEngine: malformed frame from rank " + std::to_string(j));
          } else if (i.stage == 1) {
            std::memcpy(i.rg, i.fixed + sizeof(FrameHead), i.fh.nranges * sizeof(Range));
            size_t total = i.fh.hdr_len + i.fh.direct_len + sizeof(i.trailer);
            for (uint32_t q = 0; q < i.fh.nranges; ++q) {
              if (i.rg[q].off + i.rg[q].len > slot_)
                throw std::runtime_error("TcpEngine: bad range from rank " + std::to_string(j));
              total += i.rg[q].len;
            }
            if (i.fh.round < k) {
              // stale frame of an earlier epoch: drop it. (A frame of a later epoch is
              // received and kept; once complete it makes us catch up, see above.)
              i.stage = 100;
              i.discard_left = total;
              if (total == 0) i = In{};
              continue;
            }
          }
          const int direct_stage = 3 + static_cast<int>(i.fh.nranges);
          const int trailer_stage = direct_stage + (i.fh.direct_len > 0 ? 1 : 0);
          if (i.stage == direct_stage && i.fh.direct_len > 0) direct_at_[j] += i.fh.direct_len;
          if (i.stage == trailer_stage && i.trailer != i.fh.round) {
            // finished with zeros: its sender left this round when a peer failed and is in a
            // later epoch (whose record it has agreed) already; never this round's data
            const uint64_t round = i.fh.round;
            i = In{};
            if (round < k) continue;  // stale anyway
            throw EpochAhead();
          }
          i.stage++;
          if (i.stage > trailer_stage) {
            i.stage = -1;
            i.complete = true;
          }
        }
        if (!held && !(i.complete && i.fh.round == k)) rd.push_back(fds_[j]);
        if (!o.finished || held || !(i.complete && i.fh.round == k)) all_done = false;
      } catch (const EpochAhead&) {
        throw;
      } catch (const std::exception&) {
        dead.push_back(j);  // connection lost: the peer process is gone
      }
    }
    if (!dead.empty())
      throw PeerFailure(missing_msg("tcp exchange: lost the connection to:", dead), dead, false,
                        "connection lost");
    if (hook) {
      if (!headers_in) {
        headers_in = true;
        for (int j = 0; j < size_ && headers_in; ++j) {
          if (j == rank_ || !active_[j]) continue;
          const In& i = *in_[j];
          // stage 3 on: the frame's head, ranges and header are in
          if (delayed(j) || i.fh.round != k || !(i.complete || i.stage >= 3)) headers_in = false;
        }
        if (headers_in && others_in && !others_in()) headers_in = false;
        if (headers_in)
          for (int j : others) hook(j);
      }
      if (headers_in)
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && active_[j] && !told[j] && !delayed(j) && in_[j]->complete &&
              in_[j]->fh.round == k) {
            told[j] = 1;
            hook(j);
          }
    }
    if (all_done) break;
    if (!progress) {
      if (aborted()) throw EngineAborted();
      const int64_t now = now_ns();
      int64_t left = deadline_ns - now;
      if (left <= 0 || (probe_ && now >= next_probe)) {
        std::vector<int> missing;
        for (int j = 0; j < size_; ++j)
          if (j != rank_ && active_[j] && (delayed(j) || !(in_[j]->complete && in_[j]->fh.round == k)))
            missing.push_back(j);
        if (left <= 0) throw PeerFailure(missing_msg("tcp exchange", missing), missing, true);
        // a peer that left the group (or died on this host) while we wait for it
        next_probe = now + 20000000;
        PeersGone gone = probe_(missing, k);
        if (!gone.empty()) throw PeerFailure(gone_msg("tcp exchange", gone), gone.ranks, false, gone.reason);
      }
      poll_fds(rd, wr, -1, static_cast<int>(std::min<int64_t>(left / 1000000 + 1, 100)));
    }
  }
  owe_guard.ok = true;
  for (int j = 0; j < size_; ++j)
    if (j != rank_ && active_[j]) *in_[j] = In{};
  round_ = k;
}

void TcpEngine::flush_owed() {
  int64_t last_progress = now_ns();
  while (true) {
    std::vector<int> wr;
    for (int j = 0; j < size_; ++j) {
      if (j == rank_ || !active_[j] || fds_[j] < 0 || owe_[j] == 0) continue;
      try {
        const size_t m = send_some(fds_[j], kZeros, std::min(owe_[j], sizeof(kZeros)));
        owe_[j] -= m;
        if (m > 0) last_progress = now_ns();
      } catch (const std::exception&) {
        owe_[j] = 0;  // the connection is gone: no stream left to align
      }
      if (owe_[j] > 0) wr.push_back(fds_[j]);
    }
    // a peer that reads takes a round's rest at the link's rate; one that does not (it
    // left the op too) gets the rest with its next frame
    if (wr.empty() || now_ns() - last_progress > 200000000) return;
    poll_fds({}, wr, -1, 20);
  }
}

// ---- HybridEngine --------------------------------------------------------------------
static std::vector<uint8_t*> shm_buffers(ShmEngine& shm) {
  // my header + slot of rounds 0, 1, 2 (buffer k % 3), laid out as TcpEngine expects
  return {shm.my_hdr(0), shm.my_hdr(1), shm.my_hdr(2)};
}

HybridEngine::HybridEngine(int rank, int size, std::shared_ptr<ShmSegment> seg, const ShmLayout& layout,
                           bool spin, std::vector<char> local, std::vector<int> fds)
    : CollEngine(rank, size, layout.slot, layout.hdr_cap),
      shm_(rank, size, std::move(seg), layout, spin),
      local_(std::move(local)) {
  tcp_ =
      std::make_unique<TcpEngine>(rank, size, layout.slot, layout.hdr_cap, std::move(fds), shm_buffers(shm_));
}

void HybridEngine::set_active(const std::vector<char>& active) {
  CollEngine::set_active(active);
  std::vector<char> here(active), there(active);
  for (int j = 0; j < size_; ++j) (local_[j] ? there : here)[j] = 0;
  shm_.set_active(here);
  tcp_->set_active(there);
}

void HybridEngine::set_liveness(LivenessProbe p) {
  shm_.set_liveness(p);
  tcp_->set_liveness(p);
  CollEngine::set_liveness(std::move(p));
}

void HybridEngine::start_epoch(uint64_t e) {
  CollEngine::start_epoch(e);
  shm_.start_epoch(e);
  tcp_->start_epoch(e);
}

void HybridEngine::exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns) {
  // the ranks of this host may read my slot from now on; the other hosts' frames go and
  // come meanwhile, then this host's stragglers are awaited
  shm_.arrive();
  if (hook_) {
    std::vector<int> here;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && local_[j] && active_[j]) here.push_back(j);
    tcp_->set_arrival_hook(std::move(hook_), [this] { return shm_.arrived_now(); }, std::move(here));
    hook_ = nullptr;
  }
  tcp_->exchange(sends, hdr_len, deadline_ns);
  shm_.wait_arrived(deadline_ns);
  round_ = tcp_->next_round() - 1;
}

// ---- TcpP2P ------------------------------------------------------------------------
TcpP2P::TcpP2P(int rank, int size, std::vector<int> fds)
    : rank_(rank), size_(size), fds_(std::move(fds)), want_write_(size, 0) {
  for (int j = 0; j < size; ++j)
    if (j != rank && fds_[j] >= 0) set_nonblocking(fds_[j]);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

TcpP2P::~TcpP2P() {
  for (int j = 0; j < size_; ++j)
    if (j != rank_ && fds_[j] >= 0) close(fds_[j]);
  if (wake_fd_ >= 0) close(wake_fd_);
}

size_t TcpP2P::write_some(int peer, const void* buf, size_t n) {
  size_t m = send_some(fds_[peer], buf, n);
  want_write_[peer] = m < n;
  return m;
}

size_t TcpP2P::read_some(int peer, void* buf, size_t n) { return recv_some(fds_[peer], buf, n); }

void TcpP2P::wait(uint32_t, int64_t timeout_ns, const std::vector<char>& want_read) {
  std::vector<int> rd, wr;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || fds_[j] < 0) continue;
    if (want_read[j]) rd.push_back(fds_[j]);
    if (want_write_[j]) wr.push_back(fds_[j]);
  }
  poll_fds(rd, wr, wake_fd_, static_cast<int>(timeout_ns / 1000000 + 1));
  uint64_t v;
  while (read(wake_fd_, &v, sizeof(v)) > 0) {
  }
}

void TcpP2P::notify() {
  uint64_t one = 1;
  ssize_t rc = write(wake_fd_, &one, sizeof(one));
  (void)rc;
}

}  // namespace mooncake
