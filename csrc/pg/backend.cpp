#include "pg/backend.hpp"

#include <torch/version.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <poll.h>
#include <signal.h>
#include <cerrno>
#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include <algorithm>
#include <cstring>
#include <random>
#include <sstream>

#include "transport/copy.hpp"
#ifdef MOONCAKE_WITH_CUDA
#include "transport/cuda/cuda.hpp"
#endif
#include "transport/shm.hpp"
#include "transport/tcp.hpp"
#ifdef MOONCAKE_WITH_RDMA
#include "pg/engine_rdma.hpp"
#endif

namespace mooncake {

namespace {

constexpr uint32_t kMagic = 0x4d434b31;  // "MCK1"

enum OpCode : uint32_t {
  OP_ALLREDUCE = 1,
  OP_REDUCE,
  OP_BROADCAST,
  OP_ALLGATHER,
  OP_GATHER,
  OP_REDUCE_SCATTER,
  OP_SCATTER,
  OP_ALLTOALL,
  OP_BARRIER,
  OP_ALLREDUCE_IPC,  // all_reduce of CUDA tensors through CUDA IPC (pg/cuda_ipc.hpp): one round per piece
  OP_BROADCAST_IPC,  // broadcast likewise
  OP_ALLGATHER_IPC,  // all_gather into one tensor likewise
  OP_REDUCE_SCATTER_IPC,  // reduce_scatter from one tensor likewise
};

const char* op_name(uint32_t op) {
  switch (op) {
    case OP_ALLREDUCE:
      return "all_reduce";
    case OP_REDUCE:
      return "reduce";
    case OP_BROADCAST:
      return "broadcast";
    case OP_ALLGATHER:
      return "all_gather";
    case OP_GATHER:
      return "gather";
    case OP_REDUCE_SCATTER:
      return "reduce_scatter";
    case OP_SCATTER:
      return "scatter";
    case OP_ALLTOALL:
      return "all_to_all";
    case OP_BARRIER:
      return "barrier";
    case OP_ALLREDUCE_IPC:
      return "all_reduce";  // describe() adds "through CUDA IPC"
    case OP_BROADCAST_IPC:
      return "broadcast";
    case OP_ALLGATHER_IPC:
      return "all_gather";
    case OP_REDUCE_SCATTER_IPC:
      return "reduce_scatter";
  }
  return "unknown op";
}

// Exchanged in the first round of every collective, before any user buffer is written.
struct OpHeader {
  uint32_t magic;
  uint32_t op;
  int32_t dtype;
  int32_t redop;
  int64_t root;
  int64_t count;
  uint64_t seq;
  uint32_t nextra;  // int64 values following the header
  uint32_t pad;
};
static_assert(sizeof(OpHeader) == 48, "OpHeader layout");

constexpr size_t kSmallAllreduce = 16 << 10;

size_t hdr_cap_for(int size) { return (sizeof(OpHeader) + 16 * static_cast<size_t>(size) + 63) / 64 * 64; }

std::string dtype_name(int32_t dt) { return c10::toString(static_cast<c10::ScalarType>(dt)); }

std::string describe(const OpHeader& h) {
  std::ostringstream o;
  o << op_name(h.op);
  if (h.op != OP_BARRIER) {
    o << " of " << h.count << (h.op == OP_ALLTOALL ? " element(s) per row" : " element(s)") << " of dtype "
      << dtype_name(h.dtype);
  }
  if (h.op == OP_ALLREDUCE || h.op == OP_REDUCE || h.op == OP_REDUCE_SCATTER || h.op == OP_ALLREDUCE_IPC ||
      h.op == OP_REDUCE_SCATTER_IPC)
    o << " with ReduceOp " << red_op_name(static_cast<RedOp>(h.redop));
  if (h.op == OP_REDUCE || h.op == OP_BROADCAST || h.op == OP_GATHER || h.op == OP_SCATTER ||
      h.op == OP_BROADCAST_IPC)
    o << " (root " << h.root << ")";
  if (h.op == OP_ALLREDUCE_IPC || h.op == OP_BROADCAST_IPC || h.op == OP_ALLGATHER_IPC ||
      h.op == OP_REDUCE_SCATTER_IPC)
    o << " through CUDA IPC";
  o << " [op #" << h.seq << "]";
  return o.str();
}

bool data_dtype_ok(c10::ScalarType dt) {
  using ST = c10::ScalarType;
  switch (dt) {
    case ST::Double:
    case ST::Float:
    case ST::Half:
    case ST::BFloat16:
    case ST::Float8_e4m3fn:
    case ST::Float8_e5m2:
    case ST::Char:
    case ST::Short:
    case ST::Int:
    case ST::Long:
    case ST::Byte:
    case ST::UInt16:
    case ST::UInt32:
    case ST::UInt64:
    case ST::Bool:
    case ST::ComplexFloat:
    case ST::ComplexDouble:
      return true;
    default:
      return false;
  }
}

RedOp to_redop(const c10d::ReduceOp& op, double* premul) {
  *premul = 1.0;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return RedOp::SUM;
    case c10d::ReduceOp::AVG:
      return RedOp::AVG;
    case c10d::ReduceOp::PRODUCT:
      return RedOp::PRODUCT;
    case c10d::ReduceOp::MIN:
      return RedOp::MIN;
    case c10d::ReduceOp::MAX:
      return RedOp::MAX;
    case c10d::ReduceOp::BAND:
      return RedOp::BAND;
    case c10d::ReduceOp::BOR:
      return RedOp::BOR;
    case c10d::ReduceOp::BXOR:
      return RedOp::BXOR;
    case c10d::ReduceOp::PREMUL_SUM: {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
      auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
#else  // torch <= 2.11 names it NCCLPreMulSumSupplement
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
#endif
      TORCH_CHECK_VALUE(sup != nullptr, "MooncakeBackend: PREMUL_SUM without a factor");
      *premul = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      return RedOp::PREMUL_SUM;
    }
    default:
      TORCH_CHECK_VALUE(false, "MooncakeBackend: unsupported ReduceOp ", static_cast<int>(op.op_));
  }
}

}  // namespace

// ===================================================================================
// Work
// ===================================================================================
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

// ===================================================================================
// Set-up
// ===================================================================================
MooncakeBackend::MooncakeBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 BackendConfig cfg)
    : c10d::Backend(rank, size), cfg_(std::move(cfg)), timeout_(static_cast<int64_t>(cfg_.timeout_s * 1000)) {
  setup(store);
#ifdef MOONCAKE_WITH_CUDA
  ipc_ = std::make_unique<CudaIpc>(rank_, size_, store_, store_ns_);
#endif
}

std::string MooncakeBackend::cuda_ipc_status() const {
#ifndef MOONCAKE_WITH_CUDA
  return "unavailable: this build has no CUDA (rebuild with MOONCAKE_WITH_CUDA=1)";
#else
  if (!cfg_.cuda_ipc)
    return "staging: CUDA IPC switched off (MOONCAKE_CUDA_IPC=0 or MooncakeOptions(cuda_ipc=False))";
  if (!one_host_) return "staging: the group's ranks are not all on this host (MOONCAKE_HOST_ID differs)";
  if (size_ > cuda::kMaxSources)
    return "staging: max_group_size " + std::to_string(size_) + " exceeds the " +
           std::to_string(cuda::kMaxSources) + " sources the IPC reduction kernel takes";
  return "ipc";
#endif
}

MooncakeBackend::~MooncakeBackend() {
  shutdown();
  for (int fd : peer_pidfd_)
    if (fd >= 0) close(fd);
}

void MooncakeBackend::attach_to_coalescing(const c10::intrusive_ptr<MooncakeWork>& w,
                                           const std::vector<at::Tensor>& outputs) {
  if (!coalescing_) return;
  w->parent = coalesce_parent_;
  coalesce_parent_->add_child(outputs);
}

