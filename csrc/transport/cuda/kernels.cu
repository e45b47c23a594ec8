// Element-wise reductions and scaling in CUDA kernels (see cuda.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "transport/cuda/cuda.hpp"

namespace mooncake {
namespace cuda {
namespace {

struct Sources {
  const void* p[kMaxSources];
};

// Accumulation type and conversions per element type.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<__half> {
  using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
};
template <>
struct Acc<__nv_fp8_e4m3> {
  using type = float;
};
template <>
struct Acc<__nv_fp8_e5m2> {
  using type = float;
};

template <typename T>
__device__ __forceinline__ typename Acc<T>::type load(const void* p, size_t i) {
  return static_cast<typename Acc<T>::type>(static_cast<const T*>(p)[i]);
}
template <>
__device__ __forceinline__ float load<__half>(const void* p, size_t i) {
  return __half2float(static_cast<const __half*>(p)[i]);
}
template <>
__device__ __forceinline__ float load<__nv_bfloat16>(const void* p, size_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
template <>
__device__ __forceinline__ float load<__nv_fp8_e4m3>(const void* p, size_t i) {
  return static_cast<float>(static_cast<const __nv_fp8_e4m3*>(p)[i]);
}
template <>
__device__ __forceinline__ float load<__nv_fp8_e5m2>(const void* p, size_t i) {
  return static_cast<float>(static_cast<const __nv_fp8_e5m2*>(p)[i]);
}
template <typename T, typename A>
__device__ __forceinline__ void store(void* p, size_t i, A v) {
  static_cast<T*>(p)[i] = static_cast<T>(v);
}
template <>
__device__ __forceinline__ void store<__half, float>(void* p, size_t i, float v) {
  static_cast<__half*>(p)[i] = __float2half_rn(v);
}
template <>
__device__ __forceinline__ void store<__nv_bfloat16, float>(void* p, size_t i, float v) {
  static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store<__nv_fp8_e4m3, float>(void* p, size_t i, float v) {
  static_cast<__nv_fp8_e4m3*>(p)[i] = __nv_fp8_e4m3(v);
}
template <>
__device__ __forceinline__ void store<__nv_fp8_e5m2, float>(void* p, size_t i, float v) {
  static_cast<__nv_fp8_e5m2*>(p)[i] = __nv_fp8_e5m2(v);
}

template <typename A>
__device__ __forceinline__ A combine(A a, A b, Op op) {
  switch (op) {
    case Op::PRODUCT:
      return a * b;
    case Op::MIN:
      return b < a ? b : a;
    case Op::MAX:
      return a < b ? b : a;
    default:
      return a + b;  // SUM, AVG, PREMUL_SUM
  }
}
template <typename A>
__device__ __forceinline__ A combine_int(A a, A b, Op op) {
  switch (op) {
    case Op::BAND:
      return a & b;
    case Op::BOR:
      return a | b;
    case Op::BXOR:
      return a ^ b;
    default:
      return combine<A>(a, b, op);
  }
}

template <typename T, bool kInt>
__global__ void mooncake_reduce_kernel(void* dst, Sources s, int nsrc, size_t n, Op op) {
  using A = typename Acc<T>::type;
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    A acc = load<T>(s.p[0], i);
    for (int k = 1; k < nsrc; ++k) {
      if constexpr (kInt)
        acc = combine_int<A>(acc, load<T>(s.p[k], i), op);
      else
        acc = combine<A>(acc, load<T>(s.p[k], i), op);
    }
    if (op == Op::AVG) acc = acc / static_cast<A>(nsrc);
    store<T, A>(dst, i, acc);
  }
}

// bool: SUM/MAX = OR, PRODUCT/MIN = AND (bytes 0/1)
__global__ void mooncake_reduce_kernel_bool(void* dst, Sources s, int nsrc, size_t n, Op op) {
  const bool any = op == Op::SUM || op == Op::MAX || op == Op::BOR;
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    bool acc = static_cast<const uint8_t*>(s.p[0])[i] != 0;
    for (int k = 1; k < nsrc; ++k) {
      bool v = static_cast<const uint8_t*>(s.p[k])[i] != 0;
      if (op == Op::BXOR)
        acc = acc != v;
      else
        acc = any ? (acc || v) : (acc && v);
    }
    static_cast<uint8_t*>(dst)[i] = acc ? 1 : 0;
  }
}

template <typename T>
__global__ void mooncake_scale_kernel(void* dst, const void* src, size_t n, double factor) {
  using A = typename Acc<T>::type;
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store<T, A>(dst, i, static_cast<A>(load<T>(src, i) * static_cast<A>(factor)));
}

void grid_for(size_t n, unsigned* blocks, unsigned* threads) {
  *threads = 256;
  size_t b = (n + 255) / 256;
  *blocks = static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

void check_launch(const char* fn) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("mooncake::cuda::") + fn +
                             ": kernel launch failed: " + cudaGetErrorString(e));
}

const char* dtype_name(DType dt) {
  static const char* names[] = {"float64", "float32", "float16", "bfloat16",  "float8_e4m3fn", "float8_e5m2",
                                "int8",    "int16",   "int32",   "int64",     "uint8",         "uint16",
                                "uint32",  "uint64",  "bool",    "complex64", "complex128"};
  int i = static_cast<int>(dt);
  return i >= 0 && i < 17 ? names[i] : "?";
}

template <typename T, bool kInt>
void run(void* dst, const Sources& s, int nsrc, size_t n, Op op, cudaStream_t st) {
  unsigned b, t;
  grid_for(n, &b, &t);
  mooncake_reduce_kernel<T, kInt><<<b, t, 0, st>>>(dst, s, nsrc, n, op);
}

}  // namespace

