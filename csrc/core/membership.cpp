// Membership of the group core (docs/design.md "Membership and fault tolerance"): failure
// detection (same-host process handles, op timeouts), agreement on failed ranks through the
// control store (numbered epoch records, the first proposal of an epoch wins), the
// policies' effect on the active set, and rejoin (recover_ranks on the survivors,
// join_group on the replacement, a transport rebuild over the new member set).
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <sstream>
#include <thread>

#include "core/group.hpp"

namespace mooncake {

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

void renumber_failed_global_ranks(const std::vector<int>& old_of_new) {
  std::lock_guard<std::mutex> lk(g_failed_mu);
  std::vector<int> renumbered;
  for (size_t i = 0; i < old_of_new.size(); ++i)
    if (std::binary_search(g_failed_global.begin(), g_failed_global.end(), old_of_new[i]))
      renumbered.push_back(static_cast<int>(i));
  g_failed_global = renumbered;
  g_failed_version++;
}

int Group::global_rank(int r) const { return cfg_.global_ranks.empty() ? r : cfg_.global_ranks[r]; }

BackendConfig Group::derived_config(const std::vector<int>& members, const char* op) const {
  BackendConfig cfg = cfg_;
  cfg.is_recovery = false;
  cfg.initial_active.clear();  // every member founds the new group
  cfg.setup_wait_ms = std::max<int64_t>(timeout_ms_.count(), 1000);
  // group rank -> default-group rank; a shrunk default group is the new default group,
  // numbered 0..n-1 itself (empty: identity)
  std::vector<int> globals;
  if (!(cfg_.global_ranks.empty() && std::string(op) == "shrink"))
    for (int m : members) globals.push_back(global_rank(m));
  cfg.global_ranks = globals;
  cfg.group_name = cfg_.group_name + ":" + op;
  return cfg;
}

std::vector<int> Group::failed_elsewhere() {
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
void Group::refresh_active_list() {
  act_.clear();
  for (int j = 0; j < size_; ++j)
    if (active_[j]) act_.push_back(j);
  my_index_ = static_cast<int>(std::find(act_.begin(), act_.end(), rank_) - act_.begin());
  coll_->set_active(active_);
}

namespace {
// the reason of a leave record (deactivate_ranks of a rank's own seat), then the last round
// the leaver completed (probe_dead)
constexpr const char* kLeaveReason = ";reason=left the group";
constexpr const char* kLastRound = ";last_round=";
}  // namespace

PeersGone Group::probe_dead(const std::vector<int>& ranks, uint64_t round) {
  // A rank that left is alive and sends nothing more: a newer record that names a missing
  // rank (its leave, or another survivor's verdict) ends the wait at once. Looked up at most
  // every 100 ms, and only while this rank is blocked waiting for a peer.
  //
  // In a collective's round, a leaver is gone only once the survivors are in step:
  // - Not for a round it completed before it left (its leave record gives the last one):
  //   its part of that round was sent before the record was written, yet may not show here
  //   yet (a frame in flight or unread in a socket, an arrival flag set just after this
  //   rank looked, also after the leaver exited), and the survivors that have it finish
  //   the op with the leaver's data. Taking the leaver for gone would rerun the op without
  //   it on this rank alone, in the next epoch, where op numbers restart and the rerun
  //   pairs with the others' next op.
  // - Not while a survivor has yet to arrive at this round: it may still be in a round the
  //   leaver completed, reading this rank's part of it, which this rank's rounds of the next
  //   epoch would overwrite (shared memory) before it moved on; it arrives here, and both
  //   leave the round together.
  auto has = [](const std::vector<int>& v, int j) { return std::find(v.begin(), v.end(), j) != v.end(); };
  std::vector<Record> newer;  // the records after agreed_epoch_ (up to a join)
  bool looked = false;
  auto look = [&]() {
    looked = true;
    try {
      Record rec;
      for (uint64_t e = agreed_epoch_ + 1;
           newer.size() < static_cast<size_t>(size_) && read_record_full(e, &rec) && !rec.join; ++e)
        newer.push_back(rec);
    } catch (const std::exception&) {  // an unreachable store is found out by agree()
    }
  };
  auto left_after = [&](int j, uint64_t* last) {
    for (const Record& r : newer)
      if (r.leave && has(r.ranks, j)) {
        *last = r.last_round;
        return true;
      }
    return false;
  };
  auto sift = [&](const std::vector<int>& dead) {
    if (round == 0 || dead.empty()) return dead;
    if (!looked) look();
    uint64_t last = 0;
    bool survivor_missing = false;
    for (int j : ranks)
      if (!left_after(j, &last) && !has(dead, j)) survivor_missing = true;
    std::vector<int> out;
    for (int j : dead)
      if (!(left_after(j, &last) && (round <= last || survivor_missing))) out.push_back(j);
    return out;
  };

  std::vector<int> dead;
  const int64_t now = now_ns();
  if (now >= next_record_check_ns_) {
    next_record_check_ns_ = now + 100000000;
    look();
    for (const Record& r : newer)
      for (int j : r.ranks)
        if (has(ranks, j) && !has(dead, j)) dead.push_back(j);
    dead = sift(dead);
    if (!dead.empty()) return {dead, "named in a newer membership record"};
  }
  if (!one_host_) {
    dead = sift(heartbeat_lost(ranks));
    if (!dead.empty())
      return {dead, "no heartbeat for " + std::to_string(kHeartbeatLostMs) + " ms: host cut off or frozen"};
  }
  for (int j : ranks) {
    if (j < 0 || j >= size_ || j == rank_) continue;
    if (peer_pidfd_[j] >= 0) {
      pollfd p{peer_pidfd_[j], POLLIN, 0};
      if (poll(&p, 1, 0) > 0) dead.push_back(j);
    } else if (peer_pid_[j] > 0) {
      if (kill(static_cast<pid_t>(peer_pid_[j]), 0) != 0 && errno == ESRCH) dead.push_back(j);
    }
  }
  return {sift(dead), "process exited"};
}

void Group::start_heartbeat(const std::shared_ptr<ControlStore>& st) {
  if (heartbeat_) return;
  heartbeat_ = std::make_shared<Heartbeat>();
  hb_count_.assign(size_, -1);
  hb_changed_ns_.assign(size_, 0);
  const std::string key = store_ns_ + "hb/" + std::to_string(rank_);
  const std::string records = store_ns_ + "epoch/";
  // detached, owning what it touches: a beat blocked on an unreachable store outlives the
  // backend harmlessly (that host has stopped beating, which is what the others must see)
  const std::string who = "[mooncake] rank " + std::to_string(rank_) + " group '" + cfg_.group_name + "'";
  std::thread([hb = heartbeat_, st, key, records, who]() {
    while (!hb->stop.load()) {
      try {
        st->add(key, 1);
        const uint64_t next = hb->epoch.load() + 1;
        if (hb->newer.load() < next && st->check({records + std::to_string(next)})) {
          hb->newer.store(next);  // before the read: a store lost during it must still show
          std::string v = st->get(records + std::to_string(next));
          std::lock_guard<std::mutex> g(hb->mu);
          hb->seen_epoch = next;
          hb->seen_record = std::move(v);
        }
      } catch (const StoreLost&) {
        // A TCPStore client does not reconnect: every later call would fail too (and torch
        // logs a stack trace for each). The others see this rank's beats stop, and its own
        // next op finds the store unreachable and fences it.
        if (!hb->stop.load())
          fprintf(stderr, "%s: lost the control store; heartbeats stop, the next op raises\n", who.c_str());
        return;
      } catch (const std::exception&) {  // a slow store: beat again
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(kHeartbeatPeriodMs));
    }
  }).detach();
}

void Group::fence(const std::string& why, int64_t epoch) {
  broken_ = why;
  fenced_ = true;
  throw RankFailure("MooncakeBackend (rank " + std::to_string(rank_) + "): " + why, {rank_}, epoch, true);
}

void Group::fence_if_declared_failed() {
  // Across hosts only: on one host the late rank's slots no longer match the others' and
  // it fails inside the op. A rank that finishes before the heartbeat saw the record (up
  // to kHeartbeatPeriodMs after the agreement) learns of it at its next op.
  if (!heartbeat_) return;
  heartbeat_->epoch.store(agreed_epoch_);
  if (heartbeat_->newer.load() <= agreed_epoch_) return;
  const uint64_t e = agreed_epoch_ + 1;
  Record rec;
  std::string seen;
  {
    std::lock_guard<std::mutex> g(heartbeat_->mu);
    if (heartbeat_->seen_epoch == e) seen = heartbeat_->seen_record;
  }
  if (!seen.empty()) {
    rec = parse_record(seen);
  } else {
    try {
      if (!read_record_full(e, &rec)) return;
    } catch (const std::exception&) {
      // A record this op did not take part in exists, and the store that holds it is gone
      // (its host exited): the others may have finished this op without this rank, so its
      // result is not given out.
      const std::string msg = "MooncakeBackend: membership epoch " + std::to_string(e) +
                              " was recorded while this rank was in an op, and the control store became "
                              "unreachable before this rank could read whether the record lists it";
      log_membership("fenced: " + msg);
      fence(msg, static_cast<int64_t>(agreed_epoch_));
    }
  }
  if (rec.join) return;  // a join: the survivors' call
  if (std::find(rec.ranks.begin(), rec.ranks.end(), rank_) == rec.ranks.end()) return;
  agree({}, "catch up");  // catches up with that record, which lists this rank: raises
}

std::vector<int> Group::heartbeat_lost(const std::vector<int>& ranks) {
  std::vector<int> lost;
  const int64_t now = now_ns();
  if (!heartbeat_ || now < next_hb_check_ns_) return lost;
  next_hb_check_ns_ = now + kHeartbeatPeriodMs * 1000000;
  std::vector<int> remote;  // peers of other hosts (no process handle)
  for (int j : ranks)
    if (j >= 0 && j < size_ && j != rank_ && peer_pidfd_[j] < 0 && peer_pid_[j] == 0) remote.push_back(j);
  if (remote.empty()) return lost;
  std::vector<int64_t> counts;
  const std::string ns = store_ns_;
  try {
    counts = bounded_store_call<std::vector<int64_t>>(
        "reading heartbeats",
        [ns, remote](ControlStore& st) {
          std::vector<int64_t> v;
          for (int j : remote) v.push_back(st.add(ns + "hb/" + std::to_string(j), 0));
          return v;
        },
        kHeartbeatPeriodMs * 2);
  } catch (const std::exception&) {  // an unreachable store is found out by agree()
    return lost;
  }
  for (size_t i = 0; i < remote.size(); ++i) {
    const int j = remote[i];
    if (counts[i] != hb_count_[j] || hb_changed_ns_[j] == 0) {
      hb_count_[j] = counts[i];
      hb_changed_ns_[j] = now;
    } else if (now - hb_changed_ns_[j] > kHeartbeatLostMs * 1000000) {
      lost.push_back(j);
    }
  }
  return lost;
}

template <class T>
T Group::bounded_store_call(const char* what, std::function<T(ControlStore&)> fn, int64_t limit_ms) {
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
  const auto limit = limit_ms > 0 ? std::chrono::milliseconds(limit_ms)
                                  : std::max(timeout_ms_, std::chrono::milliseconds(1000));
  if (fut.wait_for(limit) != std::future_status::ready) {
    std::ostringstream msg;
    msg << what << " got no answer within " << limit.count() / 1000.0
        << " s (this host is cut off from the store, or the store is gone)";
    throw std::runtime_error(msg.str());
  }
  return fut.get();
}

// Records: "1,3;decided_by=2;reason=..." (failure) or "join=1;active=0,1,2;decided_by=0".
bool Group::read_record_full(uint64_t epoch, Record* rec) {
  const std::string key = store_ns_ + "epoch/" + std::to_string(epoch);
  auto got = bounded_store_call<std::string>("reading membership record", [key](ControlStore& st) {
    if (!st.check({key})) return std::string("\x01");
    return st.get(key);
  });
  if (got == "\x01") return false;
  *rec = parse_record(got);
  return true;
}

Group::Record Group::parse_record(const std::string& raw) {
  Record rec;
  rec.raw = raw;
  std::string first = raw.substr(0, raw.find(';'));
  rec.join = first.rfind("join=", 0) == 0;
  rec.ranks = parse_ranks(rec.join ? first.substr(5) : first);
  rec.leave = !rec.join && raw.find(kLeaveReason) != std::string::npos;
  const size_t lr = raw.find(kLastRound);
  if (rec.leave && lr != std::string::npos) rec.last_round = std::stoull(raw.substr(lr + strlen(kLastRound)));
  if (rec.join) {
    size_t q = raw.find(";pids=");
    if (q != std::string::npos) {
      std::string rest = raw.substr(q + 6);
      rec.pids = rest.substr(0, rest.find(';'));
    }
    size_t a = raw.find(";active=");
    if (a != std::string::npos) {
      std::string rest = raw.substr(a + 8);
      rec.active = parse_ranks(rest.substr(0, rest.find(';')));
    }
  }
  return rec;
}

void Group::log_membership(const std::string& msg) {
  fprintf(stderr, "[mooncake] rank %d group '%s': %s\n", rank_, cfg_.group_name.c_str(), msg.c_str());
}

std::vector<int> Group::catch_up(bool stop_at_join) {
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
    const bool leave = rec.leave;
    for (int f : rec.ranks)
      if (f >= 0 && f < size_ && !agreed_failed_[f]) {
        agreed_failed_[f] = 1;
        left_[f] = leave ? 1 : 0;
        added.push_back(f);
        // a leaver left this group only: its own other groups keep it
        if (!(leave && f == rank_)) note_failed_global(global_rank(f));
      }
    log_membership("epoch " + std::to_string(agreed_epoch_) + " agreed: " + rec.raw);
  }
  return added;
}

std::vector<int> Group::agree(const std::vector<int>& suspects, const std::string& reason) {
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
      bounded_store_call<bool>("proposing a membership record", [key, mine](ControlStore& st) {
        st.compare_set(key, std::string(), mine);  // the first proposal of an epoch wins
        return true;
      });
      more = catch_up();
      newly.insert(newly.end(), more.begin(), more.end());
    }
  } catch (const RankFailure&) {
    throw;
  } catch (const std::exception& e) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));
    const std::string msg =
        std::string("MooncakeBackend: the control store is unreachable, so membership cannot be agreed (") +
        why +
        "); this rank fences itself: the others may have declared it failed. This is fatal for the group on "
        "this rank (if the store lived in rank 0, rank 0 is gone); it may rejoin as a recovering rank";
    log_membership("fenced: " + msg);
    fence(msg, static_cast<int64_t>(agreed_epoch_));
  }
  if (agreed_failed_[rank_])
    fence("MooncakeBackend: this rank was declared failed by its peers (epoch " +
              std::to_string(agreed_epoch_) + ") and has fenced itself; it may rejoin as a recovering rank",
          static_cast<int64_t>(agreed_epoch_));
  // a leave needs no decision of the user: applied under on_failure="manual" too
  if (policy_ != FailurePolicy::MANUAL || only_leaves(pending_failed())) apply_agreed();
  return newly;
}

