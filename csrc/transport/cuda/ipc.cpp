// CUDA runtime helpers (no kernels): IPC handles, pinned memory, events.
#ifdef MOONCAKE_WITH_CUDA
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "transport/cuda/cuda.hpp"

namespace mooncake {
namespace cuda {

static void check(cudaError_t e, const char* fn, const char* call) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls are not blamed
    throw std::runtime_error(std::string("mooncake::cuda::") + fn + ": " + call +
                             " failed: " + cudaGetErrorString(e));
  }
}

std::string ipc_export(const void* base) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "cudaIpcMemHandle_t size");
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, base), "ipc_export", "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice)
    throw std::runtime_error(
        "mooncake::cuda::ipc_export: expected device memory, got host or managed memory");
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "ipc_export", "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void* ipc_open(const std::string& handle, int device) {
  if (handle.size() != kIpcHandleBytes)
    throw std::runtime_error("mooncake::cuda::ipc_open: expected a " + std::to_string(kIpcHandleBytes) +
                             "-byte handle, got " + std::to_string(handle.size()) + " bytes");
  int prev = 0;
  check(cudaGetDevice(&prev), "ipc_open", "cudaGetDevice");
  check(cudaSetDevice(device), "ipc_open", "cudaSetDevice");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  cudaSetDevice(prev);
  check(e, "ipc_open", "cudaIpcOpenMemHandle");
  return p;
}

void ipc_close(void* base) { check(cudaIpcCloseMemHandle(base), "ipc_close", "cudaIpcCloseMemHandle"); }

void* device_alloc(size_t bytes, int device) {
  int prev = 0;
  check(cudaGetDevice(&prev), "device_alloc", "cudaGetDevice");
  check(cudaSetDevice(device), "device_alloc", "cudaSetDevice");
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  cudaSetDevice(prev);
  check(e, "device_alloc", "cudaMalloc");
  return p;
}

void device_free(void* p) {
  if (p) cudaFree(p);
}

void copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
        "copy_async", "cudaMemcpyAsync");
}

void* ipc_event_create() {
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess), "ipc_event_create",
        "cudaEventCreateWithFlags");
  return ev;
}

std::string ipc_event_export(void* ev) {
  static_assert(sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes, "cudaIpcEventHandle_t size");
  cudaIpcEventHandle_t h;
  check(cudaIpcGetEventHandle(&h, static_cast<cudaEvent_t>(ev)), "ipc_event_export", "cudaIpcGetEventHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void* ipc_event_open(const std::string& handle, int device) {
  if (handle.size() != kIpcHandleBytes)
    throw std::runtime_error("mooncake::cuda::ipc_event_open: expected a " + std::to_string(kIpcHandleBytes) +
                             "-byte handle, got " + std::to_string(handle.size()) + " bytes");
  int prev = 0;
  check(cudaGetDevice(&prev), "ipc_event_open", "cudaGetDevice");
  check(cudaSetDevice(device), "ipc_event_open", "cudaSetDevice");
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaIpcOpenEventHandle(&ev, h);
  cudaSetDevice(prev);
  check(e, "ipc_event_open", "cudaIpcOpenEventHandle");
  return ev;
}

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable), "pinned_alloc", "cudaHostAlloc");
  return p;
}

void pinned_free(void* p) {
  if (p) cudaFreeHost(p);
}

void* event_create() {
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event_create", "cudaEventCreateWithFlags");
  return ev;
}

void event_destroy(void* ev) {
  if (ev) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
}

void event_record(void* ev, void* stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(ev), static_cast<cudaStream_t>(stream)), "event_record",
        "cudaEventRecord");
}

void stream_wait_event(void* stream, void* ev) {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ev), 0),
        "stream_wait_event", "cudaStreamWaitEvent");
}

bool event_query(void* ev) {
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(ev));
  if (e == cudaErrorNotReady) return false;
  check(e, "event_query", "cudaEventQuery");
  return true;
}

void event_synchronize(void* ev) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(ev)), "event_synchronize", "cudaEventSynchronize");
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace mooncake
#endif  // MOONCAKE_WITH_CUDA