void launch_reduce(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, Op op, void* stream) {
  if (nsrc < 1 || nsrc > kMaxSources)
    throw std::runtime_error("mooncake::cuda::launch_reduce: expected 1.." + std::to_string(kMaxSources) +
                             " sources, got " + std::to_string(nsrc));
  const bool bitwise = op == Op::BAND || op == Op::BOR || op == Op::BXOR;
  const bool is_float = dt <= DType::F8E5M2 || dt == DType::C64 || dt == DType::C128;
  const bool complex = dt == DType::C64 || dt == DType::C128;
  if ((is_float && bitwise) || (complex && !(op == Op::SUM || op == Op::AVG || op == Op::PREMUL_SUM)) ||
      (dt == DType::BOOL && (op == Op::AVG || op == Op::PREMUL_SUM)) ||
      (!is_float && dt != DType::BOOL && op == Op::PREMUL_SUM))
    throw std::runtime_error(std::string("mooncake::cuda::launch_reduce: ReduceOp ") +
                             std::to_string(int(op)) + " is not defined for " + dtype_name(dt));
  if (n == 0) return;
  Sources s{};
  for (int k = 0; k < nsrc; ++k) s.p[k] = srcs[k];
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dt) {
    case DType::F64:
      run<double, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::F32:
      run<float, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::F16:
      run<__half, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::BF16:
      run<__nv_bfloat16, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::F8E4M3:
      run<__nv_fp8_e4m3, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::F8E5M2:
      run<__nv_fp8_e5m2, false>(dst, s, nsrc, n, op, st);
      break;
    case DType::C64:
      run<float, false>(dst, s, nsrc, 2 * n, op, st);
      break;  // SUM/AVG per component
    case DType::C128:
      run<double, false>(dst, s, nsrc, 2 * n, op, st);
      break;
    case DType::I8:
      run<int8_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::I16:
      run<int16_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::I32:
      run<int32_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::I64:
      run<int64_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::U8:
      run<uint8_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::U16:
      run<uint16_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::U32:
      run<uint32_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::U64:
      run<uint64_t, true>(dst, s, nsrc, n, op, st);
      break;
    case DType::BOOL: {
      unsigned b, t;
      grid_for(n, &b, &t);
      mooncake_reduce_kernel_bool<<<b, t, 0, st>>>(dst, s, nsrc, n, op);
      break;
    }
    default:
      throw std::runtime_error("mooncake::cuda::launch_reduce: unknown dtype code " +
                               std::to_string(int(dt)));
  }
  check_launch("launch_reduce");
}

void launch_scale(void* dst, const void* src, size_t n, DType dt, double factor, void* stream) {
  if (n == 0) return;
  unsigned b, t;
  grid_for(n, &b, &t);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dt) {
    case DType::F64:
      mooncake_scale_kernel<double><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    case DType::F32:
      mooncake_scale_kernel<float><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    case DType::F16:
      mooncake_scale_kernel<__half><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    case DType::BF16:
      mooncake_scale_kernel<__nv_bfloat16><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    case DType::F8E4M3:
      mooncake_scale_kernel<__nv_fp8_e4m3><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    case DType::F8E5M2:
      mooncake_scale_kernel<__nv_fp8_e5m2><<<b, t, 0, st>>>(dst, src, n, factor);
      break;
    default:
      throw std::runtime_error(
          std::string("mooncake::cuda::launch_scale: expected a floating-point dtype, got ") +
          dtype_name(dt));
  }
  check_launch("launch_scale");
}

}  // namespace cuda
}  // namespace mooncake
