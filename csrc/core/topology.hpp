// Hosts of a group's active ranks, for the hierarchical collectives
// (core/collectives/hierarchical.cpp, docs/design.md "Topology").
#pragma once
#include <vector>

namespace mooncake {

struct HostLayout {
  // active ranks by host: hosts in the order of their lowest rank, ranks ascending
  std::vector<std::vector<int>> hosts;
  int H = 0;             // hosts
  int G = 0;             // ranks per host when uniform (else 0)
  int min_G = 0;         // fewest ranks on one host
  int h = -1, g = -1;    // this rank's host and local index
  bool uniform = false;  // every host has G ranks
  int at(int host, int local) const { return hosts[host][local]; }
  // host and local index of active rank r (false: r is not active)
  bool where(int r, int* host, int* local) const {
    for (int i = 0; i < H; ++i)
      for (int j = 0; j < static_cast<int>(hosts[i].size()); ++j)
        if (hosts[i][j] == r) {
          *host = i;
          *local = j;
          return true;
        }
    return false;
  }
};

// act: active ranks ascending; host_of[r]: any id equal for ranks of one host.
inline HostLayout host_layout(const std::vector<int>& act, const std::vector<int>& host_of, int rank) {
  HostLayout L;
  std::vector<int> index_of_host;  // host id -> index in L.hosts
  for (int r : act) {
    const int id = host_of[r];
    if (id >= static_cast<int>(index_of_host.size())) index_of_host.resize(id + 1, -1);
    if (index_of_host[id] < 0) {
      index_of_host[id] = static_cast<int>(L.hosts.size());
      L.hosts.emplace_back();
    }
    auto& mates = L.hosts[index_of_host[id]];
    if (r == rank) {
      L.h = index_of_host[id];
      L.g = static_cast<int>(mates.size());
    }
    mates.push_back(r);
  }
  L.H = static_cast<int>(L.hosts.size());
  L.uniform = L.H > 0;
  for (auto& mates : L.hosts)
    if (mates.size() != L.hosts[0].size()) L.uniform = false;
  L.G = L.uniform ? static_cast<int>(L.hosts[0].size()) : 0;
  for (auto& mates : L.hosts)
    if (L.min_G == 0 || static_cast<int>(mates.size()) < L.min_G) L.min_G = static_cast<int>(mates.size());
  return L;
}

}  // namespace mooncake
