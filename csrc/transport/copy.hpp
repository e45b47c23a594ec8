// Memory copies for the data path. No torch headers here.
#pragma once
#include <cstddef>

namespace mooncake {

// Copies n bytes. Large copies into memory that nobody reads soon (user output buffers
// of big ops) use non-temporal stores where the CPU has them, which skips the
// read-for-ownership of every destination line and roughly halves memory traffic.
void copy_stream(void* dst, const void* src, size_t n);

// Size from which copy_stream bypasses the cache (bytes).
constexpr size_t kStreamThreshold = 4 << 20;

}  // namespace mooncake

#include <vector>

namespace mooncake {

struct CopyOp {
  void* dst;
  const void* src;
  size_t n;
};

// Copies every op, splitting the bytes over up to `threads` threads (the caller's thread
// included) when there are at least kParallelThreshold of them; pieces of at least
// kStreamThreshold bytes use copy_stream. Used for the store's copies to and from
// shared-memory segments, where one core's memcpy is the limit.
void copy_parallel(const std::vector<CopyOp>& ops, int threads);

constexpr size_t kParallelThreshold = 2 << 20;

}  // namespace mooncake
