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
// kStoreStreamThreshold bytes use copy_stream (non-temporal stores: on this class of
// machine 1 MiB into memory not in cache takes ~70 us instead of ~220 us with memcpy).
// Used for the store's copies to and from shared-memory segments.
void copy_parallel(const std::vector<CopyOp>& ops, int threads);

constexpr size_t kParallelThreshold = 4 << 20;
constexpr size_t kStoreStreamThreshold = 64 << 10;

}  // namespace mooncake
