#ifdef MOONCAKE_WITH_CUDA
#include "pg/cuda/ipc.hpp"

// Only c10/cuda headers (see pg/cuda/staging.cpp); CUDA calls through transport/cuda.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <unistd.h>

#include <stdexcept>

#include "pg/cuda/staging.hpp"
#include "transport/cuda/cuda.hpp"

namespace mooncake {

namespace {

// Runs a transport/cuda call; its std::runtime_error becomes a c10::Error naming `where`.
template <class F>
auto cuda_call(const char* where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, where, ": ", e.what(),
                " (MOONCAKE_CUDA_IPC=0 makes the group stage CUDA tensors through "
                "pinned host memory instead)");
  }
}

size_t size_class(size_t nbytes) {
  size_t c = CudaIpc::kMinClassBytes;
  while (c < nbytes && c < CudaIpc::kMaxClassBytes) c <<= 1;
  return c;
}

// Store values: "<pid> <raw handle bytes>"
std::string with_pid(const std::string& raw) { return std::to_string(getpid()) + " " + raw; }

}  // namespace

CudaIpcOp::CudaIpcOp(at::Tensor t, c10::Device d, c10::cuda::CUDAStream s)
    : user(std::move(t)), dev(d), stream(s) {}

CudaIpcOp::~CudaIpcOp() {
  cuda::event_destroy(start);  // released by CUDA once pending work is done
  cuda::event_destroy(end);
}

CudaIpc::CudaIpc(int rank, int size, c10::intrusive_ptr<c10d::Store> store, std::string ns)
    : rank_(rank), size_(size), store_(std::move(store)), ns_(std::move(ns)), peers_(size) {}

CudaIpc::~CudaIpc() {
  // Never throws: at process exit the driver may already be gone.
  try {
    if (stream_) stream_->synchronize();
    // best effort before freeing my buffers: the peers' latest "done reading" records (a
    // peer that passed the last round but has not queued its reduction yet is not covered)
    for (auto& p : peers_)
      for (int i = 2; i < 4; ++i)
        if (p.ev[i]) cuda::event_synchronize(p.ev[i]);
  } catch (...) {
  }
  for (auto& p : peers_) {
    try {
      drop_peer(p);
    } catch (...) {
    }
  }
  for (auto& [cls, b] : bufs_) cuda::device_free(b);
  for (void* e : ev_) cuda::event_destroy(e);
}

std::shared_ptr<CudaIpcOp> CudaIpc::begin(const at::Tensor& t, const char* opname, const at::Tensor& out) {
  std::lock_guard<std::mutex> g(mu_);
  if (!dev_) {
    dev_ = t.device();
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, t.device().index());
  }
  TORCH_CHECK_VALUE(t.device() == *dev_, "CudaIpc::begin: ", opname, " on ", t.device(),
                    ", but this group's CUDA IPC "
                    "buffers live on ",
                    *dev_,
                    " (one device per process and group; MOONCAKE_CUDA_IPC=0 stages "
                    "through host memory instead)");
  c10::cuda::CUDAGuard dg(*dev_);
  TORCH_CHECK_VALUE(!out.defined() || out.device() == *dev_, "CudaIpc::begin: ", opname, ": output on ",
                    out.defined() ? out.device() : *dev_, ", expected ", *dev_, " (the input's device)");
  auto op = std::make_shared<CudaIpcOp>(t, *dev_, *stream_);
  op->out_user = out;
  op->start = cuda_call("CudaIpc::begin", [] { return cuda::event_create(); });
  op->end = cuda_call("CudaIpc::begin", [] { return cuda::event_create(); });
  cuda_call("CudaIpc::begin",
            [&] { cuda::event_record(op->start, c10::cuda::getCurrentCUDAStream(dev_->index()).stream()); });
  op->cls = size_class(static_cast<size_t>(t.numel()) * t.element_size());
  return op;
}

void CudaIpc::prepare(CudaIpcOp& op, bool separate) {
  c10::cuda::CUDAGuard dg(op.dev);
  c10::cuda::CUDAStreamGuard sg(op.stream);
  cuda_call("CudaIpc::prepare", [&] { cuda::stream_wait_event(op.stream.stream(), op.start); });
  // the caller's tensor is used on the side stream: the allocator must not reuse it early
  if (op.user.numel()) c10::cuda::CUDACachingAllocator::recordStream(op.user.storage().data_ptr(), op.stream);
  // on the side stream; a separate tensor when the caller's must stay untouched until the end
  op.work = (op.user.is_contiguous() && !separate) ? op.user : op.user.clone(at::MemoryFormat::Contiguous);
  if (op.out_user.defined()) {
    if (op.out_user.numel())
      c10::cuda::CUDACachingAllocator::recordStream(op.out_user.storage().data_ptr(), op.stream);
    // a copy keeps the slots of inactive seats as they were
    op.out_work = (op.out_user.is_contiguous() && !separate)
                      ? op.out_user
                      : op.out_user.clone(at::MemoryFormat::Contiguous);
  }
}

