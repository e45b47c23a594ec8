// Element-wise reductions (core/reduce.hpp). 16-bit and 8-bit floats and complex numbers go
// through core/numeric.hpp's storage types, which round as torch's do.
#include "core/reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "core/numeric.hpp"

namespace mooncake {

const char* red_op_name(RedOp op) {
  switch (op) {
    case RedOp::SUM:
      return "SUM";
    case RedOp::AVG:
      return "AVG";
    case RedOp::PRODUCT:
      return "PRODUCT";
    case RedOp::MIN:
      return "MIN";
    case RedOp::MAX:
      return "MAX";
    case RedOp::BAND:
      return "BAND";
    case RedOp::BOR:
      return "BOR";
    case RedOp::BXOR:
      return "BXOR";
    case RedOp::PREMUL_SUM:
      return "PREMUL_SUM";
  }
  return "?";
}

std::string check_reduce_supported(DType dt, RedOp op) {
  if (is_complex(dt)) {
    if (op == RedOp::SUM || op == RedOp::AVG || op == RedOp::PREMUL_SUM) return "";
    return std::string("ReduceOp ") + red_op_name(op) +
           " is not defined for complex tensors (only SUM and AVG)";
  }
  if (dt == DType::BOOL) {
    if (op == RedOp::AVG || op == RedOp::PREMUL_SUM)
      return std::string("ReduceOp ") + red_op_name(op) + " is not defined for bool tensors";
    return "";
  }
  if (is_floating(dt)) {
    if (op == RedOp::BAND || op == RedOp::BOR || op == RedOp::BXOR)
      return std::string("bitwise ReduceOp ") + red_op_name(op) +
             " is not defined for floating-point tensors";
    return "";
  }
  // integers
  if (op == RedOp::PREMUL_SUM) return "PREMUL_SUM is only defined for floating-point tensors";
  return "";
}

namespace {
constexpr size_t kBlock = 512;

template <typename T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<num::Half> {
  using type = float;
};
template <>
struct AccOf<num::BFloat16> {
  using type = float;
};
template <>
struct AccOf<num::Float8_e4m3fn> {
  using type = float;
};
template <>
struct AccOf<num::Float8_e5m2> {
  using type = float;
};
template <>
struct AccOf<num::Complex<float>> {
  using type = num::Complex<float>;
};
template <>
struct AccOf<num::Complex<double>> {
  using type = num::Complex<double>;
};

template <typename A, typename F>
inline void apply(A* acc, const A* x, size_t m, F f) {
  for (size_t i = 0; i < m; ++i) acc[i] = f(acc[i], x[i]);
}

template <typename T, typename F>
void reduce_typed(T* dst, const T* const* srcs, int ns, size_t n, F f, bool avg, T* dst2, int div) {
  using A = typename AccOf<T>::type;
  if constexpr (std::is_same_v<A, T>) {
    if (!avg) {
      // Native accumulation: dst = s0 op s1, then dst = dst op s_j (vectorizes).
      for (size_t b = 0; b < n; b += kBlock) {
        size_t m = std::min(kBlock, n - b);
        T acc[kBlock];
        const T* s0 = srcs[0] + b;
        for (size_t i = 0; i < m; ++i) acc[i] = s0[i];
        for (int j = 1; j < ns; ++j) apply(acc, srcs[j] + b, m, f);
        T* d = dst + b;
        for (size_t i = 0; i < m; ++i) d[i] = acc[i];
        if (dst2) {
          T* d2 = dst2 + b;
          for (size_t i = 0; i < m; ++i) d2[i] = acc[i];
        }
      }
      return;
    }
  }
  for (size_t b = 0; b < n; b += kBlock) {
    size_t m = std::min(kBlock, n - b);
    A acc[kBlock];
    A tmp[kBlock];
    const T* s0 = srcs[0] + b;
    for (size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    for (int j = 1; j < ns; ++j) {
      const T* sj = srcs[j] + b;
      for (size_t i = 0; i < m; ++i) tmp[i] = static_cast<A>(sj[i]);
      apply(acc, tmp, m, f);
    }
    if (avg) {
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / static_cast<A>(div);
    }
    T* d = dst + b;
    for (size_t i = 0; i < m; ++i) d[i] = static_cast<T>(acc[i]);
    if (dst2) {
      T* d2 = dst2 + b;
      for (size_t i = 0; i < m; ++i) d2[i] = d[i];
    }
  }
}

template <typename T>
void reduce_arith(void* dst, const void* const* srcs, int ns, size_t n, RedOp op, void* dst2v, int div) {
  using A = typename AccOf<T>::type;
  T* d2 = static_cast<T*>(dst2v);
  T* d = static_cast<T*>(dst);
  const T* const* s = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case RedOp::SUM:
    case RedOp::PREMUL_SUM:
      return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return a + b; }, false, d2, div);
    case RedOp::AVG:
      return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return a + b; }, true, d2, div);
    default:
      break;
  }
  if constexpr (!std::is_same_v<A, num::Complex<float>> && !std::is_same_v<A, num::Complex<double>>) {
    switch (op) {
      case RedOp::PRODUCT:
        return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return a * b; }, false, d2, div);
      // floating point: a NaN wins (torch.minimum / torch.maximum propagate it); a != a
      // is false for every integer, so the same code serves both
      case RedOp::MIN:
        return reduce_typed<T>(
            d, s, ns, n, [](A a, A b) { return (b < a || b != b) && a == a ? b : a; }, false, d2, div);
      case RedOp::MAX:
        return reduce_typed<T>(
            d, s, ns, n, [](A a, A b) { return (b > a || b != b) && a == a ? b : a; }, false, d2, div);
      default:
        break;
    }
    if constexpr (std::is_integral_v<A>) {
      switch (op) {
        case RedOp::BAND:
          return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return A(a & b); }, false, d2, div);
        case RedOp::BOR:
          return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return A(a | b); }, false, d2, div);
        case RedOp::BXOR:
          return reduce_typed<T>(d, s, ns, n, [](A a, A b) { return A(a ^ b); }, false, d2, div);
        default:
          break;
      }
    }
  }
  throw std::invalid_argument(std::string("reduce: ReduceOp ") + red_op_name(op) +
                              " not supported for this dtype");
}

