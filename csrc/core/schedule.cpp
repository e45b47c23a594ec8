// Scheduling of the group core's collectives: submit() runs an op inline on the caller's
// thread or queues it for the progress thread and retries it per the failure policy;
// complete() runs the Works' future completions on the completion threads.
#include <condition_variable>
#include <cstdio>

#include "core/group.hpp"
#include "core/op_header.hpp"

namespace mooncake {

int64_t Group::deadline_ns_for(std::chrono::milliseconds t) const {
  auto ms = (t.count() > 0) ? t : timeout_ms_;
  return now_ns() + static_cast<int64_t>(ms.count()) * 1000000LL;
}

void Group::shutdown() {
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

void Group::ensure_threads(bool p2p) {
  // called with qmu_ held
  if (!p2p && !progress_thread_.joinable()) progress_thread_ = std::thread([this] { progress_loop(); });
  if (p2p && !p2p_thread_.joinable()) p2p_thread_ = std::thread([this] { p2p_loop(); });
}

void Group::complete(std::vector<std::function<void()>> fns, bool run_inline) {
  if (!run_inline) {
    std::lock_guard<std::mutex> g(qmu_);
    run_inline = stop_;  // shutting down: no completion thread may be left to run them
  }
  if (run_inline) {
    for (auto& f : fns) f();
    return;
  }
  {
    std::lock_guard<std::mutex> g(qmu_);
    for (auto& f : fns) completions_.push_back(std::move(f));
    if (completion_idle_ == 0 && completion_threads_.size() < 64 && !stop_) {
      completion_idle_++;
      completion_threads_.emplace_back([this] { completion_loop(); });
    }
  }
  ccv_.notify_one();
}

std::exception_ptr Group::run_op(const Op& op) {
  std::lock_guard<std::mutex> g(engine_mu_);
  BatchScope pos(op.block_pos, 0);
  for (int attempt = 0;; ++attempt) {
    try {
      if (fenced_) fence(broken_, static_cast<int64_t>(agreed_epoch_));  // every later op raises it too
      if (!broken_.empty()) throw GroupBackendError(broken_);
      if (joining_)
        throw GroupBackendError("MooncakeBackend (rank " + std::to_string(rank_) +
                                "): this recovering rank must call join_group before any op");
      if (policy_ == FailurePolicy::MANUAL && agreed_epoch_ != epoch_) {
        // a failure is agreed but the caller has not deactivated it yet: fail fast
        throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): rank(s) " +
                              join_ranks(pending_failed()) + " failed (epoch " +
                              std::to_string(agreed_epoch_) +
                              "); on_failure='manual': call deactivate_ranks before further ops",
                          pending_failed(), static_cast<int64_t>(agreed_epoch_));
      }
      if (attempt > 0 && op.before_retry) op.before_retry();
      std::vector<int> elsewhere = failed_elsewhere();
      if (!elsewhere.empty())
        throw PeerFailure("rank(s) agreed failed by another group of this process", elsewhere, false);
      op.job(deadline_ns_for(op.timeout));
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
      return std::make_exception_ptr(GroupBackendError(std::string("MooncakeBackend (rank ") +
                                                       std::to_string(rank_) + "): " + e.what()));
    } catch (const GroupError&) {
      // the op's own errors (a mismatch, a root that is not active, the store's errors) and
      // the torch layer's (ForeignError): the group goes on
      return std::current_exception();
    } catch (const std::exception& e) {
      broken_ = std::string("MooncakeBackend: the group is unusable after an earlier failure: ") + e.what();
      return std::make_exception_ptr(GroupBackendError(std::string("MooncakeBackend (rank ") +
                                                       std::to_string(rank_) + "): " + e.what()));
    }
  }
}

void Group::submit(bool async_op, Op op) {
  ++seq_;
  ++seq_group_;
  if (cfg_.debug) trace("issued " + op.trace_name + " #" + std::to_string(seq_) + (async_op ? " async" : ""));
  if (!async_op) {
    bool can_inline = false;
    {
      std::lock_guard<std::mutex> g(qmu_);
      MOONCAKE_CHECK(!stop_, "MooncakeBackend::submit: the process group was shut down");
      if (inflight_ == 0) {
        inflight_++;
        can_inline = true;
      }
    }
    if (can_inline) {
      std::exception_ptr err = run_op(op);
      {
        std::lock_guard<std::mutex> g(qmu_);
        inflight_--;
      }
      op.done(err, /*ran_inline=*/true);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> g(qmu_);
    MOONCAKE_CHECK(!stop_, "MooncakeBackend::submit: the process group was shut down");
    ensure_threads(false);
    inflight_++;
    queue_.push_back([this, op = std::move(op)]() { op.done(run_op(op), false); });
  }
  qcv_.notify_all();
}

void Group::run_sync(Job job, std::function<void()> before_retry) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr err;
  Op op;
  op.job = std::move(job);
  op.before_retry = std::move(before_retry);
  if (cfg_.debug) op.trace_name = "ALLREDUCE";
  op.done = [&](std::exception_ptr e, bool) {
    std::lock_guard<std::mutex> g(mu);
    err = e;
    done = true;
    cv.notify_all();
  };
  submit(false, std::move(op));
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  if (err) std::rethrow_exception(err);
}

void Group::trace(const std::string& what) {
  std::lock_guard<std::mutex> g(trace_mu_);
  trace_.push_back(std::to_string(now_ns() / 1000) + " us: " + what);
  if (trace_.size() > 64) trace_.pop_front();
}

std::string Group::dump_trace() {
  std::lock_guard<std::mutex> g(trace_mu_);
  std::string s;
  for (auto& t : trace_) s += "  " + t + "\n";
  return s;
}

void Group::progress_loop() {
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

void Group::completion_loop() {
  // this thread was counted idle when it was created
  while (true) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(qmu_);
      ccv_.wait(lk, [&] { return stop_ || !completions_.empty(); });
      if (completions_.empty()) return;
      fn = std::move(completions_.front());
      completions_.pop_front();
      completion_idle_--;
      if (!completions_.empty() && completion_idle_ == 0 && completion_threads_.size() < 64 && !stop_) {
        completion_idle_++;
        completion_threads_.emplace_back([this] { completion_loop(); });
      }
    }
    try {
      fn();
    } catch (...) {
      // a future's completion that throws (a callback's error is stored in its own future)
      // must not end this thread: the other completions still need it
    }
    std::lock_guard<std::mutex> g(qmu_);
    completion_idle_++;
  }
}

}  // namespace mooncake
