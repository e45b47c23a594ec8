#include "transport/shm.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mooncake {

static std::string errstr(const char* what, const std::string& name) {
  return std::string("ShmSegment: ") + what + " '" + name + "': " + std::strerror(errno);
}

ShmSegment::~ShmSegment() {
  if (data_) munmap(data_, size_);
  if (owner_ && linked_) shm_unlink(name_.c_str());
}

void ShmSegment::create(const std::string& name, size_t bytes) {
  name_ = name;
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errstr("shm_open(create)", name));
  owner_ = linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    throw std::runtime_error(errstr("ftruncate", name));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(errstr("mmap", name));
  data_ = static_cast<uint8_t*>(p);
  size_ = bytes;
}

void ShmSegment::open(const std::string& name, size_t bytes) {
  name_ = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errstr("shm_open", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    throw std::runtime_error("ShmSegment: segment '" + name + "' is smaller than expected");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(errstr("mmap", name));
  data_ = static_cast<uint8_t*>(p);
  size_ = bytes;
}

void ShmSegment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000LL;
  ts.tv_nsec = timeout_ns % 1000000000LL;
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  return !(rc != 0 && errno == ETIMEDOUT);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

}  // namespace mooncake
