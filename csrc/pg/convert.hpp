// Where the torch layer meets the group core's types, in one place: torch dtypes <-> DType,
// c10d::ReduceOp -> RedOp, the core's errors -> c10 errors, and the c10d::Store the group
// was created with as the core's ControlStore.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/control_store.hpp"
#include "core/dtype.hpp"
#include "core/errors.hpp"
#include "core/reduce.hpp"

namespace mooncake {

// The core's element type of a torch dtype (nullopt: one the data path does not move).
std::optional<DType> to_dtype(c10::ScalarType st);
c10::ScalarType to_scalar_type(DType dt);
// torch's name of a dtype number (the p2p header's dtype: P2PRequest::dtype_name)
std::string scalar_type_name(int32_t code);

// check_reduce_supported (core/reduce.hpp) of a torch dtype: empty if `op` is defined for
// `st`, else the reason.
std::string check_reduce_supported(c10::ScalarType st, RedOp op);

// The reduction of a c10d ReduceOp; *premul: PREMUL_SUM's factor (1.0 for the others).
RedOp to_redop(const c10d::ReduceOp& op, double* premul);

// An op failed because ranks failed (the core's RankFailure): mooncake_pg.RankFailureError,
// or RankFencedError when `fenced` (bindings/pg.cpp translates it), a
// torch.distributed.DistBackendError carrying failed_ranks and epoch.
class RankFailureError : public c10::DistBackendError {
 public:
  RankFailureError(const std::string& msg, std::vector<int> failed, int64_t epoch, bool fenced)
      : c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg),
        failed_ranks(std::move(failed)),
        epoch(epoch),
        fenced(fenced) {}
  std::vector<int> failed_ranks;
  int64_t epoch;
  bool fenced;
};

// The error the torch layer raises for `e`: each core error (core/errors.hpp) as its c10
// error, a ForeignError as its original exception, anything else unchanged.
std::exception_ptr to_torch_error(std::exception_ptr e);

// Calls f(), raising a core error that leaves it as its c10 error.
template <class F>
auto translated(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (...) {
    std::rethrow_exception(to_torch_error(std::current_exception()));
  }
}

// Runs a torch-layer job inside the core: its c10 errors travel through the core as
// ForeignError (the op fails, the group goes on) and come out as themselves.
template <class F>
void as_core_job(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    throw ForeignError(e.what_without_backtrace(), std::current_exception());
  }
}

// The c10d::Store as the core's ControlStore; the store's own errors become StoreError
// (StoreLost for a DistNetworkError: a TCPStore client never reconnects).
std::shared_ptr<ControlStore> control_store(const c10::intrusive_ptr<c10d::Store>& store);

}  // namespace mooncake
