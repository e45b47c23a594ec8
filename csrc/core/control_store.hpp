// The control store as the group core sees it: the key-value store the group was created
// with (rendezvous, membership records, heartbeats). The torch layer's adapter over the
// c10d::Store (pg/convert.cpp) is its implementation. Every call may throw StoreError
// (StoreLost once the connection is gone for good, core/errors.hpp).
//
// Calls block for at most the store's own timeout (get, wait without a timeout) or the
// timeout given; a store whose host was cut off may block longer than that (no RST, no
// keepalive), which is why the membership code bounds such calls itself
// (Group::bounded_store_call).
//
// Also here: the rank lists membership records hold ("1,3" <-> {1, 3}).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace mooncake {

class ControlStore {
 public:
  virtual ~ControlStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The key's value, once it exists (within timeout()).
  virtual std::string get(const std::string& key) = 0;
  // Adds `delta` to the integer the key holds (0 when absent) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets the key to `desired` when it holds `expected` ("": when it is absent) and returns
  // what it holds afterwards: `desired` if this call set it, else the value set before.
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // Whether every key exists (no wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Until every key exists: within timeout(), or within `timeout`; throws StoreError after.
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // The store's own timeout (what get and wait without a timeout take at most).
  virtual std::chrono::milliseconds timeout() const = 0;
  // Another connection to the same store: its calls never queue behind this one's.
  virtual std::shared_ptr<ControlStore> clone() = 0;
};

inline std::string join_ranks(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

inline std::vector<int> parse_ranks(const std::string& list) {
  std::vector<int> out;
  std::istringstream in(list);
  std::string tok;
  while (std::getline(in, tok, ',')) {
    if (!tok.empty()) out.push_back(std::stoi(tok));
  }
  return out;
}

}  // namespace mooncake
