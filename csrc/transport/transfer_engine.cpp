#include "transport/transfer_engine.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "transport/copy.hpp"
#include "transport/tcp.hpp"

namespace mooncake {

namespace {

constexpr char kMagic[8] = {'M', 'C', 'T', 'E', '0', '0', '0', '1'};
constexpr uint32_t kOpWrite = 1, kOpRead = 2;
constexpr int kIoTimeoutS =
    10;  // a send or receive that makes no progress this long fails (a live
         // peer always moves some bytes within it; a stopped one blocks its clients this long)
constexpr int kConnectTimeoutMs = 2000;  // a peer's engine listens before it is advertised: refused = gone
constexpr int kHandshakeTimeoutS = 5;    // a live peer answers the hello at once (a stopped one never)
constexpr size_t kWindow = 256;          // ops in flight per round (bounds unread replies)

struct ReqHdr {
  uint32_t op;
  uint32_t region;
  uint64_t offset;
  uint64_t len;
};
struct RepHdr {
  uint32_t status;
  uint32_t pad;
  uint64_t len;
};
static_assert(sizeof(ReqHdr) == 24 && sizeof(RepHdr) == 16, "wire structs");

std::runtime_error err(const char* method, const std::string& msg) {
  return std::runtime_error(std::string("TransferEngine::") + method + ": " + msg);
}

PeerConnectionError conn_err(const char* method, const std::string& msg) {
  return PeerConnectionError(std::string("TransferEngine::") + method + ": " + msg);
}

// Blocking full send/recv; false on a closed or broken peer.
bool send_full(int fd, const void* buf, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool recv_full(int fd, void* buf, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, MSG_WAITALL);
    if (k == 0) return false;
    if (k < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Sends every byte of iov (in sendmsg calls of at most IOV_MAX pieces); false on a closed
// or broken peer. One system call for many small pieces: a batch of 4 KiB ops costs one
// wake-up of the peer instead of one per header and one per payload.
// A call that the socket's send timeout (SO_SNDTIMEO) ended after a part was sent
// returns that part; the peer has then stopped reading for that long, which counts as a
// failure too (else every further call would wait the timeout again).
bool send_iov(int fd, std::vector<iovec>& iov) {
  timeval tv{};
  socklen_t tl = sizeof(tv);
  double timeout_s =
      getsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, &tl) == 0 ? tv.tv_sec + tv.tv_usec * 1e-6 : 0;
  size_t i = 0;
  while (i < iov.size()) {
    msghdr m{};
    m.msg_iov = &iov[i];
    m.msg_iovlen = std::min<size_t>(iov.size() - i, IOV_MAX);
    size_t want = 0;
    for (size_t j = 0; j < m.msg_iovlen; ++j) want += iov[i + j].iov_len;
    auto t0 = std::chrono::steady_clock::now();
    ssize_t k = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (timeout_s > 0 && static_cast<size_t>(k) < want &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= timeout_s)
      return false;
    size_t left = static_cast<size_t>(k);
    while (i < iov.size() && left >= iov[i].iov_len) left -= iov[i++].iov_len;
    if (left) {
      iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + left;
      iov[i].iov_len -= left;
    }
  }
  return true;
}

// Why recv_full failed during op i (errno 0 before the call): the socket timeout
// (SO_RCVTIMEO: EAGAIN) or a closed or broken connection.
std::string recv_failure(const std::string& peer, size_t i) {
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return "peer " + peer + " sent nothing for " + std::to_string(kIoTimeoutS) + " s during op " +
           std::to_string(i) + " (stopped or hung)";
  return "peer " + peer + " closed the connection during op " + std::to_string(i);
}

void set_timeout(int fd, int seconds) {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

TransferEngine::TransferEngine(const std::string& listen_host, const std::string& secret)
    : host_(listen_host), secret_(secret) {
  if (secret_.size() > 256) throw err("TransferEngine", "secret longer than 256 bytes");
  if (listen_host.empty()) return;
  {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(listen_host.c_str(), "0", &hints, &res) != 0 || !res)
      throw err("TransferEngine", "cannot resolve " + listen_host);
    listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    bool ok = listen_fd_ >= 0 && bind(listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
              listen(listen_fd_, 256) == 0;
    freeaddrinfo(res);
    if (!ok) throw err("TransferEngine", "cannot listen on " + listen_host + ": " + std::strerror(errno));
    sockaddr_storage bound{};
    socklen_t blen = sizeof(bound);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &blen);
    port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                             : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  }
  acceptor_ = std::thread([this] { accept_loop(); });
}

TransferEngine::~TransferEngine() { close(); }

void TransferEngine::close() {
  if (stop_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  {
    std::lock_guard<std::mutex> g(serve_mu_);
    for (int fd : server_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto& t : servers_) t.join();
  servers_.clear();
  std::lock_guard<std::mutex> g(conns_mu_);
  for (auto& kv : conns_) {
    std::lock_guard<std::mutex> cg(kv.second->mu);
    if (kv.second->fd >= 0) ::close(kv.second->fd);
    kv.second->fd = -1;
  }
  conns_.clear();
}

uint32_t TransferEngine::register_memory(void* addr, size_t len) {
  if (!addr && len) throw err("register_memory", "null address");
  std::unique_lock<std::shared_mutex> g(regions_mu_);
  uint32_t id = next_region_++;
  regions_[id] = Region{static_cast<uint8_t*>(addr), len};
  return id;
}

void TransferEngine::unregister_memory(uint32_t region) {
  std::unique_lock<std::shared_mutex> g(regions_mu_);  // waits for transfers in progress
  if (regions_.erase(region) == 0) throw err("unregister_memory", "unknown region " + std::to_string(region));
}

void TransferEngine::accept_loop() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_socket_options(fd);
    std::lock_guard<std::mutex> g(serve_mu_);
    server_fds_.push_back(fd);
    servers_.emplace_back([this, fd] { serve(fd); });
  }
}

void TransferEngine::serve(int fd) {
  set_timeout(fd, kIoTimeoutS);
  char magic[8];
  uint32_t slen = 0;
  bool ok =
      recv_full(fd, magic, 8) && std::memcmp(magic, kMagic, 8) == 0 && recv_full(fd, &slen, 4) && slen <= 256;
  std::string secret(ok ? slen : 0, '\0');
  ok = ok && recv_full(fd, secret.data(), slen);
  if (ok) {
    // constant-time comparison
    unsigned diff = secret.size() != secret_.size();
    for (size_t i = 0; i < secret.size() && i < secret_.size(); ++i) diff |= secret[i] ^ secret_[i];
    uint32_t status = diff ? 1 : 0;
    ok = send_full(fd, &status, 4) && status == 0;
  }
  set_timeout(fd, 0);
  while (ok && !stop_) {
    ReqHdr h;
    if (!recv_full(fd, &h, sizeof(h))) break;
    std::shared_lock<std::shared_mutex> g(regions_mu_);
    auto it = regions_.find(h.region);
    bool valid = (h.op == kOpWrite || h.op == kOpRead) && it != regions_.end() &&
                 h.offset <= it->second.len && h.len <= it->second.len - h.offset;
    RepHdr r{valid ? 0u : 1u, 0, valid ? h.len : 0};
    if (!valid) {
      send_full(fd, &r, sizeof(r));
      break;
    }
    uint8_t* p = it->second.base + h.offset;
    if (h.op == kOpWrite) {
      if (!recv_full(fd, p, h.len)) break;
      if (!send_full(fd, &r, sizeof(r))) break;
    } else {
      std::vector<iovec> iov{{&r, sizeof(r)}, {p, h.len}};
      if (!send_iov(fd, iov)) break;
    }
  }
  {
    std::lock_guard<std::mutex> g(serve_mu_);
    for (auto& x : server_fds_)
      if (x == fd) x = -1;
  }
  ::close(fd);
}

std::shared_ptr<TransferEngine::Conn> TransferEngine::connect_to(const std::string& host, int port) {
  std::string key = host + ":" + std::to_string(port);
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    auto it = conns_.find(key);
    if (it != conns_.end()) return it->second;
    c = std::make_shared<Conn>();
    conns_[key] = c;
  }
  return c;
}

void TransferEngine::drop(const std::string& host, int port, const std::shared_ptr<Conn>& c) {
  if (c->fd >= 0) ::close(c->fd);
  c->fd = -1;
  std::lock_guard<std::mutex> g(conns_mu_);
  auto it = conns_.find(host + ":" + std::to_string(port));
  if (it != conns_.end() && it->second == c) conns_.erase(it);
}

// Reads one byte of every page of the caller's buffers on a helper thread while a batch
// of at least kTouchAheadMin bytes is sent or received, ahead of the kernel's copies.
// On VMs a page nobody touched for about a second costs extra at its next access, and
// more inside send/recv than from user space: on the 2-core CI VM the first put over
// TCP of a 64 MiB value idle for 1.2 s took 225-235 ms against 43-60 ms for the next
// ones, and 47-67 ms with this thread running ahead (which costs nothing measurable on
// touched memory). Stops (and is joined) when the batch ends.
class TouchAhead {
 public:
  static constexpr uint64_t kTouchAheadMin = 4 << 20;
  static constexpr uint64_t kChunk = 1 << 20;  // checks for the end of the batch this often

