// The element types the group core moves and reduces, with their sizes and names. The
// core's own enum (the torch layer maps torch dtypes onto it in pg/convert.cpp); the
// names are the ones torch prints, so that messages read the same from either side.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mooncake {

// Same order as the CUDA kernels' cuda::DType (transport/cuda/cuda.hpp).
enum class DType : int32_t {
  F64 = 0,
  F32,
  F16,
  BF16,
  F8E4M3,  // float8_e4m3fn
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
constexpr int kNumDTypes = static_cast<int>(DType::C128) + 1;

inline size_t element_size(DType dt) {
  switch (dt) {
    case DType::F64:
    case DType::I64:
    case DType::U64:
    case DType::C64:
      return 8;
    case DType::F32:
    case DType::I32:
    case DType::U32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
    case DType::U16:
      return 2;
    case DType::F8E4M3:
    case DType::F8E5M2:
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
    case DType::C128:
      return 16;
  }
  return 1;
}

inline bool is_floating(DType dt) { return dt <= DType::F8E5M2; }
inline bool is_complex(DType dt) { return dt == DType::C64 || dt == DType::C128; }

// torch's name of the dtype ("Float", "BFloat16", "ComplexDouble", ...)
inline const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F64:
      return "Double";
    case DType::F32:
      return "Float";
    case DType::F16:
      return "Half";
    case DType::BF16:
      return "BFloat16";
    case DType::F8E4M3:
      return "Float8_e4m3fn";
    case DType::F8E5M2:
      return "Float8_e5m2";
    case DType::I8:
      return "Char";
    case DType::I16:
      return "Short";
    case DType::I32:
      return "Int";
    case DType::I64:
      return "Long";
    case DType::U8:
      return "Byte";
    case DType::U16:
      return "UInt16";
    case DType::U32:
      return "UInt32";
    case DType::U64:
      return "UInt64";
    case DType::BOOL:
      return "Bool";
    case DType::C64:
      return "ComplexFloat";
    case DType::C128:
      return "ComplexDouble";
  }
  return "UNKNOWN_SCALAR";
}

// A buffer of `count` elements of `dtype` (contiguous).
struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::F32;
  size_t bytes() const { return count * element_size(dtype); }
  uint8_t* bytes_ptr() const { return static_cast<uint8_t*>(data); }
};

}  // namespace mooncake