void reduce_bool(void* dst, const void* const* srcs, int ns, size_t n, RedOp op, void* dst2) {
  // bool tensors hold 0/1 bytes; normalise so no value wraps past 255 contributors.
  uint8_t* d = static_cast<uint8_t*>(dst);
  const uint8_t* const* s = reinterpret_cast<const uint8_t* const*>(srcs);
  bool is_and = (op == RedOp::PRODUCT || op == RedOp::MIN || op == RedOp::BAND);
  bool is_xor = (op == RedOp::BXOR);
  for (size_t i = 0; i < n; ++i) {
    uint8_t a = s[0][i] != 0;
    for (int j = 1; j < ns; ++j) {
      uint8_t b = s[j][i] != 0;
      a = is_and ? (a & b) : is_xor ? (a ^ b) : (a | b);
    }
    d[i] = a;
    if (dst2) static_cast<uint8_t*>(dst2)[i] = a;
  }
}
}  // namespace

void reduce_buffers(void* dst, const void* const* srcs, int ns, size_t n, DType dt, RedOp op, void* dst2,
                    int avg_div) {
  const int div = avg_div > 0 ? avg_div : ns;
  switch (dt) {
    case DType::F64:
      return reduce_arith<double>(dst, srcs, ns, n, op, dst2, div);
    case DType::F32:
      return reduce_arith<float>(dst, srcs, ns, n, op, dst2, div);
    case DType::F16:
      return reduce_arith<num::Half>(dst, srcs, ns, n, op, dst2, div);
    case DType::BF16:
      return reduce_arith<num::BFloat16>(dst, srcs, ns, n, op, dst2, div);
    case DType::F8E4M3:
      return reduce_arith<num::Float8_e4m3fn>(dst, srcs, ns, n, op, dst2, div);
    case DType::F8E5M2:
      return reduce_arith<num::Float8_e5m2>(dst, srcs, ns, n, op, dst2, div);
    case DType::I8:
      return reduce_arith<int8_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::I16:
      return reduce_arith<int16_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::I32:
      return reduce_arith<int32_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::I64:
      return reduce_arith<int64_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::U8:
      return reduce_arith<uint8_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::U16:
      return reduce_arith<uint16_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::U32:
      return reduce_arith<uint32_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::U64:
      return reduce_arith<uint64_t>(dst, srcs, ns, n, op, dst2, div);
    case DType::C64:
      return reduce_arith<num::Complex<float>>(dst, srcs, ns, n, op, dst2, div);
    case DType::C128:
      return reduce_arith<num::Complex<double>>(dst, srcs, ns, n, op, dst2, div);
    case DType::BOOL:
      return reduce_bool(dst, srcs, ns, n, op, dst2);
    default:
      throw std::invalid_argument(std::string("reduce: unsupported dtype ") + dtype_name(dt));
  }
}

namespace {
template <typename T>
void scale_typed(void* dst, const void* src, size_t n, double f) {
  using A = typename AccOf<T>::type;
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  if constexpr (std::is_same_v<A, num::Complex<float>> || std::is_same_v<A, num::Complex<double>>) {
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(s[i] * static_cast<typename A::value_type>(f));
  } else {
    A af = static_cast<A>(f);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<A>(s[i]) * af);
  }
}
}  // namespace

void scale_copy(void* dst, const void* src, size_t n, DType dt, double f) {
  switch (dt) {
    case DType::F64:
      return scale_typed<double>(dst, src, n, f);
    case DType::F32:
      return scale_typed<float>(dst, src, n, f);
    case DType::F16:
      return scale_typed<num::Half>(dst, src, n, f);
    case DType::BF16:
      return scale_typed<num::BFloat16>(dst, src, n, f);
    case DType::F8E4M3:
      return scale_typed<num::Float8_e4m3fn>(dst, src, n, f);
    case DType::F8E5M2:
      return scale_typed<num::Float8_e5m2>(dst, src, n, f);
    case DType::C64:
      return scale_typed<num::Complex<float>>(dst, src, n, f);
    case DType::C128:
      return scale_typed<num::Complex<double>>(dst, src, n, f);
    default:
      throw std::invalid_argument(std::string("PREMUL_SUM: unsupported dtype ") + dtype_name(dt));
  }
}

}  // namespace mooncake