static std::string join_ranks(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

static std::string store_get_str(const c10::intrusive_ptr<c10d::Store>& store, const std::string& k) {
  auto v = store->get(k);
  return std::string(v.begin(), v.end());
}

static void store_set_str(const c10::intrusive_ptr<c10d::Store>& store, const std::string& k,
                          const std::string& v) {
  store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
}

void MooncakeBackend::setup(const c10::intrusive_ptr<c10d::Store>& store) {
  const int W = size_;
  const std::string& t = cfg_.transport;
  TORCH_CHECK_VALUE(t == "auto" || t == "shm" || t == "tcp" || t == "rdma",
                    "MooncakeBackend::setup: unknown transport '", t, "'");
#ifndef MOONCAKE_WITH_RDMA
  TORCH_CHECK(t != "rdma",
              "MooncakeBackend::setup: transport 'rdma' needs a build with ibverbs: expected a build with "
              "MOONCAKE_WITH_RDMA (infiniband/verbs.h present at build time), got one with shm and tcp only "
              "(install libibverbs-dev and rebuild)");
#else
  if (t == "rdma") {
    // no active device port: a joiner raises now; a founder raises once it has told the
    // other founders (build_transport publishes it in place of its host record), so that
    // they raise too instead of waiting for this rank's record
    std::string dev;
    int port = 0;
    try {
      rdma_choose(rdma_devices(), cfg_.rdma_device, &dev, &port);
    } catch (const std::exception& e) {
      setup_error_ = std::string("MooncakeBackend::setup: transport 'rdma': ") + e.what();
      TORCH_CHECK(!cfg_.is_recovery, setup_error_);
    }
  }
#endif
  TORCH_CHECK_VALUE(cfg_.shm_slot_bytes >= 4096, "MooncakeBackend::setup: shm_slot_bytes must be >= 4096");
  TORCH_CHECK_VALUE(cfg_.on_failure == "raise" || cfg_.on_failure == "mask" || cfg_.on_failure == "manual",
                    "MooncakeBackend::setup: on_failure must be raise, mask or manual, got '",
                    cfg_.on_failure, "'");
  policy_ = cfg_.on_failure == "mask"     ? FailurePolicy::MASK
            : cfg_.on_failure == "manual" ? FailurePolicy::MANUAL
                                          : FailurePolicy::RAISE;
  store_ = store;
  active_.assign(W, 1);
  agreed_failed_.assign(W, 0);
  peer_pidfd_.assign(W, -1);
  peer_pid_.assign(W, 0);
  if (cfg_.is_recovery) {
    // A replacement for a failed rank: find the group's current incarnation and ask to be
    // admitted; the transport is built in join_group() once the survivors recover us.
    store_ns_ = store_get_str(store, "mc/current");
    // a replacement must match the group it joins (checked here, before it asks to join)
    if (store->check({store_ns_ + "cfg"})) {
      const std::string want = store_get_str(store, store_ns_ + "cfg");
      const std::string mine = group_cfg_string();
      TORCH_CHECK_VALUE(want == mine, "MooncakeBackend::setup: recovering rank ", rank_,
                        " does not match the group "
                        "it joins: the group has world_size|transport|shm_slot_bytes = '",
                        want, "', this process '", mine,
                        "' (start it with the founders' world size and settings)");
    }
    store_set_str(store, store_ns_ + "joinhost/" + std::to_string(rank_), cfg_.host_id);
    store_set_str(store, store_ns_ + "join/" + std::to_string(rank_), std::to_string(getpid()));
    joining_ = true;
    log_membership("waiting to be recovered into seat " + std::to_string(rank_));
    return;
  }
  // Founders: every seat, or the seats named in initial_active (the others are extension
  // seats, inactive until someone joins them; nobody waits for them here).
  std::vector<int> founders = cfg_.initial_active;
  if (founders.empty()) {
    founders.resize(W);
    for (int j = 0; j < W; ++j) founders[j] = j;
  }
  std::sort(founders.begin(), founders.end());
  founders.erase(std::unique(founders.begin(), founders.end()), founders.end());
  for (int j : founders)
    TORCH_CHECK_VALUE(j >= 0 && j < W, "MooncakeBackend::setup: active rank ", j, " is out of range [0, ", W,
                      ")");
  TORCH_CHECK_VALUE(std::binary_search(founders.begin(), founders.end(), rank_),
                    "MooncakeBackend::setup: rank ", rank_, " is not among the initial active ranks [",
                    join_ranks(founders),
                    "]; a process for an extension seat starts with is_recovery=True and calls join_group");
  std::fill(active_.begin(), active_.end(), 0);
  for (int j : founders) active_[j] = 1;
  // The store may outlive a destroyed group of the same name (torchrun's TCPStore): keys
  // of each set-up live under their own incarnation number (every founder adds 1 once).
  const int64_t inc = (store->add("mc/setups", 1) - 1) / static_cast<int64_t>(founders.size());
  store_ns_ = "mc/" + std::to_string(inc) + "/";
  build_transport(store_ns_ + "t0/", founders);
  refresh_active_list();
  store_set_str(store, store_ns_ + "cfg", group_cfg_string());
  store_set_str(store, "mc/current", store_ns_);
}

std::string MooncakeBackend::group_cfg_string() const {
  return std::to_string(size_) + "|" + cfg_.transport + "|" + std::to_string(cfg_.shm_slot_bytes / 64 * 64);
}

void MooncakeBackend::build_transport(const std::string& ns, const std::vector<int>& members,
                                      int64_t wait_ms) {
  // Connects `members` (ascending group ranks, this rank among them): shared memory when
  // they share a host (or forced), else a TCP mesh. Keys live under `ns`.
  const int W = size_;
  const std::string& t = cfg_.transport;
  const c10::intrusive_ptr<c10d::Store>& store = store_;
  const size_t slot = static_cast<size_t>(cfg_.shm_slot_bytes) / 64 * 64;
  const size_t hcap = hdr_cap_for(W);
  auto key = [&](const std::string& k) { return ns + k; };
  const int lead = members.front();
  // wait_ms > 0 (a rebuild): every wait for the members' keys is bounded, so a member that
  // died meanwhile makes this throw instead of blocking on the store
  auto await_keys = [&](const std::string& what, const std::vector<int>& who) {
    if (wait_ms <= 0) return;
    std::vector<std::string> keys;
    for (int j : who) keys.push_back(key(what + std::to_string(j)));
    try {
      store->wait(keys, std::chrono::milliseconds(wait_ms));
    } catch (const std::exception&) {
      std::vector<int> missing;
      for (int j : who)
        if (!store->check({key(what + std::to_string(j))})) missing.push_back(j);
      TORCH_CHECK(false, "MooncakeBackend::build_transport: rank(s) [", join_ranks(missing),
                  "] did not publish '", what, "' within ", wait_ms,
                  " ms (died or stopped during the rebuild)");
    }
  };

  // 1. who shares a host (and agree on the transport); a rank that cannot set up its
  // transport says so here ("!" + why) and raises, and so does every rank that reads it
  if (!setup_error_.empty()) {
    store_set_str(store, key("host/" + std::to_string(rank_)), "!" + setup_error_);
    TORCH_CHECK(false, setup_error_);
  }
  const std::string mine =
      cfg_.host_id + "|" + t + "|" + std::to_string(slot) + "|members=" + join_ranks(members);
  store_set_str(store, key("host/" + std::to_string(rank_)), mine);
  await_keys("host/", members);
  bool one_host = true;
  std::vector<std::string> hosts(W);
  for (int j : members) {
    std::string v = store_get_str(store, key("host/" + std::to_string(j)));
    TORCH_CHECK(v.empty() || v[0] != '!', "MooncakeBackend::setup: rank ", j,
                " could not set up its transport, so this group cannot start (", v.substr(v.empty() ? 0 : 1),
                ")");
    hosts[j] = v.substr(0, v.find('|'));
    if (hosts[j] != cfg_.host_id) one_host = false;
    TORCH_CHECK_VALUE(v.substr(v.find('|')) == mine.substr(mine.find('|')), "MooncakeBackend::setup: rank ",
                      j, " uses transport|slot|members '", v.substr(v.find('|') + 1), "' but rank ", rank_,
                      " uses '", mine.substr(mine.find('|') + 1),
                      "'; MOONCAKE_TRANSPORT, shm_slot_bytes and active_ranks "
                      "must agree across ranks");
  }
  // 2. process handles of same-host peers (failure detection)
  store_set_str(store, key("pid/" + std::to_string(rank_)), std::to_string(getpid()));
  await_keys("pid/", members);
  for (int j : members) {
    if (j == rank_ || hosts[j] != cfg_.host_id) continue;
    int64_t pid = std::stoll(store_get_str(store, key("pid/" + std::to_string(j))));
    if (peer_pid_[j] == pid) continue;
    if (peer_pidfd_[j] >= 0) close(peer_pidfd_[j]);
    peer_pidfd_[j] = -1;
#ifdef SYS_pidfd_open
    int fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
    if (fd >= 0) peer_pidfd_[j] = fd;
#endif
    peer_pid_[j] = pid;
  }
  one_host_ = one_host;
  const bool use_shm = (t == "shm") || (t == "auto" && one_host);
  TORCH_CHECK(
      !(t == "shm" && !one_host),
      "MooncakeBackend::setup: transport 'shm' needs every rank on one host (MOONCAKE_HOST_ID differs)");

  std::unique_ptr<CollEngine> coll;
  std::unique_ptr<P2PChannel> p2p;
  if (use_shm) {
    ShmLayout layout(W, slot, hcap, static_cast<size_t>(cfg_.p2p_ring_bytes));
    auto seg = std::make_shared<ShmSegment>();
    if (rank_ == lead) {
      std::random_device rd;
      std::string name = "/mooncake-" + std::to_string(getpid()) + "-" + std::to_string(rd());
      seg->create(name, layout.total);
      store_set_str(store, key("shm"), name);
    } else {
      if (wait_ms > 0) {
        try {
          store->wait({key("shm")}, std::chrono::milliseconds(wait_ms));
        } catch (const std::exception&) {
          TORCH_CHECK(false, "MooncakeBackend::build_transport: rank ", lead,
                      " did not create the shared segment "
                      "within ",
                      wait_ms, " ms (died or stopped during the rebuild)");
        }
      }
      seg->open(store_get_str(store, key("shm")), layout.total);
    }
    store_set_str(store, key("mapped/" + std::to_string(rank_)), "1");
    if (rank_ == lead) {
      std::vector<std::string> keys;
      for (int j : members) keys.push_back(key("mapped/" + std::to_string(j)));
      try {
        if (wait_ms > 0)
          await_keys("mapped/", members);
        else
          store->wait(keys);
      } catch (...) {
        seg->unlink();  // nothing is left behind in /dev/shm
        throw;
      }
      seg->unlink();  // every member has it mapped: nothing is left behind if one dies
    }
    bool spin = static_cast<int>(members.size()) <= available_cpus();
    coll = std::make_unique<ShmEngine>(rank_, W, seg, layout, spin);
    p2p = std::make_unique<ShmP2P>(rank_, W, seg, layout);
  } else {
    TcpListener lc(cfg_.listen_host), lp(cfg_.listen_host);
    store_set_str(store, key("addr/" + std::to_string(rank_)),
                  cfg_.listen_host + " " + std::to_string(lc.port()) + " " + std::to_string(lp.port()));
    std::vector<int> cfds(W, -1), pfds(W, -1);
    const int64_t tmo = wait_ms > 0 ? wait_ms : std::max<int64_t>(timeout_.count(), 60000);
    std::vector<int> lower;
    for (int j : members)
      if (j < rank_) lower.push_back(j);
    await_keys("addr/", lower);
    int higher = 0;
    for (int j : members) {
      if (j > rank_) {
        higher++;
        continue;
      }
      if (j == rank_) continue;
      std::istringstream in(store_get_str(store, key("addr/" + std::to_string(j))));
      std::string host;
      int pc = 0, pp = 0;
      in >> host >> pc >> pp;
      int32_t me = rank_;
      cfds[j] = tcp_connect(host, pc, tmo);
      send_all_blocking(cfds[j], &me, sizeof(me));
      pfds[j] = tcp_connect(host, pp, tmo);
      send_all_blocking(pfds[j], &me, sizeof(me));
    }
    for (int n = 0; n < higher; ++n) {
      for (TcpListener* l : {&lc, &lp}) {
        int fd = l->accept_fd(tmo);
        int32_t who = -1;
        recv_all_blocking(fd, &who, sizeof(who), tmo);
        TORCH_CHECK(who > rank_ && who < W && std::binary_search(members.begin(), members.end(), who),
                    "MooncakeBackend::setup: bad handshake from rank ", who);
        (l == &lc ? cfds : pfds)[who] = fd;
      }
    }
    if (t == "rdma") {
#ifdef MOONCAKE_WITH_RDMA
      // collectives over RDMA queue pairs; p2p byte streams stay on TCP
      for (int& fd : cfds)
        if (fd >= 0) close(fd);
      auto publish = [&](const std::string& k, const std::string& v) {
        store_set_str(store, key("rdma/" + k), v);
      };
      auto fetch = [&](int j, const std::string& k) {
        const std::string full = key("rdma/" + k);
        try {
          store->wait({full}, std::chrono::milliseconds(tmo));
        } catch (const std::exception&) {
          TORCH_CHECK(false, "MooncakeBackend::build_transport: rank ", j, " did not publish its RDMA '", k,
                      "' within ", tmo, " ms");
        }
        return store_get_str(store, full);
      };
      try {
        coll = std::make_unique<RdmaEngine>(rank_, W, slot, hcap, members, cfg_.rdma_device,
                                            static_cast<int>(cfg_.rdma_gid_index), publish, fetch);
      } catch (const c10::Error&) {
        throw;
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "MooncakeBackend::build_transport: transport 'rdma': ", e.what());
      }
#endif
    } else {
      coll = std::make_unique<TcpEngine>(rank_, W, slot, hcap, cfds);
    }
    p2p = std::make_unique<TcpP2P>(rank_, W, pfds);
  }
  coll->set_liveness([this](const std::vector<int>& ranks) { return probe_dead(ranks); });
  coll_ = std::move(coll);
  p2p_ = std::move(p2p);
}

// ===================================================================================
// Membership
// ===================================================================================
namespace {
std::mutex g_failed_mu;
std::vector<int> g_failed_global;  // ascending, unique
std::atomic<uint64_t> g_failed_version{0};

void note_failed_global(int g) {
  std::lock_guard<std::mutex> lk(g_failed_mu);
  auto it = std::lower_bound(g_failed_global.begin(), g_failed_global.end(), g);
  if (it != g_failed_global.end() && *it == g) return;
  g_failed_global.insert(it, g);
  g_failed_version++;
}
}  // namespace

std::vector<int> known_failed_global_ranks() {
  std::lock_guard<std::mutex> lk(g_failed_mu);
  return g_failed_global;
}

int MooncakeBackend::global_rank(int r) const { return cfg_.global_ranks.empty() ? r : cfg_.global_ranks[r]; }

std::vector<int> MooncakeBackend::failed_elsewhere() {
  std::vector<int> out;
  if (g_failed_version.load() == registry_seen_) return out;
  registry_seen_ = g_failed_version.load();
  std::vector<int> dead = known_failed_global_ranks();
  for (int j = 0; j < size_; ++j)
    if (j != rank_ && active_[j] && !agreed_failed_[j] &&
        std::binary_search(dead.begin(), dead.end(), global_rank(j)))
      out.push_back(j);
  return out;
}
void MooncakeBackend::refresh_active_list() {
  act_.clear();
  for (int j = 0; j < size_; ++j)
    if (active_[j]) act_.push_back(j);
  my_index_ = static_cast<int>(std::find(act_.begin(), act_.end(), rank_) - act_.begin());
  coll_->set_active(active_);
}

std::vector<int> MooncakeBackend::probe_dead(const std::vector<int>& ranks) {
  std::vector<int> dead;
  for (int j : ranks) {
    if (j < 0 || j >= size_ || j == rank_) continue;
    if (peer_pidfd_[j] >= 0) {
      pollfd p{peer_pidfd_[j], POLLIN, 0};
      if (poll(&p, 1, 0) > 0) dead.push_back(j);
    } else if (peer_pid_[j] > 0) {
      if (kill(static_cast<pid_t>(peer_pid_[j]), 0) != 0 && errno == ESRCH) dead.push_back(j);
    }
  }
  return dead;
}

static std::vector<int> parse_ranks(const std::string& list) {
  std::vector<int> out;
  std::istringstream in(list);
  std::string tok;
  while (std::getline(in, tok, ','))
    if (!tok.empty()) out.push_back(std::stoi(tok));
  return out;
}

template <class T>
T MooncakeBackend::bounded_store_call(const char* what, std::function<T(c10d::Store&)> fn) {
  // The call runs on a detached thread that owns everything it touches (the store handle,
  // the function, the promise): if it outlives the deadline it finishes (or stays blocked)
  // harmlessly after this backend is gone.
  auto st = store_;
  auto prom = std::make_shared<std::promise<T>>();
  auto fut = prom->get_future();
  std::thread([st, prom, fn = std::move(fn)]() {
    try {
      prom->set_value(fn(*st));
    } catch (...) {
      prom->set_exception(std::current_exception());
    }
  }).detach();
  const auto limit = std::max(timeout_, std::chrono::milliseconds(1000));
  if (fut.wait_for(limit) != std::future_status::ready) {
    std::ostringstream msg;
    msg << what << " got no answer within " << limit.count() / 1000.0
        << " s (this host is cut off from the store, or the store is gone)";
    throw std::runtime_error(msg.str());
  }
  return fut.get();
}

