// The Work of MooncakeBackend's ops: completes once (finish), wakes wait(), then its
// future completes on a completion thread (complete_future). Inside a coalescing session
// each op's Work is a child of the session's parent Work, which completes when the last
// child does (with the first child's error, if any). Defined here, inline: a translation
// unit of its own would compile torch's headers once more for these few lines.
#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace mooncake {

class MooncakeWork : public c10d::Work {
 public:
  MooncakeWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void synchronize() override {}

  // Marks the work done (err == nullptr: success). Wakes wait(); does not touch the future.
  void finish(std::exception_ptr err);
  // Completes the future (runs its callbacks): call off the progress threads.
  void complete_future();

  int source_rank = -1;
  std::function<void()> after;  // copies results back into non-contiguous user tensors
  // Coalescing: each child names its parent, which completes when every child has.
  c10::intrusive_ptr<MooncakeWork> parent;
  void add_child(const std::vector<at::Tensor>& outs) {
    std::lock_guard<std::mutex> g(child_mu_);
    pending_children_++;
    add_output(outs);
  }
  bool child_done(std::exception_ptr err);  // true when it was the last one
  std::exception_ptr child_error() {
    std::lock_guard<std::mutex> g(child_mu_);
    return child_err_;
  }
  void add_output(const std::vector<at::Tensor>& ts);

 private:
  std::mutex child_mu_;
  int pending_children_ = 0;
  std::exception_ptr child_err_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

inline MooncakeWork::MooncakeWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

inline bool MooncakeWork::isCompleted() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

inline bool MooncakeWork::isSuccess() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_ && !err_;
}

inline std::exception_ptr MooncakeWork::exception() const {
  std::lock_guard<std::mutex> g(mu_);
  return err_;
}

inline int MooncakeWork::sourceRank() const { return source_rank; }

inline std::vector<at::Tensor> MooncakeWork::result() { return outputs_; }

inline void MooncakeWork::add_output(const std::vector<at::Tensor>& ts) {
  outputs_.insert(outputs_.end(), ts.begin(), ts.end());
}

inline bool MooncakeWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout == kNoTimeout) {
    cv_.wait(lk, [&] { return done_; });
  } else if (!cv_.wait_for(lk, timeout, [&] { return done_; })) {
    C10_THROW_ERROR(DistBackendError, "MooncakeWork::wait: timed out after " +
                                          std::to_string(timeout.count()) +
                                          " ms; the op goes on and no rank is declared failed");
  }
  std::exception_ptr err = err_;
  lk.unlock();
  // The future is completed (before its callbacks run) right after finish(); wait for it
  // so that get_future().done() holds once wait() returns, as with gloo.
  future_->wait();
  if (err) std::rethrow_exception(err);
  return true;
}

inline c10::intrusive_ptr<c10::ivalue::Future> MooncakeWork::getFuture() { return future_; }

inline void MooncakeWork::finish(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    done_ = true;
    err_ = err;
  }
  cv_.notify_all();
}

inline void MooncakeWork::complete_future() {
  if (future_->completed()) return;
  std::exception_ptr e = exception();
  if (e) {
    future_->setError(e);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

inline bool MooncakeWork::child_done(std::exception_ptr err) {
  std::lock_guard<std::mutex> g(child_mu_);
  if (err && !child_err_) child_err_ = err;
  return --pending_children_ == 0;
}

}  // namespace mooncake
