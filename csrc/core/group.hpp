// The group core: everything of the "mooncake" process group that needs no torch type. It
// works on raw buffers (Buffer: pointer, count, core DType) with the core's reductions
// (RedOp), talks to the control store through ControlStore, and runs the whole contract of
// pg/backend.hpp's top comment below the c10d surface: set-up and transport build
// (core/setup.cpp), the collective bodies (core/collectives/), the op header round
// (core/op_header.cpp), scheduling and the progress thread (core/schedule.cpp), p2p
// (core/p2p.cpp), membership: detection, agreement, heartbeats, fencing, leave and rejoin
// (core/membership.cpp).
//
// The torch layer (pg/) owns one Group per MooncakeBackend: it checks the caller's tensors,
// turns them into buffers, and submits jobs that call the collective bodies; the Works, their
// futures, sparse tensors, derived groups and the CUDA paths are its own. Errors leave the
// core as the classes of core/errors.hpp.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/control_store.hpp"
#include "core/dtype.hpp"
#include "core/engine.hpp"
#include "core/errors.hpp"
#include "core/reduce.hpp"
#include "core/topology.hpp"

namespace mooncake {

struct OpHeader;         // core/op_header.hpp
enum OpCode : uint32_t;  // core/op_header.hpp

enum class FailurePolicy : int { RAISE = 0, MASK = 1, MANUAL = 2 };

struct BackendConfig {
  double timeout_s = 30.0;
  std::string transport = "auto";  // auto | shm | tcp | rdma
  std::string host_id;             // ranks with equal ids share memory
  std::string listen_host = "127.0.0.1";
  // listen_host came from MooncakeOptions.host_ip or MOONCAKE_SOCKET_IFNAME: used as is
  bool listen_host_explicit = false;
  // IPv4 address of the rendezvous store's host as this rank reaches it ("" unknown); a
  // rank on the store's host (loopback) listens towards another host's view of it
  std::string rendezvous_addr;
  int64_t shm_slot_bytes = 1 << 20;
  int64_t p2p_ring_bytes = 1 << 20;
  bool debug = false;
  std::string group_name;
  std::string on_failure = "raise";  // raise | mask | manual
  std::string rdma_device;           // transport "rdma": "DEVICE[:PORT]" (empty: first active port)
  int64_t rdma_gid_index = -1;       // transport "rdma": GID index (-1: RoCE v2 IPv4 GID, or none on IB)
  // Fault injection for tests (MOONCAKE_FAULT_INJECT="OP:ROUND"): the process SIGKILLs
  // itself on the collective with sequence number OP (0-based, per group) just before it
  // arrives at that op's round ROUND (0 = the first round).
  bool is_recovery = false;  // a replacement for a failed rank: join_group() admits it
  int64_t inject_kill_op = -1;
  int64_t inject_kill_round = 0;
  // Tests only (MOONCAKE_FAULT_DELAY="OP:PEER:MS"): on collective OP (as above) this rank
  // takes peer PEER's part of the op's rounds MS ms late, as if it were still in flight.
  int64_t inject_delay_op = -1;
  int64_t inject_delay_peer = -1;
  int64_t inject_delay_ms = 0;
  std::vector<int> global_ranks;  // group rank -> default-group rank (empty: identity)
  // Seats that found the group (ascending; empty: every seat). The others are extension
  // seats: inactive until a process joins them through recover_ranks/join_group.
  std::vector<int> initial_active;
  // CUDA builds: all_reduce, broadcast, all_gather into one tensor and reduce_scatter from
  // one tensor of CUDA tensors through CUDA IPC when every rank is on this host
  // (MOONCAKE_CUDA_IPC=0 / MooncakeOptions(cuda_ipc=False): pinned host staging always).
  bool cuda_ipc = true;
  // Groups spanning hosts with the same number of ranks on each: collectives in two levels
  // (inside each host, then between hosts; core/collectives/hierarchical.cpp). Must agree.
  bool hierarchical = true;
  // > 0: set-up waits at most this long for the other members' keys (groups derived by
  // shrink/split, whose members are alive processes already); 0: the store's own timeout.
  int64_t setup_wait_ms = 0;
};

// Default-group ranks agreed failed by any group of this process (docs/design.md: an agreed
// failure applies to every group that contains the rank).
std::vector<int> known_failed_global_ranks();
// After the default group was shrunk, default-group rank new_rank is old_of_new[new_rank]:
// the record of agreed failures is renumbered (ranks not kept are dropped).
void renumber_failed_global_ranks(const std::vector<int>& old_of_new);

// A point-to-point message to send, or a receive to post (Group::post_p2p).
struct P2PRequest {
  bool is_send = false;
  int peer = -1;  // -1: any source (receives only)
  int tag = 0;
  void* data = nullptr;  // contiguous: read (send) or written (receive) until `done`
  size_t nbytes = 0;
  // The element type, numbered by the caller (a message and its receive must carry the
  // same number): the torch layer passes torch's own dtype numbers, so that every dtype
  // moves point to point. dtype_name names a number in the error of a mismatch.
  int32_t dtype = 0;
  std::string (*dtype_name)(int32_t) = nullptr;
  int64_t deadline_ns = 0;
  // The outcome (null: success) and, for a receive, the rank the message came from; called
  // once, on the p2p thread (or the caller's, when the group is shutting down).
  std::function<void(std::exception_ptr, int source_rank)> done;
};

class Group {
 public:
  // A collective's body, run with the engine held, by `deadline_ns` (now_ns() time).
  using Job = std::function<void(int64_t deadline_ns)>;
  struct Op {
    Job job;
    std::chrono::milliseconds timeout{0};  // <= 0: the group's op timeout
    // on_failure="mask" reruns the job over the survivors: this restores in-place inputs first
    std::function<void()> before_retry;
    uint32_t block_pos = 0;  // position in a coalescing block (OpHeader::batch_index); 0 outside one
    std::string trace_name;  // the op in MOONCAKE_DEBUG's trace (set only when config().debug)
    // The outcome (null: success), on the thread that ran the op; ran_inline: the caller's.
    std::function<void(std::exception_ptr, bool ran_inline)> done;
  };