// Records: "1,3;decided_by=2;reason=..." (failure) or "join=1;active=0,1,2;decided_by=0".
bool MooncakeBackend::read_record_full(uint64_t epoch, Record* rec) {
  const std::string key = store_ns_ + "epoch/" + std::to_string(epoch);
  auto got = bounded_store_call<std::string>("reading membership record", [key](c10d::Store& st) {
    if (!st.check({key})) return std::string("\x01");
    auto v = st.get(key);
    return std::string(v.begin(), v.end());
  });
  if (got == "\x01") return false;
  rec->raw = got;
  std::string first = rec->raw.substr(0, rec->raw.find(';'));
  rec->join = first.rfind("join=", 0) == 0;
  rec->ranks = parse_ranks(rec->join ? first.substr(5) : first);
  rec->active.clear();
  rec->pids.clear();
  if (rec->join) {
    size_t q = rec->raw.find(";pids=");
    if (q != std::string::npos) {
      std::string rest = rec->raw.substr(q + 6);
      rec->pids = rest.substr(0, rest.find(';'));
    }
    size_t a = rec->raw.find(";active=");
    if (a != std::string::npos) {
      std::string rest = rec->raw.substr(a + 8);
      rec->active = parse_ranks(rest.substr(0, rest.find(';')));
    }
  }
  return true;
}

void MooncakeBackend::log_membership(const std::string& msg) {
  fprintf(stderr, "[mooncake] rank %d group '%s': %s\n", rank_, cfg_.group_name.c_str(), msg.c_str());
}

std::vector<int> MooncakeBackend::catch_up(bool stop_at_join) {
  std::vector<int> added;
  Record rec;
  while (read_record_full(agreed_epoch_ + 1, &rec)) {
    if (rec.join) {
      if (stop_at_join) break;
      throw std::runtime_error("membership epoch " + std::to_string(agreed_epoch_ + 1) +
                               " admits ranks that this rank did not recover: every survivor must call "
                               "recover_ranks between the same two ops");
    }
    agreed_epoch_++;
    for (int f : rec.ranks)
      if (f >= 0 && f < size_ && !agreed_failed_[f]) {
        agreed_failed_[f] = 1;
        added.push_back(f);
        note_failed_global(global_rank(f));
      }
    log_membership("epoch " + std::to_string(agreed_epoch_) + " agreed: " + rec.raw);
  }
  return added;
}

std::vector<int> MooncakeBackend::agree(const std::vector<int>& suspects, const std::string& reason) {
  std::vector<int> newly;
  try {
    auto more = catch_up();
    newly.insert(newly.end(), more.begin(), more.end());
    while (true) {
      std::vector<int> todo;
      for (int j : suspects)
        if (j >= 0 && j < size_ && j != rank_ && !agreed_failed_[j]) todo.push_back(j);
      if (todo.empty()) break;
      std::sort(todo.begin(), todo.end());
      const std::string key = store_ns_ + "epoch/" + std::to_string(agreed_epoch_ + 1);
      const std::string mine =
          join_ranks(todo) + ";decided_by=" + std::to_string(rank_) + ";reason=" + reason;
      bounded_store_call<bool>("proposing a membership record", [key, mine](c10d::Store& st) {
        st.compareSet(key, std::string(), mine);  // the first proposal of an epoch wins
        return true;
      });
      more = catch_up();
      newly.insert(newly.end(), more.begin(), more.end());
    }
  } catch (const RankFailure&) {
    throw;
  } catch (const std::exception& e) {
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    std::string why = ce ? ce->what_without_backtrace() : e.what();
    why = why.substr(0, why.find('\n'));
    broken_ =
        std::string("MooncakeBackend: the control store is unreachable, so membership cannot be agreed (") +
        why +
        "); this rank fences itself: the others may have declared it failed. This is fatal for the group on "
        "this rank (if the store lived in rank 0, rank 0 is gone); it may rejoin as a recovering rank";
    log_membership("fenced: " + broken_);
    throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_, {rank_},
                      static_cast<int64_t>(agreed_epoch_), true);
  }
  if (agreed_failed_[rank_]) {
    broken_ = "MooncakeBackend: this rank was declared failed by its peers (epoch " +
              std::to_string(agreed_epoch_) + ") and has fenced itself; it may rejoin as a recovering rank";
    throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_, {rank_},
                      static_cast<int64_t>(agreed_epoch_), true);
  }
  if (policy_ != FailurePolicy::MANUAL) apply_agreed();
  return newly;
}

void MooncakeBackend::apply_agreed() {
  if (epoch_ == agreed_epoch_) return;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    for (int j = 0; j < size_; ++j)
      if (agreed_failed_[j]) active_[j] = 0;
    epoch_ = agreed_epoch_;
  }
  refresh_active_list();
  coll_->start_epoch(epoch_);
  log_membership("epoch " + std::to_string(epoch_) + " applied: active ranks " + join_ranks(act_));
}

std::vector<int> MooncakeBackend::pending_failed() {
  std::lock_guard<std::mutex> g(mem_mu_);
  std::vector<int> v;
  for (int j = 0; j < size_; ++j)
    if (agreed_failed_[j] && active_[j]) v.push_back(j);
  return v;
}

std::vector<int32_t> MooncakeBackend::active_ranks() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return std::vector<int32_t>(active_.begin(), active_.end());
}

int64_t MooncakeBackend::epoch() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return static_cast<int64_t>(epoch_);
}

std::vector<int> MooncakeBackend::failed_ranks() {
  std::lock_guard<std::mutex> g(mem_mu_);
  std::vector<int> v;
  for (int j = 0; j < size_; ++j)
    if (agreed_failed_[j]) v.push_back(j);
  return v;
}

void MooncakeBackend::deactivate_ranks(const std::vector<int>& ranks) {
  for (int r : ranks)
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "mooncake deactivate_ranks (rank ", rank_, "): rank ", r,
                      " is out of range [0, ", size_, ")");
  std::lock_guard<std::mutex> g(engine_mu_);
  agree(ranks, "deactivate_ranks");
  apply_agreed();
}

std::vector<int> MooncakeBackend::pending_ranks() {
  std::vector<int> out;
  if (joining_) return out;
  std::vector<char> active;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    active = active_;
  }
  for (int j = 0; j < size_; ++j) {
    if (active[j]) continue;
    const std::string k = store_ns_ + "join/" + std::to_string(j);
    if (!store_->check({k})) continue;
    const std::string adm = store_ns_ + "admitted/" + std::to_string(j);
    const std::string pid = store_get_str(store_, k);
    if (store_->check({adm}) && store_get_str(store_, adm) == pid) continue;
    // a joiner on this host that died before being admitted is not pending (admitting it
    // would make the transport rebuild wait for it in vain)
    const std::string hk = store_ns_ + "joinhost/" + std::to_string(j);
    if (store_->check({hk}) && store_get_str(store_, hk) == cfg_.host_id &&
        kill(static_cast<pid_t>(std::stoll(pid)), 0) != 0 && errno == ESRCH)
      continue;
    out.push_back(j);
  }
  return out;
}

std::vector<int> MooncakeBackend::last_joined() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return last_joined_;
}

void MooncakeBackend::stop_p2p_thread() {
  {
    std::lock_guard<std::mutex> g(qmu_);
    p2p_restart_ = true;
  }
  if (p2p_) p2p_->notify();
  if (p2p_thread_.joinable()) p2p_thread_.join();
  std::lock_guard<std::mutex> g(qmu_);
  p2p_restart_ = false;
}

void MooncakeBackend::apply_join(const Record& rec, uint64_t epoch) {
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    std::fill(active_.begin(), active_.end(), 0);
    for (int j : rec.active)
      if (j >= 0 && j < size_) active_[j] = 1;
    for (int j : rec.ranks)
      if (j >= 0 && j < size_) agreed_failed_[j] = 0;
    epoch_ = agreed_epoch_ = epoch;
    last_joined_ = rec.ranks;
  }
  {
    std::lock_guard<std::mutex> lk(g_failed_mu);
    for (int j : rec.ranks) {
      auto it = std::lower_bound(g_failed_global.begin(), g_failed_global.end(), global_rank(j));
      if (it != g_failed_global.end() && *it == global_rank(j)) g_failed_global.erase(it);
    }
  }
  // Build the transport over the new member set. If a member dies (or stops) meanwhile,
  // the members agree through the store on who did not finish (first proposal of the
  // outcome wins), record those ranks as failed (next epoch) and build again without them.
  const int64_t wait_ms = std::max<int64_t>(timeout_.count(), 1000);
  for (int attempt = 0;; ++attempt) {
    std::vector<int> members;
    for (int j = 0; j < size_; ++j)
      if (active_[j]) members.push_back(j);
    const std::string ns = store_ns_ + "e" + std::to_string(agreed_epoch_) + "/";
    std::string why;
    store_set_str(store_, ns + "ready/" + std::to_string(rank_), "1");
    try {
      std::vector<std::string> keys;
      for (int j : members) keys.push_back(ns + "ready/" + std::to_string(j));
      store_->wait(keys, std::chrono::milliseconds(wait_ms));
      build_transport(ns, members, wait_ms);
    } catch (const std::exception& e) {
      const auto* ce = dynamic_cast<const c10::Error*>(&e);
      why = ce ? ce->what_without_backtrace() : e.what();
      why = why.substr(0, why.find('\n'));
    }
    store_set_str(store_, ns + "built/" + std::to_string(rank_), why.empty() ? "ok" : "failed");
    std::vector<std::string> built;
    for (int j : members) built.push_back(ns + "built/" + std::to_string(j));
    try {
      store_->wait(built, std::chrono::milliseconds(wait_ms));
    } catch (const std::exception&) {
    }
    std::vector<int> gone;  // members that did not finish the build at all
    bool all_ok = true;
    for (int j : members) {
      const std::string k = ns + "built/" + std::to_string(j);
      if (!store_->check({k})) {
        gone.push_back(j);
        all_ok = false;
      } else if (store_get_str(store_, k) != "ok") {
        all_ok = false;
      }
    }
    const std::string proposal = all_ok ? "ok" : "failed:" + join_ranks(gone);
    auto cur = store_->compareSet(ns + "outcome", std::vector<uint8_t>(),
                                  std::vector<uint8_t>(proposal.begin(), proposal.end()));
    const std::string outcome(cur.begin(), cur.end());
    if (outcome == "ok") {
      if (!why.empty()) {  // cannot happen: "ok" needs every member's "ok"
        broken_ = "MooncakeBackend: transport rebuild disagreement in epoch " + std::to_string(agreed_epoch_);
        C10_THROW_ERROR(DistBackendError, "MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_);
      }
      break;
    }
    std::vector<int> failed = parse_ranks(outcome.substr(outcome.find(':') + 1));
    if (failed.empty() || attempt >= size_) {
      broken_ = "MooncakeBackend: rebuilding the transport for membership epoch " +
                std::to_string(agreed_epoch_) +
                " failed: " + (why.empty() ? std::string("another member failed to build it") : why);
      C10_THROW_ERROR(DistBackendError, "MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_);
    }
    // the ranks that did not finish are failed: the next epoch's record says so
    const uint64_t e = agreed_epoch_ + 1;
    const std::string rec_s = join_ranks(failed) + ";decided_by=" + std::to_string(rank_) +
                              ";reason=did not finish the transport rebuild of epoch " +
                              std::to_string(agreed_epoch_);
    store_->compareSet(store_ns_ + "epoch/" + std::to_string(e), std::string(), rec_s);
    Record frec;
    TORCH_CHECK(read_record_full(e, &frec), "mooncake: epoch record ", e, " vanished");
    log_membership("epoch " + std::to_string(e) + " agreed: " + frec.raw);
    {
      std::lock_guard<std::mutex> g(mem_mu_);
      for (int f : frec.ranks)
        if (f >= 0 && f < size_) {
          agreed_failed_[f] = 1;
          active_[f] = 0;
        }
      epoch_ = agreed_epoch_ = e;
      std::vector<int> still;
      for (int j : last_joined_)
        if (!agreed_failed_[j]) still.push_back(j);
      last_joined_ = still;
    }
    for (int f : frec.ranks) note_failed_global(global_rank(f));
    if (agreed_failed_[rank_]) {
      broken_ =
          "MooncakeBackend: this rank did not finish the transport rebuild in time and was declared failed "
          "(epoch " +
          std::to_string(e) + "); it has fenced itself and may rejoin as a recovering rank";
      throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_, {rank_},
                        static_cast<int64_t>(e), true);
    }
  }
  refresh_active_list();
  coll_->start_epoch(epoch_);
  seq_exec_ = 0;  // op numbering restarts with the new member set (the joiner starts at 0)
  log_membership("epoch " + std::to_string(epoch_) + " applied: ranks " + join_ranks(last_joined_) +
                 " rejoined; active ranks " + join_ranks(act_));
}

