// CUDA helpers of the transport layer: element-wise reductions in CUDA kernels, CUDA IPC
// handle export/import, pinned host staging, events. No torch headers here, and no CUDA
// headers either (streams and events are passed as void*), so the process group can name
// these functions in a build without CUDA. Built only with MOONCAKE_WITH_CUDA; errors are
// std::runtime_error("mooncake::cuda::function: ...").
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mooncake {
namespace cuda {

// Element types the kernels handle, in the order of the group core's DType (core/dtype.hpp).
enum class DType : int {
  F64 = 0,
  F32,
  F16,
  BF16,
  F8E4M3,
  F8E5M2,
  I8,
  I16,
  I32,
  I64,
  U8,
  U16,
  U32,
  U64,
  BOOL,
  C64,
  C128,
};
// Same order as mooncake::RedOp (core/reduce.hpp).
enum class Op : int { SUM = 0, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM };

constexpr int kMaxSources = 8;

// dst[i] = srcs[0][i] (op) srcs[1][i] ... (op) srcs[nsrc-1][i], n elements, on `stream`
// (a cudaStream_t; nullptr: the legacy default stream). Every pointer is device memory
// (own allocations or CUDA-IPC-mapped ones of peers); dst may alias a source. 16-bit and
// 8-bit floats accumulate in float; AVG divides by nsrc (integers truncate toward zero);
// PREMUL_SUM sums (inputs are scaled beforehand). 1 <= nsrc <= kMaxSources. Throws on an
// unsupported (dtype, op) pair or a launch error. Asynchronous.
void launch_reduce(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, Op op, void* stream);

// dst[i] = src[i] * factor for float dtypes (PREMUL_SUM's pre-multiplication). Asynchronous.
void launch_scale(void* dst, const void* src, size_t n, DType dt, double factor, void* stream);

// Size of an exported IPC handle (cudaIpcMemHandle_t), bytes.
constexpr size_t kIpcHandleBytes = 64;
// Exports the device allocation starting at `base` (the base of a cudaMalloc'd block, e.g.
// what torch's caching allocator reports for a tensor) for other processes of this host:
// the 64-byte handle.
std::string ipc_export(const void* base);
// Maps a peer's exported allocation; returns its base (close with ipc_close). A handle of
// this process's own allocation cannot be opened (CUDA refuses): callers use the pointer.
void* ipc_open(const std::string& handle, int device);
void ipc_close(void* base);

// Device memory of its own cudaMalloc block (so it can be exported whole with ipc_export)
// on `device`; device_free(nullptr) is a no-op. copy_async: device-to-device bytes on
// `stream`. Asynchronous.
void* device_alloc(size_t bytes, int device);
void device_free(void* p);
void copy_async(void* dst, const void* src, size_t bytes, void* stream);

// Interprocess events (cudaEventInterprocess | cudaEventDisableTiming) on the current
// device: ipc_event_export gives the 64-byte cudaIpcEventHandle_t; ipc_event_open maps a
// peer's event (on `device`; destroy with event_destroy). A stream that waits on an opened
// event waits for the exporter's most recent record of it.
void* ipc_event_create();
std::string ipc_event_export(void* ev);
void* ipc_event_open(const std::string& handle, int device);

// Page-locked host memory (cudaHostAlloc, portable). Throws when it cannot be allocated.
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);

// Events: created without timing; record on a stream, make a stream wait, query.
void* event_create();
void event_destroy(void* ev);
void event_record(void* ev, void* stream);
void stream_wait_event(void* stream, void* ev);
bool event_query(void* ev);  // true when complete
void event_synchronize(void* ev);

int device_count();  // 0 when no device or no driver (never throws)

}  // namespace cuda
}  // namespace mooncake