bool Group::only_leaves(const std::vector<int>& ranks) const {
  if (ranks.empty()) return false;
  for (int r : ranks)
    if (r < 0 || r >= size_ || !left_[r]) return false;
  return true;
}

void Group::leave() {
  std::lock_guard<std::mutex> g(engine_mu_);
  if (!broken_.empty())
    throw GroupBackendError("mooncake deactivate_ranks (rank " + std::to_string(rank_) + "): " + broken_);
  // propose "this rank left" for the next free epoch (a failure agreed meanwhile takes
  // that epoch first: read it, then propose for the one after)
  while (true) {
    catch_up();
    if (agreed_failed_[rank_]) break;
    const std::string key = store_ns_ + "epoch/" + std::to_string(agreed_epoch_ + 1);
    const uint64_t last_round = coll_ ? coll_->next_round() - 1 : 0;
    const std::string mine = std::to_string(rank_) + ";decided_by=" + std::to_string(rank_) + kLeaveReason +
                             kLastRound + std::to_string(last_round);
    bounded_store_call<bool>("proposing a membership record", [key, mine](ControlStore& st) {
      st.compare_set(key, std::string(), mine);
      return true;
    });
  }
  broken_ = "MooncakeBackend: this rank left the group (deactivate_ranks of its own rank, epoch " +
            std::to_string(agreed_epoch_) + "); a new process may take its seat through recover_ranks";
  left_self_ = true;
  {
    // the leaver's view of the membership (get_active_ranks, get_epoch) as the others see it;
    // its transport is not used again
    std::lock_guard<std::mutex> m(mem_mu_);
    for (int j = 0; j < size_; ++j)
      if (agreed_failed_[j]) active_[j] = 0;
    epoch_ = agreed_epoch_;
  }
  log_membership("left the group (epoch " + std::to_string(agreed_epoch_) + ")");
}

