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

// Waits until one of the fds is ready (read for rd, write for wr) or wake_fd is readable
// or timeout_ms passes.
void poll_fds(const std::vector<int>& rd, const std::vector<int>& wr, int wake_fd, int timeout_ms);

// One byte stream to a peer carried by several connected TCP sockets
// (MooncakeOptions.tcp_streams), for links that one TCP connection cannot fill (its window
// over a long round trip, or a NIC that hashes one flow to one queue and core, caps it
// below the link rate). The stream is cut into chunks of kStripeChunkBytes by byte
// position: chunk c travels on socket c % n, so a large message is spread evenly over the
// sockets and the receiver, reading the same positions in the same order, puts every byte
// where it belongs without any framing. A message shorter than a chunk goes on one socket
// (two when it straddles a chunk boundary); with one socket every call is a single
// send/recv, as without striping. Any socket that fails makes the whole stream fail (the
// peer counts as gone).
class TcpStreams {
 public:
  // Chunk of the stream that one socket carries before the next takes over: 128 KiB is
  // 8 syscalls per MiB, and a frame of the default 1 MiB slot covers 8 sockets.
  static constexpr size_t kStripeChunkBytes = 128 << 10;
  TcpStreams() = default;
  // Takes ownership of the connected sockets (made non-blocking); empty: not connected.
  explicit TcpStreams(std::vector<int> fds);
  ~TcpStreams();
  TcpStreams(TcpStreams&& o) noexcept;
  TcpStreams& operator=(TcpStreams&& o) noexcept;
  TcpStreams(const TcpStreams&) = delete;
  TcpStreams& operator=(const TcpStreams&) = delete;

  bool connected() const { return !fds_.empty(); }
  const std::vector<int>& fds() const { return fds_; }
  // As send_some / recv_some on one socket: bytes moved, 0 if the socket the next byte
  // belongs to would block; throws on a closed or broken socket.
  size_t send_some(const void* buf, size_t n);
  size_t recv_some(void* buf, size_t n);
  // The socket the next byte to send / receive belongs to (what to poll when blocked).
  int send_fd() const { return fds_[(sent_ / kStripeChunkBytes) % fds_.size()]; }
  int recv_fd() const { return fds_[(received_ / kStripeChunkBytes) % fds_.size()]; }

 private:
  void close_all();
  std::vector<int> fds_;
  uint64_t sent_ = 0, received_ = 0;  // stream positions
};

// Address of the local interface used to reach `peer_host` (a UDP connect trick; no
// packet is sent), or of interface `ifname` when given.
std::string local_address_for(const std::string& peer_host, const std::string& ifname);

}  // namespace mooncake
