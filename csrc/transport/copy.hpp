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