void Group::apply_agreed() {
  if (epoch_ == agreed_epoch_) return;
  {
    std::lock_guard<std::mutex> g(mem_mu_);
    for (int j = 0; j < size_; ++j)
      if (agreed_failed_[j]) active_[j] = 0;
    epoch_ = agreed_epoch_;
  }
  refresh_active_list();
  coll_->start_epoch(epoch_);
  // op numbering restarts with the new member set, as after a join: a survivor whose op was
  // under way when the failure struck counted it, one that learned of the failure from
  // another group before its op ran did not
  seq_exec_ = 0;
  log_membership("epoch " + std::to_string(epoch_) + " applied: active ranks " + join_ranks(act_));
}

std::vector<int> Group::pending_failed() {
  std::lock_guard<std::mutex> g(mem_mu_);
  std::vector<int> v;
  for (int j = 0; j < size_; ++j)
    if (agreed_failed_[j] && active_[j]) v.push_back(j);
  return v;
}

std::vector<int32_t> Group::active_ranks() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return std::vector<int32_t>(active_.begin(), active_.end());
}

std::vector<int> Group::rank_hosts() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return host_of_;
}

int64_t Group::epoch() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return static_cast<int64_t>(epoch_);
}

std::vector<int> Group::failed_ranks() {
  std::lock_guard<std::mutex> g(mem_mu_);
  std::vector<int> v;
  for (int j = 0; j < size_; ++j)
    if (agreed_failed_[j]) v.push_back(j);
  return v;
}

