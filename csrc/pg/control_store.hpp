// Strings in the control store (the c10d Store the group was created with) and the rank
// lists its membership records hold ("1,3" <-> {1, 3}). Used by set-up and membership.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <sstream>
#include <string>
#include <vector>

namespace mooncake {

inline std::string join_ranks(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

inline std::vector<int> parse_ranks(const std::string& list) {
  std::vector<int> out;
  std::istringstream in(list);
  std::string tok;
  while (std::getline(in, tok, ','))
    if (!tok.empty()) out.push_back(std::stoi(tok));
  return out;
}

inline std::string store_get_str(const c10::intrusive_ptr<c10d::Store>& store, const std::string& k) {
  auto v = store->get(k);
  return std::string(v.begin(), v.end());
}

inline void store_set_str(const c10::intrusive_ptr<c10d::Store>& store, const std::string& k,
                          const std::string& v) {
  store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
}

}  // namespace mooncake