void MooncakeBackend::recover_ranks(const std::vector<int>& ranks) {
  TORCH_CHECK(!joining_, "mooncake recover_ranks (rank ", rank_,
              "): this rank is itself waiting to join; call join_group");
  for (int r : ranks)
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "mooncake recover_ranks (rank ", rank_, "): rank ", r,
                      " is out of range [0, ", size_, ")");
  // 1. the union of what the survivors ask for (they may have looked at different times)
  at::Tensor want = at::zeros({size_}, at::kInt);
  for (int r : ranks) want[r] = 1;
  std::vector<at::Tensor> ts{want};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  o.asyncOp = false;
  allreduce(ts, o)->wait();
  std::vector<int> todo;
  for (int j = 0; j < size_; ++j)
    if (want[j].item<int>()) todo.push_back(j);
  if (todo.empty()) return;
  std::lock_guard<std::mutex> g(engine_mu_);
  for (int r : todo) {
    TORCH_CHECK_VALUE(!active_[r], "mooncake recover_ranks (rank ", rank_, "): rank ", r, " is active");
    TORCH_CHECK_VALUE(store_->check({store_ns_ + "join/" + std::to_string(r)}),
                      "mooncake recover_ranks (rank ", rank_, "): no replacement for rank ", r,
                      " has asked to join (start it with is_recovery=True)");
  }
  // 2. agree on the record of the next epoch (identical proposals; the first one wins)
  catch_up(/*stop_at_join=*/true);
  if (policy_ != FailurePolicy::MANUAL) apply_agreed();
  std::vector<char> next = active_;
  for (int r : todo) next[r] = 1;
  std::vector<int> next_list;
  for (int j = 0; j < size_; ++j)
    if (next[j]) next_list.push_back(j);
  const uint64_t e = agreed_epoch_ + 1;
  std::string pids;
  for (int r : todo)
    pids += (pids.empty() ? "" : ",") + store_get_str(store_, store_ns_ + "join/" + std::to_string(r));
  const std::string proposal = "join=" + join_ranks(todo) + ";active=" + join_ranks(next_list) +
                               ";pids=" + pids + ";decided_by=" + std::to_string(rank_);
  store_->compareSet(store_ns_ + "epoch/" + std::to_string(e), std::string(), proposal);
  Record rec;
  TORCH_CHECK(read_record_full(e, &rec), "mooncake recover_ranks: epoch record ", e, " vanished");
  TORCH_CHECK(rec.join && rec.ranks == todo && rec.active == next_list && rec.pids == pids,
              "mooncake recover_ranks (rank ", rank_, "): survivors disagree about epoch ", e, ": '", rec.raw,
              "' vs mine '", proposal, "' (a failure was agreed concurrently; retry)");
  log_membership("epoch " + std::to_string(e) + " agreed: " + rec.raw);
  for (int r : todo)
    store_set_str(store_, store_ns_ + "admitted/" + std::to_string(r),
                  store_get_str(store_, store_ns_ + "join/" + std::to_string(r)));
  // 3. a fresh transport over the new member set
  stop_p2p_thread();
  apply_join(rec, e);
}

