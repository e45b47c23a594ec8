// CUDA tensors in the process group (built with MOONCAKE_WITH_CUDA only).
//
// First path: pinned host staging. An op on CUDA tensors copies them into pinned host
// tensors on the caller's current stream (so it is ordered after the work queued there),
// runs the CPU op over the usual transports, then copies the outputs back on a side stream
// and records an event; Work.wait() makes the caller's current stream wait on that event
// (NCCL's semantics) and the Work's future is marked completed on the side stream.
// Known cost of this first path: the caller's thread waits until its stream reached the op.
#pragma once
#ifdef MOONCAKE_WITH_CUDA
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <string>
#include <vector>

namespace mooncake {

bool any_cuda(const std::vector<at::Tensor*>& ts);

// The kernels' element type code (cuda::DType) of a torch dtype; ValueError naming `fn` for
// a dtype the kernels do not handle.
int cuda_dtype_code(c10::ScalarType st, const char* fn);

// Swaps every CUDA tensor in `ins` and `outs` for a pinned host copy while `cpu_call` runs
// (the same pointers may appear in both), then restores them; returns a Work that copies
// `outs` back. `op` names the op in errors. Raises ValueError when the tensors are not all
// on one CUDA device. Works made while `coalescing` are also appended to `coalesced`.
c10::intrusive_ptr<c10d::Work> cuda_staged(int rank, c10d::OpType type, const char* op,
                                           const std::vector<at::Tensor*>& ins,
                                           const std::vector<at::Tensor*>& outs,
                                           const std::function<c10::intrusive_ptr<c10d::Work>()>& cpu_call,
                                           bool coalescing,
                                           std::vector<c10::intrusive_ptr<c10d::Work>>* coalesced);

// The Work endCoalescing returns when CUDA ops were coalesced: waits for `inner` (the
// coalesced CPU work), then for every staged child's copy-back.
c10::intrusive_ptr<c10d::Work> cuda_coalesced(int rank, c10::intrusive_ptr<c10d::Work> inner,
                                              std::vector<c10::intrusive_ptr<c10d::Work>> children);

// Test/benchmark helpers behind private bindings: dst = reduce(dst, srcs...) in a CUDA
// kernel on the current stream; CUDA IPC export of a tensor's allocation and a reduction
// from a peer's exported tensor.
void cuda_reduce_(at::Tensor& dst, const std::vector<at::Tensor>& srcs, int op);
std::string cuda_ipc_export(const at::Tensor& t, int64_t* offset);
void cuda_ipc_reduce_from(at::Tensor& dst, const std::string& handle, int64_t offset, int op);

}  // namespace mooncake
#endif  // MOONCAKE_WITH_CUDA
