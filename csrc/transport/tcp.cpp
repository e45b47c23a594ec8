#include "transport/tcp.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "transport/shm.hpp"

namespace mooncake {

static std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error("tcp: " + what + ": " + std::strerror(errno));
}

static bool resolve(const std::string& host, int port, sockaddr_storage* out, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string p = std::to_string(port);
  if (getaddrinfo(host.c_str(), p.c_str(), &hints, &res) != 0 || !res) return false;
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}

std::string local_address_towards(const std::string& ip) {
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);
  if (inet_pton(AF_INET, ip.c_str(), &to.sin_addr) != 1) return "";
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  std::string out;
  sockaddr_in me{};
  socklen_t len = sizeof(me);
  char buf[INET_ADDRSTRLEN] = {0};
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
      inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf)) != nullptr)
    out = buf;
  close(fd);
  return out;
}

bool is_loopback_address(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  return inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

TcpListener::TcpListener(const std::string& host) : host_(host) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (!resolve(host, 0, &addr, &len)) throw std::runtime_error("tcp: cannot resolve " + host);
  fd_ = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw sys_error("socket");
  int one = 1;
  setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int saved = errno;
    close(fd_);
    fd_ = -1;
    errno = saved;
    throw sys_error("bind " + host);
  }
  if (listen(fd_, 256) != 0) throw sys_error("listen");
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &blen);
  port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
}

TcpListener::~TcpListener() {
  if (fd_ >= 0) close(fd_);
}

int TcpListener::accept_fd(int64_t timeout_ms) {
  pollfd p{fd_, POLLIN, 0};
  int rc = poll(&p, 1, static_cast<int>(timeout_ms));
  if (rc <= 0) throw std::runtime_error("tcp: timed out waiting for a peer to connect");
  int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) throw sys_error("accept");
  set_socket_options(fd);
  return fd;
}

void set_socket_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

int tcp_connect(const std::string& host, int port, int64_t timeout_ms) {
  int64_t deadline = now_ns() + timeout_ms * 1000000LL;
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (!resolve(host, port, &addr, &len)) throw std::runtime_error("tcp: cannot resolve " + host);
  while (true) {
    // Non-blocking, so that one attempt ends at the deadline too (a blocking connect to a
    // host that drops SYNs waits for the kernel's retries, about two minutes).
    int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) throw sys_error("socket");
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), len);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pf{fd, POLLOUT, 0};
      int left = static_cast<int>(std::max<int64_t>(1, (deadline - now_ns()) / 1000000LL));
      int err = ETIMEDOUT;
      socklen_t elen = sizeof(err);
      if (poll(&pf, 1, left) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0) err = errno;
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      int fl = fcntl(fd, F_GETFL);
      if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        close(fd);
        throw sys_error("fcntl");
      }
      set_socket_options(fd);
      return fd;
    }
    const int saved = errno;
    close(fd);
    errno = saved;
    if (now_ns() > deadline)
      throw std::runtime_error("tcp: cannot connect to " + host + ":" + std::to_string(port) + ": " +
                               std::strerror(errno));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void send_all_blocking(int fd, const void* buf, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw sys_error("send");
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all_blocking(int fd, void* buf, size_t n, int64_t timeout_ms) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  int64_t deadline = now_ns() + timeout_ms * 1000000LL;
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    int left = static_cast<int>((deadline - now_ns()) / 1000000LL);
    if (left <= 0 || poll(&pf, 1, left) <= 0) throw std::runtime_error("tcp: timed out in recv");
    ssize_t k = ::recv(fd, p, n, 0);
    if (k == 0) throw std::runtime_error("tcp: peer closed the connection");
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw sys_error("recv");
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

size_t send_some(int fd, const void* buf, size_t n) {
  if (n == 0) return 0;
  ssize_t k = ::send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw sys_error("send to peer");
  }
  return static_cast<size_t>(k);
}

size_t send_some_v(int fd, const ConstBytes* pieces, size_t npieces) {
  iovec iov[64];
  size_t n = 0;
  for (size_t q = 0; q < npieces && n < 64; ++q)
    if (pieces[q].len > 0) iov[n++] = iovec{const_cast<void*>(pieces[q].ptr), pieces[q].len};
  if (n == 0) return 0;
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw sys_error("send to peer");
  }
  return static_cast<size_t>(k);
}

size_t recv_some(int fd, void* buf, size_t n) {
  if (n == 0) return 0;
  ssize_t k = ::recv(fd, buf, n, MSG_DONTWAIT);
  if (k == 0) throw std::runtime_error("tcp: peer closed the connection");
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw sys_error("recv from peer");
  }
  return static_cast<size_t>(k);
}

void poll_fds(const std::vector<int>& rd, const std::vector<int>& wr, int wake_fd, int timeout_ms) {
  std::vector<pollfd> fds;
  fds.reserve(rd.size() + wr.size() + 1);
  for (int fd : rd) fds.push_back({fd, POLLIN, 0});
  for (int fd : wr) fds.push_back({fd, POLLOUT, 0});
  if (wake_fd >= 0) fds.push_back({wake_fd, POLLIN, 0});
  poll(fds.data(), fds.size(), timeout_ms);
}

std::string local_address_for(const std::string& peer_host, const std::string& ifname) {
  if (!ifname.empty()) {
    ifaddrs* ifa = nullptr;
    if (getifaddrs(&ifa) == 0) {
      for (ifaddrs* p = ifa; p; p = p->ifa_next) {
        if (!p->ifa_addr || ifname != p->ifa_name || p->ifa_addr->sa_family != AF_INET) continue;
        char buf[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(p->ifa_addr)->sin_addr, buf, sizeof(buf));
        freeifaddrs(ifa);
        return buf;
      }
      freeifaddrs(ifa);
    }
    throw std::runtime_error("tcp: interface '" + ifname + "' has no IPv4 address");
  }
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (!resolve(peer_host, 9, &addr, &len) || addr.ss_family != AF_INET) return "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  std::string out = "127.0.0.1";
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
    sockaddr_in me{};
    socklen_t ml = sizeof(me);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&me), &ml) == 0) {
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf));
      out = buf;
    }
  }
  if (fd >= 0) close(fd);
  return out;
}

}  // namespace mooncake
