// Point-to-point ops of the group core: send / recv / recv from any source.
//
// Every posted op goes to one p2p thread that advances all of them without blocking
// (a send whose ring or socket is full never holds up a receive), so a ring of
// isend/irecv issued one by one cannot deadlock. Messages between two ranks arrive in
// the order they were sent; a receive takes the next message from its source and must
// match its tag, size and dtype (a mismatch fails that receive with ValueError).
#include <cstring>

#include "core/group.hpp"

namespace mooncake {

namespace {
constexpr uint32_t kP2PMagic = 0x4d435032;
struct P2PHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t nbytes;
  int32_t dtype;  // P2PRequest::dtype
  int32_t pad;
  uint64_t reserved;
};
static_assert(sizeof(P2PHeader) == 32, "P2PHeader layout");
}  // namespace

struct Group::P2POp {
  std::shared_ptr<P2PRequest> req;
  P2PHeader hdr{};
  size_t hdr_done = 0;
  size_t done = 0;
  bool started = false;
  int source = -1;    // recv: the rank the message came from (known once matched)
  std::string error;  // recv: set when the arriving message does not match
};

void Group::check_peer_active(int peer, bool is_send) {
  if (joining_)
    throw GroupBackendError("MooncakeBackend (rank " + std::to_string(rank_) +
                            "): this recovering rank must call join_group before any op");
  if (left_self_)
    throw GroupBackendError(std::string("mooncake ") + (is_send ? "send" : "recv") + " (rank " +
                            std::to_string(rank_) + "): this rank left the group (leave_group)");
  if (peer < 0) return;
  bool inactive;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    inactive = !active_[peer];
  }
  if (inactive)
    throw RankFailure(std::string("mooncake ") + (is_send ? "send" : "recv") + " (rank " +
                          std::to_string(rank_) + "): peer rank " + std::to_string(peer) +
                          " is not active (failed or not joined)",
                      {peer}, epoch());
  // a peer already gone must not take a buffered send as if it were alive
  PeersGone gone = probe_dead({peer});
  if (!gone.empty())
    throw RankFailure(std::string("mooncake ") + (is_send ? "send" : "recv") + " (rank " +
                          std::to_string(rank_) + "): peer rank " + std::to_string(peer) + " is gone (" +
                          gone.reason + ")",
                      {peer}, epoch());
}

void Group::post_p2p(std::shared_ptr<P2PRequest> req) {
  auto op = std::make_shared<P2POp>();
  if (req->is_send)
    op->hdr = P2PHeader{kP2PMagic, req->tag, static_cast<uint64_t>(req->nbytes), req->dtype, 0, 0};
  op->req = std::move(req);
  {
    std::lock_guard<std::mutex> g(qmu_);
    MOONCAKE_CHECK(!stop_, "MooncakeBackend::post_p2p: the process group was shut down");
    ensure_threads(true);
  }
  {
    std::lock_guard<std::mutex> g(p2p_mu_);
    p2p_posted_.push_back(std::move(op));
  }
  p2p_->notify();
}