  // Sets the group up (rendezvous, transport build; docs/design.md "Process group"), or, for
  // a recovering rank (cfg.is_recovery), asks to be admitted (join_group completes it).
  Group(std::shared_ptr<ControlStore> store, int rank, int size, BackendConfig cfg);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const BackendConfig& config() const { return cfg_; }
  FailurePolicy policy() const { return policy_; }
  std::chrono::milliseconds timeout() const { return timeout_ms_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_ = t; }
  std::string transport_name() const { return coll_ ? coll_->name() : "none"; }
  uint64_t ops_issued() const { return seq_; }
  // collectives issued since the member set formed (c10d's sequence number of the group)
  uint64_t seq_group() const { return seq_group_.load(); }
  // every member of the current transport shares this host
  bool one_host() const { return one_host_.load(); }
  int global_rank(int r) const;
  // key prefix of this incarnation of the group in the control store
  const std::string& store_ns() const { return store_ns_; }
  void log_membership(const std::string& msg);
  // The settings of a group derived from this one (shrink, split) over `members` (this
  // group's ranks, ascending, this rank among them): renumbered, every member a founder,
  // every set-up wait bounded by the op timeout.
  BackendConfig derived_config(const std::vector<int>& members, const char* op) const;

  // ---- scheduling (core/schedule.cpp) ----
  // Runs `op` as the group's next collective: on the caller's thread when !async_op and no
  // op is queued or running, else on the progress thread in issue order; retries or raises
  // per the failure policy. Throws GroupError when the group was shut down.
  void submit(bool async_op, Op op);
  // Runs the functions (the Works' future completions) on the completion threads, or here
  // when run_inline or shutting down. A pool that grows while every thread is busy: a
  // function may wait on another op's completion.
  void complete(std::vector<std::function<void()>> fns, bool run_inline);
  // Stops the threads; ops in flight raise (never waits for a dead peer).
  void shutdown();

  // ---- point to point (core/p2p.cpp) ----
  // Raises unless `peer` (-1: any) is active and alive, and this rank may send (no join
  // pending, not left).
  void check_peer_active(int peer, bool is_send);
  void post_p2p(std::shared_ptr<P2PRequest> req);