void CudaIpc::publish_events() {
  if (ev_published_) return;
  c10::cuda::CUDAGuard dg(*dev_);
  std::string raw;
  for (int i = 0; i < 4; ++i) {
    if (!ev_[i]) ev_[i] = cuda_call("CudaIpc::publish_events", [] { return cuda::ipc_event_create(); });
    raw += cuda_call("CudaIpc::publish_events", [&] { return cuda::ipc_event_export(ev_[i]); });
  }
  const std::string v = with_pid(raw);
  store_->set(ns_ + "cudaipc/" + std::to_string(rank_) + "/ev", std::vector<uint8_t>(v.begin(), v.end()));
  ev_published_ = true;
}

void CudaIpc::ensure_own(size_t cls) {
  publish_events();
  if (bufs_.count(cls)) return;
  c10::cuda::CUDAGuard dg(*dev_);
  void* b = cuda_call("CudaIpc::stage", [&] { return cuda::device_alloc(2 * cls, dev_->index()); });
  std::string h;
  try {
    h = cuda::ipc_export(b);
  } catch (const std::runtime_error& e) {
    cuda::device_free(b);
    TORCH_CHECK(false, "CudaIpc::stage: ", e.what());
  }
  bufs_[cls] = b;
  const std::string v = with_pid(h);
  store_->set(ns_ + "cudaipc/" + std::to_string(rank_) + "/" + std::to_string(cls),
              std::vector<uint8_t>(v.begin(), v.end()));
}

bool CudaIpc::get_key(const std::string& k, int j, int64_t pid, bool required, std::string* out) {
  // required: published by rank j before the round this rank has just passed with it
  const std::string key = ns_ + "cudaipc/" + std::to_string(j) + "/" + k;
  if (!store_->check({key})) {
    TORCH_CHECK(!required, "CudaIpc::get_key: rank ", j, " has not published '", key,
                "' although it passed the op's round");
    return false;
  }
  auto raw = store_->get(key);
  std::string v(raw.begin(), raw.end());
  const size_t sp = v.find(' ');
  TORCH_CHECK(sp != std::string::npos, "CudaIpc::get_key: malformed value of '", key, "'");
  const int64_t got = std::stoll(v.substr(0, sp));
  if (got != pid) {
    TORCH_CHECK(!required, "CudaIpc::get_key: '", key, "' belongs to process ", got, " but rank ", j,
                " is process ", pid, " (a stale incarnation)");
    return false;
  }
  *out = v.substr(sp + 1);
  return true;
}

void CudaIpc::drop_peer(Peer& p) {
  for (auto& [cls, b] : p.bufs) {
    try {
      cuda::ipc_close(b);
    } catch (const std::runtime_error&) {
    }
  }
  p.bufs.clear();
  for (void*& e : p.ev) {
    cuda::event_destroy(e);
    e = nullptr;
  }
  p.pid = -1;
}

bool CudaIpc::open_events(int j, int64_t pid, bool required) {
  Peer& p = peers_[j];
  if (p.pid == pid) return true;
  // first use, or a new incarnation of rank j (rejoined)
  std::string raw;
  if (!get_key("ev", j, pid, required, &raw)) return false;
  drop_peer(p);
  TORCH_CHECK(raw.size() == 4 * cuda::kIpcHandleBytes, "CudaIpc::open_events: rank ", j, " published ",
              raw.size(), " bytes of event handles, expected ", 4 * cuda::kIpcHandleBytes);
  for (int i = 0; i < 4; ++i)
    p.ev[i] = cuda_call("CudaIpc::open_events", [&] {
      return cuda::ipc_event_open(raw.substr(i * cuda::kIpcHandleBytes, cuda::kIpcHandleBytes),
                                  dev_->index());
    });
  p.pid = pid;
  return true;
}

CudaIpc::Peer& CudaIpc::peer(int j, int64_t pid, size_t cls) {
  open_events(j, pid, /*required=*/true);
  Peer& p = peers_[j];
  if (!p.bufs.count(cls)) {
    std::string h;
    get_key(std::to_string(cls), j, pid, /*required=*/true, &h);
    p.bufs[cls] = cuda_call("CudaIpc::peer", [&] { return cuda::ipc_open(h, dev_->index()); });
  }
  return p;
}