void MooncakeBackend::join_group(double timeout_s) {
  TORCH_CHECK(joining_, "mooncake join_group (rank ", rank_,
              "): this rank is not a recovering rank "
              "(create the group with MooncakeOptions(is_recovery=True))");
  std::lock_guard<std::mutex> g(engine_mu_);
  const int64_t deadline = now_ns() + static_cast<int64_t>(timeout_s * 1e9);
  int64_t next_liveness_check = now_ns() + 200 * 1000 * 1000;
  std::string members_ns;
  uint64_t member_epoch = 0;
  while (true) {
    Record rec;
    while (read_record_full(agreed_epoch_ + 1, &rec)) {
      agreed_epoch_++;
      if (!rec.join) {
        for (int f : rec.ranks)
          if (f >= 0 && f < size_) agreed_failed_[f] = 1;
        continue;
      }
      auto it = std::find(rec.ranks.begin(), rec.ranks.end(), rank_);
      std::vector<std::string> pids;
      {
        std::istringstream in(rec.pids);
        std::string tok;
        while (std::getline(in, tok, ',')) pids.push_back(tok);
      }
      const size_t pos = static_cast<size_t>(it - rec.ranks.begin());
      if (it != rec.ranks.end() && pos < pids.size() && pids[pos] == std::to_string(getpid())) {
        {
          std::lock_guard<std::mutex> m(mem_mu_);
          std::fill(agreed_failed_.begin(), agreed_failed_.end(), 0);
        }
        apply_join(rec, agreed_epoch_);
        joining_ = false;
        return;
      }
    }
    TORCH_CHECK(now_ns() < deadline, "mooncake join_group (rank ", rank_, "): not admitted within ",
                timeout_s, " s; the survivors must call recover_ranks(group, get_pending_ranks(group))");
    if (now_ns() >= next_liveness_check) {
      next_liveness_check = now_ns() + 500 * 1000 * 1000;
      std::vector<int> members = joinable_members(&members_ns, &member_epoch);
      if (!members.empty() && members_all_dead(members_ns, members))
        C10_THROW_ERROR(DistBackendError, "mooncake join_group (rank " + std::to_string(rank_) +
                                              "): no live member is left to admit "
                                              "this rank (every active rank [" +
                                              join_ranks(members) +
                                              "] of the group has exited on this "
                                              "host); the group is gone");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int> MooncakeBackend::joinable_members(std::string* ns, uint64_t* epoch) {
  // The group's members as a joiner can tell from the store: the founders (their t0 host
  // keys), minus agreed failures, as replaced by each join record's active set.
  std::vector<int> members;
  if (ns->empty()) {
    *ns = store_ns_ + "t0/";
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && store_->check({*ns + "host/" + std::to_string(j)})) members.push_back(j);
    members_cache_ = members;
  }
  members = members_cache_;
  Record rec;
  while (read_record_full(*epoch + 1, &rec)) {
    (*epoch)++;
    if (rec.join) {
      members = rec.active;
      *ns = store_ns_ + "e" + std::to_string(*epoch) + "/";
    } else {
      for (int f : rec.ranks) members.erase(std::remove(members.begin(), members.end(), f), members.end());
    }
  }
  members.erase(std::remove(members.begin(), members.end(), rank_), members.end());
  members_cache_ = members;
  return members;
}

bool MooncakeBackend::members_all_dead(const std::string& ns, const std::vector<int>& members) {
  for (int j : members) {
    const std::string hk = ns + "host/" + std::to_string(j), pk = ns + "pid/" + std::to_string(j);
    if (!store_->check({hk}) || !store_->check({pk})) return false;
    const std::string host = store_get_str(store_, hk);
    if (host.substr(0, host.find('|')) != cfg_.host_id) return false;  // another host: cannot tell
    if (kill(static_cast<pid_t>(std::stoll(store_get_str(store_, pk))), 0) == 0 || errno != ESRCH)
      return false;
  }
  return true;
}

void MooncakeBackend::throw_failure(const std::string& what, const std::vector<int>& newly) {
  std::vector<int> failed = newly;
  if (failed.empty()) failed = failed_ranks();
  std::string msg = "MooncakeBackend (rank " + std::to_string(rank_) + "): rank(s) " + join_ranks(failed) +
                    " failed (" + what + "); membership epoch " + std::to_string(agreed_epoch_);
  if (policy_ == FailurePolicy::MANUAL)
    msg += "; on_failure='manual': later ops fail fast until every survivor calls deactivate_ranks";
  else
    msg += "; later ops run over the surviving ranks";
  throw RankFailure(msg, failed, static_cast<int64_t>(agreed_epoch_));
}

void MooncakeBackend::setTimeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

int64_t MooncakeBackend::deadline_for(std::chrono::milliseconds t) const {
  auto ms = (t.count() > 0) ? t : timeout_;
  return now_ns() + static_cast<int64_t>(ms.count()) * 1000000LL;
}

void MooncakeBackend::shutdown() {
  {
    std::lock_guard<std::mutex> g(qmu_);
    if (stop_) return;
    stop_ = true;
  }
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

// ===================================================================================
// Scheduling
// ===================================================================================
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
  ++seq_;
  if (cfg_.debug)
    trace("issued " + c10d::opTypeToString(type) + " #" + std::to_string(seq_) + (async_op ? " async" : ""));
  auto run = [this, job, timeout, before_retry]() -> std::exception_ptr {
    std::lock_guard<std::mutex> g(engine_mu_);
    for (int attempt = 0;; ++attempt) {
      try {
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
        job(deadline_for(timeout));
        return nullptr;
      } catch (const PeerFailure& e) {
        try {
          std::vector<int> newly = agree(e.ranks, e.timed_out ? "op timeout" : "process died");
          if (cfg_.debug)
            fprintf(stderr, "%s\nrecent ops (MOONCAKE_DEBUG):\n%s", e.what(), dump_trace().c_str());
          if (policy_ == FailurePolicy::MASK && attempt < size_) continue;  // rerun over survivors
          throw_failure(e.what(), newly);
        } catch (...) {
          return std::current_exception();
        }
      } catch (const EpochAhead&) {
        try {
          std::vector<int> newly = agree({}, "catch up");
          if (policy_ == FailurePolicy::MASK && attempt < size_) continue;
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
      TORCH_CHECK(!stop_, "MooncakeBackend: the process group was shut down");
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
    TORCH_CHECK(!stop_, "MooncakeBackend: the process group was shut down");
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

// ===================================================================================
// Collective bodies
// ===================================================================================
void MooncakeBackend::exchange(const PeerRanges* sends, size_t hdr_len, int64_t dl, const char*) {
  if (hdr_len > 0) op_round_ = 0;  // the first round of every collective carries the header
  if (cfg_.inject_kill_op >= 0 && static_cast<int64_t>(seq_exec_) - 1 == cfg_.inject_kill_op &&
      static_cast<int64_t>(op_round_) == cfg_.inject_kill_round) {
    fprintf(stderr, "[mooncake] rank %d: fault injection: SIGKILL at op %lld round %lld\n", rank_,
            static_cast<long long>(cfg_.inject_kill_op), static_cast<long long>(cfg_.inject_kill_round));
    fflush(stderr);
    raise(SIGKILL);
  }
  coll_->exchange(sends, hdr_len, dl);
  op_round_++;
}

static void write_header(CollEngine* e, uint64_t k, OpHeader h, const std::vector<int64_t>& extra) {
  h.magic = kMagic;
  h.nextra = static_cast<uint32_t>(extra.size());
  std::memcpy(e->my_hdr(k), &h, sizeof(h));
  if (!extra.empty()) std::memcpy(e->my_hdr(k) + sizeof(h), extra.data(), extra.size() * 8);
}

static size_t header_len(const std::vector<int64_t>& extra) { return sizeof(OpHeader) + extra.size() * 8; }

// Compares every rank's header of round k with the reference rank's; throws ValueError on
// every rank (they all see the same headers) naming the ranks that differ.
// Compares every active rank's header of round k with the reference rank's; throws
// ValueError on every rank (they all see the same headers) naming the ranks that differ.
static void check_headers(CollEngine* e, uint64_t k, int ref, const std::vector<int>& act) {
  const int W = e->size();
  OpHeader r;
  std::memcpy(&r, e->peer_hdr(ref, k), sizeof(r));
  std::vector<int> bad;
  OpHeader first_bad{};
  for (int j : act) {
    OpHeader h;
    std::memcpy(&h, e->peer_hdr(j, k), sizeof(h));
    bool same = h.magic == kMagic && h.op == r.op && h.dtype == r.dtype && h.redop == r.redop &&
                h.root == r.root && h.count == r.count && h.seq == r.seq && h.nextra == r.nextra;
    if (same && r.op != OP_ALLTOALL && h.nextra > 0)
      same = std::memcmp(e->peer_hdr(j, k) + sizeof(h), e->peer_hdr(ref, k) + sizeof(h), h.nextra * 8) == 0;
    if (!same) {
      if (bad.empty()) first_bad = h;
      bad.push_back(j);
    }
  }
  if (r.op == OP_ALLTOALL && bad.empty()) {
    // rank i's send split to j must equal rank j's receive split from i
    std::vector<char> flagged(W, 0);
    std::string detail;
    for (int i : act) {
      const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
      for (int j : act) {
        const int64_t* xj = reinterpret_cast<const int64_t*>(e->peer_hdr(j, k) + sizeof(OpHeader));
        if (xi[j] != xj[W + i]) {
          if (detail.empty())
            detail = "rank " + std::to_string(i) + " sends " + std::to_string(xi[j]) + " row(s) to rank " +
                     std::to_string(j) + " but rank " + std::to_string(j) + " expects " +
                     std::to_string(xj[W + i]) + " from it";
          if (i != ref) flagged[i] = 1;
          if (j != ref) flagged[j] = 1;
        }
      }
    }
    if (!detail.empty()) {
      std::string who;
      for (int j = 0; j < W; ++j)
        if (flagged[j]) who += (who.empty() ? "" : ", ") + std::to_string(j);
      TORCH_CHECK_VALUE(false, "mooncake all_to_all (rank ", e->rank(),
                        "): cross-rank mismatch of split sizes: ", detail, "; offending rank(s): ", who,
                        ". The op was cancelled on every rank and no output was modified.");
    }
    return;
  }
  if (!bad.empty()) {
    std::string who;
    for (int j : bad) who += (who.empty() ? "" : ", ") + std::to_string(j);
    OpHeader mine;
    std::memcpy(&mine, e->peer_hdr(e->rank(), k), sizeof(mine));
    TORCH_CHECK_VALUE(false, "mooncake ", op_name(mine.op), " (rank ", e->rank(),
                      "): cross-rank mismatch: rank ", bad[0], " called ", describe(first_bad), " but rank ",
                      ref, " called ", describe(r), "; offending rank(s): ", who,
                      ". The op was cancelled on every rank and no output was modified.");
  }
}

static void copy_plain(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }

static void copy_in(void* dst, const void* src, size_t n_elems, size_t esize, c10::ScalarType dt, RedOp op,
                    double premul) {
  if (op == RedOp::PREMUL_SUM && premul != 1.0)
    scale_copy(dst, src, n_elems, dt, premul);
  else
    std::memcpy(dst, src, n_elems * esize);
}

void MooncakeBackend::require_active_root(int root, const char* op) {
  if (!active_[root]) {
    std::vector<int> failed{root};
    throw RankFailure(std::string("mooncake ") + op + " (rank " + std::to_string(rank_) + "): root rank " +
                          std::to_string(root) +
                          " is not active (failed or not joined); rooted ops whose root died always raise",
                      failed, static_cast<int64_t>(epoch_));
  }
}

void MooncakeBackend::run_allreduce(at::Tensor& t, RedOp op, double premul, int root, int64_t dl) {
  // root < 0: all_reduce; else reduce to `root` (other ranks' tensors stay untouched).
  // Contributors are the active ranks (act_); AVG divides by their number.
  CollEngine* e = coll_.get();
  const std::vector<int>& act = act_;
  const int A = static_cast<int>(act.size()), r = rank_;
  const int me = my_index_;
  const auto dt = t.scalar_type();
  const size_t E = t.element_size();
  const size_t n = static_cast<size_t>(t.numel());
  uint8_t* data = static_cast<uint8_t*>(t.data_ptr());
  const bool all = root < 0;
  if (!all) require_active_root(root, "reduce");
  OpHeader h{};
  h.op = all ? OP_ALLREDUCE : OP_REDUCE;
  h.dtype = static_cast<int32_t>(dt);
  h.redop = static_cast<int32_t>(op);
  h.root = all ? -1 : root;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  const int ref = all ? act[0] : root;
  const bool writes_out = all || r == root;
  std::vector<const void*> srcs(A);

  if (n * E <= std::min(kSmallAllreduce, S)) {
    // one round: every rank reduces the whole (small) tensor in rank order
    const uint64_t k = e->next_round();
    copy_in(e->my_slot(k), data, n, E, dt, op, premul);
    write_header(e, k, h, noextra);
    PeerRanges sends(size_);
    for (int j : act)
      if (j != r && (all || j == root)) sends[j].push_back({0, n * E});
    exchange(&sends, header_len(noextra), dl, "all_reduce");
    check_headers(e, k, ref, act);
    if (n == 0 || !writes_out) return;
    for (int i = 0; i < A; ++i) srcs[i] = e->peer_slot(act[i], k);
    reduce_buffers(data, srcs.data(), A, n, dt, op);
    return;
  }

  // Pipelined reduce-scatter + all-gather. Slot = [A: the parts of my input piece that
  // peers reduce | B: my reduced sub-chunk]. Active rank i reduces sub-chunk i of each
  // piece, reading its own part straight from its tensor, and publishes the result in B
  // of the next round, which peers copy out while the next piece is being reduced.
  const size_t half = S / 2 / 64 * 64;
  size_t P = half / (A * E) * A;  // elements per piece
  if (P == 0) P = A;
  const size_t npieces = (n + P - 1) / P;
  const bool scaled = op == RedOp::PREMUL_SUM && premul != 1.0;
  auto piece_len = [&](size_t p) { return std::min(P, n - p * P); };
  auto sub = [&](size_t L, int i, size_t* off, size_t* len) {
    size_t c = (L + A - 1) / A;
    size_t b = std::min(L, c * i), en = std::min(L, c * (i + 1));
    *off = b;
    *len = en - b;
  };
  auto out_copy = n * E >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p <= npieces; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(size_);
    if (p < npieces) {
      const size_t L = piece_len(p);
      for (int i = 0; i < A; ++i) {
        size_t o, l;
        sub(L, i, &o, &l);
        if (i != me || scaled) copy_in(e->my_slot(k) + o * E, data + (p * P + o) * E, l, E, dt, op, premul);
        if (i != me) sends[act[i]].push_back({o * E, l * E});
      }
    }
    if (p > 0) {
      size_t o, l;
      sub(piece_len(p - 1), me, &o, &l);
      for (int j : act)
        if (j != r && (all || j == root)) sends[j].push_back({half, l * E});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, dl, "all_reduce");
    if (p == 0) check_headers(e, k, ref, act);
    if (p > 0 && writes_out) {
      const size_t L = piece_len(p - 1);
      for (int i = 0; i < A; ++i) {
        if (i == me) continue;
        size_t o, l;
        sub(L, i, &o, &l);
        if (l) out_copy(data + ((p - 1) * P + o) * E, e->peer_slot(act[i], k) + half, l * E);
      }
    }
    if (p < npieces) {
      const size_t L = piece_len(p);
      size_t o, l;
      sub(L, me, &o, &l);
      if (l) {
        uint8_t* mine = data + (p * P + o) * E;
        for (int i = 0; i < A; ++i) srcs[i] = (i == me && !scaled) ? mine : e->peer_slot(act[i], k) + o * E;
        uint8_t* red = e->my_slot(k + 1) + half;  // next round's slot (see engine.hpp)
        reduce_buffers(red, srcs.data(), A, l, dt, op, writes_out ? mine : nullptr);
      }
    }
  }
}

void MooncakeBackend::run_broadcast(at::Tensor& t, int root, int64_t dl) {
  CollEngine* e = coll_.get();
  const int r = rank_;
  require_active_root(root, "broadcast");
  const size_t nbytes = t.numel() * t.element_size();
  uint8_t* data = static_cast<uint8_t*>(t.data_ptr());
  OpHeader h{};
  h.op = OP_BROADCAST;
  h.dtype = static_cast<int32_t>(t.scalar_type());
  h.root = root;
  h.count = t.numel();
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  const size_t npieces = std::max<size_t>(1, (nbytes + S - 1) / S);
  auto out_copy = nbytes >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * S, len = std::min(S, nbytes - std::min(nbytes, off));
    PeerRanges sends(size_);
    if (r == root) {
      if (len) std::memcpy(e->my_slot(k), data + off, len);
      for (int j : act_)
        if (j != r) sends[j].push_back({0, len});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, dl, "broadcast");
    if (p == 0) check_headers(e, k, root, act_);
    if (r != root && len) out_copy(data + off, e->peer_slot(root, k), len);
  }
}

void MooncakeBackend::run_allgather(const at::Tensor& in, const std::vector<uint8_t*>& outs, int opcode,
                                    int root, int64_t dl) {
  // opcode OP_ALLGATHER: outs[j] for every seat j; OP_GATHER: outs only on root.
  // Output slots of inactive seats are left untouched.
  CollEngine* e = coll_.get();
  const int r = rank_;
  if (opcode == OP_GATHER) require_active_root(root, "gather");
  const size_t nbytes = in.numel() * in.element_size();
  const uint8_t* data = static_cast<const uint8_t*>(in.data_ptr());
  OpHeader h{};
  h.op = static_cast<uint32_t>(opcode);
  h.dtype = static_cast<int32_t>(in.scalar_type());
  h.root = opcode == OP_GATHER ? root : -1;
  h.count = in.numel();
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  const size_t npieces = std::max<size_t>(1, (nbytes + S - 1) / S);
  const bool receiver = opcode == OP_ALLGATHER || r == root;
  auto out_copy = nbytes * act_.size() >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * S, len = std::min(S, nbytes - std::min(nbytes, off));
    if (len) std::memcpy(e->my_slot(k), data + off, len);
    PeerRanges sends(size_);
    for (int j : act_)
      if (j != r && (opcode == OP_ALLGATHER || j == root)) sends[j].push_back({0, len});
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, dl, op_name(opcode));
    if (p == 0) check_headers(e, k, opcode == OP_GATHER ? root : act_[0], act_);
    if (receiver && len)
      for (int j : act_) out_copy(outs[j] + off, e->peer_slot(j, k), len);
  }
}

void MooncakeBackend::run_reduce_scatter(const std::vector<const uint8_t*>& ins, at::Tensor& out, RedOp op,
                                         double premul, int64_t dl) {
  // Chunk j of every active rank's input is reduced into active rank j's output; chunks of
  // inactive seats are not computed.
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  const auto dt = out.scalar_type();
  const size_t E = out.element_size();
  const size_t n = out.numel();
  uint8_t* data = static_cast<uint8_t*>(out.data_ptr());
  OpHeader h{};
  h.op = OP_REDUCE_SCATTER;
  h.dtype = static_cast<int32_t>(dt);
  h.redop = static_cast<int32_t>(op);
  h.root = -1;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  size_t q = S / W / 64 * 64 / E;  // elements per sub-slot (one per seat)
  if (q == 0) q = std::max<size_t>(1, S / W / E);
  const size_t npieces = std::max<size_t>(1, (n + q - 1) / q);
  const int A = static_cast<int>(act_.size());
  std::vector<const void*> srcs(A);
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * q, len = std::min(q, n - std::min(n, off));
    PeerRanges sends(W);
    for (int j : act_) {
      if (len) copy_in(e->my_slot(k) + j * q * E, ins[j] + off * E, len, E, dt, op, premul);
      if (j != r) sends[j].push_back({j * q * E, len * E});
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, dl, "reduce_scatter");
    if (p == 0) check_headers(e, k, act_[0], act_);
    if (len) {
      for (int i = 0; i < A; ++i) srcs[i] = e->peer_slot(act_[i], k) + r * q * E;
      reduce_buffers(data + off * E, srcs.data(), A, len, dt, op);
    }
  }
}

void MooncakeBackend::run_scatter(const std::vector<const uint8_t*>& ins, at::Tensor& out, int root,
                                  int64_t dl) {
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  require_active_root(root, "scatter");
  const size_t E = out.element_size();
  const size_t n = out.numel();
  uint8_t* data = static_cast<uint8_t*>(out.data_ptr());
  OpHeader h{};
  h.op = OP_SCATTER;
  h.dtype = static_cast<int32_t>(out.scalar_type());
  h.root = root;
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const size_t S = e->slot_bytes();
  size_t q = S / W / 64 * 64 / E;
  if (q == 0) q = std::max<size_t>(1, S / W / E);
  const size_t npieces = std::max<size_t>(1, (n + q - 1) / q);
  for (size_t p = 0; p < npieces; ++p) {
    const uint64_t k = e->next_round();
    const size_t off = p * q, len = std::min(q, n - std::min(n, off));
    PeerRanges sends(W);
    if (r == root) {
      for (int j : act_) {
        if (len) std::memcpy(e->my_slot(k) + j * q * E, ins[j] + off * E, len * E);
        if (j != r) sends[j].push_back({j * q * E, len * E});
      }
    }
    if (p == 0) write_header(e, k, h, noextra);
    exchange(&sends, p == 0 ? header_len(noextra) : 0, dl, "scatter");
    if (p == 0) check_headers(e, k, root, act_);
    if (len) std::memcpy(data + off * E, e->peer_slot(root, k) + r * q * E, len * E);
  }
}

void MooncakeBackend::run_alltoall(const uint8_t* in, uint8_t* out, c10::ScalarType dt, int64_t row_elems,
                                   const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows,
                                   int64_t dl) {
  // Rows to or from inactive seats are not moved (their output rows stay untouched).
  CollEngine* e = coll_.get();
  const int W = size_, r = rank_;
  const size_t R = static_cast<size_t>(row_elems) * c10::elementSize(dt);
  std::vector<size_t> soff(W + 1, 0), roff(W + 1, 0);
  for (int j = 0; j < W; ++j) {
    soff[j + 1] = soff[j] + in_rows[j] * R;
    roff[j + 1] = roff[j] + out_rows[j] * R;
  }
  std::vector<int64_t> extra(in_rows);
  extra.insert(extra.end(), out_rows.begin(), out_rows.end());
  OpHeader h{};
  h.op = OP_ALLTOALL;
  h.dtype = static_cast<int32_t>(dt);
  h.root = -1;
  h.count = row_elems;
  h.seq = seq_exec_++;
  const size_t S = e->slot_bytes();
  size_t Q = S / W / 64 * 64;
  if (Q == 0) Q = std::max<size_t>(1, S / W);
  size_t rounds = 1;  // known after round 1 (needs every rank's splits)
  auto out_copy = roff[W] >= kStreamThreshold ? copy_stream : copy_plain;
  for (size_t p = 0; p < rounds; ++p) {
    const uint64_t k = e->next_round();
    PeerRanges sends(W);
    for (int j : act_) {
      if (j == r) continue;
      const size_t tot = soff[j + 1] - soff[j];
      const size_t off = p * Q, len = std::min(Q, tot - std::min(tot, off));
      if (len) std::memcpy(e->my_slot(k) + j * Q, in + soff[j] + off, len);
      sends[j].push_back({j * Q, len});
    }
    if (p == 0) write_header(e, k, h, extra);
    exchange(&sends, p == 0 ? header_len(extra) : 0, dl, "all_to_all");
    if (p == 0) {
      check_headers(e, k, act_[0], act_);
      size_t maxb = 0;
      for (int i : act_) {
        const int64_t* xi = reinterpret_cast<const int64_t*>(e->peer_hdr(i, k) + sizeof(OpHeader));
        for (int j : act_)
          if (i != j) maxb = std::max(maxb, static_cast<size_t>(xi[j]) * R);
      }
      rounds = std::max<size_t>(1, (maxb + Q - 1) / Q);
      const size_t self = soff[r + 1] - soff[r];
      if (self) (self >= kStreamThreshold ? copy_stream : copy_plain)(out + roff[r], in + soff[r], self);
    }
    for (int i : act_) {
      if (i == r) continue;
      const size_t tot = roff[i + 1] - roff[i];
      const size_t off = p * Q, len = std::min(Q, tot - std::min(tot, off));
      if (len) out_copy(out + roff[i] + off, e->peer_slot(i, k) + r * Q, len);
    }
  }
}

void MooncakeBackend::run_barrier(int64_t dl) {
  CollEngine* e = coll_.get();
  OpHeader h{};
  h.op = OP_BARRIER;
  h.root = -1;
  h.seq = seq_exec_++;
  const std::vector<int64_t> noextra;
  const uint64_t k = e->next_round();
  write_header(e, k, h, noextra);
  PeerRanges sends(size_);
  exchange(&sends, header_len(noextra), dl, "barrier");
  check_headers(e, k, act_[0], act_);
}

// ===================================================================================
// Argument checks and the c10d entry points
// ===================================================================================
namespace {

// dense (strided) with a dtype the data path moves
void check_dense(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "mooncake ", op, " (rank ", rank,
                    "): expected a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(data_dtype_ok(t.scalar_type()), "mooncake ", op, " (rank ", rank, "): unsupported dtype ",
                    t.scalar_type());
}

void check_tensor(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined(), "mooncake ", op, " (rank ", rank, "): undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "mooncake ", op, " (rank ", rank,
                    "): expected a CPU tensor, got one on ", t.device(),
                    " (CUDA tensors need a build with CUDA)");
  check_dense(t, op, rank);
}

// an output's elements must be distinct in memory (not an expanded view)
void check_distinct(const at::Tensor& out) {
  TORCH_CHECK_VALUE(
      at::has_internal_overlap(out) != at::MemOverlap::Yes,
      "mooncake: an output tensor has overlapping elements (e.g. an expanded view with stride 0); "
      "pass a tensor whose elements are distinct in memory");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, int rank, const char* what) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "mooncake ", op, " (rank ", rank, "): ", what,
                    " has dtype ", b.scalar_type(), ", expected ", a.scalar_type());
}