  // ---- collective bodies (core/collectives/), called from a job (engine held) ----
  // Outputs of inactive seats stay untouched; contributors are the active ranks.
  void allreduce(const Buffer& t, RedOp rop, double premul, int64_t deadline_ns);
  void reduce(const Buffer& t, RedOp rop, double premul, int root, int64_t deadline_ns);
  void broadcast(const Buffer& t, int root, int64_t deadline_ns);
  // outs[j]: where seat j's input lands (every seat; gather: on the root only)
  void allgather(const Buffer& in, const std::vector<uint8_t*>& outs, int64_t deadline_ns);
  void gather(const Buffer& in, const std::vector<uint8_t*>& outs, int root, int64_t deadline_ns);
  // ins[j]: the chunk for seat j (out.count elements each)
  void reduce_scatter(const std::vector<const uint8_t*>& ins, const Buffer& out, RedOp rop, double premul,
                      int64_t deadline_ns);
  void scatter(const std::vector<const uint8_t*>& ins, const Buffer& out, int root, int64_t deadline_ns);
  // rows of row_elems elements: in_rows[j] to seat j, out_rows[j] from seat j
  void alltoall(const uint8_t* in, uint8_t* out, DType dt, int64_t row_elems,
                const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows,
                int64_t deadline_ns);
  void barrier(int64_t deadline_ns);
  // Rounds that carry only the op header, for ops whose data moves elsewhere (the CUDA IPC
  // path's handshake): per piece of at most R of n elements, before(parity, off, len), one
  // round with `hdr` (mismatches and dead peers as in every collective), after(...).
  // The first such op of a membership epoch starts with an extra header round;
  // *epoch_seen keeps the epoch of the latest one.
  using PieceFn = std::function<void(int parity, size_t off, size_t len)>;
  void header_rounds(const OpHeader& hdr, int ref, size_t n, size_t R, uint64_t* epoch_seen,
                     int64_t deadline_ns, const PieceFn& before, const PieceFn& after);
  // Rooted ops whose root is inactive raise RankFailure.
  void require_active_root(int root, const char* op);
  // With the engine held: the active ranks (ascending) and each same-host peer's process id.
  const std::vector<int>& active_list() const { return act_; }
  const std::vector<int64_t>& peer_pids() const { return peer_pid_; }

  // ---- membership (core/membership.cpp; docs/design.md "Membership and fault tolerance") ----
  // Host of each seat (equal = one host; hosts numbered in the order of their lowest
  // active member, an inactive seat counts as a host of its own). Rebuilt with the
  // transport at every membership change.
  std::vector<int> rank_hosts();
  std::vector<int32_t> active_ranks();
  int64_t epoch();
  std::vector<int> failed_ranks();    // every rank agreed failed so far
  std::vector<int> pending_failed();  // manual policy: agreed failed, not yet deactivated
  // Deactivates `ranks` on this rank (agreed through the control store; every survivor
  // calls it with the same ranks).
  void deactivate_ranks(const std::vector<int>& ranks);
  // Rejoin (docs/design.md): seats whose replacement asked to join and is not admitted yet.
  std::vector<int> pending_ranks();
  // Survivors, all of them, between the same two ops: admit `ranks` (the union over the
  // survivors' arguments is admitted; a no-op when it is empty).
  void recover_ranks(const std::vector<int>& ranks);
  // The replacement: blocks until the survivors admitted it (or raises after timeout_s).
  void join_group(double timeout_s);
  bool joining() const { return joining_; }
  std::vector<int> last_joined();  // ranks admitted by the latest recovery

 private:
  int rank_, size_;
  std::atomic<bool> one_host_{false};

  // now + t (t <= 0: the group timeout), in ns of now_ns()
  int64_t deadline_ns_for(std::chrono::milliseconds t) const;
  // The op with its retries; returns its outcome.
  std::exception_ptr run_op(const Op& op);
  // A collective of the core's own (recover_ranks' union of the survivors' requests):
  // submitted as a sync op, counted and ordered as the torch layer's are; raises its error.
  void run_sync(Job job, std::function<void()> before_retry);
  void ensure_threads(bool p2p);
  void progress_loop();
  void completion_loop();
  void p2p_loop();

