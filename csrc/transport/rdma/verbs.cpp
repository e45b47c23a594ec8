#include "transport/rdma/verbs.hpp"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

namespace mooncake {

namespace {

std::string err(const char* where, const std::string& what) { return std::string(where) + ": " + what; }

std::string errno_str(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

std::string gid_str(const uint8_t* g) {
  char buf[48];
  snprintf(buf, sizeof(buf), "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0],
           g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return buf;
}

int mtu_bytes(int m) {
  switch (m) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
    default:
      return 0;
  }
}

bool gid_zero(const uint8_t* g) {
  for (int i = 0; i < 16; ++i)
    if (g[i]) return false;
  return true;
}

// The GID index to use on a port: on Ethernet (RoCE) the first RoCE v2 GID holding an
// IPv4-mapped address, else the first RoCE v2 one, else the first non-zero one; on
// InfiniBand index 0 when non-zero (routing by LID works without it).
int default_gid_index(ibv_context* ctx, int port, const ibv_port_attr& pa, uint8_t* gid_out) {
  int best = -1, best_rank = 99;
  for (int i = 0; i < pa.gid_tbl_len && i < 256; ++i) {
    ibv_gid g{};
    if (ibv_query_gid(ctx, port, i, &g) != 0) continue;
    if (gid_zero(g.raw)) continue;
    int rank = 3;
    if (pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
      ibv_gid_entry e{};
      bool v2 = ibv_query_gid_ex(ctx, port, i, &e, 0) == 0 && e.gid_type == IBV_GID_TYPE_ROCE_V2;
      bool v4 = g.raw[10] == 0xff && g.raw[11] == 0xff;
      for (int q = 0; q < 10; ++q) v4 = v4 && g.raw[q] == 0;
      rank = v2 && v4 ? 0 : v2 ? 1 : 2;
    } else {
      rank = i == 0 ? 0 : 3;
    }
    if (rank < best_rank) {
      best_rank = rank;
      best = i;
      std::memcpy(gid_out, g.raw, 16);
    }
  }
  return best;
}

}  // namespace

std::vector<RdmaDeviceInfo> rdma_devices() {
  std::vector<RdmaDeviceInfo> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return out;
  for (int d = 0; d < n; ++d) {
    RdmaDeviceInfo info;
    info.name = ibv_get_device_name(list[d]);
    char guid[24];
    snprintf(guid, sizeof(guid), "%016llx",
             static_cast<unsigned long long>(be64toh(ibv_get_device_guid(list[d]))));
    info.node_guid = guid;
    ibv_context* ctx = ibv_open_device(list[d]);
    if (ctx) {
      ibv_device_attr da{};
      if (ibv_query_device(ctx, &da) == 0) {
        for (int p = 1; p <= da.phys_port_cnt; ++p) {
          ibv_port_attr pa{};
          if (ibv_query_port(ctx, p, &pa) != 0) continue;
          RdmaPortInfo pi;
          pi.port = p;
          pi.state = ibv_port_state_str(pa.state);
          pi.active = pa.state == IBV_PORT_ACTIVE;
          pi.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
          pi.lid = pa.lid;
          pi.active_mtu = mtu_bytes(pa.active_mtu);
          uint8_t g[16] = {};
          pi.gid_index = default_gid_index(ctx, p, pa, g);
          if (pi.gid_index >= 0) pi.gid = gid_str(g);
          info.ports.push_back(pi);
        }
      }
      ibv_close_device(ctx);
    }
    out.push_back(info);
  }
  ibv_free_device_list(list);
  return out;
}

void rdma_choose(const std::vector<RdmaDeviceInfo>& devs, const std::string& spec, std::string* device,
                 int* port) {
  std::string want = spec;
  int want_port = 0;
  auto colon = spec.find(':');
  if (colon != std::string::npos) {
    want = spec.substr(0, colon);
    try {
      want_port = std::stoi(spec.substr(colon + 1));
    } catch (const std::exception&) {
      throw std::runtime_error(
          err("rdma_choose", "expected DEVICE[:PORT] (e.g. mlx5_0:1), got '" + spec + "'"));
    }
  }
  std::string seen;
  for (const auto& d : devs) {
    for (const auto& p : d.ports) {
      seen += (seen.empty() ? "" : ", ") + d.name + ":" + std::to_string(p.port) + " " + p.state;
      if (!want.empty() && d.name != want) continue;
      if (want_port && p.port != want_port) continue;
      if (!p.active) continue;
      *device = d.name;
      *port = p.port;
      return;
    }
  }
  throw std::runtime_error(
      err("rdma_choose", "expected an RDMA device port in state PORT_ACTIVE" +
                             (spec.empty() ? std::string() : " matching '" + spec + "'") + ", got " +
                             std::to_string(devs.size()) + " device(s)" +
                             (seen.empty() ? std::string() : " [" + seen + "]")));
}

// ---- RdmaQpInfo ------------------------------------------------------------------------
std::string RdmaQpInfo::encode() const {
  char buf[128];
  int n = snprintf(buf, sizeof(buf), "%u %u %u %d ", qpn, psn, static_cast<unsigned>(lid), mtu);
  std::string s(buf, n);
  for (int i = 0; i < 16; ++i) {
    snprintf(buf, sizeof(buf), "%02x", gid[i]);
    s += buf;
  }
  return s;
}

RdmaQpInfo RdmaQpInfo::decode(const std::string& s) {
  RdmaQpInfo q;
  unsigned lid = 0;
  char hex[40] = {};
  if (sscanf(s.c_str(), "%u %u %u %d %32s", &q.qpn, &q.psn, &lid, &q.mtu, hex) != 5 || strlen(hex) != 32)
    throw std::runtime_error(err("RdmaQpInfo::decode", "malformed queue pair info '" + s + "'"));
  q.lid = static_cast<uint16_t>(lid);
  for (int i = 0; i < 16; ++i) {
    unsigned v = 0;
    sscanf(hex + 2 * i, "%2x", &v);
    q.gid[i] = static_cast<uint8_t>(v);
  }
  return q;
}

// ---- RdmaContext -----------------------------------------------------------------------
RdmaContext::RdmaContext(const std::string& device, int port, int gid_index, int cq_depth)
    : device_(device), port_(port) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list)
    throw std::runtime_error(err("RdmaContext::RdmaContext", "ibv_get_device_list: " + errno_str(errno)));
  for (int d = 0; d < n && !ctx_; ++d)
    if (device == ibv_get_device_name(list[d])) ctx_ = ibv_open_device(list[d]);
  int e = errno;
  ibv_free_device_list(list);
  if (!ctx_)
    throw std::runtime_error(
        err("RdmaContext::RdmaContext", "cannot open RDMA device '" + device + "': " + errno_str(e)));
  auto fail = [&](const std::string& what) {
    int e2 = errno;
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    ibv_close_device(ctx_);
    throw std::runtime_error(err("RdmaContext::RdmaContext",
                                 device + ":" + std::to_string(port) + ": " + what + ": " + errno_str(e2)));
  };
  ibv_port_attr pa{};
  if (ibv_query_port(ctx_, port, &pa) != 0) fail("ibv_query_port");
  if (pa.state != IBV_PORT_ACTIVE) {
    errno = ENETDOWN;
    fail(std::string("expected port state PORT_ACTIVE, got ") + ibv_port_state_str(pa.state));
  }
  lid_ = pa.lid;
  mtu_ = pa.active_mtu;
  if (gid_index < 0) {
    gid_index_ = default_gid_index(ctx_, port, pa, gid_);
    if (pa.link_layer == IBV_LINK_LAYER_ETHERNET && gid_index_ < 0) {
      errno = EADDRNOTAVAIL;
      fail("a RoCE port needs a GID, got none (is an IP address configured on its interface?)");
    }
  } else {
    ibv_gid g{};
    if (ibv_query_gid(ctx_, port, gid_index, &g) != 0)
      fail("ibv_query_gid(" + std::to_string(gid_index) + ")");
    gid_index_ = gid_index;
    std::memcpy(gid_, g.raw, 16);
  }
  pd_ = ibv_alloc_pd(ctx_);
  if (!pd_) fail("ibv_alloc_pd");
  cq_ = ibv_create_cq(ctx_, cq_depth, nullptr, nullptr, 0);
  if (!cq_) fail("ibv_create_cq");
}