void check_single(const std::vector<at::Tensor>& ts, const char* op, int rank) {
  TORCH_CHECK_VALUE(ts.size() == 1, "mooncake ", op, " (rank ", rank, "): expected exactly one tensor, got ",
                    ts.size());
  check_tensor(ts[0], op, rank);
}

void check_root(int64_t root, int size, const char* op, int rank) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "mooncake ", op, " (rank ", rank, "): root ", root,
                    " is out of range [0, ", size, ")");
}

void check_reduce(c10::ScalarType dt, RedOp op, const char* opname, int rank) {
  std::string why = check_reduce_supported(dt, op);
  TORCH_CHECK_VALUE(why.empty(), "mooncake ", opname, " (rank ", rank, "): ", why);
}

// all_gather_into_tensor: output holds world_size inputs of input's dtype
void check_gather_shapes(const at::Tensor& output, const at::Tensor& input, int size, const char* op,
                         int rank) {
  check_same(input, output, op, rank, "the output");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size, "mooncake ", op, " (rank ", rank,
                    "): output must have world_size * input.numel() = ", input.numel() * size,
                    " element(s), got ", output.numel());
}

// reduce_scatter_tensor: input holds world_size outputs of output's dtype, and the
// reduction is supported for it; returns the reduction (premul: PREMUL_SUM's factor)
RedOp check_scatter_args(const at::Tensor& output, const at::Tensor& input,
                         const c10d::ReduceScatterOptions& opts, int size, const char* op, int rank,
                         double* premul) {
  check_same(output, input, op, rank, "the input");
  const RedOp rop = to_redop(opts.reduceOp, premul);
  check_reduce(output.scalar_type(), rop, op, rank);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, "mooncake ", op, " (rank ", rank,
                    "): input must have world_size * output.numel() = ", output.numel() * size,
                    " element(s), got ", input.numel());
  return rop;
}

// A contiguous tensor to work on; copies back into `user` afterwards when they differ.
at::Tensor contiguous_out(const at::Tensor& user, std::vector<std::function<void()>>& backs) {
  check_distinct(user);
  if (user.is_contiguous()) return user;
  at::Tensor tmp = user.contiguous();
  backs.push_back([user, tmp]() mutable { user.copy_(tmp); });
  return tmp;
}

std::function<void()> join_backs(std::vector<std::function<void()>> backs) {
  if (backs.empty()) return nullptr;
  return [backs]() {
    for (auto& b : backs) b();
  };
}

std::vector<at::Tensor> flat_outputs(std::vector<std::vector<at::Tensor>>& outs) {
  std::vector<at::Tensor> v;
  for (auto& l : outs)
    for (auto& t : l) v.push_back(t);
  return v;
}

}  // namespace

std::function<void()> MooncakeBackend::backup_for_retry(const std::vector<at::Tensor>& ts) {
  // on_failure='mask' reruns an op over the survivors; in-place ops need their input back
  if (policy_ != FailurePolicy::MASK) return nullptr;
  std::vector<at::Tensor> copies;
  for (auto& t : ts) copies.push_back(t.clone());
  std::vector<at::Tensor> dst = ts;
  return [dst, copies]() mutable {
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(copies[i]);
  };
}