void CudaIpc::stage_segments(CudaIpcOp& op, int parity, const std::vector<std::pair<size_t, size_t>>& segs,
                             size_t len, const std::vector<int>& act, const std::vector<int64_t>& pids,
                             RedOp rop, double premul) {
  ensure_own(op.cls);
  c10::cuda::CUDAGuard dg(op.dev);
  void* st = op.stream.stream();
  // peers' reads of my half `parity` (two rounds ago) are done before I overwrite it; a peer
  // whose events are not published yet (or only by an earlier incarnation) has read nothing
  for (int j : act) {
    if (j == rank_ || !open_events(j, pids[j], /*required=*/false)) continue;
    void* d = peers_[j].ev[2 + parity];
    cuda_call("CudaIpc::stage", [&] { cuda::stream_wait_event(st, d); });
  }
  const size_t E = op.work.element_size();
  uint8_t* half = static_cast<uint8_t*>(bufs_[op.cls]) + parity * op.cls;
  const bool scaled = rop == RedOp::PREMUL_SUM && premul != 1.0;
  const auto dt = static_cast<cuda::DType>(cuda_dtype_code(op.work.scalar_type(), "CudaIpc::stage"));
  for (const auto& [src_off, dst_off] : segs) {
    TORCH_CHECK((dst_off + len) * E <= op.cls, "CudaIpc::stage: segment beyond the buffer");
    uint8_t* dst = half + dst_off * E;
    const uint8_t* src = static_cast<const uint8_t*>(op.work.data_ptr()) + src_off * E;
    if (scaled)
      cuda_call("CudaIpc::stage", [&] { cuda::launch_scale(dst, src, len, dt, premul, st); });
    else
      cuda_call("CudaIpc::stage", [&] { cuda::copy_async(dst, src, len * E, st); });
  }
  cuda_call("CudaIpc::stage", [&] { cuda::event_record(ev_[parity], st); });
}

void CudaIpc::stage(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
                    const std::vector<int64_t>& pids, RedOp rop, double premul) {
  stage_segments(op, parity, {{off, 0}}, len, act, pids, rop, premul);
}

void CudaIpc::stage_scatter(CudaIpcOp& op, int parity, size_t off, size_t len, size_t n,
                            const std::vector<int>& act, const std::vector<int64_t>& pids, RedOp rop,
                            double premul) {
  std::vector<std::pair<size_t, size_t>> segs;
  for (int d : act) segs.emplace_back(d * n + off, d * len);  // seat d's piece
  stage_segments(op, parity, segs, len, act, pids, rop, premul);
}

void CudaIpc::reduce_at(CudaIpcOp& op, int parity, size_t half_off, void* out, size_t len,
                        const std::vector<int>& act, const std::vector<int64_t>& pids, RedOp rop) {
  c10::cuda::CUDAGuard dg(op.dev);
  void* st = op.stream.stream();
  TORCH_CHECK(static_cast<int>(act.size()) <= cuda::kMaxSources, "CudaIpc::reduce: ", act.size(),
              " active ranks, the kernels take at most ", cuda::kMaxSources);
  const size_t E = op.work.element_size();
  std::vector<const void*> srcs;
  for (int j : act) {
    if (j == rank_) {
      srcs.push_back(static_cast<const uint8_t*>(bufs_[op.cls]) + parity * op.cls + half_off * E);
      continue;
    }
    Peer& p = peer(j, pids[j], op.cls);
    cuda_call("CudaIpc::reduce", [&] { cuda::stream_wait_event(st, p.ev[parity]); });  // its copy is done
    srcs.push_back(static_cast<const uint8_t*>(p.bufs[op.cls]) + parity * op.cls + half_off * E);
  }
  auto dt = static_cast<cuda::DType>(cuda_dtype_code(op.work.scalar_type(), "CudaIpc::reduce"));
  cuda_call("CudaIpc::reduce", [&] {
    cuda::launch_reduce(out, srcs.data(), static_cast<int>(srcs.size()), len, dt, static_cast<cuda::Op>(rop),
                        st);
  });
  cuda_call("CudaIpc::reduce", [&] { cuda::event_record(ev_[2 + parity], st); });  // my reads are done
}

void CudaIpc::reduce(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
                     const std::vector<int64_t>& pids, RedOp rop) {
  reduce_at(op, parity, 0, static_cast<uint8_t*>(op.work.data_ptr()) + off * op.work.element_size(), len, act,
            pids, rop);
}

void CudaIpc::reduce_scatter(CudaIpcOp& op, int parity, size_t off, size_t len, const std::vector<int>& act,
                             const std::vector<int64_t>& pids, RedOp rop) {
  reduce_at(op, parity, rank_ * len,
            static_cast<uint8_t*>(op.out_work.data_ptr()) + off * op.out_work.element_size(), len, act, pids,
            rop);
}

