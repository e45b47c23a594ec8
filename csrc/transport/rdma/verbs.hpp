// RDMA over libibverbs: NIC discovery, a device context, registered memory and RC queue
// pairs with RDMA write (optionally with immediate) and read. No torch headers here.
// Compiled only when <infiniband/verbs.h> exists (setup.py defines MOONCAKE_WITH_RDMA).
// Errors are std::runtime_error("Class::method: ...").
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct ibv_context;
struct ibv_pd;
struct ibv_cq;
struct ibv_mr;
struct ibv_qp;

namespace mooncake {

struct RdmaPortInfo {
  int port = 0;       // 1-based port number
  std::string state;  // "PORT_ACTIVE", "PORT_DOWN", ... (ibv_port_state_str)
  bool active = false;
  std::string link_layer;  // "InfiniBand" or "Ethernet" (RoCE)
  int lid = 0;
  int active_mtu = 0;  // bytes
  int gid_index = -1;  // the GID index this code would use (-1: none usable)
  std::string gid;     // that GID, as 8 groups of 4 hex digits
};

struct RdmaDeviceInfo {
  std::string name;       // e.g. "mlx5_0"
  std::string node_guid;  // hex
  std::vector<RdmaPortInfo> ports;
};

// Every RDMA device the verbs library sees, with its ports. Empty when there is none (or
// no provider library is installed). Never throws for a missing device; a device that
// cannot be opened is listed without ports.
std::vector<RdmaDeviceInfo> rdma_devices();

// Picks "<device>[:<port>]" (empty: the first device with an active port) from `devs`.
// Throws with what was expected and what was found when nothing fits.
void rdma_choose(const std::vector<RdmaDeviceInfo>& devs, const std::string& spec, std::string* device,
                 int* port);

// Connection details of one queue pair, exchanged through the rendezvous store.
struct RdmaQpInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  int mtu = 0;  // ibv_mtu enum value
  std::string encode() const;
  static RdmaQpInfo decode(const std::string& s);
};

// One opened device port with a protection domain and one completion queue.
class RdmaContext {
 public:
  // device/port from rdma_choose; gid_index < 0: the port's default (RoCE v2 IPv4 GID on
  // Ethernet, none on InfiniBand).
  RdmaContext(const std::string& device, int port, int gid_index, int cq_depth);
  ~RdmaContext();
  RdmaContext(const RdmaContext&) = delete;
  RdmaContext& operator=(const RdmaContext&) = delete;
  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_cq* cq() const { return cq_; }
  int port() const { return port_; }
  int gid_index() const { return gid_index_; }
  const std::string& device() const { return device_; }
  RdmaQpInfo local_template() const;  // lid/gid/mtu filled, qpn/psn zero

 private:
  std::string device_;
  int port_ = 1, gid_index_ = -1, mtu_ = 0;
  uint16_t lid_ = 0;
  uint8_t gid_[16] = {};
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
};

// Page-aligned memory registered for local write and remote read/write.
class RdmaMemory {
 public:
  RdmaMemory(RdmaContext& ctx, size_t bytes);
  ~RdmaMemory();
  RdmaMemory(const RdmaMemory&) = delete;
  RdmaMemory& operator=(const RdmaMemory&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  uint32_t lkey() const;
  uint32_t rkey() const;

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  ibv_mr* mr_ = nullptr;
};

// A reliable-connected queue pair on the context's CQ.
class RdmaQp {
 public:
  RdmaQp(RdmaContext& ctx, int max_send_wr, int max_recv_wr);
  ~RdmaQp();
  RdmaQp(const RdmaQp&) = delete;
  RdmaQp& operator=(const RdmaQp&) = delete;
  RdmaQpInfo info() const;
  uint32_t qpn() const;
  // INIT -> RTR -> RTS against the peer's info.
  void connect(const RdmaQpInfo& remote);
  // RDMA write of [local, local+len) (in memory with lkey) to remote_addr/rkey. With
  // `imm`, a write with immediate (consumes one posted receive at the peer).
  void post_write(const void* local, size_t len, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                  uint64_t wr_id, bool signaled, const uint32_t* imm = nullptr);
  void post_read(void* local, size_t len, uint32_t lkey, uint64_t remote_addr, uint32_t rkey, uint64_t wr_id,
                 bool signaled);
  // A receive without buffers (for writes with immediate).
  void post_recv(uint64_t wr_id);

 private:
  RdmaContext& ctx_;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;
};

// One completion from the CQ.
struct RdmaCompletion {
  uint64_t wr_id;
  uint32_t qpn;
  int status;    // 0: success (IBV_WC_SUCCESS)
  bool is_recv;  // a receive (write with immediate arrived)
  uint32_t imm;  // host order
  std::string status_str;
};
// Polls up to `max` completions without blocking.
int rdma_poll(RdmaContext& ctx, RdmaCompletion* out, int max);

}  // namespace mooncake
