// Errors the group core raises. Each class stands for one kind of Python error; the torch
// layer turns them into the c10 errors of that kind (pg/convert.cpp), which torch shows as
// RuntimeError, ValueError, DistBackendError, and RankFailureError / RankFencedError.
// Messages follow STYLE.md and name the c10d class the caller holds ("MooncakeBackend::
// setup: ...", "mooncake all_reduce (rank 1): ...", "MooncakeBackend (rank 1): ...").
//
// Any other exception out of the core (std::runtime_error of a transport, PeerFailure, ...)
// is an internal failure: an op that ends with one leaves the group unusable.
#pragma once
#include <cstdint>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mooncake {

// RuntimeError
struct GroupError : std::runtime_error {
  explicit GroupError(const std::string& msg) : std::runtime_error(msg) {}
};

// ValueError: bad arguments, a cross-rank mismatch
struct GroupValueError : GroupError {
  explicit GroupValueError(const std::string& msg) : GroupError(msg) {}
};

// torch.distributed.DistBackendError: the group cannot serve the op (shut down, fenced, a
// rank that must join first, p2p failures)
struct GroupBackendError : GroupError {
  explicit GroupBackendError(const std::string& msg) : GroupError(msg) {}
};

// An op could not complete because ranks failed (agreed through the control store).
// Python: mooncake_pg.RankFailureError (RankFencedError when `fenced`).
struct RankFailure : GroupBackendError {
  RankFailure(const std::string& msg, std::vector<int> failed, int64_t epoch, bool fenced = false)
      : GroupBackendError(msg), failed_ranks(std::move(failed)), epoch(epoch), fenced(fenced) {}
  std::vector<int> failed_ranks;
  int64_t epoch;
  bool fenced;  // this rank itself was declared failed (RankFencedError)
};

// An error that stands for another exception: `original`, which the torch layer raises in
// its place when this one leaves the core; what() is its message. An op that ends with one
// leaves the group usable. Raised by the torch layer's own code inside a job (a tensor op's
// c10 error in the sparse all_reduce) and by the control store.
struct ForeignError : GroupError {
  ForeignError(const std::string& msg, std::exception_ptr original)
      : GroupError(msg), original(std::move(original)) {}
  std::exception_ptr original;
};

// A call of the control store failed (ControlStore, core/control_store.hpp); `original` is
// the store's own exception (a TCPStore timeout stays a DistStoreError).
struct StoreError : ForeignError {
  using ForeignError::ForeignError;
};

// The connection to the control store is gone for good (a TCPStore client does not
// reconnect: every later call fails too).
struct StoreLost : StoreError {
  using StoreError::StoreError;
};

// The arguments streamed into one string (what TORCH_CHECK does with its message).
template <typename... A>
std::string cat(const A&... a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}

}  // namespace mooncake

// Checks of the core: the message is built only when the check fails.
#define MOONCAKE_CHECK(cond, ...)                                            \
  do {                                                                       \
    if (!(cond)) throw ::mooncake::GroupError(::mooncake::cat(__VA_ARGS__)); \
  } while (0)
#define MOONCAKE_CHECK_VALUE(cond, ...)                                           \
  do {                                                                            \
    if (!(cond)) throw ::mooncake::GroupValueError(::mooncake::cat(__VA_ARGS__)); \
  } while (0)