#ifdef MOONCAKE_WITH_CUDA
void MooncakeBackend::ipc_epoch_start(const void* hdr, int ref, const char* opname, int64_t dl) {
  // Buffer half p of round k may be overwritten once every peer recorded "done reading"
  // for the rounds before k-1 (pg/cuda_ipc.hpp); within an epoch the round k-1 in between
  // proves it. Rounds restart with each membership epoch (a failure agreed through the
  // store, a join), so the first IPC op of an epoch starts with an extra round (a barrier
  // carrying the op's header, so a mismatch is caught there too): every active rank has
  // left its previous op, its records included.
  if (ipc_epoch_ == coll_->epoch()) return;
  CollEngine* e = coll_.get();
  const uint64_t k = e->next_round();
  OpHeader h;
  std::memcpy(&h, hdr, sizeof(h));
  write_header(e, k, h, {});
  PeerRanges sends(size_);
  exchange(&sends, header_len({}), dl, opname);
  check_headers(e, k, ref, act_);
  ipc_epoch_ = coll_->epoch();
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_ipc(at::Tensor& t,
                                                              const c10d::AllreduceOptions& opts) {
  // the rank's own argument errors raise here, before anything is queued
  const char* op = "all_reduce";
  check_dense(t, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(t.scalar_type(), rop, op, rank_);
  check_distinct(t);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(t, op);
  auto w = submit(c10d::OpType::ALLREDUCE, {}, opts.asyncOp, opts.timeout,
                  [this, iop, rop, premul](int64_t dl) { run_allreduce_ipc(*iop, rop, premul, dl); });
  return CudaIpc::wrap(rank_, c10d::OpType::ALLREDUCE, w, iop);
}

void MooncakeBackend::ipc_check_one_host(const char* method) const {
  TORCH_CHECK(one_host_, "MooncakeBackend::", method,
              ": the CUDA IPC path needs every rank on this host, and the "
              "membership now spans hosts (MOONCAKE_CUDA_IPC=0 stages through host memory instead)");
}

void MooncakeBackend::run_ipc_pieces(CudaIpcOp& op, const void* hdr, int ref, size_t n, size_t R,
                                     const char* opname, int64_t dl, const IpcPieceFn& before,
                                     const IpcPieceFn& after) {
  // pg/cuda_ipc.hpp: per piece of at most R elements, `before` (copies in, side stream),
  // one engine round with the header (the handshake: peers' copies are queued; failures
  // and mismatches as on the CPU path), `after` (reads peers' buffers, side stream). The
  // calling thread never waits for the GPU.
  CollEngine* e = coll_.get();
  const size_t pieces = std::max<size_t>(1, (n + R - 1) / R);
  const std::vector<int64_t> noextra;
  OpHeader h;
  std::memcpy(&h, hdr, sizeof(h));
  h.count = static_cast<int64_t>(n);
  h.seq = seq_exec_++;  // once per op, as on the CPU path
  ipc_epoch_start(&h, ref, opname, dl);
  for (size_t s = 0; s < pieces; ++s) {
    const uint64_t k = e->next_round();
    const int parity = static_cast<int>(k & 1);  // alternates; equal on every rank (engine.hpp)
    const size_t off = s * R, len = std::min(R, n - std::min(n, off));
    before(parity, off, len);
    write_header(e, k, h, noextra);
    PeerRanges sends(size_);
    exchange(&sends, header_len(noextra), dl, opname);
    check_headers(e, k, ref, act_);
    after(parity, off, len);
  }
  ipc_->finish(op);
}

void MooncakeBackend::run_allreduce_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t dl) {
  // every rank copies its piece into its buffer, the round is the handshake, every rank
  // reduces every active rank's piece into its output
  ipc_check_one_host("allreduce");
  const size_t n = static_cast<size_t>(op.user.numel());
  const size_t R = ipc_->round_elems(op);
  // a rerun over survivors (mask) must find the input as it was: reduce into a copy
  ipc_->prepare(op, policy_ == FailurePolicy::MASK && n > R);
  OpHeader h{};
  h.op = OP_ALLREDUCE_IPC;
  h.dtype = static_cast<int32_t>(op.user.scalar_type());
  h.redop = static_cast<int32_t>(rop);
  h.root = -1;
  run_ipc_pieces(
      op, &h, act_[0], n, R, "all_reduce", dl,
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->stage(op, parity, off, len, act_, peer_pid_, rop, premul);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->reduce(op, parity, off, len, act_, peer_pid_, rop);
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast_ipc(at::Tensor& t,
                                                              const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  check_dense(t, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  if (rank_ != root) check_distinct(t);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(t, op);
  auto w = submit(c10d::OpType::BROADCAST, {}, opts.asyncOp, opts.timeout,
                  [this, iop, root](int64_t dl) { run_broadcast_ipc(*iop, root, dl); });
  return CudaIpc::wrap(rank_, c10d::OpType::BROADCAST, w, iop);
}

void MooncakeBackend::run_broadcast_ipc(CudaIpcOp& op, int root, int64_t dl) {
  // the root copies each piece into its buffer, the round is the handshake, the others
  // copy the piece out of the root's buffer
  ipc_check_one_host("broadcast");
  require_active_root(root, "broadcast");
  const size_t n = static_cast<size_t>(op.user.numel());
  ipc_->prepare(op, false);  // a rerun rewrites every piece; the root's tensor is only read
  OpHeader h{};
  h.op = OP_BROADCAST_IPC;
  h.dtype = static_cast<int32_t>(op.user.scalar_type());
  h.root = root;
  run_ipc_pieces(
      op, &h, root, n, ipc_->round_elems(op), "broadcast", dl,
      [&](int parity, size_t off, size_t len) {
        if (rank_ == root && len)
          ipc_->stage(op, parity, off, len, act_, peer_pid_, RedOp::SUM, 1.0);
        else
          ipc_->publish_events();  // the root waits for my reads before it overwrites its buffer
      },
      [&](int parity, size_t off, size_t len) {
        if (rank_ != root && len) ipc_->copy_from(op, parity, root, off, len, peer_pid_);
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_base_ipc(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_single";
  check_dense(input, op, rank_);
  check_dense(output, op, rank_);
  check_gather_shapes(output, input, size_, op, rank_);
  check_distinct(output);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(input, op, output);
  iop->writes_user = false;  // the input is only read
  auto w = submit(c10d::OpType::_ALLGATHER_BASE, {}, opts.asyncOp, opts.timeout,
                  [this, iop](int64_t dl) { run_allgather_ipc(*iop, dl); });
  return CudaIpc::wrap(rank_, c10d::OpType::_ALLGATHER_BASE, w, iop);
}

void MooncakeBackend::run_allgather_ipc(CudaIpcOp& op, int64_t dl) {
  // every rank copies its piece into its buffer, the round is the handshake, every rank
  // copies every active rank's piece into its slot of the output (slots of inactive seats
  // are left untouched)
  ipc_check_one_host("_allgather_base");
  const size_t n = static_cast<size_t>(op.user.numel());
  const size_t R = ipc_->round_elems(op);
  // a rerun over survivors (mask) must find the slot of a rank that died mid-op untouched
  ipc_->prepare(op, policy_ == FailurePolicy::MASK && n > R);
  OpHeader h{};
  h.op = OP_ALLGATHER_IPC;
  h.dtype = static_cast<int32_t>(op.user.scalar_type());
  h.root = -1;
  run_ipc_pieces(
      op, &h, act_[0], n, R, "all_gather", dl,
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->stage(op, parity, off, len, act_, peer_pid_, RedOp::SUM, 1.0);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->gather_into(op, parity, off, len, n, act_, peer_pid_);
      });
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_base_ipc(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_single";
  check_dense(input, op, rank_);
  check_dense(output, op, rank_);
  double premul;
  const RedOp rop = check_scatter_args(output, input, opts, size_, op, rank_, &premul);
  check_distinct(output);
  std::shared_ptr<CudaIpcOp> iop = ipc_->begin(input, op, output);
  iop->writes_user = false;  // the input is only read
  auto w = submit(c10d::OpType::_REDUCE_SCATTER_BASE, {}, opts.asyncOp, opts.timeout,
                  [this, iop, rop, premul](int64_t dl) { run_reduce_scatter_ipc(*iop, rop, premul, dl); });
  return CudaIpc::wrap(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, w, iop);
}

void MooncakeBackend::run_reduce_scatter_ipc(CudaIpcOp& op, RedOp rop, double premul, int64_t dl) {
  // every rank copies its pieces for every active seat into its buffer, the round is the
  // handshake, every rank reduces the active ranks' pieces for it
  ipc_check_one_host("_reduce_scatter_base");
  const size_t n = static_cast<size_t>(op.out_user.numel());  // elements per seat
  ipc_->prepare(op, false);  // a rerun rewrites every piece of the output; the input is only read
  OpHeader h{};
  h.op = OP_REDUCE_SCATTER_IPC;
  h.dtype = static_cast<int32_t>(op.user.scalar_type());
  h.redop = static_cast<int32_t>(rop);
  h.root = -1;
  run_ipc_pieces(
      op, &h, act_[0], n, ipc_->scatter_round_elems(op), "reduce_scatter", dl,
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->stage_scatter(op, parity, off, len, n, act_, peer_pid_, rop, premul);
      },
      [&](int parity, size_t off, size_t len) {
        if (len) ipc_->reduce_scatter(op, parity, off, len, act_, peer_pid_, rop);
      });
}

bool MooncakeBackend::ipc_eligible(const std::vector<at::Tensor>& ts) const {
  // one host, one CUDA tensor: CUDA IPC (cuda_ipc_status() says why not otherwise)
  return ts.size() == 1 && ts[0].defined() && ts[0].is_cuda() && !coalescing_ && cfg_.cuda_ipc && one_host_ &&
         size_ <= cuda::kMaxSources;
}
#endif

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible(tensors)) return allreduce_ipc(tensors[0], opts);
#endif
  MOONCAKE_CUDA_STAGED(ALLREDUCE, "allreduce", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       allreduce(tensors, opts));
  const char* op = "all_reduce";
  check_single(tensors, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(tensors[0].scalar_type(), rop, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  return submit(
      c10d::OpType::ALLREDUCE, tensors, opts.asyncOp, opts.timeout,
      [this, t, rop, premul](int64_t dl) mutable { run_allreduce(t, rop, premul, -1, dl); },
      join_backs(backs), backup_for_retry({t}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLREDUCE_COALESCED, "allreduce_coalesced", (tensor_ptrs(tensors)),
                       (tensor_ptrs(tensors)), allreduce_coalesced(tensors, opts));
  const char* op = "all_reduce_coalesced";
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> work;
  for (auto& t : tensors) {
    check_tensor(t, op, rank_);
    check_reduce(t.scalar_type(), rop, op, rank_);
    work.push_back(contiguous_out(t, backs));
  }
  return submit(
      c10d::OpType::ALLREDUCE_COALESCED, tensors, opts.asyncOp, opts.timeout,
      [this, work, rop, premul](int64_t dl) mutable {
        for (auto& t : work) run_allreduce(t, rop, premul, -1, dl);
      },
      join_backs(backs), backup_for_retry(work));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  MOONCAKE_CUDA_STAGED(REDUCE, "reduce", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       reduce(tensors, opts));
  const char* op = "reduce";
  check_single(tensors, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(tensors[0].scalar_type(), rop, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  int root = static_cast<int>(opts.rootRank);
  return submit(
      c10d::OpType::REDUCE, tensors, opts.asyncOp, opts.timeout,
      [this, t, rop, premul, root](int64_t dl) mutable { run_allreduce(t, rop, premul, root, dl); },
      join_backs(backs), rank_ == root ? backup_for_retry({t}) : nullptr);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible(tensors)) return broadcast_ipc(tensors[0], opts);
#endif
  MOONCAKE_CUDA_STAGED(BROADCAST, "broadcast", (tensor_ptrs(tensors)), (tensor_ptrs(tensors)),
                       broadcast(tensors, opts));
  const char* op = "broadcast";
  check_single(tensors, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  std::vector<std::function<void()>> backs;
  at::Tensor t = contiguous_out(tensors[0], backs);
  int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) backs.clear();  // the root's tensor is only read
  return submit(
      c10d::OpType::BROADCAST, tensors, opts.asyncOp, opts.timeout,
      [this, t, root](int64_t dl) mutable { run_broadcast(t, root, dl); }, join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLGATHER, "allgather", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       allgather(outputs, inputs, opts));
  const char* op = "all_gather";
  check_single(inputs, op, rank_);
  TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "mooncake ", op,
                    " (rank ", rank_, "): expected one list of ", size_, " output tensors, got ",
                    outputs.size() == 1 ? outputs[0].size() : outputs.size());
  at::Tensor in = inputs[0].contiguous();
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> outs;
  std::vector<uint8_t*> ptrs;
  for (auto& o : outputs[0]) {
    check_tensor(o, op, rank_);
    check_same(in, o, op, rank_, "an output tensor");
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "mooncake ", op, " (rank ", rank_,
                      "): each output tensor must have ", in.numel(), " element(s) like the input, got ",
                      o.numel());
    outs.push_back(contiguous_out(o, backs));
    ptrs.push_back(static_cast<uint8_t*>(outs.back().data_ptr()));
  }
  return submit(
      c10d::OpType::ALLGATHER, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, in, outs, ptrs](int64_t dl) { run_allgather(in, ptrs, OP_ALLGATHER, -1, dl); },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible({input}) && output.defined() && output.is_cuda())
    return allgather_base_ipc(output, input, opts);
#endif
  MOONCAKE_CUDA_STAGED(_ALLGATHER_BASE, "_allgather_base", (tensor_ptrs(input)), (tensor_ptrs(output)),
                       _allgather_base(output, input, opts));
  const char* op = "all_gather_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  check_gather_shapes(output, input, size_, op, rank_);
  at::Tensor in = input.contiguous();
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  std::vector<uint8_t*> ptrs;
  const size_t nb = in.numel() * in.element_size();
  for (int j = 0; j < size_; ++j) ptrs.push_back(static_cast<uint8_t*>(out.data_ptr()) + j * nb);
  return submit(
      c10d::OpType::_ALLGATHER_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, out, ptrs](int64_t dl) { run_allgather(in, ptrs, OP_ALLGATHER, -1, dl); }, join_backs(backs),
      backup_for_retry({out}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLGATHER_COALESCED, "allgather_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), allgather_coalesced(outputs, inputs, opts));
  const char* op = "all_gather_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                    "): expected one output list per input, got ", outputs.size(), " for ", inputs.size());
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins;
  std::vector<std::vector<uint8_t*>> ptrs;
  std::vector<at::Tensor> keep;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    ins.push_back(inputs[i].contiguous());
    TORCH_CHECK_VALUE(static_cast<int>(outputs[i].size()) == size_, "mooncake ", op, " (rank ", rank_,
                      "): expected ", size_, " output tensors per input, got ", outputs[i].size());
    ptrs.emplace_back();
    for (auto& o : outputs[i]) {
      check_tensor(o, op, rank_);
      check_same(inputs[i], o, op, rank_, "an output tensor");
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), "mooncake ", op, " (rank ", rank_,
                        "): output tensor size ", o.numel(), " differs from input size ", inputs[i].numel());
      keep.push_back(contiguous_out(o, backs));
      ptrs.back().push_back(static_cast<uint8_t*>(keep.back().data_ptr()));
    }
  }
  return submit(
      c10d::OpType::ALLGATHER_COALESCED, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, ins, ptrs, keep](int64_t dl) {
        for (size_t i = 0; i < ins.size(); ++i) run_allgather(ins[i], ptrs[i], OP_ALLGATHER, -1, dl);
      },
      join_backs(backs), backup_for_retry(keep));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(MOONCAKE_OP_AG_COALESCED, "allgather_into_tensor_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), allgather_into_tensor_coalesced(outputs, inputs, opts));
  const char* op = "all_gather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                    "): expected as many outputs as inputs, got ", outputs.size(), " and ", inputs.size());
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins, outs;
  std::vector<std::vector<uint8_t*>> ptrs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    check_tensor(outputs[i], op, rank_);
    check_same(inputs[i], outputs[i], op, rank_, "an output");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "mooncake ", op, " (rank ", rank_,
                      "): output ", i, " must have ", inputs[i].numel() * size_, " element(s), got ",
                      outputs[i].numel());
    ins.push_back(inputs[i].contiguous());
    outs.push_back(contiguous_out(outputs[i], backs));
    ptrs.emplace_back();
    const size_t nb = ins.back().numel() * ins.back().element_size();
    for (int j = 0; j < size_; ++j)
      ptrs.back().push_back(static_cast<uint8_t*>(outs.back().data_ptr()) + j * nb);
  }
  return submit(
      c10d::OpType::COALESCED, outputs, opts.asyncOp, opts.timeout,
      [this, ins, outs, ptrs](int64_t dl) {
        for (size_t i = 0; i < ins.size(); ++i) run_allgather(ins[i], ptrs[i], OP_ALLGATHER, -1, dl);
      },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  MOONCAKE_CUDA_STAGED(GATHER, "gather", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       gather(outputs, inputs, opts));
  const char* op = "gather";
  check_single(inputs, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor in = inputs[0].contiguous();
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> outs;
  std::vector<uint8_t*> ptrs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "mooncake ", op,
                      " (rank ", rank_, "): the root needs one list of ", size_, " output tensors");
    for (auto& o : outputs[0]) {
      check_tensor(o, op, rank_);
      check_same(in, o, op, rank_, "an output tensor");
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "mooncake ", op, " (rank ", rank_,
                        "): each output tensor must have ", in.numel(), " element(s), got ", o.numel());
      outs.push_back(contiguous_out(o, backs));
      ptrs.push_back(static_cast<uint8_t*>(outs.back().data_ptr()));
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "mooncake ", op, " (rank ", rank_,
                      "): only the root (rank ", root, ") passes output tensors");
  }
  return submit(
      c10d::OpType::GATHER, flat_outputs(outputs), opts.asyncOp, opts.timeout,
      [this, in, outs, ptrs, root](int64_t dl) { run_allgather(in, ptrs, OP_GATHER, root, dl); },
      join_backs(backs), backup_for_retry(outs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(SCATTER, "scatter", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       scatter(outputs, inputs, opts));
  const char* op = "scatter";
  check_single(outputs, op, rank_);
  check_root(opts.rootRank, size_, op, rank_);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(outputs[0], backs);
  std::vector<at::Tensor> ins;
  std::vector<const uint8_t*> ptrs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "mooncake ", op,
                      " (rank ", rank_, "): the root needs one list of ", size_, " input tensors");
    for (auto& i : inputs[0]) {
      check_tensor(i, op, rank_);
      check_same(out, i, op, rank_, "an input tensor");
      TORCH_CHECK_VALUE(i.numel() == out.numel(), "mooncake ", op, " (rank ", rank_,
                        "): each input tensor must have ", out.numel(), " element(s) like the output, got ",
                        i.numel());
      ins.push_back(i.contiguous());
      ptrs.push_back(static_cast<const uint8_t*>(ins.back().data_ptr()));
    }
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "mooncake ", op, " (rank ", rank_,
                      "): only the root (rank ", root, ") passes input tensors");
  }
  return submit(
      c10d::OpType::SCATTER, outputs, opts.asyncOp, opts.timeout,
      [this, ins, ptrs, out, root](int64_t dl) mutable { run_scatter(ptrs, out, root, dl); },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(REDUCE_SCATTER, "reduce_scatter", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       reduce_scatter(outputs, inputs, opts));
  const char* op = "reduce_scatter";
  check_single(outputs, op, rank_);
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  check_reduce(outputs[0].scalar_type(), rop, op, rank_);
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "mooncake ", op,
                    " (rank ", rank_, "): expected one list of ", size_, " input tensors");
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(outputs[0], backs);
  std::vector<at::Tensor> ins;
  std::vector<const uint8_t*> ptrs;
  for (auto& i : inputs[0]) {
    check_tensor(i, op, rank_);
    check_same(out, i, op, rank_, "an input tensor");
    TORCH_CHECK_VALUE(i.numel() == out.numel(), "mooncake ", op, " (rank ", rank_,
                      "): each input tensor must have ", out.numel(), " element(s) like the output, got ",
                      i.numel());
    ins.push_back(i.contiguous());
    ptrs.push_back(static_cast<const uint8_t*>(ins.back().data_ptr()));
  }
  return submit(
      c10d::OpType::REDUCE_SCATTER, outputs, opts.asyncOp, opts.timeout,
      [this, ins, ptrs, out, rop, premul](int64_t dl) mutable {
        run_reduce_scatter(ptrs, out, rop, premul, dl);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
#ifdef MOONCAKE_WITH_CUDA
  if (ipc_eligible({input}) && output.defined() && output.is_cuda())
    return reduce_scatter_base_ipc(output, input, opts);
#endif
  MOONCAKE_CUDA_STAGED(_REDUCE_SCATTER_BASE, "_reduce_scatter_base", (tensor_ptrs(input)),
                       (tensor_ptrs(output)), _reduce_scatter_base(output, input, opts));
  const char* op = "reduce_scatter_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  double premul;
  const RedOp rop = check_scatter_args(output, input, opts, size_, op, rank_, &premul);
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  at::Tensor in = input.contiguous();
  std::vector<const uint8_t*> ptrs;
  const size_t nb = out.numel() * out.element_size();
  for (int j = 0; j < size_; ++j) ptrs.push_back(static_cast<const uint8_t*>(in.data_ptr()) + j * nb);
  return submit(
      c10d::OpType::_REDUCE_SCATTER_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, ptrs, out, rop, premul](int64_t dl) mutable {
        run_reduce_scatter(ptrs, out, rop, premul, dl);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  MOONCAKE_CUDA_STAGED(MOONCAKE_OP_RS_COALESCED, "reduce_scatter_tensor_coalesced", (tensor_ptrs(inputs)),
                       (tensor_ptrs(outputs)), reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  const char* op = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "mooncake ", op, " (rank ", rank_,
                    "): expected as many outputs as inputs");
  double premul;
  RedOp rop = to_redop(opts.reduceOp, &premul);
  std::vector<std::function<void()>> backs;
  std::vector<at::Tensor> ins, outs;
  std::vector<std::vector<const uint8_t*>> ptrs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], op, rank_);
    check_tensor(outputs[i], op, rank_);
    check_same(outputs[i], inputs[i], op, rank_, "an input");
    check_reduce(outputs[i].scalar_type(), rop, op, rank_);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "mooncake ", op, " (rank ", rank_,
                      "): input ", i, " must have ", outputs[i].numel() * size_, " element(s), got ",
                      inputs[i].numel());
    ins.push_back(inputs[i].contiguous());
    outs.push_back(contiguous_out(outputs[i], backs));
    ptrs.emplace_back();
    const size_t nb = outs.back().numel() * outs.back().element_size();
    for (int j = 0; j < size_; ++j)
      ptrs.back().push_back(static_cast<const uint8_t*>(ins.back().data_ptr()) + j * nb);
  }
  return submit(
      c10d::OpType::COALESCED, outputs, opts.asyncOp, opts.timeout,
      [this, ins, outs, ptrs, rop, premul](int64_t dl) mutable {
        for (size_t i = 0; i < outs.size(); ++i) run_reduce_scatter(ptrs[i], outs[i], rop, premul, dl);
      },
      join_backs(backs));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_split_sizes,
                                                              std::vector<int64_t>& input_split_sizes,
                                                              const c10d::AllToAllOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLTOALL_BASE, "alltoall_base", (tensor_ptrs(input)), (tensor_ptrs(output)),
                       alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
  const char* op = "all_to_all_single";
  check_tensor(input, op, rank_);
  check_tensor(output, op, rank_);
  check_same(input, output, op, rank_, "the output");
  const int W = size_;
  auto splits = [&](const at::Tensor& t, const std::vector<int64_t>& s, const char* which) {
    std::vector<int64_t> rows;
    const int64_t dim0 = t.dim() == 0 ? 1 : t.size(0);
    if (s.empty()) {
      TORCH_CHECK_VALUE(dim0 % W == 0, "mooncake ", op, " (rank ", rank_, "): ", which, ".size(0) = ", dim0,
                        " is not divisible by world_size ", W, " (pass split sizes for uneven splits)");
      rows.assign(W, dim0 / W);
    } else {
      TORCH_CHECK_VALUE(static_cast<int>(s.size()) == W, "mooncake ", op, " (rank ", rank_, "): ", which,
                        " split sizes have ", s.size(), " entries, expected world_size = ", W);
      int64_t sum = 0;
      for (int64_t v : s) {
        TORCH_CHECK_VALUE(v >= 0, "mooncake ", op, " (rank ", rank_, "): negative ", which, " split size ",
                          v);
        sum += v;
      }
      TORCH_CHECK_VALUE(sum == dim0, "mooncake ", op, " (rank ", rank_, "): ", which, " split sizes sum to ",
                        sum, " but ", which, ".size(0) is ", dim0);
      rows = s;
    }
    return rows;
  };
  std::vector<int64_t> in_rows = splits(input, input_split_sizes, "input");
  std::vector<int64_t> out_rows = splits(output, output_split_sizes, "output");
  const int64_t in_dim0 = input.dim() == 0 ? 1 : input.size(0);
  const int64_t out_dim0 = output.dim() == 0 ? 1 : output.size(0);
  const int64_t row_in = in_dim0 ? input.numel() / in_dim0 : (input.dim() ? input.numel() : 1);
  int64_t row_elems = 1;
  for (int64_t d = 1; d < input.dim(); ++d) row_elems *= input.size(d);
  int64_t row_out = 1;
  for (int64_t d = 1; d < output.dim(); ++d) row_out *= output.size(d);
  (void)row_in;
  (void)out_dim0;
  TORCH_CHECK_VALUE(row_elems == row_out, "mooncake ", op, " (rank ", rank_, "): input rows have ", row_elems,
                    " element(s) but output rows have ", row_out);
  at::Tensor in = input.contiguous();
  std::vector<std::function<void()>> backs;
  at::Tensor out = contiguous_out(output, backs);
  const auto dt = input.scalar_type();
  return submit(
      c10d::OpType::ALLTOALL_BASE, {output}, opts.asyncOp, opts.timeout,
      [this, in, out, dt, row_elems, in_rows, out_rows](int64_t dl) mutable {
        run_alltoall(static_cast<const uint8_t*>(in.data_ptr()), static_cast<uint8_t*>(out.data_ptr()), dt,
                     row_elems, in_rows, out_rows, dl);
      },
      join_backs(backs), backup_for_retry({out}));
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  MOONCAKE_CUDA_STAGED(ALLTOALL, "alltoall", (tensor_ptrs(inputs)), (tensor_ptrs(outputs)),
                       alltoall(outputs, inputs, opts));
  const char* op = "all_to_all";
  const int W = size_;
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == W && static_cast<int>(outputs.size()) == W,
                    "mooncake ", op, " (rank ", rank_, "): expected ", W, " input and ", W,
                    " output tensors, got ", inputs.size(), " and ", outputs.size());
  for (auto& t : inputs) check_tensor(t, op, rank_);
  for (auto& t : outputs) {
    check_tensor(t, op, rank_);
    check_same(inputs[0], t, op, rank_, "an output tensor");
  }
  for (auto& t : inputs) check_same(inputs[0], t, op, rank_, "an input tensor");
  std::vector<int64_t> in_rows, out_rows;
  std::vector<at::Tensor> flat_in;
  for (auto& t : inputs) {
    in_rows.push_back(t.numel());
    flat_in.push_back(t.contiguous().view(-1));
  }
  for (auto& t : outputs) out_rows.push_back(t.numel());
  at::Tensor in = at::cat(flat_in);
  int64_t total_out = 0;
  for (auto v : out_rows) total_out += v;
  at::Tensor out = at::empty({total_out}, inputs[0].options());
  std::vector<at::Tensor> outs = outputs;
  auto back = [this, outs, out, out_rows]() mutable {
    std::vector<int32_t> active = active_ranks();  // inactive seats' outputs stay untouched
    int64_t off = 0;
    for (size_t j = 0; j < outs.size(); ++j) {
      if (active[j]) outs[j].copy_(out.narrow(0, off, out_rows[j]).view(outs[j].sizes()));
      off += out_rows[j];
    }
  };
  const auto dt = inputs[0].scalar_type();
  return submit(
      c10d::OpType::ALLTOALL, outputs, opts.asyncOp, opts.timeout,
      [this, in, out, dt, in_rows, out_rows](int64_t dl) mutable {
        run_alltoall(static_cast<const uint8_t*>(in.data_ptr()), static_cast<uint8_t*>(out.data_ptr()), dt, 1,
                     in_rows, out_rows, dl);
      },
      back);
}

c10::intrusive_ptr<c10d::Work> MooncakeBackend::barrier(const c10d::BarrierOptions& opts) {
  return submit(c10d::OpType::BARRIER, {}, opts.asyncOp, opts.timeout,
                [this](int64_t dl) { run_barrier(dl); });
}

}  // namespace mooncake
