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

#include <cstdint>
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
// Used for the store's copies to and from shared-memory segments. With prefault_dst the
// destinations are fresh outputs: each thread first runs prefault_write over the part of
// them it fills, by the rule of prefault_fresh_outputs below, so that the kernel's page
// allocation is split over the threads too (fresh 64 MiB on the CI VM: one thread 16.3 ms,
// two 9.2 ms).
void copy_parallel(const std::vector<CopyOp>& ops, int threads, bool prefault_dst = false);

constexpr size_t kParallelThreshold = 4 << 20;
constexpr size_t kStoreStreamThreshold = 64 << 10;

// Makes the kernel allocate the pages of fresh, never-touched memory [p, p+n) in one call
// (madvise MADV_POPULATE_WRITE, Linux 5.14+) instead of one fault per 4 KiB page during the
// copy that follows. Measured on the 2-core CI VM (store gets into new bytes objects):
// 64 MiB 48 -> 25 ms, a batch of 16 x 1 MiB 10.2 -> 6.2 ms; but a lone 1 MiB get, whose
// bytes come from already-touched heap, 0.19 -> 0.21 ms (the call walks present pages), so
// callers use it for outputs of at least kPrefaultMinTotal bytes in all and pieces of at
// least kPrefaultMinPiece. A no-op where the kernel does not have it. Not in 2 MiB pages
// (MADV_HUGEPAGE): on the CI VM that mapped a fresh 64 MiB output in 8.5 ms instead of
// 19 ms, but the first one after a pause took ~180 ms (free 2 MiB blocks are the ones the
// VM hands back to its host, which then has to supply them again). Pages already present
// (mincore) are skipped at the ends of the range.
void prefault_write(void* p, size_t n);

constexpr size_t kPrefaultMinTotal = 4 << 20;
constexpr size_t kPrefaultMinPiece = 256 << 10;

// prefault_write over fresh outputs [ptrs[i], ptrs[i] + lens[i]) that are about to be
// filled, by the rule above (at least kPrefaultMinTotal bytes in all; pieces of at least
// kPrefaultMinPiece).
void prefault_fresh_outputs(const std::vector<void*>& ptrs, const std::vector<uint64_t>& lens);

// Reads one byte of every page of [p, p+n) and changes nothing. On VMs (the 2-core CI VM
// among them) a page nobody has touched for about a second costs ~0.5 us at its next
// access, read or write: a 1 MiB copy into such memory takes 150-300 us instead of ~60 us.
// The store's client runs this over a fresh put reservation on a background thread, ahead
// of the puts that will write there. Returns the number of pages read.
size_t touch_pages(const void* p, size_t n);

}  // namespace mooncake
