// The Work of MooncakeBackend's ops: completes once (finish), wakes wait(), then its
// future completes on a completion thread (complete_future). Inside a coalescing session
// each op's Work is a child of the session's parent Work, which completes when the last
// child does (with the first child's error, if any).
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

}  // namespace mooncake
