// The torch layer's mapping onto the group core's types (pg/convert.hpp).
#include "pg/convert.hpp"

#include <torch/version.h>

namespace mooncake {

namespace {
using ST = c10::ScalarType;
// DType -> ScalarType, in DType's order
constexpr ST kScalarTypeOf[kNumDTypes] = {
    ST::Double, ST::Float,  ST::Half, ST::BFloat16,     ST::Float8_e4m3fn, ST::Float8_e5m2,
    ST::Char,   ST::Short,  ST::Int,  ST::Long,         ST::Byte,          ST::UInt16,
    ST::UInt32, ST::UInt64, ST::Bool, ST::ComplexFloat, ST::ComplexDouble,
};
}  // namespace

std::optional<DType> to_dtype(c10::ScalarType st) {
  for (int i = 0; i < kNumDTypes; ++i)
    if (kScalarTypeOf[i] == st) return static_cast<DType>(i);
  return std::nullopt;
}

c10::ScalarType to_scalar_type(DType dt) { return kScalarTypeOf[static_cast<int>(dt)]; }

std::string scalar_type_name(int32_t code) { return c10::toString(static_cast<c10::ScalarType>(code)); }

std::string check_reduce_supported(c10::ScalarType st, RedOp op) {
  const std::optional<DType> dt = to_dtype(st);
  if (dt) return check_reduce_supported(*dt, op);
  return std::string(c10::isComplexType(st) ? "unsupported complex dtype " : "unsupported dtype ") +
         c10::toString(st);
}

RedOp to_redop(const c10d::ReduceOp& op, double* premul) {
  *premul = 1.0;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return RedOp::SUM;
    case c10d::ReduceOp::AVG:
      return RedOp::AVG;
    case c10d::ReduceOp::PRODUCT:
      return RedOp::PRODUCT;
    case c10d::ReduceOp::MIN:
      return RedOp::MIN;
    case c10d::ReduceOp::MAX:
      return RedOp::MAX;
    case c10d::ReduceOp::BAND:
      return RedOp::BAND;
    case c10d::ReduceOp::BOR:
      return RedOp::BOR;
    case c10d::ReduceOp::BXOR:
      return RedOp::BXOR;
    case c10d::ReduceOp::PREMUL_SUM: {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
      auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
#else  // torch <= 2.11 names it NCCLPreMulSumSupplement
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
#endif
      TORCH_CHECK_VALUE(sup != nullptr, "MooncakeBackend::to_redop: PREMUL_SUM without a factor");
      *premul = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      return RedOp::PREMUL_SUM;
    }
    default:
      TORCH_CHECK_VALUE(false, "MooncakeBackend::to_redop: unsupported ReduceOp ", static_cast<int>(op.op_));
  }
}

std::exception_ptr to_torch_error(std::exception_ptr e) {
  if (!e) return e;
  const c10::SourceLocation here{__func__, __FILE__, __LINE__};
  try {
    std::rethrow_exception(e);
  } catch (const ForeignError& f) {
    return f.original ? f.original : std::make_exception_ptr(c10::Error(here, f.what()));
  } catch (const RankFailure& f) {
    return std::make_exception_ptr(RankFailureError(f.what(), f.failed_ranks, f.epoch, f.fenced));
  } catch (const GroupBackendError& g) {
    return std::make_exception_ptr(c10::DistBackendError(here, g.what()));
  } catch (const GroupValueError& g) {
    return std::make_exception_ptr(c10::ValueError(here, g.what()));
  } catch (const GroupError& g) {
    return std::make_exception_ptr(c10::Error(here, g.what()));
  } catch (...) {
    return e;
  }
}

namespace {

class C10dControlStore : public ControlStore {
 public:
  explicit C10dControlStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::string& value) override {
    call([&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::string get(const std::string& key) override {
    std::string out;
    call([&] {
      auto v = store_->get(key);
      out.assign(v.begin(), v.end());
    });
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    call([&] { out = store_->add(key, delta); });
    return out;
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    std::string out;
    call([&] { out = store_->compareSet(key, expected, desired); });
    return out;
  }
  bool check(const std::vector<std::string>& keys) override {
    bool out = false;
    call([&] { out = store_->check(keys); });
    return out;
  }
  void wait(const std::vector<std::string>& keys) override {
    call([&] { store_->wait(keys); });
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    call([&] { store_->wait(keys, timeout); });
  }
  std::chrono::milliseconds timeout() const override { return store_->getTimeout(); }
  std::shared_ptr<ControlStore> clone() override {
    c10::intrusive_ptr<c10d::Store> c;
    call([&] { c = store_->clone(); });
    return std::make_shared<C10dControlStore>(std::move(c));
  }

 private:
  template <class F>
  static void call(F&& f) {
    try {
      f();
    } catch (const c10::DistNetworkError& e) {
      throw StoreLost(e.what_without_backtrace(), std::current_exception());
    } catch (const c10::Error& e) {
      throw StoreError(e.what_without_backtrace(), std::current_exception());
    }
  }
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace

std::shared_ptr<ControlStore> control_store(const c10::intrusive_ptr<c10d::Store>& store) {
  return std::make_shared<C10dControlStore>(store);
}

}  // namespace mooncake