void Group::p2p_loop() {
  const int W = size_;
  std::vector<std::deque<std::shared_ptr<P2POp>>> sendq(W), recvq(W);
  std::deque<std::shared_ptr<P2POp>> anyq;
  struct Incoming {
    P2PHeader hdr{};
    size_t got = 0;
    std::shared_ptr<P2POp> op;  // matched receive taking the payload
    size_t left = 0;            // payload bytes still to read
  };
  std::vector<Incoming> in(W);
  std::vector<std::string> broken(W);
  std::vector<uint8_t> scratch(64 << 10);
  std::vector<char> want_read(W, 0);
  int64_t next_timeout_check = 0;

  std::vector<char> dead(W, 0);
  auto fail = [&](const std::shared_ptr<P2POp>& op, const std::string& msg, bool value_error) {
    std::exception_ptr e;
    const int peer = op->req->peer;
    if (value_error)
      e = std::make_exception_ptr(GroupValueError(msg));
    else if (peer >= 0 && dead[peer])
      e = std::make_exception_ptr(RankFailure(msg, {peer}, epoch()));
    else
      e = std::make_exception_ptr(GroupBackendError(msg));
    op->req->done(e, op->source);
  };
  auto mark_dead = [&](int j, const std::string& why) {
    dead[j] = 1;
    broken[j] = std::string("mooncake p2p (rank ") + std::to_string(rank_) + "): peer rank " +
                std::to_string(j) + " failed (" + why + ")";
    for (auto& op : sendq[j]) fail(op, broken[j], false);
    for (auto& op : recvq[j]) fail(op, broken[j], false);
    sendq[j].clear();
    recvq[j].clear();
    if (in[j].op) fail(in[j].op, broken[j], false);
    in[j] = Incoming{};
  };

  while (true) {
    const uint32_t token = p2p_->wait_token();
    {
      std::lock_guard<std::mutex> g(qmu_);
      if (stop_ || p2p_restart_) break;
    }
    {
      std::lock_guard<std::mutex> g(p2p_mu_);
      while (!p2p_posted_.empty()) {
        auto op = std::move(p2p_posted_.front());
        p2p_posted_.pop_front();
        const int peer = op->req->peer;
        if (peer >= 0 && !broken[peer].empty()) {
          fail(op, broken[peer], false);
          continue;
        }
        if (op->req->is_send)
          sendq[peer].push_back(op);
        else if (peer < 0)
          anyq.push_back(op);
        else
          recvq[peer].push_back(op);
      }
    }
    bool progress = false;
    for (int j = 0; j < W; ++j) {
      if (j == rank_) continue;
      try {
        // sends, in order
        while (!sendq[j].empty()) {
          auto& op = sendq[j].front();
          if (op->hdr_done < sizeof(P2PHeader)) {
            size_t m = p2p_->write_some(j, reinterpret_cast<uint8_t*>(&op->hdr) + op->hdr_done,
                                        sizeof(P2PHeader) - op->hdr_done);
            op->hdr_done += m;
            if (m) {
              progress = true;
              op->started = true;
            }
            if (op->hdr_done < sizeof(P2PHeader)) break;
          }
          const size_t nb = op->hdr.nbytes;
          if (op->done < nb) {
            size_t m =
                p2p_->write_some(j, static_cast<const uint8_t*>(op->req->data) + op->done, nb - op->done);
            op->done += m;
            if (m) progress = true;
            if (op->done < nb) break;
          }
          auto finished = op;
          sendq[j].pop_front();
          finished->req->done(nullptr, -1);
          progress = true;
        }
        // receives: headers first, then payload into the matched op
        while (true) {
          Incoming& ic = in[j];
          if (!ic.op) {
            if (recvq[j].empty() && anyq.empty()) break;
            size_t m =
                p2p_->read_some(j, reinterpret_cast<uint8_t*>(&ic.hdr) + ic.got, sizeof(P2PHeader) - ic.got);
            ic.got += m;
            if (m) progress = true;
            if (ic.got < sizeof(P2PHeader)) break;
            if (ic.hdr.magic != kP2PMagic)
              throw std::runtime_error("corrupt p2p stream from rank " + std::to_string(j));
            std::shared_ptr<P2POp> op;
            if (!recvq[j].empty()) {
              op = recvq[j].front();
              recvq[j].pop_front();
            } else {
              op = anyq.front();
              anyq.pop_front();
            }
            op->source = j;
            op->started = true;
            const P2PRequest& rq = *op->req;
            const size_t want = rq.nbytes;
            if (ic.hdr.tag != rq.tag || ic.hdr.nbytes != want || ic.hdr.dtype != rq.dtype) {
              op->error = "mooncake recv (rank " + std::to_string(rank_) + "): the next message from rank " +
                          std::to_string(j) + " has tag " + std::to_string(ic.hdr.tag) + ", " +
                          std::to_string(ic.hdr.nbytes) + " byte(s) of dtype " + rq.dtype_name(ic.hdr.dtype) +
                          " but this recv expects tag " + std::to_string(rq.tag) + ", " +
                          std::to_string(want) + " byte(s) of dtype " + rq.dtype_name(rq.dtype) +
                          "; the message was dropped";
            }
            ic.op = op;
            ic.left = ic.hdr.nbytes;
            ic.got = 0;
          }
          auto& op = ic.op;
          while (ic.left > 0) {
            size_t m;
            if (op->error.empty()) {
              m = p2p_->read_some(j, static_cast<uint8_t*>(op->req->data) + op->done, ic.left);
              op->done += m;
            } else {
              m = p2p_->read_some(j, scratch.data(), std::min(ic.left, scratch.size()));
            }
            ic.left -= m;
            if (!m) break;
            progress = true;
          }
          if (ic.left > 0) break;
          auto finished = op;
          ic.op.reset();
          if (finished->error.empty())
            finished->req->done(nullptr, finished->source);
          else
            fail(finished, finished->error, true);
          progress = true;
        }
      } catch (const std::exception& e) {
        mark_dead(j, std::string("lost the connection: ") + e.what());
      }
    }
    const int64_t now = now_ns();
    if (now >= next_timeout_check) {
      next_timeout_check = now + 20000000;
      // peers with pending ops whose process died
      std::vector<int> busy;
      for (int j = 0; j < W; ++j)
        if (j != rank_ && !dead[j] && (!sendq[j].empty() || !recvq[j].empty() || in[j].op)) busy.push_back(j);
      PeersGone gone = probe_dead(busy);
      for (int j : gone.ranks) mark_dead(j, gone.reason);
      auto expire = [&](std::deque<std::shared_ptr<P2POp>>& q, int peer) {
        for (auto it = q.begin(); it != q.end();) {
          if ((*it)->req->deadline_ns < now && (*it)->started && peer >= 0) {
            // part of the message has moved: the stream to this peer cannot be resynced
            std::string why = std::string("mooncake ") + ((*it)->req->is_send ? "send to" : "recv from") +
                              " rank " + std::to_string(peer) + " (rank " + std::to_string(rank_) +
                              "): timed out mid-message; the link to that rank is closed";
            broken[peer] = why;
            std::deque<std::shared_ptr<P2POp>> doomed;
            doomed.swap(q);
            for (auto& op : doomed) fail(op, why, false);
            return;
          }
          if ((*it)->req->deadline_ns < now && !(*it)->started) {
            fail(*it,
                 std::string("mooncake ") + ((*it)->req->is_send ? "send" : "recv") + " (rank " +
                     std::to_string(rank_) + "): timed out waiting for rank " +
                     (peer < 0 ? std::string("<any>") : std::to_string(peer)),
                 false);
            it = q.erase(it);
          } else {
            ++it;
          }
        }
      };
      for (int j = 0; j < W; ++j) {
        expire(sendq[j], j);
        expire(recvq[j], j);
        if (in[j].op && in[j].op->req->deadline_ns < now) {
          std::string why = "mooncake recv from rank " + std::to_string(j) + " (rank " +
                            std::to_string(rank_) +
                            "): timed out mid-message; the link to that rank is closed";
          broken[j] = why;
          fail(in[j].op, why, false);
          in[j] = Incoming{};
          for (auto& op : recvq[j]) fail(op, why, false);
          recvq[j].clear();
        }
      }
      expire(anyq, -1);
    }
    if (!progress) {
      for (int j = 0; j < W; ++j)
        want_read[j] = j != rank_ && (!recvq[j].empty() || !anyq.empty() || in[j].op);
      p2p_->wait(token, 20000000, want_read);
    }
  }
  // shutting down (or the transport is being rebuilt by recover_ranks): fail what is left
  for (int j = 0; j < W; ++j) {
    for (auto& op : sendq[j]) fail(op, "mooncake: process group shut down", false);
    for (auto& op : recvq[j]) fail(op, "mooncake: process group shut down", false);
    if (in[j].op) fail(in[j].op, "mooncake: process group shut down", false);
  }
  for (auto& op : anyq) fail(op, "mooncake: process group shut down", false);
}

}  // namespace mooncake
