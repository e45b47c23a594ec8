// Scheduling of MooncakeBackend's collectives: submit() runs an op inline on the caller's
// thread or queues it for the progress thread, retries it per the failure policy, and
// deliver() completes its Work; futures complete on the completion threads; coalescing
// sessions (startCoalescing / endCoalescing) group works under one parent.
#include <cstdio>

#include "pg/backend.hpp"
#include "pg/collectives/op_header.hpp"
#include "pg/control_store.hpp"

namespace mooncake {

void MooncakeBackend::setTimeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout; }

int64_t MooncakeBackend::deadline_ns_for(std::chrono::milliseconds t) const {
  auto ms = (t.count() > 0) ? t : timeout_ms_;
  return now_ns() + static_cast<int64_t>(ms.count()) * 1000000LL;
}

void MooncakeBackend::shutdown() {
  {
    std::lock_guard<std::mutex> g(qmu_);
    if (stop_) return;
    stop_ = true;
  }
  if (heartbeat_) heartbeat_->stop = true;
  if (coll_) coll_->request_abort();
  qcv_.notify_all();
  ccv_.notify_all();
  if (p2p_) p2p_->notify();
  if (progress_thread_.joinable()) progress_thread_.join();
  if (p2p_thread_.joinable()) p2p_thread_.join();
  std::vector<std::thread> ct;
  {
    std::lock_guard<std::mutex> g(qmu_);
    ct.swap(completion_threads_);
  }
  for (auto& t : ct)
    if (t.joinable()) t.join();
}

void MooncakeBackend::ensure_threads(bool p2p) {
  // called with qmu_ held
  if (!p2p && !progress_thread_.joinable()) progress_thread_ = std::thread([this] { progress_loop(); });
  if (p2p && !p2p_thread_.joinable()) p2p_thread_ = std::thread([this] { p2p_loop(); });
}

void MooncakeBackend::deliver(const c10::intrusive_ptr<MooncakeWork>& w, std::exception_ptr err,
                              bool inline_future) {
  if (!err && w->after) {
    try {
      w->after();
    } catch (...) {
      err = std::current_exception();
    }
  }
  w->finish(err);
  std::vector<c10::intrusive_ptr<MooncakeWork>> done{w};
  if (w->parent && w->parent->child_done(err)) {
    w->parent->finish(w->parent->child_error());
    done.push_back(w->parent);
  }
  if (!inline_future) {
    std::lock_guard<std::mutex> g(qmu_);
    inline_future = stop_;  // shutting down: no completion thread may be left to run them
  }
  if (inline_future) {
    for (auto& d : done) d->complete_future();
  } else {
    {
      std::lock_guard<std::mutex> g(qmu_);
      for (auto& d : done) completions_.push_back(d);
      if (completion_idle_ == 0 && completion_threads_.size() < 64 && !stop_) {
        completion_idle_++;
        completion_threads_.emplace_back([this] { completion_loop(); });
      }
    }
    ccv_.notify_one();
  }
}

