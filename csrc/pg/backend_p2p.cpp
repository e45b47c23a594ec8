// Point-to-point ops of MooncakeBackend: send / recv / recvAnysource.
//
// Every posted op goes to one p2p thread that advances all of them without blocking
// (a send whose ring or socket is full never holds up a receive), so a ring of
// isend/irecv issued one by one cannot deadlock. Messages between two ranks arrive in
// the order they were sent; a receive takes the next message from its source and must
// match its tag and size (a mismatch fails that receive with ValueError).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "pg/backend.hpp"

namespace mooncake {

namespace {
constexpr uint32_t kP2PMagic = 0x4d435032;
struct P2PHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t nbytes;
  int32_t dtype;
  int32_t pad;
  uint64_t reserved;
};
static_assert(sizeof(P2PHeader) == 32, "P2PHeader layout");
}  // namespace

struct MooncakeBackend::P2POp {
  bool is_send = false;
  int peer = -1;  // -1: any source
  int tag = 0;
  at::Tensor buf;  // contiguous data
  c10::intrusive_ptr<MooncakeWork> work;
  int64_t deadline_ns = 0;
  P2PHeader hdr{};
  size_t hdr_done = 0;
  size_t done = 0;
  bool started = false;
  std::string error;  // recv: set when the arriving message does not match
};

