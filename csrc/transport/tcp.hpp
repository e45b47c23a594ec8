// TCP sockets for the data plane. No torch headers here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mooncake {

// A listening socket bound to host:0 (an ephemeral port chosen by the kernel).
class TcpListener {
 public:
  explicit TcpListener(const std::string& host);
  ~TcpListener();
  int port() const { return port_; }
  const std::string& host() const { return host_; }
  // Accepts one connection; throws std::runtime_error after timeout_ms.
  int accept_fd(int64_t timeout_ms);

 private:
  int fd_ = -1;
  int port_ = 0;
  std::string host_;
};

// The local IPv4 address the kernel routes towards `ip` ("" if none; no packet is sent).
std::string local_address_towards(const std::string& ip);
// True for 127.0.0.0/8, ::1 and "localhost".
bool is_loopback_address(const std::string& host);

// Connects to host:port, retrying until timeout_ms; returns a connected fd.
int tcp_connect(const std::string& host, int port, int64_t timeout_ms);

// Blocking helpers on a connected fd (used during set-up only).
void send_all_blocking(int fd, const void* buf, size_t n);
void recv_all_blocking(int fd, void* buf, size_t n, int64_t timeout_ms);

void set_nonblocking(int fd);
void set_socket_options(int fd);

// Non-blocking I/O: bytes moved (0 if it would block); throws on a closed or broken peer.
size_t send_some(int fd, const void* buf, size_t n);
size_t recv_some(int fd, void* buf, size_t n);
// A piece of bytes for send_some_v (what struct iovec holds, without <sys/uio.h> here).
struct ConstBytes {
  const void* ptr;
  size_t len;
};
// Gathering send_some: the pieces in order, as one byte stream, in one system call (a
// small frame leaves as one packet, not one per piece); at most 64 pieces are used.
size_t send_some_v(int fd, const ConstBytes* pieces, size_t npieces);

// Waits until one of the fds is ready (read for rd, write for wr) or wake_fd is readable
// or timeout_ms passes.
void poll_fds(const std::vector<int>& rd, const std::vector<int>& wr, int wake_fd, int timeout_ms);

// Address of the local interface used to reach `peer_host` (a UDP connect trick; no
// packet is sent), or of interface `ifname` when given.
std::string local_address_for(const std::string& peer_host, const std::string& ifname);

}  // namespace mooncake