  void setup();
  // before_last_sync: this rank's last store writes of the build (the founders' group
  // record); it runs before the step that holds the lowest member back until every member has
  // reached it, so that no member still talks to the store when that one (usually the store's
  // host) may return and exit.
  void build_transport(const std::string& ns, const std::vector<int>& members, int64_t wait_ms = 0,
                       const std::function<void()>& before_last_sync = {});
  // A recovering process that finds no group yet: waits for one, raising ValueError when
  // its founders count its seat as one of theirs.
  void await_group();
  void stop_p2p_thread();
  struct Record {
    bool join = false;
    std::vector<int> ranks;   // failed (or joining) ranks
    std::vector<int> active;  // join records: the active set afterwards
    std::string pids;         // join records: the admitted processes (one pid per rank)
    bool leave = false;       // a leave record (the one rank it names left of its own accord)
    // leave records: the last round (epoch_base(epoch) + round) the leaver completed
    uint64_t last_round = 0;
    std::string raw;
  };
  bool read_record_full(uint64_t epoch, Record* rec);
  static Record parse_record(const std::string& raw);
  std::string group_cfg_string() const;
  std::vector<int> joinable_members(std::string* ns, uint64_t* epoch);
  bool members_all_dead(const std::string& ns, const std::vector<int>& members);
  std::vector<int> members_cache_;
  // A control-store call bounded by the op timeout (TCPStore calls block without bound
  // when the store's host is cut off: no RST, no keepalive); throws std::runtime_error.
  // limit_ms > 0: that bound instead of the op timeout
  template <class T>
  T bounded_store_call(const char* what, std::function<T(ControlStore&)> fn, int64_t limit_ms = 0);
  // Heartbeats, in groups that span hosts: a detached thread adds 1 to "hb/<rank>" in the
  // control store every kHeartbeatPeriodMs (through its own clone of the store); a rank
  // blocked on peers of other hosts reads their counts and takes a peer whose count has not
  // moved for kHeartbeatLostMs for dead. A cut link or a frozen host sends no RST or FIN,
  // so without this only the op timeout would end the wait; a live rank that is busy
  // between ops keeps beating (the thread does not need the GIL or the op).
  // The thread also looks for a membership record newer than `epoch` (the agreed epoch as
  // of this rank's last op) and notes its epoch in `newer` (see fence_if_declared_failed).
  static constexpr int64_t kHeartbeatPeriodMs = 200;
  static constexpr int64_t kHeartbeatLostMs = 2000;
  struct Heartbeat {
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> epoch{0};
    std::atomic<uint64_t> newer{0};
    // the text of record `newer` as the thread read it (records never change once written),
    // for an op that finds the store gone by the time it checks the record
    std::mutex mu;
    uint64_t seen_epoch = 0;
    std::string seen_record;
  };
  std::shared_ptr<Heartbeat> heartbeat_;
  std::vector<int64_t> hb_count_, hb_changed_ns_;
  int64_t next_hb_check_ns_ = 0;
  // st: the connection the beats use (a clone of the store made while set-up still talks to it)
  void start_heartbeat(const std::shared_ptr<ControlStore>& st);
  std::vector<int> heartbeat_lost(const std::vector<int>& ranks);
  // After an op that succeeded here: raises RankFencedError when the others have declared
  // this rank failed meanwhile (a rank late to an op by more than the timeout can still
  // find every frame it needs, sent before the others gave up on it, in its sockets).
  void fence_if_declared_failed();
  // This rank fences itself: broken_ = why, and raises RankFailure with fenced set
  // (RankFencedError) for membership epoch `epoch`.
  [[noreturn]] void fence(const std::string& why, int64_t epoch);
  void apply_join(const Record& rec, uint64_t epoch);

  // collective bodies (run with the engine held)
  void run_allreduce(const Buffer& t, RedOp rop, double premul, int root, int64_t deadline_ns);
  void run_allgather(const Buffer& in, const std::vector<uint8_t*>& outs, OpCode opcode, int root,
                     int64_t deadline_ns);
  // Two-level versions (core/collectives/hierarchical.cpp): H >= 2 hosts, uniform except for
  // broadcast; `h` the op's header (seq taken). run_hierarchical() gives the layout when
  // they apply (uneven: hosts of any sizes allowed).
  bool run_hierarchical(size_t nbytes, HostLayout* hl, bool uneven = false) const;
  void run_allreduce_hier(const Buffer& t, RedOp rop, double premul, int root, const HostLayout& hl,
                          const OpHeader& h, int64_t deadline_ns);
  void run_broadcast_hier(const Buffer& t, int root, const HostLayout& hl, const OpHeader& h,
                          int64_t deadline_ns, bool star);
  void run_allgather_hier(const Buffer& in, const std::vector<uint8_t*>& outs, const HostLayout& hl,
                          const OpHeader& h, int64_t deadline_ns);
  void run_reduce_scatter_hier(const std::vector<const uint8_t*>& ins, const Buffer& out, RedOp rop,
                               double premul, const HostLayout& hl, const OpHeader& h, int64_t deadline_ns);
  // One engine round of the running collective (hdr_len > 0: its first round, which carries
  // the header). MOONCAKE_FAULT_INJECT's SIGKILL fires here.
  void exchange(const PeerRanges* sends, size_t hdr_len, int64_t deadline_ns);

