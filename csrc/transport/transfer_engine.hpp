// TransferEngine: moves bytes between registered memory of two processes over TCP.
// No torch headers here. Errors are std::runtime_error("TransferEngine::method: ..."); a
// failure of the connection to a peer (it cannot be reached, the handshake failed, it
// closed the connection or stopped reading) is the subclass PeerConnectionError, so that
// callers can tell it from a live peer that refused an op.
//
// Wire format (little-endian, both ends are this code):
//   hello   client -> server: "MCTE0001", u32 secret length, secret bytes (<= 256)
//           server -> client: u32 status (0 ok, 1 wrong secret: then closed)
//   request client -> server: u32 op (1 write, 2 read), u32 region, u64 offset, u64 len,
//                             then len bytes for a write
//   reply   server -> client: u32 status (0 ok, else error: then closed), u32 0, u64 len,
//                             then len bytes for a read
// A request outside its region (or for an unknown region) is refused with an error
// status and the connection is closed; no memory is touched.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace mooncake {

// The connection to a peer failed (see the top of this file); the binding raises it as
// torch.distributed.DistNetworkError.
struct PeerConnectionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class TransferEngine {
 public:
  // listen_host empty: client only (no server). Otherwise listens on listen_host:0.
  TransferEngine(const std::string& listen_host, const std::string& secret);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

  // Registers [addr, addr + len) for peers to read and write; returns its region id.
  uint32_t register_memory(void* addr, size_t len);
  void unregister_memory(uint32_t region);

  // Writes srcs[i] (lens[i] bytes) to offset offsets[i] of the peer's region, or reads
  // into dsts[i]. All-or-error: throws if any op fails (the peer's region may then hold
  // part of the data, the caller's buffers part of the reply).
  void batch_write(const std::string& host, int port, uint32_t region, const std::vector<uint64_t>& offsets,
                   const std::vector<const void*>& srcs, const std::vector<uint64_t>& lens);
  void batch_read(const std::string& host, int port, uint32_t region, const std::vector<uint64_t>& offsets,
                  const std::vector<void*>& dsts, const std::vector<uint64_t>& lens);

  // Stops the server and closes every connection. Idempotent.
  void close();

 private:
  struct Region {
    uint8_t* base;
    size_t len;
  };
  struct Conn {
    int fd = -1;
    std::mutex mu;
  };

  void accept_loop();
  void serve(int fd);
  std::shared_ptr<Conn> connect_to(const std::string& host, int port);
  void drop(const std::string& host, int port, const std::shared_ptr<Conn>& c);
  template <bool kWrite>
  void batch(const char* what, const std::string& host, int port, uint32_t region,
             const std::vector<uint64_t>& offsets, const std::vector<uint8_t*>& bufs,
             const std::vector<uint64_t>& lens);

  std::string host_;
  std::string secret_;
  int port_ = 0;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex serve_mu_;
  std::vector<std::thread> servers_;
  std::vector<int> server_fds_;

  std::shared_mutex regions_mu_;
  std::map<uint32_t, Region> regions_;
  uint32_t next_region_ = 1;

  std::mutex conns_mu_;
  std::map<std::string, std::shared_ptr<Conn>> conns_;
};

}  // namespace mooncake