void Group::deactivate_ranks(const std::vector<int>& ranks) {
  for (int r : ranks)
    MOONCAKE_CHECK_VALUE(r >= 0 && r < size_, "mooncake deactivate_ranks (rank ", rank_, "): rank ", r,
                         " is out of range [0, ", size_, ")");
  if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) {
    MOONCAKE_CHECK_VALUE(std::all_of(ranks.begin(), ranks.end(), [this](int r) { return r == rank_; }),
                         "mooncake deactivate_ranks (rank ", rank_,
                         "): a rank that deactivates itself (leaves) names only itself, got [",
                         join_ranks(ranks), "]");
    leave();
    return;
  }
  std::lock_guard<std::mutex> g(engine_mu_);
  agree(ranks, "deactivate_ranks");
  apply_agreed();
}

std::vector<int> Group::pending_ranks() {
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
    const std::string pid = store_->get(k);
    if (store_->check({adm}) && store_->get(adm) == pid) continue;
    // a joiner on this host that died before being admitted is not pending (admitting it
    // would make the transport rebuild wait for it in vain)
    const std::string hk = store_ns_ + "joinhost/" + std::to_string(j);
    if (store_->check({hk}) && store_->get(hk) == cfg_.host_id &&
        kill(static_cast<pid_t>(std::stoll(pid)), 0) != 0 && errno == ESRCH)
      continue;
    out.push_back(j);
  }
  return out;
}