  TouchAhead(const std::vector<uint8_t*>& bufs, const std::vector<uint64_t>& lens) {
    uint64_t total = 0;
    for (uint64_t n : lens) total += n;
    if (total < kTouchAheadMin) return;
    th_ = std::thread([this, &bufs, &lens] {
      for (size_t i = 0; i < bufs.size(); ++i)
        for (uint64_t off = 0; off < lens[i]; off += kChunk) {
          if (stop_.load(std::memory_order_relaxed)) return;
          touch_pages(bufs[i] + off, std::min(kChunk, lens[i] - off));
        }
    });
  }
  ~TouchAhead() {
    stop_.store(true, std::memory_order_relaxed);
    if (th_.joinable()) th_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread th_;
};

template <bool kWrite>
void TransferEngine::batch(const char* what, const std::string& host, int port, uint32_t region,
                           const std::vector<uint64_t>& offsets, const std::vector<uint8_t*>& bufs,
                           const std::vector<uint64_t>& lens) {
  if (stop_) throw err(what, "engine is closed");
  if (offsets.size() != bufs.size() || offsets.size() != lens.size())
    throw err(what, "offsets, buffers and lengths differ in count");
  auto c = connect_to(host, port);
  std::lock_guard<std::mutex> g(c->mu);
  const std::string peer = host + ":" + std::to_string(port);
  if (c->fd < 0) {
    int fd;
    try {
      fd = tcp_connect(host, port, kConnectTimeoutMs);
    } catch (const std::exception& e) {
      drop(host, port, c);
      throw conn_err(what, std::string("cannot connect to ") + peer + ": " + e.what());
    }
    set_timeout(fd, kHandshakeTimeoutS);
    uint32_t slen = static_cast<uint32_t>(secret_.size()), status = 1;
    errno = 0;
    bool ok = send_full(fd, kMagic, 8) && send_full(fd, &slen, 4) && send_full(fd, secret_.data(), slen) &&
              recv_full(fd, &status, 4);
    if (!ok || status != 0) {
      const bool timed_out = !ok && (errno == EAGAIN || errno == EWOULDBLOCK);
      ::close(fd);
      drop(host, port, c);
      throw conn_err(what, ok          ? "peer " + peer + " rejected the shared secret"
                           : timed_out ? "peer " + peer + " did not answer the handshake within " +
                                             std::to_string(kHandshakeTimeoutS) + " s (stopped or hung)"
                                       : "handshake with " + peer + " failed");
    }
    set_timeout(fd, kIoTimeoutS);
    c->fd = fd;
  }
  int fd = c->fd;
  TouchAhead ahead(bufs, lens);
  for (size_t start = 0; start < offsets.size(); start += kWindow) {
    size_t end = std::min(offsets.size(), start + kWindow);
    // the whole window's headers (and payloads) in one gathered send
    std::vector<ReqHdr> hdrs(end - start);
    std::vector<iovec> iov;
    iov.reserve(2 * (end - start));
    for (size_t i = start; i < end; ++i) {
      hdrs[i - start] = ReqHdr{kWrite ? kOpWrite : kOpRead, region, offsets[i], lens[i]};
      iov.push_back({&hdrs[i - start], sizeof(ReqHdr)});
      if (kWrite && lens[i]) iov.push_back({bufs[i], lens[i]});
    }
    if (!send_iov(fd, iov)) {
      drop(host, port, c);
      throw conn_err(
          what, "peer " + peer + " stopped taking ops " + std::to_string(start) + "-" +
                    std::to_string(end - 1) +
                    " (it refused one: unknown region or out of bounds; or it died, or read nothing for " +
                    std::to_string(kIoTimeoutS) + " s)");
    }
    for (size_t i = start; i < end; ++i) {
      RepHdr r;
      errno = 0;
      if (!recv_full(fd, &r, sizeof(r))) {
        drop(host, port, c);
        throw conn_err(what, recv_failure(peer, i));
      }
      if (r.status != 0) {
        drop(host, port, c);
        throw err(what, "peer " + peer + " refused op " + std::to_string(i) + " (region " +
                            std::to_string(region) + ", offset " + std::to_string(offsets[i]) + ", " +
                            std::to_string(lens[i]) + " bytes): unknown region or out of bounds");
      }
      if (!kWrite && !recv_full(fd, bufs[i], lens[i])) {
        drop(host, port, c);
        throw conn_err(what, recv_failure(peer, i));
      }
    }
  }
}

void TransferEngine::batch_write(const std::string& host, int port, uint32_t region,
                                 const std::vector<uint64_t>& offsets, const std::vector<const void*>& srcs,
                                 const std::vector<uint64_t>& lens) {
  std::vector<uint8_t*> bufs;
  bufs.reserve(srcs.size());
  for (auto p : srcs) bufs.push_back(const_cast<uint8_t*>(static_cast<const uint8_t*>(p)));
  batch<true>("batch_write", host, port, region, offsets, bufs, lens);
}

void TransferEngine::batch_read(const std::string& host, int port, uint32_t region,
                                const std::vector<uint64_t>& offsets, const std::vector<void*>& dsts,
                                const std::vector<uint64_t>& lens) {
  std::vector<uint8_t*> bufs;
  bufs.reserve(dsts.size());
  for (auto p : dsts) bufs.push_back(static_cast<uint8_t*>(p));
  batch<false>("batch_read", host, port, region, offsets, bufs, lens);
}

}  // namespace mooncake
