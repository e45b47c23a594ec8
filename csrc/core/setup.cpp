// Set-up of the group core: the constructor, rendezvous through the control store and the
// transport build (shared memory on one host, else TCP or RDMA), which rejoin
// (core/membership.cpp) runs again over each new member set.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "core/group.hpp"
#include "core/op_header.hpp"
#include "transport/shm.hpp"
#include "transport/tcp.hpp"
#ifdef MOONCAKE_WITH_RDMA
#include "core/engine_rdma.hpp"
#endif

namespace mooncake {

Group::Group(std::shared_ptr<ControlStore> store, int rank, int size, BackendConfig cfg)
    : rank_(rank),
      size_(size),
      store_(std::move(store)),
      cfg_(std::move(cfg)),
      timeout_ms_(static_cast<int64_t>(cfg_.timeout_s * 1000)) {
  setup();
}

Group::~Group() {
  shutdown();
  for (int fd : peer_pidfd_)
    if (fd >= 0) close(fd);
}

void Group::setup() {
  const int W = size_;
  ControlStore* store = store_.get();
  const std::string& t = cfg_.transport;
  MOONCAKE_CHECK_VALUE(t == "auto" || t == "shm" || t == "tcp" || t == "rdma",
                       "MooncakeBackend::setup: unknown transport '", t, "'");
#ifndef MOONCAKE_WITH_RDMA
  MOONCAKE_CHECK(
      t != "rdma",
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
      MOONCAKE_CHECK(!cfg_.is_recovery, setup_error_);
    }
  }
#endif
  MOONCAKE_CHECK_VALUE(cfg_.shm_slot_bytes >= 4096, "MooncakeBackend::setup: shm_slot_bytes must be >= 4096");
  MOONCAKE_CHECK_VALUE(cfg_.on_failure == "raise" || cfg_.on_failure == "mask" || cfg_.on_failure == "manual",
                       "MooncakeBackend::setup: on_failure must be raise, mask or manual, got '",
                       cfg_.on_failure, "'");
  policy_ = cfg_.on_failure == "mask"     ? FailurePolicy::MASK
            : cfg_.on_failure == "manual" ? FailurePolicy::MANUAL
                                          : FailurePolicy::RAISE;
  active_.assign(W, 1);
  agreed_failed_.assign(W, 0);
  left_.assign(W, 0);
  peer_pidfd_.assign(W, -1);
  peer_pid_.assign(W, 0);
  if (cfg_.is_recovery) {
    // A replacement for a failed rank: find the group's current incarnation and ask to be
    // admitted; the transport is built in join_group() once the survivors recover us.
    if (!store->check({"mc/current"})) await_group();
    store_ns_ = store->get("mc/current");
    // a replacement must match the group it joins (checked here, before it asks to join)
    if (store->check({store_ns_ + "cfg"})) {
      const std::string want = store->get(store_ns_ + "cfg");
      const std::string mine = group_cfg_string();
      MOONCAKE_CHECK_VALUE(want == mine, "MooncakeBackend::setup: recovering rank ", rank_,
                           " does not match the group "
                           "it joins: the group has world_size|transport|shm_slot_bytes = '",
                           want, "', this process '", mine,
                           "' (start it with the founders' world size and settings)");
    }
    store->set(store_ns_ + "joinhost/" + std::to_string(rank_), cfg_.host_id);
    store->set(store_ns_ + "join/" + std::to_string(rank_), std::to_string(getpid()));
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
    MOONCAKE_CHECK_VALUE(j >= 0 && j < W, "MooncakeBackend::setup: active rank ", j, " is out of range [0, ",
                         W, ")");
  MOONCAKE_CHECK_VALUE(
      std::binary_search(founders.begin(), founders.end(), rank_), "MooncakeBackend::setup: rank ", rank_,
      " is not among the initial active ranks [", join_ranks(founders),
      "]; a process for an extension seat starts with is_recovery=True and calls join_group");
  std::fill(active_.begin(), active_.end(), 0);
  for (int j : founders) active_[j] = 1;
  // The store may outlive a destroyed group of the same name (torchrun's TCPStore): keys
  // of each set-up live under their own incarnation number (every founder adds 1 once).
  const int64_t inc = (store->add("mc/setups", 1) - 1) / static_cast<int64_t>(founders.size());
  store_ns_ = "mc/" + std::to_string(inc) + "/";
  founding_adds_ = inc * static_cast<int64_t>(founders.size());
  // The group record a replacement looks for: written before the transport's last step (see
  // build_transport), every member's transport is up or about to be when it appears.
  build_transport(store_ns_ + "t0/", founders, cfg_.setup_wait_ms, [&]() {
    store->set(store_ns_ + "cfg", group_cfg_string());
    store->set("mc/current", store_ns_);
  });
  founding_adds_ = -1;
  refresh_active_list();
}

void Group::await_group() {
  ControlStore* store = store_.get();
  // No incarnation of the group is up yet (a replacement started with the founders). Waited
  // for in slices: founders that count this seat as one of theirs would wait for its
  // records, which a recovering process never writes; they find this key and refuse both.
  const std::string ticket = std::to_string(store->add("mc/setups", 0)) + " " + cfg_.host_id + ":" +
                             std::to_string(getpid()) + ":" + std::to_string(now_ns());
  const std::string refused = "mc/refused/" + ticket.substr(ticket.find(' ') + 1);
  store->set("mc/recovering/" + std::to_string(rank_), ticket);
  const auto limit = store->timeout();
  const auto give_up = std::chrono::steady_clock::now() + limit;
  for (int64_t slice_ms = 200;; slice_ms = std::min<int64_t>(slice_ms * 2, 2000)) {
    try {
      store->wait({"mc/current"}, std::chrono::milliseconds(slice_ms));
      return;
    } catch (const std::exception&) {
    }
    if (store->check({refused})) MOONCAKE_CHECK_VALUE(false, store->get(refused));
    MOONCAKE_CHECK(std::chrono::steady_clock::now() < give_up, "MooncakeBackend::setup: recovering rank ",
                   rank_, " found no group to join within ", limit.count(),
                   " ms (its founders did not start, or did not finish their init_process_group)");
  }
}

std::string Group::group_cfg_string() const {
  return std::to_string(size_) + "|" + cfg_.transport + "|" + std::to_string(cfg_.shm_slot_bytes / 64 * 64);
}

void Group::build_transport(const std::string& ns, const std::vector<int>& members, int64_t wait_ms,
                            const std::function<void()>& before_last_sync) {
  // Connects `members` (ascending group ranks, this rank among them): shared memory when
  // they share a host (or forced), else a TCP mesh. Keys live under `ns`.
  const int W = size_;
  const std::string& t = cfg_.transport;
  ControlStore* store = store_.get();
  const size_t slot = static_cast<size_t>(cfg_.shm_slot_bytes) / 64 * 64;
  const size_t hcap = hdr_cap_for(W);
  auto key = [&](const std::string& k) { return ns + k; };
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
      MOONCAKE_CHECK(false, "MooncakeBackend::build_transport: rank(s) [", join_ranks(missing),
                     "] did not publish '", what, "' within ", wait_ms,
                     " ms (died or stopped during the rebuild, or builds another group: shrink_group and "
                     "split_group must be called alike on every member)");
    }
  };

  // An error every member finds in the same published keys: each says it has seen it and
  // waits (briefly) until all have, so that the rank hosting the store (whose store goes
  // away when its init raises) does not leave the others with a broken pipe instead.
  auto fail_together = [&](const std::string& msg, bool value_error = false,
                           const std::vector<int>& absent = {}) {
    store->set(key("failed/" + std::to_string(rank_)), "1");
    std::vector<std::string> keys;
    for (int j : members)
      if (std::find(absent.begin(), absent.end(), j) == absent.end())
        keys.push_back(key("failed/" + std::to_string(j)));
    try {
      store->wait(keys, std::chrono::milliseconds(5000));
      // a store server that closes with a request unread resets the connection, and the
      // answer to another rank's wait can be lost with it: give those answers time to arrive
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    } catch (const std::exception&) {
    }
    MOONCAKE_CHECK_VALUE(!value_error, msg);
    MOONCAKE_CHECK(false, msg);
  };

  // 1. who shares a host (and agree on the transport); a rank that cannot set up its
  // transport says so here ("!" + why) and raises, and so does every rank that reads it
  if (!setup_error_.empty()) {
    store->set(key("host/" + std::to_string(rank_)), "!" + setup_error_);
    MOONCAKE_CHECK(false, setup_error_);
  }
  const std::string mine = cfg_.host_id + "|" + t + "|" + std::to_string(slot) +
                           "|hierarchical=" + (cfg_.hierarchical ? "1" : "0") +
                           "|on_failure=" + cfg_.on_failure + "|members=" + join_ranks(members);
  store->set(key("rdv/" + std::to_string(rank_)), cfg_.rendezvous_addr);
  store->set(key("host/" + std::to_string(rank_)), mine);
  auto check_host = [&](int j, const std::string& v) {
    MOONCAKE_CHECK(v.empty() || v[0] != '!', "MooncakeBackend::setup: rank ", j,
                   " could not set up its transport, so this group cannot start (",
                   v.substr(v.empty() ? 0 : 1), ")");
    if (v.substr(v.find('|')) != mine.substr(mine.find('|')))
      // every rank sees a difference (it is symmetric); all raise together, so that rank 0,
      // which may host the store, does not take it away while another still reads it
      fail_together(
          "MooncakeBackend::setup: rank " + std::to_string(j) +
              " uses transport|slot|hierarchical|on_failure|members '" + v.substr(v.find('|') + 1) +
              "' but rank " + std::to_string(rank_) + " uses '" + mine.substr(mine.find('|') + 1) +
              "'; MOONCAKE_TRANSPORT, shm_slot_bytes, hierarchical, on_failure and active_ranks must agree "
              "across ranks",
          /*value_error=*/true);
  };
  {
    // Waited for in slices, comparing the keys published so far: with active_ranks that
    // differ, a member that only this rank names may never come, and the difference shows
    // in the keys of those that did. Each key is compared once.
    std::vector<std::string> keys;
    for (int j : members) keys.push_back(key("host/" + std::to_string(j)));
    std::vector<char> compared(W, 0);
    const auto limit = std::chrono::milliseconds(wait_ms > 0 ? wait_ms : store->timeout().count());
    const auto give_up = std::chrono::steady_clock::now() + limit;
    for (int64_t slice_ms = 200;; slice_ms = std::min<int64_t>(slice_ms * 2, 2000)) {
      try {
        store->wait(keys, std::chrono::milliseconds(slice_ms));
        break;
      } catch (const std::exception&) {
      }
      std::vector<int> missing;
      for (int j : members) {
        if (compared[j]) continue;
        const std::string k = key("host/" + std::to_string(j));
        if (!store->check({k})) {
          missing.push_back(j);
          continue;
        }
        check_host(j, store->get(k));
        compared[j] = 1;
      }
      // a missing member that is a recovering process waiting for this incarnation
      for (int j : founding_adds_ >= 0 ? missing : std::vector<int>{}) {
        const std::string rk = "mc/recovering/" + std::to_string(j);
        if (!store->check({rk})) continue;
        const std::string ticket = store->get(rk);
        if (std::stoll(ticket.substr(0, ticket.find(' '))) < founding_adds_)
          continue;  // waited for an older one
        const std::string msg =
            "MooncakeBackend::setup: rank " + std::to_string(j) +
            " started with is_recovery=True, but the founders [" + join_ranks(members) +
            "] count it as one of theirs: start it as a founder (is_recovery=False), or leave "
            "it out of the founders' active_ranks so that it joins an extension seat";
        store->set("mc/refused/" + ticket.substr(ticket.find(' ') + 1), msg);
        fail_together(msg, /*value_error=*/true, missing);
      }
      MOONCAKE_CHECK(
          std::chrono::steady_clock::now() < give_up, "MooncakeBackend::setup (rank ", rank_, "): rank(s) [",
          join_ranks(missing), "] did not join within ", limit.count(),
          " ms (not started, died, or given other active_ranks: every member must create the group "
          "alike)");
    }
  }
  bool one_host = true;
  std::vector<std::string> hosts(W);
  for (int j : members) {
    std::string v = store->get(key("host/" + std::to_string(j)));
    check_host(j, v);
    hosts[j] = v.substr(0, v.find('|'));
    if (hosts[j] != cfg_.host_id) one_host = false;
  }
  // 2. process handles of same-host peers (failure detection)
  store->set(key("pid/" + std::to_string(rank_)), std::to_string(getpid()));
  await_keys("pid/", members);
  for (int j : members) {
    if (j == rank_ || hosts[j] != cfg_.host_id) continue;
    int64_t pid = std::stoll(store->get(key("pid/" + std::to_string(j))));
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
  // hosts numbered in order of their lowest member; a seat outside `members` is a host of its own
  {
    std::vector<int> host_of(W, -1);
    std::vector<std::string> seen;
    for (int j : members) {
      auto it = std::find(seen.begin(), seen.end(), hosts[j]);
      host_of[j] = static_cast<int>(it - seen.begin());
      if (it == seen.end()) seen.push_back(hosts[j]);
    }
    for (int j = 0; j < W; ++j)
      if (host_of[j] < 0) host_of[j] = static_cast<int>(seen.size()) + j;
    std::lock_guard<std::mutex> g(mem_mu_);  // rank_hosts() reads it from Python threads
    host_of_ = std::move(host_of);
  }
  const bool use_shm = (t == "shm") || (t == "auto" && one_host);
  MOONCAKE_CHECK(
      !(t == "shm" && !one_host),
      "MooncakeBackend::setup: transport 'shm' needs every rank on one host (MOONCAKE_HOST_ID differs)");

  // Every store request of this build comes before its last step, which holds the lowest
  // member back until every member has reached it: on one host the lead's wait for each
  // mate's mapped/ key, across hosts its accept of each higher member's connection (a member
  // connects only after its store requests, the host segment's and the RDMA exchange's
  // included). The lowest member is usually rank 0, whose process hosts the TCPStore and may
  // exit as soon as its init returns; a request after that fails with a broken pipe (a
  // clone's connect retries for the whole timeout).
  std::shared_ptr<ControlStore> hb_store;
  auto last_store_requests = [&]() {
    if (!one_host && !heartbeat_) {
      try {
        hb_store = store_->clone();  // beats on a connection of their own: never queued behind a blocked call
      } catch (const std::exception&) {
        hb_store = store_;
      }
    }
    if (before_last_sync) before_last_sync();
  };
  std::unique_ptr<CollEngine> coll;
  std::unique_ptr<P2PChannel> p2p;
  // The ranks of this host (members with my host id) map one shared segment, created by
  // the lowest of them and unlinked once all have mapped it.
  std::vector<int> mates;
  for (int j : members)
    if (hosts[j] == cfg_.host_id) mates.push_back(j);
  ShmLayout layout(W, slot, hcap, static_cast<size_t>(cfg_.p2p_ring_bytes));
  // last: this segment's mapped/ keys are the build's last step (shm only, see above)
  auto host_segment = [&](bool last) {
    const int host_lead = mates.front();
    const std::string seg_key = key("shm/" + std::to_string(host_of_[rank_]));
    auto seg = std::make_shared<ShmSegment>();
    if (rank_ == host_lead) {
      std::random_device rd;
      std::string name = "/mooncake-" + std::to_string(getpid()) + "-" + std::to_string(rd());
      seg->create(name, layout.total);
      store->set(seg_key, name);
    } else {
      if (wait_ms > 0) {
        try {
          store->wait({seg_key}, std::chrono::milliseconds(wait_ms));
        } catch (const std::exception&) {
          MOONCAKE_CHECK(false, "MooncakeBackend::build_transport: rank ", host_lead,
                         " did not create the shared segment "
                         "within ",
                         wait_ms, " ms (died or stopped during the rebuild)");
        }
      }
      seg->open(store->get(seg_key), layout.total);
    }
    if (last) last_store_requests();
    store->set(key("mapped/" + std::to_string(rank_)), "1");
    if (rank_ == host_lead) {
      std::vector<std::string> keys;
      for (int j : mates) keys.push_back(key("mapped/" + std::to_string(j)));
      try {
        if (wait_ms > 0)
          await_keys("mapped/", mates);
        else
          store->wait(keys);
      } catch (...) {
        seg->unlink();  // nothing is left behind in /dev/shm
        throw;
      }
      seg->unlink();  // every member has it mapped: nothing is left behind if one dies
    }
    return seg;
  };
  const bool spin = static_cast<int>(mates.size()) <= available_cpus();
  // across hosts under "auto", the ranks of a host share collectives (not p2p) in memory
  const bool hybrid = !use_shm && t == "auto" && mates.size() > 1;
  if (use_shm) {
    auto seg = host_segment(/*last=*/true);
    coll = std::make_unique<ShmEngine>(rank_, W, seg, layout, spin);
    p2p = std::make_unique<ShmP2P>(rank_, W, seg, layout);
  } else {
    std::shared_ptr<ShmSegment> host_seg;
    if (hybrid) {
      layout = ShmLayout(W, slot, hcap, 0);
      host_seg = host_segment(/*last=*/false);
    }
    // A rank that reached the store over loopback is on the store's host; when the group
    // spans hosts it listens on the interface routed to the store's address as a rank of
    // another host reaches it (that rank's route and ours lead to the same network).
    std::string listen = cfg_.listen_host;
    if (!one_host && !cfg_.listen_host_explicit && is_loopback_address(listen)) {
      for (int j : members) {
        if (hosts[j] == cfg_.host_id) continue;
        const std::string seen = store->get(key("rdv/" + std::to_string(j)));
        const std::string mine_towards = seen.empty() ? "" : local_address_towards(seen);
        if (!mine_towards.empty() && !is_loopback_address(mine_towards)) {
          listen = mine_towards;
          break;
        }
      }
    }
    std::optional<TcpListener> lc, lp;
    try {
      lc.emplace(listen);
      lp.emplace(listen);
    } catch (const std::exception& e) {
      const std::string why =
          "rank " + std::to_string(rank_) + " cannot listen on " + listen + " (" + e.what() + "); " +
          (cfg_.listen_host_explicit
               ? "MooncakeOptions.host_ip / MOONCAKE_SOCKET_IFNAME must give an address of "
                 "this host"
               : "set MooncakeOptions.host_ip or MOONCAKE_SOCKET_IFNAME");
      store->set(key("addr/" + std::to_string(rank_)), "!" + why);
      fail_together("MooncakeBackend::setup: " + why);
    }
    store->set(key("addr/" + std::to_string(rank_)),
               listen + " " + std::to_string(lc->port()) + " " + std::to_string(lp->port()));
    std::vector<int> cfds(W, -1), pfds(W, -1);
    const int64_t connect_timeout_ms = wait_ms > 0 ? wait_ms : std::max<int64_t>(timeout_ms_.count(), 60000);
    // every member's address before any connect: one that cannot work raises on every rank
    await_keys("addr/", members);
    std::vector<std::string> addr_host(W);
    std::vector<int> addr_port_c(W, 0), addr_port_p(W, 0);
    for (int j : members) {
      const std::string v = store->get(key("addr/" + std::to_string(j)));
      if (!v.empty() && v[0] == '!') fail_together("MooncakeBackend::setup: " + v.substr(1));
      std::istringstream in(v);
      in >> addr_host[j] >> addr_port_c[j] >> addr_port_p[j];
    }
    for (int j : members) {
      if (!is_loopback_address(addr_host[j])) continue;
      for (int k : members)
        if (hosts[k] != hosts[j])
          fail_together(
              "MooncakeBackend::setup: rank " + std::to_string(j) + " listens on the loopback address " +
              addr_host[j] + " but rank " + std::to_string(k) + " is on another host (MOONCAKE_HOST_ID '" +
              hosts[k] + "', not '" + hosts[j] + "') and cannot reach it; give rank " + std::to_string(j) +
              " an address the other hosts reach: MooncakeOptions(host_ip=...) or "
              "MOONCAKE_SOCKET_IFNAME, or rendezvous through such an address (MASTER_ADDR / init_method)");
    }
    if (t == "rdma") {
#ifdef MOONCAKE_WITH_RDMA
      // collectives over RDMA queue pairs (their addresses go through the store, so before
      // the connects); p2p byte streams stay on TCP
      auto publish = [&](const std::string& k, const std::string& v) { store->set(key("rdma/" + k), v); };
      auto fetch = [&](int j, const std::string& k) {
        const std::string full = key("rdma/" + k);
        try {
          store->wait({full}, std::chrono::milliseconds(connect_timeout_ms));
        } catch (const std::exception&) {
          MOONCAKE_CHECK(false, "MooncakeBackend::build_transport: rank ", j, " did not publish its RDMA '",
                         k, "' within ", connect_timeout_ms, " ms");
        }
        return store->get(full);
      };
      try {
        coll = std::make_unique<RdmaEngine>(rank_, W, slot, hcap, members, cfg_.rdma_device,
                                            static_cast<int>(cfg_.rdma_gid_index), publish, fetch);
      } catch (const GroupError&) {
        throw;
      } catch (const std::exception& e) {
        MOONCAKE_CHECK(false, "MooncakeBackend::build_transport: transport 'rdma': ", e.what());
      }
#endif
    }
    last_store_requests();
    int higher = 0;
    for (int j : members) {
      if (j > rank_) {
        higher++;
        continue;
      }
      if (j == rank_) continue;
      const std::string& host = addr_host[j];
      const int pc = addr_port_c[j], pp = addr_port_p[j];
      int32_t me = rank_;
      cfds[j] = tcp_connect(host, pc, connect_timeout_ms);
      send_all_blocking(cfds[j], &me, sizeof(me));
      pfds[j] = tcp_connect(host, pp, connect_timeout_ms);
      send_all_blocking(pfds[j], &me, sizeof(me));
    }
    for (int n = 0; n < higher; ++n) {
      for (TcpListener* l : {&*lc, &*lp}) {
        int fd = l->accept_fd(connect_timeout_ms);
        int32_t who = -1;
        recv_all_blocking(fd, &who, sizeof(who), connect_timeout_ms);
        MOONCAKE_CHECK(who > rank_ && who < W && std::binary_search(members.begin(), members.end(), who),
                       "MooncakeBackend::setup: bad handshake from rank ", who);
        (l == &*lc ? cfds : pfds)[who] = fd;
      }
    }
    if (t == "rdma") {
#ifdef MOONCAKE_WITH_RDMA
      for (int& fd : cfds)
        if (fd >= 0) close(fd);
#endif
    } else if (hybrid) {
      // collectives: shared memory between the ranks of this host, TCP to the others
      std::vector<char> local(W, 0);
      for (int j : mates) {
        local[j] = 1;
        if (j != rank_ && cfds[j] >= 0) close(cfds[j]);
        if (j != rank_) cfds[j] = -1;
      }
      coll = std::make_unique<HybridEngine>(rank_, W, host_seg, layout, spin, local, cfds);
    } else {
      coll = std::make_unique<TcpEngine>(rank_, W, slot, hcap, cfds);
    }
    p2p = std::make_unique<TcpP2P>(rank_, W, pfds);
  }
  coll->set_liveness(
      [this](const std::vector<int>& ranks, uint64_t round) { return probe_dead(ranks, round); });
  coll_ = std::move(coll);
  p2p_ = std::move(p2p);
  if (!one_host) start_heartbeat(hb_store);
}

}  // namespace mooncake