std::vector<int> Group::last_joined() {
  std::lock_guard<std::mutex> g(mem_mu_);
  return last_joined_;
}

void Group::stop_p2p_thread() {
  {
    std::lock_guard<std::mutex> g(qmu_);
    p2p_restart_ = true;
  }
  if (p2p_) p2p_->notify();
  if (p2p_thread_.joinable()) p2p_thread_.join();
  std::lock_guard<std::mutex> g(qmu_);
  p2p_restart_ = false;
}

void Group::apply_join(const Record& rec, uint64_t epoch) {
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
  const int64_t wait_ms = std::max<int64_t>(timeout_ms_.count(), 1000);
  for (int attempt = 0;; ++attempt) {
    std::vector<int> members;
    for (int j = 0; j < size_; ++j)
      if (active_[j]) members.push_back(j);
    const std::string ns = store_ns_ + "e" + std::to_string(agreed_epoch_) + "/";
    std::string why;
    store_->set(ns + "ready/" + std::to_string(rank_), "1");
    try {
      std::vector<std::string> keys;
      for (int j : members) keys.push_back(ns + "ready/" + std::to_string(j));
      store_->wait(keys, std::chrono::milliseconds(wait_ms));
      build_transport(ns, members, wait_ms);
    } catch (const std::exception& e) {
      why = e.what();
      why = why.substr(0, why.find('\n'));
    }
    store_->set(ns + "built/" + std::to_string(rank_), why.empty() ? "ok" : "failed");
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
      } else if (store_->get(k) != "ok") {
        all_ok = false;
      }
    }
    const std::string proposal = all_ok ? "ok" : "failed:" + join_ranks(gone);
    const std::string outcome = store_->compare_set(ns + "outcome", std::string(), proposal);
    if (outcome == "ok") {
      if (!why.empty()) {  // cannot happen: "ok" needs every member's "ok"
        broken_ = "MooncakeBackend: transport rebuild disagreement in epoch " + std::to_string(agreed_epoch_);
        throw GroupBackendError("MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_);
      }
      break;
    }
    std::vector<int> failed = parse_ranks(outcome.substr(outcome.find(':') + 1));
    if (failed.empty() || attempt >= size_) {
      broken_ = "MooncakeBackend: rebuilding the transport for membership epoch " +
                std::to_string(agreed_epoch_) +
                " failed: " + (why.empty() ? std::string("another member failed to build it") : why);
      throw GroupBackendError("MooncakeBackend (rank " + std::to_string(rank_) + "): " + broken_);
    }
    // the ranks that did not finish are failed: the next epoch's record says so
    const uint64_t e = agreed_epoch_ + 1;
    const std::string rec_s = join_ranks(failed) + ";decided_by=" + std::to_string(rank_) +
                              ";reason=did not finish the transport rebuild of epoch " +
                              std::to_string(agreed_epoch_);
    store_->compare_set(store_ns_ + "epoch/" + std::to_string(e), std::string(), rec_s);
    Record frec;
    MOONCAKE_CHECK(read_record_full(e, &frec), "MooncakeBackend::apply_join: epoch record ", e, " vanished");
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
    if (agreed_failed_[rank_])
      fence(
          "MooncakeBackend: this rank did not finish the transport rebuild in time and was declared failed "
          "(epoch " +
              std::to_string(e) + "); it has fenced itself and may rejoin as a recovering rank",
          static_cast<int64_t>(e));
  }
  refresh_active_list();
  coll_->start_epoch(epoch_);
  seq_exec_ = 0;  // op numbering restarts with the new member set (the joiner starts at 0)
  seq_group_ = 0;
  log_membership("epoch " + std::to_string(epoch_) + " applied: ranks " + join_ranks(last_joined_) +
                 " rejoined; active ranks " + join_ranks(act_));
}

