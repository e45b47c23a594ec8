// What the collective bodies (core/collectives/*.cpp, pg/cuda/ipc_ops.cpp) share: the op
// header every collective exchanges in its first round, the op codes it names, and the
// copies into a round's slot.
//
// The first round of every collective carries one OpHeader per rank (plus `nextra` int64
// values: all_to_all's split sizes) next to the data; every rank compares the active ranks'
// headers with a reference rank's (check_headers) before it writes any user buffer, so a
// cross-rank mismatch raises ValueError on every rank and leaves every output untouched.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/engine.hpp"
#include "core/reduce.hpp"

namespace mooncake {

constexpr uint32_t kOpHeaderMagic = 0x4d434b31;  // "MCK1"

enum OpCode : uint32_t {
  OP_ALLREDUCE = 1,
  OP_REDUCE,
  OP_BROADCAST,
  OP_ALLGATHER,
  OP_GATHER,
  OP_REDUCE_SCATTER,
  OP_SCATTER,
  OP_ALLTOALL,
  OP_BARRIER,
  // CUDA tensors through CUDA IPC (pg/cuda/ipc.hpp): one round per piece
  OP_ALLREDUCE_IPC,
  OP_BROADCAST_IPC,
  OP_ALLGATHER_IPC,       // all_gather into one tensor
  OP_REDUCE_SCATTER_IPC,  // reduce_scatter from one tensor
};

// The op's name in errors ("all_reduce", "broadcast", ...); an IPC op has its CPU op's name.
const char* op_name(uint32_t op);

// Exchanged in the first round of every collective, before any user buffer is written.
struct OpHeader {
  uint32_t magic;   // kOpHeaderMagic
  uint32_t op;      // OpCode
  int32_t dtype;    // DType
  int32_t redop;    // RedOp (reductions only)
  int64_t root;     // rooted ops; -1 otherwise
  int64_t count;    // elements (all_to_all: elements per row)
  uint64_t seq;     // collectives executed by the group (equal on every rank)
  uint32_t nextra;  // int64 values following the header
  // Within a call that runs one collective per tensor (all_reduce_coalesced, ...): the
  // tensor's 1-based position and the call's tensor count; within a coalescing block
  // (startCoalescing .. endCoalescing): the op's 1-based position and 0; else 0 and 0.
  // Ranks that pass different tensor counts, or put different ops in a block, then
  // mismatch on every rank at the first op that differs, instead of the later tensors
  // pairing with other calls.
  uint32_t batch_index;
  uint32_t batch_size;
  uint32_t pad;
};
static_assert(sizeof(OpHeader) == 56, "OpHeader layout");

// The batch position write_header puts into the headers of the collectives this thread
// runs; BatchScope sets it for a scope (the thread that runs collectives is one thread).
struct BatchPos {
  uint32_t index = 0;
  uint32_t size = 0;
};
BatchPos& current_batch();
class BatchScope {
 public:
  BatchScope(uint32_t index, uint32_t size) : saved_(current_batch()) { current_batch() = {index, size}; }
  ~BatchScope() { current_batch() = saved_; }
  BatchScope(const BatchScope&) = delete;
  BatchScope& operator=(const BatchScope&) = delete;

 private:
  BatchPos saved_;
};

// Header bytes per rank per round: the header, all_to_all's 2 x size split sizes and the
// rounds it needs after the first (one int64), rounded up to 64 bytes.
inline size_t hdr_cap_for(int size) {
  return (sizeof(OpHeader) + 16 * static_cast<size_t>(size) + 8 + 63) / 64 * 64;
}

// "all_reduce of 4 element(s) of dtype Float with ReduceOp SUM [op #3]"
std::string describe(const OpHeader& h);

// Writes this rank's header (and `extra`) for round k.
void write_header(CollEngine* e, uint64_t k, OpHeader h, const std::vector<int64_t>& extra);

// Bytes of the header part of a round that carries `extra`.
inline size_t header_len(const std::vector<int64_t>& extra) { return sizeof(OpHeader) + extra.size() * 8; }

// Compares every active rank's header of round k with the reference rank's; throws
// ValueError on every rank (they all see the same headers) naming the ranks that differ.
void check_headers(CollEngine* e, uint64_t k, int ref, const std::vector<int>& act);

inline void copy_plain(void* dst, const void* src, size_t nbytes) { std::memcpy(dst, src, nbytes); }

// Copies n_elems elements into a slot; PREMUL_SUM scales them by `premul` on the way.
inline void copy_in(void* dst, const void* src, size_t n_elems, size_t esize, DType dt, RedOp rop,
                    double premul) {
  if (rop == RedOp::PREMUL_SUM && premul != 1.0)
    scale_copy(dst, src, n_elems, dt, premul);
  else
    std::memcpy(dst, src, n_elems * esize);
}

}  // namespace mooncake