c10::intrusive_ptr<MooncakeWork> MooncakeBackend::submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                         bool async_op, std::chrono::milliseconds timeout,
                                                         Job job, std::function<void()> after,
                                                         std::function<void()> before_retry) {
  auto w = c10::make_intrusive<MooncakeWork>(rank_, type, outputs);
  w->after = std::move(after);
  attach_to_coalescing(w, outputs);
  const uint32_t block_pos = coalescing_ ? ++coalesced_ops_ : 0;  // see OpHeader::batch_index
  ++seq_;
  ++seq_group_;
  if (cfg_.debug)
    trace("issued " + c10d::opTypeToString(type) + " #" + std::to_string(seq_) + (async_op ? " async" : ""));
  auto run = [this, job, timeout, before_retry, block_pos]() -> std::exception_ptr {
    std::lock_guard<std::mutex> g(engine_mu_);
    BatchScope pos(block_pos, 0);
    for (int attempt = 0;; ++attempt) {
      try {
        if (fenced_) fence(broken_, static_cast<int64_t>(agreed_epoch_));  // every later op raises it too
        if (!broken_.empty()) C10_THROW_ERROR(DistBackendError, broken_);
        if (joining_)
          C10_THROW_ERROR(DistBackendError, "MooncakeBackend (rank " + std::to_string(rank_) +
                                                "): this recovering rank must call join_group before any op");
        if (policy_ == FailurePolicy::MANUAL && agreed_epoch_ != epoch_) {
          // a failure is agreed but the caller has not deactivated it yet: fail fast
          throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): rank(s) " +
                                join_ranks(pending_failed()) + " failed (epoch " +
                                std::to_string(agreed_epoch_) +
                                "); on_failure='manual': call deactivate_ranks before further ops",
                            pending_failed(), static_cast<int64_t>(agreed_epoch_));
        }
        if (attempt > 0 && before_retry) before_retry();
        std::vector<int> elsewhere = failed_elsewhere();
        if (!elsewhere.empty())
          throw PeerFailure("rank(s) agreed failed by another group of this process", elsewhere, false);
        job(deadline_ns_for(timeout));
        try {
          fence_if_declared_failed();
        } catch (...) {
          return std::current_exception();
        }
        return nullptr;
      } catch (const PeerFailure& e) {
        try {
          std::vector<int> newly = agree(e.ranks, e.reason);
          if (cfg_.debug)
            fprintf(stderr, "%s\nrecent ops (MOONCAKE_DEBUG):\n%s", e.what(), dump_trace().c_str());
          if (policy_ == FailurePolicy::MASK && attempt < size_) continue;  // rerun over survivors
          // a rank that left sent nothing for this op (it leaves between ops): rerun without it
          if (only_leaves(e.ranks) && attempt < size_) continue;
          throw_failure(e.what(), newly);
        } catch (...) {
          return std::current_exception();
        }
      } catch (const EpochAhead&) {
        try {
          std::vector<int> newly = agree({}, "catch up");
          if (policy_ == FailurePolicy::MASK && attempt < size_) continue;
          if (only_leaves(newly) && attempt < size_) continue;
          throw_failure("a peer moved to a later membership epoch", newly);
        } catch (...) {
          return std::current_exception();
        }
      } catch (const EngineAborted& e) {
        return std::make_exception_ptr(c10::DistBackendError(
            c10::SourceLocation{__func__, __FILE__, __LINE__},
            std::string("MooncakeBackend (rank ") + std::to_string(rank_) + "): " + e.what()));
      } catch (const c10::Error&) {
        return std::current_exception();
      } catch (const std::exception& e) {
        broken_ = std::string("MooncakeBackend: the group is unusable after an earlier failure: ") + e.what();
        return std::make_exception_ptr(c10::DistBackendError(
            c10::SourceLocation{__func__, __FILE__, __LINE__},
            std::string("MooncakeBackend (rank ") + std::to_string(rank_) + "): " + e.what()));
      }
    }
  };
  if (!async_op) {
    bool can_inline = false;
    {
      std::lock_guard<std::mutex> g(qmu_);
      TORCH_CHECK(!stop_, "MooncakeBackend::submit: the process group was shut down");
      if (inflight_ == 0) {
        inflight_++;
        can_inline = true;
      }
    }
    if (can_inline) {
      std::exception_ptr err = run();
      {
        std::lock_guard<std::mutex> g(qmu_);
        inflight_--;
      }
      deliver(w, err, /*inline_future=*/true);
      return w;
    }
  }
  {
    std::lock_guard<std::mutex> g(qmu_);
    TORCH_CHECK(!stop_, "MooncakeBackend::submit: the process group was shut down");
    ensure_threads(false);
    inflight_++;
    queue_.push_back([this, w, run]() { deliver(w, run(), false); });
  }
  qcv_.notify_all();
  return w;
}

void MooncakeBackend::trace(const std::string& what) {
  std::lock_guard<std::mutex> g(trace_mu_);
  trace_.push_back(std::to_string(now_ns() / 1000) + " us: " + what);
  if (trace_.size() > 64) trace_.pop_front();
}

std::string MooncakeBackend::dump_trace() {
  std::lock_guard<std::mutex> g(trace_mu_);
  std::string s;
  for (auto& t : trace_) s += "  " + t + "\n";
  return s;
}

void MooncakeBackend::progress_loop() {
  while (true) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(qmu_);
      qcv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
    {
      std::lock_guard<std::mutex> g(qmu_);
      inflight_--;
    }
  }
}

void MooncakeBackend::completion_loop() {
  // this thread was counted idle when it was created
  while (true) {
    c10::intrusive_ptr<MooncakeWork> w;
    {
      std::unique_lock<std::mutex> lk(qmu_);
      ccv_.wait(lk, [&] { return stop_ || !completions_.empty(); });
      if (completions_.empty()) return;
      w = completions_.front();
      completions_.pop_front();
      completion_idle_--;
      if (!completions_.empty() && completion_idle_ == 0 && completion_threads_.size() < 64 && !stop_) {
        completion_idle_++;
        completion_threads_.emplace_back([this] { completion_loop(); });
      }
    }
    try {
      w->complete_future();
    } catch (...) {
    }
    std::lock_guard<std::mutex> g(qmu_);
    completion_idle_++;
  }
}

void MooncakeBackend::startCoalescing() {
  if (coalescing_) {
    // a previous session was never ended (torch's _coalescing_manager does not call
    // _end_coalescing when its body raised): close it so its works still complete
    endCoalescing();
  }
  coalescing_ = true;
  coalesced_ops_ = 0;
  coalesce_parent_ =
      c10::make_intrusive<MooncakeWork>(rank_, c10d::OpType::COALESCED, std::vector<at::Tensor>{});
  coalesce_parent_->add_child({});  // guard released by endCoalescing
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "MooncakeBackend::endCoalescing: not coalescing");
  coalescing_ = false;
  auto p = coalesce_parent_;
  coalesce_parent_.reset();
  if (p->child_done(nullptr)) {
    p->finish(p->child_error());
    p->complete_future();
  }
#ifdef MOONCAKE_WITH_CUDA
  if (!coalesced_cuda_.empty()) {
    auto children = std::move(coalesced_cuda_);
    coalesced_cuda_.clear();
    return cuda_coalesced(rank_, p, std::move(children));
  }
#endif
  return p;
}

void MooncakeBackend::attach_to_coalescing(const c10::intrusive_ptr<MooncakeWork>& w,
                                           const std::vector<at::Tensor>& outputs) {
  if (!coalescing_) return;
  w->parent = coalesce_parent_;
  coalesce_parent_->add_child(outputs);
}

}  // namespace mooncake