void CudaIpc::copy_from(CudaIpcOp& op, int parity, int src, size_t off, size_t len,
                        const std::vector<int64_t>& pids) {
  publish_events();
  c10::cuda::CUDAGuard dg(op.dev);
  void* st = op.stream.stream();
  Peer& p = peer(src, pids[src], op.cls);
  cuda_call("CudaIpc::copy_from", [&] { cuda::stream_wait_event(st, p.ev[parity]); });  // its copy is done
  const size_t E = op.work.element_size();
  cuda_call("CudaIpc::copy_from", [&] {
    cuda::copy_async(static_cast<uint8_t*>(op.work.data_ptr()) + off * E,
                     static_cast<const uint8_t*>(p.bufs[op.cls]) + parity * op.cls, len * E, st);
  });
  cuda_call("CudaIpc::copy_from", [&] { cuda::event_record(ev_[2 + parity], st); });  // my reads are done
}

void CudaIpc::gather_into(CudaIpcOp& op, int parity, size_t off, size_t len, size_t n,
                          const std::vector<int>& act, const std::vector<int64_t>& pids) {
  c10::cuda::CUDAGuard dg(op.dev);
  void* st = op.stream.stream();
  const size_t E = op.work.element_size();
  uint8_t* out = static_cast<uint8_t*>(op.out_work.data_ptr());
  for (int j : act) {
    const uint8_t* src;
    if (j == rank_) {
      src = static_cast<const uint8_t*>(bufs_[op.cls]) + parity * op.cls;  // copied on this stream
    } else {
      Peer& p = peer(j, pids[j], op.cls);
      cuda_call("CudaIpc::gather_into",
                [&] { cuda::stream_wait_event(st, p.ev[parity]); });  // its copy is done
      src = static_cast<const uint8_t*>(p.bufs[op.cls]) + parity * op.cls;
    }
    cuda_call("CudaIpc::gather_into", [&] { cuda::copy_async(out + (j * n + off) * E, src, len * E, st); });
  }
  cuda_call("CudaIpc::gather_into", [&] { cuda::event_record(ev_[2 + parity], st); });  // my reads are done
}

void CudaIpc::finish(CudaIpcOp& op) {
  c10::cuda::CUDAGuard dg(op.dev);
  c10::cuda::CUDAStreamGuard sg(op.stream);
  if (op.writes_user && !op.work.is_same(op.user)) op.user.copy_(op.work);
  if (op.out_user.defined() && !op.out_work.is_same(op.out_user)) op.out_user.copy_(op.out_work);
  cuda_call("CudaIpc::finish", [&] { cuda::event_record(op.end, op.stream.stream()); });
  op.ended = true;
}

namespace {

class CudaIpcWork : public c10d::Work {
 public:
  CudaIpcWork(int rank, c10d::OpType type, c10::intrusive_ptr<c10d::Work> inner,
              std::shared_ptr<CudaIpcOp> op)
      : c10d::Work(rank, type), inner_(std::move(inner)), op_(std::move(op)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{op_->dev});
  }
  void hook() {
    c10::intrusive_ptr<c10::ivalue::Future> fut = future_;
    std::shared_ptr<CudaIpcOp> op = op_;
    inner_->getFuture()->addCallback([fut, op](c10::ivalue::Future& f) {
      if (f.hasError()) {
        fut->setErrorIfNeeded(f.exception_ptr());
        return;
      }
      try {
        c10::cuda::CUDAGuard dg(op->dev);
        c10::cuda::CUDAStreamGuard sg(op->stream);  // the future's event goes after the op
        fut->markCompleted(
            c10::IValue(std::vector<at::Tensor>{op->out_user.defined() ? op->out_user : op->user}));
      } catch (...) {
        fut->setErrorIfNeeded(std::current_exception());
      }
    });
  }
  void block_current() {
    if (!op_->ended) return;
    c10::cuda::CUDAGuard dg(op_->dev);
    cuda_call("CudaIpcWork::wait", [&] {
      cuda::stream_wait_event(c10::cuda::getCurrentCUDAStream(op_->dev.index()).stream(), op_->end);
    });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);  // the op's error (or a timeout), as on the CPU
    block_current();
    return true;
  }
  bool isCompleted() override {
    if (!inner_->isCompleted()) return false;
    if (!inner_->isSuccess() || !op_->ended) return true;
    return cuda_call("CudaIpcWork::isCompleted", [&] { return cuda::event_query(op_->end); });
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return {op_->out_user.defined() ? op_->out_user : op_->user}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void synchronize() override { block_current(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<CudaIpcOp> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> CudaIpc::wrap(int rank, c10d::OpType type,
                                             c10::intrusive_ptr<c10d::Work> inner,
                                             std::shared_ptr<CudaIpcOp> op) {
  auto w = c10::make_intrusive<CudaIpcWork>(rank, type, std::move(inner), std::move(op));
  w->hook();
  return w;
}

}  // namespace mooncake
#endif  // MOONCAKE_WITH_CUDA
