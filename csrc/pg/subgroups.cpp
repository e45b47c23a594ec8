// Groups derived from a MooncakeBackend (torch 2.13's dist.shrink_group and the
// ProcessGroup::splitGroup behind dist.split_group). The new group's ranks are renumbered
// 0..n-1 in the parent's order; it is set up over the parent's store, so no new
// init_process_group (or TCPStore) is needed, and every wait of its set-up is bounded by
// the op timeout, so a member that died meanwhile is an error, never a hang.
#include <algorithm>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "pg/backend.hpp"

namespace mooncake {

c10::intrusive_ptr<MooncakeBackend> MooncakeBackend::derive(const c10::intrusive_ptr<c10d::Store>& store,
                                                            const std::vector<int>& members,
                                                            const char* op) const {
  BackendConfig cfg = group_->derived_config(members, op);
  const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  return c10::make_intrusive<MooncakeBackend>(store, new_rank, static_cast<int>(members.size()), cfg);
}

c10::intrusive_ptr<c10d::Backend> MooncakeBackend::shrink(
    const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts_override) {
  const char* op = "shrink_group";
  TORCH_CHECK(!group_->joining(), "mooncake ", op, " (rank ", rank_,
              "): this rank is waiting to join the group; call join_group first");
  TORCH_CHECK_VALUE(!opts_override, "mooncake ", op, " (rank ", rank_,
                    "): pg_options are not taken; the shrunk group keeps the parent's options");
  TORCH_CHECK_VALUE(shrink_flags == 0 || shrink_flags == 1, "mooncake ", op, " (rank ", rank_,
                    "): shrink_flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT (1), got ", shrink_flags);
  std::vector<int> excluded;
  for (int64_t r : ranks_to_exclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "mooncake ", op, " (rank ", rank_, "): rank ", r,
                      " to exclude is out of range [0, ", size_, ")");
    excluded.push_back(static_cast<int>(r));
  }
  std::sort(excluded.begin(), excluded.end());
  TORCH_CHECK_VALUE(std::adjacent_find(excluded.begin(), excluded.end()) == excluded.end(), "mooncake ", op,
                    " (rank ", rank_, "): ranks_to_exclude has a rank twice: [", join_ranks(excluded), "]");
  TORCH_CHECK_VALUE(!std::binary_search(excluded.begin(), excluded.end(), rank_), "mooncake ", op, " (rank ",
                    rank_, "): this rank is among the ranks to exclude; only the remaining ranks call it");
  std::vector<int> members;
  for (int j = 0; j < size_; ++j)
    if (!std::binary_search(excluded.begin(), excluded.end(), j)) members.push_back(j);
  // SHRINK_ABORT: ops still in flight on this group fail now instead of waiting for a
  // peer that may be gone; the group is unusable afterwards (torch destroys it anyway)
  if (shrink_flags == 1) shutdown();
  // Survivors that name different ranks to exclude use different keys: each side's set-up
  // then times out waiting for members that never come, instead of forming a wrong group.
  const std::string prefix = "mc/shrink/" + std::to_string(shrinks_++) + "/" + join_ranks(excluded) + "/";
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  auto be = derive(store, members, "shrink");
  if (group_->config().global_ranks.empty()) {
    std::vector<int> old_of_new;
    for (int m : members) old_of_new.push_back(m);
    renumber_failed_global_ranks(old_of_new);
  }
  group_->log_membership("shrink_group: excluded ranks " + join_ranks(excluded) + "; this rank is rank " +
                         std::to_string(be->getRank()) + " of " + std::to_string(be->getSize()) +
                         " in the new group");
  return be;
}

c10::intrusive_ptr<c10d::Backend> MooncakeBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& /*opts*/) {
  const char* op = "split_group";
  TORCH_CHECK(!group_->joining(), "mooncake ", op, " (rank ", rank_,
              "): this rank is waiting to join the group; call join_group first");
  std::vector<int> members(ranks.begin(), ranks.end());
  std::sort(members.begin(), members.end());
  TORCH_CHECK_VALUE(!members.empty(), "mooncake ", op, " (rank ", rank_, "): the split's ranks are empty");
  TORCH_CHECK_VALUE(std::adjacent_find(members.begin(), members.end()) == members.end(), "mooncake ", op,
                    " (rank ", rank_, "): the split's ranks repeat a rank: [", join_ranks(members), "]");
  for (int r : members)
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "mooncake ", op, " (rank ", rank_, "): rank ", r,
                      " is out of range [0, ", size_, ")");
  // the no-colour path: a rank outside every split gets no group
  if (!std::binary_search(members.begin(), members.end(), rank_)) return nullptr;
  return derive(store, members, "split");
}

}  // namespace mooncake
