// Shared memory and futex helpers for processes of one host. No torch headers here.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mooncake {

// A POSIX shared-memory segment mapped into this process. The creator unlinks the name
// once every peer has mapped it (Segment::unlink), so a SIGKILL afterwards leaks nothing.
class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates a zero-filled segment of `bytes` under `name` (must start with '/').
  void create(const std::string& name, size_t bytes);
  // Maps an existing segment; throws std::runtime_error if absent or too small.
  void open(const std::string& name, size_t bytes);
  void unlink();
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = false;
};

// Process-shared futex on a 32-bit word. Returns false on timeout.
bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
void futex_wake_all(std::atomic<uint32_t>* word);

// Number of CPUs this process may run on (sched_getaffinity).
int available_cpus();

// Monotonic clock, nanoseconds.
int64_t now_ns();

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace mooncake