RdmaContext::~RdmaContext() {
  if (cq_) ibv_destroy_cq(cq_);
  if (pd_) ibv_dealloc_pd(pd_);
  if (ctx_) ibv_close_device(ctx_);
}

RdmaQpInfo RdmaContext::local_template() const {
  RdmaQpInfo q;
  q.lid = lid_;
  q.mtu = mtu_;
  if (gid_index_ >= 0) std::memcpy(q.gid, gid_, 16);
  return q;
}

// ---- RdmaMemory ------------------------------------------------------------------------
RdmaMemory::RdmaMemory(RdmaContext& ctx, size_t bytes) : size_(bytes) {
  const size_t len = (bytes + 4095) / 4096 * 4096;
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw std::runtime_error(
        err("RdmaMemory::RdmaMemory", "mmap of " + std::to_string(len) + " bytes: " + errno_str(errno)));
  data_ = static_cast<uint8_t*>(p);
  mr_ = ibv_reg_mr(ctx.pd(), data_, len,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr_) {
    int e = errno;
    munmap(data_, len);
    throw std::runtime_error(
        err("RdmaMemory::RdmaMemory",
            "ibv_reg_mr of " + std::to_string(len) + " bytes: " + errno_str(e) + " (check `ulimit -l`)"));
  }
  size_ = len;
}

RdmaMemory::~RdmaMemory() {
  if (mr_) ibv_dereg_mr(mr_);
  if (data_) munmap(data_, size_);
}