  struct P2POp;

  // membership
  // Which of `ranks` are gone while this rank waits for them; round > 0: for their part of
  // that round of a collective (a leaver that completed it sent its part and is not gone),
  // else for p2p.
  PeersGone probe_dead(const std::vector<int>& ranks, uint64_t round = 0);
  // deactivate_ranks of this rank itself: agreed like a failure, marked as a leave
  void leave();
  // every rank of `ranks` (non-empty) left the group of its own accord (a leave record)
  bool only_leaves(const std::vector<int>& ranks) const;
  int64_t next_record_check_ns_ = 0;  // probe_dead: next look for a newer membership record
  // Reads every agreed record after agreed_epoch_; returns the ranks they add.
  std::vector<int> catch_up(bool stop_at_join = false);
  // Proposes `suspects` as failed for the next epoch (the first compare-and-set wins),
  // catches up and applies per policy; returns the ranks newly agreed failed.
  std::vector<int> agree(const std::vector<int>& suspects, const std::string& reason);
  void apply_agreed();  // active_ -= agreed failures; epoch_ = agreed_epoch_
  void refresh_active_list();
  [[noreturn]] void throw_failure(const std::string& what, const std::vector<int>& newly);
  // Group ranks that another group of this process has agreed failed.
  std::vector<int> failed_elsewhere();
  uint64_t registry_seen_ = 0;
  bool joining_ = false;
  bool p2p_restart_ = false;
  std::vector<int> last_joined_;

  std::shared_ptr<ControlStore> store_;
  std::string store_ns_;     // key prefix of this incarnation of the group in the store
  std::string setup_error_;  // why this rank cannot set up its transport (told to the founders, then raised)
  // While founders build a new incarnation: the count of "mc/setups" adds before its own.
  // A recovering process that recorded a count at least this waits for this incarnation.
  int64_t founding_adds_ = -1;
  FailurePolicy policy_ = FailurePolicy::RAISE;
  std::vector<char> active_;
  std::vector<int> act_;       // active ranks, ascending
  int my_index_ = 0;           // position of rank_ in act_
  uint64_t epoch_ = 0;         // applied membership epoch
  uint64_t agreed_epoch_ = 0;  // last agreed record read from the store
  std::vector<char> agreed_failed_;
  std::vector<char> left_;       // agreed out by their own leave record (no data of theirs is missing)
  std::mutex mem_mu_;            // guards copies read from Python threads
  std::vector<int> peer_pidfd_;  // same-host peers: pidfd (or -1)
  std::vector<int64_t> peer_pid_;
  std::vector<int> host_of_;  // per rank of the transport: index of its host (setup; written under mem_mu_)

  BackendConfig cfg_;
  std::chrono::milliseconds timeout_ms_;  // op timeout (MooncakeOptions.timeout, setTimeout)
  std::unique_ptr<CollEngine> coll_;
  std::unique_ptr<P2PChannel> p2p_;
  std::string broken_;   // non-empty: the group is unusable (fenced, store lost, shut down)
  bool fenced_ = false;  // broken_ because this rank fenced itself: every later op raises RankFencedError

  std::mutex engine_mu_;
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::function<void()>> queue_;
  int inflight_ = 0;
  bool stop_ = false;
  std::thread progress_thread_, p2p_thread_;
  // Futures are completed (callbacks run) on a small pool that grows when every thread
  // is busy in a callback: a callback may wait on the future of an op it issued.
  std::vector<std::thread> completion_threads_;
  int completion_idle_ = 0;
  std::deque<std::function<void()>> completions_;
  std::condition_variable ccv_;

  // p2p state (owned by the p2p thread after posting)
  std::mutex p2p_mu_;
  std::deque<std::shared_ptr<P2POp>> p2p_posted_;

  std::atomic<bool> left_self_{false};  // this rank left the group (leave): p2p raises too
  std::deque<std::string> trace_;       // MOONCAKE_DEBUG: recent ops, dumped on timeout
  std::mutex trace_mu_;
  void trace(const std::string& what);
  std::string dump_trace();
  uint64_t seq_ = 0;                    // ops issued
  std::atomic<uint64_t> seq_group_{0};  // collectives issued since the member set formed
  uint64_t seq_exec_ = 0;               // collectives executed (in the op header; equal on all ranks)
  uint64_t op_round_ = 0;               // rounds completed by the current collective
};

}  // namespace mooncake