void MooncakeBackend::check_peer_active(int peer, bool is_send) {
  if (joining_)
    C10_THROW_ERROR(DistBackendError, "MooncakeBackend (rank " + std::to_string(rank_) +
                                          "): this recovering rank must call join_group before any op");
  if (left_self_)
    C10_THROW_ERROR(DistBackendError, std::string("mooncake ") + (is_send ? "send" : "recv") + " (rank " +
                                          std::to_string(rank_) +
                                          "): this rank left the group (leave_group)");
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

void MooncakeBackend::post_p2p(std::shared_ptr<P2POp> op) {
  {
    std::lock_guard<std::mutex> g(qmu_);
    TORCH_CHECK(!stop_, "MooncakeBackend::post_p2p: the process group was shut down");
    ensure_threads(true);
  }
  {
    std::lock_guard<std::mutex> g(p2p_mu_);
    p2p_posted_.push_back(std::move(op));
  }
  p2p_->notify();
}

static void check_p2p(std::vector<at::Tensor>& tensors, int peer, int size, int rank, const char* op,
                      bool any) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "mooncake ", op, " (rank ", rank, "): expected one tensor, got ",
                    tensors.size());
  const at::Tensor& t = tensors[0];
  TORCH_CHECK_VALUE(t.device().is_cpu(), "mooncake ", op, " (rank ", rank,
                    "): expected a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "mooncake ", op, " (rank ", rank,
                    "): expected a dense tensor");
  if (!any) {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size, "mooncake ", op, " (rank ", rank, "): peer rank ", peer,
                      " is out of range [0, ", size, ")");
    TORCH_CHECK_VALUE(peer != rank, "mooncake ", op, " (rank ", rank, "): cannot ", op, " to/from itself");
  }
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::failed_work(c10d::OpType type,
                                                            std::vector<at::Tensor> outputs,
                                                            std::exception_ptr err) {
  auto w = c10::make_intrusive<MooncakeWork>(rank_, type, std::move(outputs));
  attach_to_coalescing(w, {});
  deliver(w, err, true);
  return w;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  MOONCAKE_CUDA_STAGED(SEND, "send", (tensor_ptrs(tensors)), (std::vector<at::Tensor*>{}),
                       send(tensors, dstRank, tag));
  if (coalescing_) {
    // inside batch_isend_irecv: report bad arguments through the batch's Work
    try {
      return send_impl(tensors, dstRank, tag);
    } catch (...) {
      return failed_work(c10d::OpType::SEND, tensors, std::current_exception());
    }
  }
  return send_impl(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  MOONCAKE_CUDA_STAGED(RECV, "recv", (std::vector<at::Tensor*>{}), (tensor_ptrs(tensors)),
                       recv(tensors, srcRank, tag));
  if (coalescing_) {
    try {
      return recv_impl(tensors, srcRank, tag);
    } catch (...) {
      return failed_work(c10d::OpType::RECV, tensors, std::current_exception());
    }
  }
  return recv_impl(tensors, srcRank, tag);
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::send_impl(std::vector<at::Tensor>& tensors, int dstRank,
                                                            int tag) {
  check_p2p(tensors, dstRank, size_, rank_, "send", false);
  check_peer_active(dstRank, true);
  auto op = std::make_shared<P2POp>();
  op->is_send = true;
  op->peer = dstRank;
  op->tag = tag;
  op->buf = tensors[0].contiguous();
  op->work = c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::SEND, tensors);
  op->deadline_ns = deadline_ns_for(std::chrono::milliseconds(0));
  op->hdr = P2PHeader{kP2PMagic,
                      tag,
                      static_cast<uint64_t>(op->buf.numel() * op->buf.element_size()),
                      static_cast<int32_t>(op->buf.scalar_type()),
                      0,
                      0};
  auto w = op->work;
  attach_to_coalescing(w, tensors);
  post_p2p(op);
  return w;
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::recv_impl(std::vector<at::Tensor>& tensors, int srcRank,
                                                            int tag) {
  check_p2p(tensors, srcRank, size_, rank_, "recv", srcRank < 0);
  check_peer_active(srcRank, false);
  auto op = std::make_shared<P2POp>();
  op->peer = srcRank;
  op->tag = tag;
  const at::Tensor& user = tensors[0];
  op->buf = user.is_contiguous() ? user : at::empty_like(user, at::MemoryFormat::Contiguous);
  op->work = c10::make_intrusive<MooncakeWork>(
      rank_, srcRank < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensors);
  if (!user.is_contiguous()) {
    at::Tensor u = user, b = op->buf;
    op->work->after = [u, b]() mutable { u.copy_(b); };
  }
  op->deadline_ns = deadline_ns_for(std::chrono::milliseconds(0));
  auto w = op->work;
  attach_to_coalescing(w, tensors);
  post_p2p(op);
  return w;
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recv(tensors, -1, tag);
}

void MooncakeBackend::p2p_loop() {
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
    if (value_error)
      e = std::make_exception_ptr(c10::ValueError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg));
    else if (op->peer >= 0 && dead[op->peer])
      e = std::make_exception_ptr(RankFailure(msg, {op->peer}, epoch()));
    else
      e = std::make_exception_ptr(
          c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg));
    deliver(op->work, e, false);
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
        if (op->peer >= 0 && !broken[op->peer].empty()) {
          fail(op, broken[op->peer], false);
          continue;
        }
        if (op->is_send)
          sendq[op->peer].push_back(op);
        else if (op->peer < 0)
          anyq.push_back(op);
        else
          recvq[op->peer].push_back(op);
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
                p2p_->write_some(j, static_cast<uint8_t*>(op->buf.data_ptr()) + op->done, nb - op->done);
            op->done += m;
            if (m) progress = true;
            if (op->done < nb) break;
          }
          auto finished = op;
          sendq[j].pop_front();
          deliver(finished->work, nullptr, false);
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
              op->work->source_rank = j;
            }
            op->started = true;
            const size_t want = op->buf.numel() * op->buf.element_size();
            if (ic.hdr.tag != op->tag || ic.hdr.nbytes != want ||
                ic.hdr.dtype != static_cast<int32_t>(op->buf.scalar_type())) {
              op->error = "mooncake recv (rank " + std::to_string(rank_) + "): the next message from rank " +
                          std::to_string(j) + " has tag " + std::to_string(ic.hdr.tag) + ", " +
                          std::to_string(ic.hdr.nbytes) + " byte(s) of dtype " +
                          c10::toString(static_cast<c10::ScalarType>(ic.hdr.dtype)) +
                          " but this recv expects tag " + std::to_string(op->tag) + ", " +
                          std::to_string(want) + " byte(s) of dtype " + c10::toString(op->buf.scalar_type()) +
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
              m = p2p_->read_some(j, static_cast<uint8_t*>(op->buf.data_ptr()) + op->done, ic.left);
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
            deliver(finished->work, nullptr, false);
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
          if ((*it)->deadline_ns < now && (*it)->started && peer >= 0) {
            // part of the message has moved: the stream to this peer cannot be resynced
            std::string why = std::string("mooncake ") + ((*it)->is_send ? "send to" : "recv from") +
                              " rank " + std::to_string(peer) + " (rank " + std::to_string(rank_) +
                              "): timed out mid-message; the link to that rank is closed";
            broken[peer] = why;
            std::deque<std::shared_ptr<P2POp>> doomed;
            doomed.swap(q);
            for (auto& op : doomed) fail(op, why, false);
            return;
          }
          if ((*it)->deadline_ns < now && !(*it)->started) {
            fail(*it,
                 std::string("mooncake ") + ((*it)->is_send ? "send" : "recv") + " (rank " +
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
        if (in[j].op && in[j].op->deadline_ns < now) {
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