uint32_t RdmaMemory::lkey() const { return mr_->lkey; }
uint32_t RdmaMemory::rkey() const { return mr_->rkey; }

// ---- RdmaQp ----------------------------------------------------------------------------
RdmaQp::RdmaQp(RdmaContext& ctx, int max_send_wr, int max_recv_wr) : ctx_(ctx) {
  ibv_qp_init_attr ia{};
  ia.send_cq = ctx.cq();
  ia.recv_cq = ctx.cq();
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap.max_send_wr = max_send_wr;
  ia.cap.max_recv_wr = max_recv_wr;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  qp_ = ibv_create_qp(ctx.pd(), &ia);
  if (!qp_) throw std::runtime_error(err("RdmaQp::RdmaQp", "ibv_create_qp: " + errno_str(errno)));
  std::random_device rd;
  psn_ = rd() & 0xffffff;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(ctx.port());
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  int rc = ibv_modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) {
    ibv_destroy_qp(qp_);
    throw std::runtime_error(err("RdmaQp::RdmaQp", "ibv_modify_qp(INIT): " + errno_str(rc)));
  }
}

RdmaQp::~RdmaQp() {
  if (qp_) ibv_destroy_qp(qp_);
}

uint32_t RdmaQp::qpn() const { return qp_->qp_num; }

RdmaQpInfo RdmaQp::info() const {
  RdmaQpInfo q = ctx_.local_template();
  q.qpn = qp_->qp_num;
  q.psn = psn_;
  return q;
}

void RdmaQp::connect(const RdmaQpInfo& r) {
  const RdmaQpInfo me = info();
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min(me.mtu, r.mtu));
  a.dest_qp_num = r.qpn;
  a.rq_psn = r.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = r.lid;
  a.ah_attr.sl = 0;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.port_num = static_cast<uint8_t>(ctx_.port());
  if (ctx_.gid_index() >= 0 && !gid_zero(r.gid)) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(ctx_.gid_index());
    a.ah_attr.grh.hop_limit = 64;
  }
  int rc = ibv_modify_qp(qp_, &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) throw std::runtime_error(err("RdmaQp::connect", "ibv_modify_qp(RTR): " + errno_str(rc)));
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
  a.retry_cnt = 7;
  a.rnr_retry = 7;  // infinite: a peer that has not posted receives yet is waited for
  a.sq_psn = psn_;
  a.max_rd_atomic = 1;
  rc = ibv_modify_qp(qp_, &a,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                         IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) throw std::runtime_error(err("RdmaQp::connect", "ibv_modify_qp(RTS): " + errno_str(rc)));
}

namespace {
// One RDMA write or read work request on `qp` (no scatter entry for zero bytes).
void post_rdma(ibv_qp* qp, ibv_wr_opcode opcode, const char* where, const void* local, size_t len,
               uint32_t lkey, uint64_t remote_addr, uint32_t rkey, uint64_t wr_id, bool signaled,
               const uint32_t* imm) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(local);
  sge.length = static_cast<uint32_t>(len);
  sge.lkey = lkey;
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = opcode;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  if (imm) wr.imm_data = htonl(*imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  int rc = ibv_post_send(qp, &wr, &bad);
  if (rc != 0) throw std::runtime_error(err(where, "ibv_post_send: " + errno_str(rc)));
}
}  // namespace

void RdmaQp::post_write(const void* local, size_t len, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                        uint64_t wr_id, bool signaled, const uint32_t* imm) {
  post_rdma(qp_, imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE, "RdmaQp::post_write", local, len, lkey,
            remote_addr, rkey, wr_id, signaled, imm);
}

void RdmaQp::post_read(void* local, size_t len, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                       uint64_t wr_id, bool signaled) {
  post_rdma(qp_, IBV_WR_RDMA_READ, "RdmaQp::post_read", local, len, lkey, remote_addr, rkey, wr_id, signaled,
            nullptr);
}

void RdmaQp::post_recv(uint64_t wr_id) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = nullptr;
  wr.num_sge = 0;
  int rc = ibv_post_recv(qp_, &wr, &bad);
  if (rc != 0) throw std::runtime_error(err("RdmaQp::post_recv", "ibv_post_recv: " + errno_str(rc)));
}

int rdma_poll(RdmaContext& ctx, RdmaCompletion* out, int max) {
  ibv_wc wc[16];
  int n = ibv_poll_cq(ctx.cq(), std::min(max, 16), wc);
  if (n < 0) throw std::runtime_error(err("rdma_poll", "ibv_poll_cq failed"));
  for (int i = 0; i < n; ++i) {
    out[i].wr_id = wc[i].wr_id;
    out[i].qpn = wc[i].qp_num;
    out[i].status = wc[i].status;
    out[i].is_recv = wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM || wc[i].opcode == IBV_WC_RECV;
    out[i].imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
    out[i].status_str = wc[i].status == IBV_WC_SUCCESS ? "" : ibv_wc_status_str(wc[i].status);
  }
  return n;
}

}  // namespace mooncake
