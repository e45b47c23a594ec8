// MooncakeWork (pg/work.hpp).
#include "pg/work.hpp"

namespace mooncake {

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

bool MooncakeWork::isCompleted() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

bool MooncakeWork::isSuccess() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_ && !err_;
}

std::exception_ptr MooncakeWork::exception() const {
  std::lock_guard<std::mutex> g(mu_);
  return err_;
}

int MooncakeWork::sourceRank() const { return source_rank; }

std::vector<at::Tensor> MooncakeWork::result() { return outputs_; }

void MooncakeWork::add_output(const std::vector<at::Tensor>& ts) {
  outputs_.insert(outputs_.end(), ts.begin(), ts.end());
}

bool MooncakeWork::wait(std::chrono::milliseconds timeout) {
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

c10::intrusive_ptr<c10::ivalue::Future> MooncakeWork::getFuture() { return future_; }

void MooncakeWork::finish(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    done_ = true;
    err_ = err;
  }
  cv_.notify_all();
}

void MooncakeWork::complete_future() {
  if (future_->completed()) return;
  std::exception_ptr e = exception();
  if (e) {
    future_->setError(e);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

bool MooncakeWork::child_done(std::exception_ptr err) {
  std::lock_guard<std::mutex> g(child_mu_);
  if (err && !child_err_) child_err_ = err;
  return --pending_children_ == 0;
}

}  // namespace mooncake
