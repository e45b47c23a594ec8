#ifdef MOONCAKE_WITH_CUDA
#include "pg/cuda/staging.hpp"

// Only c10/cuda headers (not ATen/cuda, which pulls in cuBLAS/cuSPARSE headers a bare
// toolkit may lack); events through transport/cuda.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>

#include <initializer_list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "pg/convert.hpp"
#include "transport/cuda/cuda.hpp"

namespace mooncake {

cuda::DType to_cuda_dtype(c10::ScalarType st, const char* fn);

namespace {

// A CUDA event without timing (RAII over transport/cuda's helpers).
class Event {
 public:
  Event() : ev_(cuda::event_create()) {}
  ~Event() { cuda::event_destroy(ev_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(const c10::cuda::CUDAStream& s) { cuda::event_record(ev_, s.stream()); }
  void block(const c10::cuda::CUDAStream& s) { cuda::stream_wait_event(s.stream(), ev_); }
  bool query() { return cuda::event_query(ev_); }

 private:
  void* ev_;
};

class CudaStagedWork : public c10d::Work {
 public:
  CudaStagedWork(int rank, c10d::OpType type, c10::intrusive_ptr<c10d::Work> inner,
                 std::vector<std::pair<at::Tensor, at::Tensor>> back, c10::Device dev,
                 std::vector<at::Tensor> outputs, std::vector<c10::intrusive_ptr<c10d::Work>> children)
      : c10d::Work(rank, type),
        inner_(std::move(inner)),
        back_(std::move(back)),
        dev_(dev),
        outputs_(std::move(outputs)),
        children_(std::move(children)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{dev_});
  }

  static c10::intrusive_ptr<CudaStagedWork> make(int rank, c10d::OpType type,
                                                 c10::intrusive_ptr<c10d::Work> inner,
                                                 std::vector<std::pair<at::Tensor, at::Tensor>> back,
                                                 c10::Device dev, std::vector<at::Tensor> outputs,
                                                 std::vector<c10::intrusive_ptr<c10d::Work>> children = {}) {
    auto w = c10::make_intrusive<CudaStagedWork>(rank, type, inner, std::move(back), dev, std::move(outputs),
                                                 std::move(children));
    // completes the CUDA future once the CPU op finished and the copies back are queued
    // (the callback holds `w` until the inner future completes, then it is dropped)
    inner->getFuture()->addCallback([w](c10::ivalue::Future& f) {
      if (f.hasError()) {
        w->future_->setErrorIfNeeded(f.exception_ptr());
        return;
      }
      try {
        w->copy_back();
        c10::cuda::CUDAStreamGuard sg(w->side_stream());
        w->future_->markCompleted(c10::IValue(w->outputs_));
      } catch (...) {
        w->future_->setErrorIfNeeded(std::current_exception());
      }
    });
    return w;
  }

  // Queues the copies of the staged outputs back into the user's CUDA tensors on a side
  // stream and records `done_` there. Idempotent; only after the inner work succeeded.
  void copy_back() {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    for (auto& c : children_) static_cast<CudaStagedWork*>(c.get())->copy_back();
    c10::cuda::CUDAGuard dg(dev_);
    stream_ = c10::cuda::getStreamFromPool(false, dev_.index());
    {
      c10::cuda::CUDAStreamGuard sg(*stream_);
      for (auto& [user, pinned] : back_) {
        if (user.numel() == 0) continue;
        user.copy_(pinned, /*non_blocking=*/true);
        c10::cuda::CUDACachingAllocator::recordStream(user.storage().data_ptr(), *stream_);
      }
    }
    done_ = std::make_unique<Event>();
    done_->record(*stream_);
  }

  c10::cuda::CUDAStream side_stream() {
    std::lock_guard<std::mutex> g(mu_);
    return *stream_;
  }

  // The caller's current stream waits for the copies back (NCCL's Work.wait semantics).
  void block_current() {
    for (auto& c : children_) static_cast<CudaStagedWork*>(c.get())->block_current();
    std::lock_guard<std::mutex> g(mu_);
    if (done_) done_->block(c10::cuda::getCurrentCUDAStream(dev_.index()));
  }

  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);  // throws the op's error (or a timeout) like a CPU work
    copy_back();
    block_current();
    return true;
  }
  bool isCompleted() override {
    if (!inner_->isCompleted()) return false;
    if (!inner_->isSuccess()) return true;
    copy_back();
    for (auto& c : children_)
      if (!c->isCompleted()) return false;
    std::lock_guard<std::mutex> g(mu_);
    return done_->query();
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void synchronize() override { block_current(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (user's CUDA tensor, pinned staging)
  c10::Device dev_;
  std::vector<at::Tensor> outputs_;
  std::vector<c10::intrusive_ptr<c10d::Work>> children_;
  std::mutex mu_;
  std::optional<c10::cuda::CUDAStream> stream_;
  std::unique_ptr<Event> done_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

void check_reduce_args(const at::Tensor& dst, const at::Tensor& src, int op, const char* fn) {
  TORCH_CHECK_VALUE(dst.is_cuda() && src.is_cuda(), fn, ": expected CUDA tensors, got ", dst.device(),
                    " and ", src.device());
  TORCH_CHECK_VALUE(dst.device() == src.device(), fn, ": expected tensors on one device, got ", dst.device(),
                    " and ", src.device());
  TORCH_CHECK_VALUE(dst.scalar_type() == src.scalar_type(), fn, ": expected dtype ", dst.scalar_type(),
                    ", got ", src.scalar_type());
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), fn, ": expected ", dst.numel(), " elements, got ",
                    src.numel());
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), fn, ": expected contiguous tensors");
  TORCH_CHECK_VALUE(op >= 0 && op <= static_cast<int>(RedOp::PREMUL_SUM), fn, ": unknown ReduceOp code ", op);
  const std::string why = check_reduce_supported(dst.scalar_type(), static_cast<RedOp>(op));
  TORCH_CHECK_VALUE(why.empty(), fn, ": ", why);
}

}  // namespace

int cuda_dtype_code(c10::ScalarType st, const char* fn) { return static_cast<int>(to_cuda_dtype(st, fn)); }

cuda::DType to_cuda_dtype(c10::ScalarType st, const char* fn) {
  const std::optional<DType> dt = to_dtype(st);
  TORCH_CHECK_VALUE(dt.has_value(), fn, ": unsupported dtype ", c10::toString(st));
  return static_cast<cuda::DType>(*dt);
}
// The kernels' enums (transport/cuda/cuda.hpp, which depends on nothing above it) follow the
// group core's value for value, so that a DType or RedOp passes by a cast.
namespace {
template <typename A, typename B>
constexpr bool same_values(std::initializer_list<std::pair<A, B>> pairs) {
  for (const auto& p : pairs)
    if (static_cast<int>(p.first) != static_cast<int>(p.second)) return false;
  return true;
}
}  // namespace
static_assert(same_values<cuda::DType, DType>({{cuda::DType::F64, DType::F64},
                                               {cuda::DType::F32, DType::F32},
                                               {cuda::DType::F16, DType::F16},
                                               {cuda::DType::BF16, DType::BF16},
                                               {cuda::DType::F8E4M3, DType::F8E4M3},
                                               {cuda::DType::F8E5M2, DType::F8E5M2},
                                               {cuda::DType::I8, DType::I8},
                                               {cuda::DType::I16, DType::I16},
                                               {cuda::DType::I32, DType::I32},
                                               {cuda::DType::I64, DType::I64},
                                               {cuda::DType::U8, DType::U8},
                                               {cuda::DType::U16, DType::U16},
                                               {cuda::DType::U32, DType::U32},
                                               {cuda::DType::U64, DType::U64},
                                               {cuda::DType::BOOL, DType::BOOL},
                                               {cuda::DType::C64, DType::C64},
                                               {cuda::DType::C128, DType::C128}}),
              "cuda::DType follows DType");
static_assert(same_values<cuda::Op, RedOp>({{cuda::Op::SUM, RedOp::SUM},
                                            {cuda::Op::AVG, RedOp::AVG},
                                            {cuda::Op::PRODUCT, RedOp::PRODUCT},
                                            {cuda::Op::MIN, RedOp::MIN},
                                            {cuda::Op::MAX, RedOp::MAX},
                                            {cuda::Op::BAND, RedOp::BAND},
                                            {cuda::Op::BOR, RedOp::BOR},
                                            {cuda::Op::BXOR, RedOp::BXOR},
                                            {cuda::Op::PREMUL_SUM, RedOp::PREMUL_SUM}}),
              "cuda::Op follows RedOp");

bool any_cuda(const std::vector<at::Tensor*>& ts) {
  for (const at::Tensor* t : ts)
    if (t->defined() && t->is_cuda()) return true;
  return false;
}

c10::intrusive_ptr<c10d::Work> cuda_staged(int rank, c10d::OpType type, const char* op,
                                           const std::vector<at::Tensor*>& ins,
                                           const std::vector<at::Tensor*>& outs,
                                           const std::function<c10::intrusive_ptr<c10d::Work>()>& cpu_call,
                                           bool coalescing,
                                           std::vector<c10::intrusive_ptr<c10d::Work>>* coalesced) {
  std::vector<at::Tensor*> all;
  std::unordered_set<at::Tensor*> seen;
  for (auto* v : {&ins, &outs})
    for (at::Tensor* p : *v)
      if (p->defined() && seen.insert(p).second) all.push_back(p);
  std::optional<c10::Device> dev;
  for (at::Tensor* p : all) {
    TORCH_CHECK_VALUE(p->is_cuda(), "MooncakeBackend::", op,
                      ": expected every tensor on one CUDA device, got one on ", p->device(),
                      " next to CUDA tensors");
    if (!dev) dev = p->device();
    TORCH_CHECK_VALUE(p->device() == *dev, "MooncakeBackend::", op, ": expected every tensor on ", *dev,
                      ", got one on ", p->device());
  }
  c10::cuda::CUDAGuard g(*dev);
  auto cur = c10::cuda::getCurrentCUDAStream(dev->index());
  std::unordered_map<at::Tensor*, at::Tensor> orig;
  for (at::Tensor* p : all) {
    at::Tensor pinned = at::empty(p->sizes(), p->options().device(at::kCPU).pinned_memory(true));
    if (p->numel()) pinned.copy_(*p, /*non_blocking=*/true);  // on the current stream: after prior work
    orig[p] = *p;
    *p = pinned;
  }
  auto restore = [&] {
    for (auto& [p, t] : orig) *p = t;
  };
  c10::intrusive_ptr<c10d::Work> inner;
  try {
    cur.synchronize();  // the staged inputs are ready (first path: the host waits here)
    inner = cpu_call();
  } catch (...) {
    restore();
    throw;
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  std::vector<at::Tensor> outputs;
  std::unordered_set<at::Tensor*> out_seen;
  for (at::Tensor* p : outs) {
    if (!p->defined() || !out_seen.insert(p).second) continue;
    back.emplace_back(orig[p], *p);
    outputs.push_back(orig[p]);
  }
  restore();
  c10::intrusive_ptr<c10d::Work> w =
      CudaStagedWork::make(rank, type, inner, std::move(back), *dev, std::move(outputs));
  if (coalescing && coalesced) coalesced->push_back(w);
  return w;
}

c10::intrusive_ptr<c10d::Work> cuda_coalesced(int rank, c10::intrusive_ptr<c10d::Work> inner,
                                              std::vector<c10::intrusive_ptr<c10d::Work>> children) {
  TORCH_CHECK(!children.empty(), "cuda_coalesced: no children");
  std::vector<at::Tensor> outputs;
  c10::Device dev(c10::kCUDA, 0);
  for (auto& c : children)
    for (auto& t : c->result()) {
      outputs.push_back(t);
      dev = t.device();
    }
  return CudaStagedWork::make(rank, c10d::OpType::COALESCED, inner, {}, dev, std::move(outputs),
                              std::move(children));
}

void cuda_reduce_(at::Tensor& dst, const std::vector<at::Tensor>& srcs, int op) {
  const char* fn = "mooncake_pg._C._cuda_reduce";
  TORCH_CHECK_VALUE(!srcs.empty() && srcs.size() < static_cast<size_t>(cuda::kMaxSources), fn,
                    ": expected 1..", cuda::kMaxSources - 1, " sources, got ", srcs.size());
  std::vector<const void*> ptrs{dst.data_ptr()};
  for (const auto& s : srcs) {
    check_reduce_args(dst, s, op, fn);
    ptrs.push_back(s.data_ptr());
  }
  c10::cuda::CUDAGuard g(dst.device());
  try {
    cuda::launch_reduce(dst.data_ptr(), ptrs.data(), static_cast<int>(ptrs.size()),
                        static_cast<size_t>(dst.numel()), to_cuda_dtype(dst.scalar_type(), fn),
                        static_cast<cuda::Op>(op),
                        c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, fn, ": ", e.what());
  }
}

std::string cuda_ipc_export(const at::Tensor& t, int64_t* offset) {
  TORCH_CHECK_VALUE(t.is_cuda(), "mooncake_pg._C._cuda_ipc_export: expected a CUDA tensor, got one on ",
                    t.device());
  c10::cuda::CUDAGuard g(t.device());
  size_t size = 0;
  void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.storage().data_ptr().get(), &size);
  *offset = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(base);
  try {
    return cuda::ipc_export(base);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "mooncake_pg._C._cuda_ipc_export: ", e.what());
  }
}