void Group::recover_ranks(const std::vector<int>& ranks) {
  MOONCAKE_CHECK(!joining_, "mooncake recover_ranks (rank ", rank_,
                 "): this rank is itself waiting to join; call join_group");
  for (int r : ranks)
    MOONCAKE_CHECK_VALUE(r >= 0 && r < size_, "mooncake recover_ranks (rank ", rank_, "): rank ", r,
                         " is out of range [0, ", size_, ")");
  // 1. the union of what the survivors ask for (they may have looked at different times)
  std::vector<int32_t> want(size_, 0);
  for (int r : ranks) want[r] = 1;
  const std::vector<int32_t> asked = want;
  run_sync(
      [this, &want](int64_t deadline_ns) {
        allreduce(Buffer{want.data(), want.size(), DType::I32}, RedOp::MAX, 1.0, deadline_ns);
      },
      // a rerun over the survivors (on_failure="mask") starts from this rank's own answer
      policy_ == FailurePolicy::MASK ? std::function<void()>([&want, &asked]() { want = asked; }) : nullptr);
  std::vector<int> todo;
  for (int j = 0; j < size_; ++j)
    if (want[j]) todo.push_back(j);
  if (todo.empty()) return;
  std::lock_guard<std::mutex> g(engine_mu_);
  for (int r : todo) {
    MOONCAKE_CHECK_VALUE(!active_[r], "mooncake recover_ranks (rank ", rank_, "): rank ", r, " is active");
    MOONCAKE_CHECK_VALUE(store_->check({store_ns_ + "join/" + std::to_string(r)}),
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
  for (int r : todo) pids += (pids.empty() ? "" : ",") + store_->get(store_ns_ + "join/" + std::to_string(r));
  const std::string proposal = "join=" + join_ranks(todo) + ";active=" + join_ranks(next_list) +
                               ";pids=" + pids + ";decided_by=" + std::to_string(rank_);
  store_->compare_set(store_ns_ + "epoch/" + std::to_string(e), std::string(), proposal);
  Record rec;
  MOONCAKE_CHECK(read_record_full(e, &rec), "MooncakeBackend::recover_ranks: epoch record ", e, " vanished");
  MOONCAKE_CHECK(rec.join && rec.ranks == todo && rec.active == next_list && rec.pids == pids,
                 "mooncake recover_ranks (rank ", rank_, "): survivors disagree about epoch ", e, ": '",
                 rec.raw, "' vs mine '", proposal, "' (a failure was agreed concurrently; retry)");
  log_membership("epoch " + std::to_string(e) + " agreed: " + rec.raw);
  for (int r : todo)
    store_->set(store_ns_ + "admitted/" + std::to_string(r),
                store_->get(store_ns_ + "join/" + std::to_string(r)));
  // 3. a fresh transport over the new member set
  stop_p2p_thread();
  apply_join(rec, e);
}

void Group::join_group(double timeout_s) {
  MOONCAKE_CHECK(joining_, "mooncake join_group (rank ", rank_,
                 "): this rank is not a recovering rank "
                 "(create the group with MooncakeOptions(is_recovery=True))");
  std::lock_guard<std::mutex> g(engine_mu_);
  const int64_t deadline_ns = now_ns() + static_cast<int64_t>(timeout_s * 1e9);
  int64_t next_liveness_check_ns = now_ns() + 200 * 1000 * 1000;
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
    MOONCAKE_CHECK(now_ns() < deadline_ns, "mooncake join_group (rank ", rank_, "): not admitted within ",
                   timeout_s, " s; the survivors must call recover_ranks(group, get_pending_ranks(group))");
    if (now_ns() >= next_liveness_check_ns) {
      next_liveness_check_ns = now_ns() + 500 * 1000 * 1000;
      std::vector<int> members = joinable_members(&members_ns, &member_epoch);
      if (!members.empty() && members_all_dead(members_ns, members))
        throw GroupBackendError("mooncake join_group (rank " + std::to_string(rank_) +
                                "): no live member is left to admit "
                                "this rank (every active rank [" +
                                join_ranks(members) +
                                "] of the group has exited on this "
                                "host); the group is gone");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int> Group::joinable_members(std::string* ns, uint64_t* epoch) {
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

bool Group::members_all_dead(const std::string& ns, const std::vector<int>& members) {
  for (int j : members) {
    const std::string hk = ns + "host/" + std::to_string(j), pk = ns + "pid/" + std::to_string(j);
    if (!store_->check({hk}) || !store_->check({pk})) return false;
    const std::string host = store_->get(hk);
    if (host.substr(0, host.find('|')) != cfg_.host_id) return false;  // another host: cannot tell
    if (kill(static_cast<pid_t>(std::stoll(store_->get(pk))), 0) == 0 || errno != ESRCH) return false;
  }
  return true;
}

void Group::throw_failure(const std::string& what, const std::vector<int>& newly) {
  std::vector<int> failed = newly;
  if (failed.empty()) failed = failed_ranks();
  // ranks are this group's; a subgroup's message also gives the default group's numbers
  std::vector<int> global;
  for (int f : failed) global.push_back(global_rank(f));
  const std::string in_default =
      cfg_.global_ranks.empty() ? "" : " (rank(s) " + join_ranks(global) + " of the default group)";
  const std::string which = cfg_.global_ranks.empty() ? "" : " of group '" + cfg_.group_name + "'";
  std::string msg = "MooncakeBackend (rank " + std::to_string(rank_) + which + "): rank(s) " +
                    join_ranks(failed) + in_default + " failed (" + what + "); membership epoch " +
                    std::to_string(agreed_epoch_);
  if (policy_ == FailurePolicy::MANUAL)
    msg += "; on_failure='manual': later ops fail fast until every survivor calls deactivate_ranks";
  else
    msg += "; later ops run over the surviving ranks";
  throw RankFailure(msg, failed, static_cast<int64_t>(agreed_epoch_));
}

}  // namespace mooncake