void cuda_ipc_reduce_from(at::Tensor& dst, const std::string& handle, int64_t offset, int op) {
  const char* fn = "mooncake_pg._C._cuda_ipc_reduce_from";
  check_reduce_args(dst, dst, op, fn);
  c10::cuda::CUDAGuard g(dst.device());
  void* base = nullptr;
  try {
    base = cuda::ipc_open(handle, dst.device().index());
    const void* ptrs[2] = {dst.data_ptr(), static_cast<const char*>(base) + offset};
    auto stream = c10::cuda::getCurrentCUDAStream(dst.device().index());
    cuda::launch_reduce(dst.data_ptr(), ptrs, 2, static_cast<size_t>(dst.numel()),
                        to_cuda_dtype(dst.scalar_type(), fn), static_cast<cuda::Op>(op), stream.stream());
    stream.synchronize();  // the mapping is closed below
  } catch (const std::runtime_error& e) {
    if (base) {
      try {
        cuda::ipc_close(base);
      } catch (const std::runtime_error&) {
      }
    }
    TORCH_CHECK(false, fn, ": ", e.what());
  }
  try {
    cuda::ipc_close(base);
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, fn, ": ", e.what());
  }
}

}  // namespace mooncake
#endif  // MOONCAKE_WITH_CUDA
