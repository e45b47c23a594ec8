// Storage types of the 16-bit and 8-bit floats and of the complex numbers the core reduces,
// with their conversions to and from float. Each conversion rounds exactly as torch's own
// (c10::Half, c10::BFloat16, c10::Float8_e4m3fn, c10::Float8_e5m2 on a CPU without F16C:
// round to nearest even, the same NaN and overflow results) and complex AVG divides as
// c10::complex does, so a reduction gives the bits it gives with torch's types. Written here
// because the core includes no torch header.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mooncake::num {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE half <-> float, without F16C (the FP16 library's branch-free method: the exponent
// is rebiased by a float multiply, so Inf/NaN and subnormals come out right).
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float exp_scale = float_of(15u << 23);  // 2**-112
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * exp_scale;
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized));
  return float_of(result);
}

inline uint16_t float_to_half(float f) {
  const float scale_to_inf = float_of(239u << 23);  // 2**112
  const float scale_to_zero = float_of(17u << 23);  // 2**-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// bfloat16: the upper half of a float; rounding to nearest even, NaN to the quiet 0x7FC0.
// Written without a branch on the value so that loops over it vectorize.
inline float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// float8_e4m3fn: no infinities; NaN is 0x7F; out of range (and Inf) saturates to 0x7E.
inline float e4m3fn_to_float(uint8_t v) {
  const uint32_t w = static_cast<uint32_t>(v) << 24;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t nonsign = w & 0x7FFFFFFFu;
  uint32_t renorm_shift = nonsign != 0 ? static_cast<uint32_t>(__builtin_clz(nonsign)) : 32u;
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask = (static_cast<int32_t>(nonsign + 0x01000000u) >> 8) & 0x7F800000;
  const int32_t zero_mask = static_cast<int32_t>(nonsign - 1) >> 31;
  const uint32_t result =
      sign | ((((nonsign << renorm_shift >> 4) + ((0x78u - renorm_shift) << 23)) | inf_nan_mask) &
              ~static_cast<uint32_t>(zero_mask));
  return float_of(result);
}

inline uint8_t float_to_e4m3fn(float f) {
  const uint32_t fp8_max = 1087u << 20;
  const uint32_t denorm_mask = 141u << 23;
  uint32_t f_bits = bits_of(f);
  uint8_t result = 0;
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  if (f_bits >= fp8_max) {
    result = f_bits > 0x7F800000u ? 0x7F : 0x7E;
  } else if (f_bits < (121u << 23)) {  // below 2**-6, the smallest normal: subnormal result
    f_bits = bits_of(float_of(f_bits) + float_of(denorm_mask));
    result = static_cast<uint8_t>(f_bits - denorm_mask);
  } else {
    const uint8_t mant_odd = (f_bits >> 20) & 1;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 20);
    if (result == 0x7F) result = 0x7E;  // rounding carried into the NaN pattern
  }
  return static_cast<uint8_t>(result | static_cast<uint8_t>(sign >> 24));
}

// float8_e5m2: the upper byte of a half.
inline float e5m2_to_float(uint8_t v) { return half_to_float(static_cast<uint16_t>(v << 8)); }

inline uint8_t float_to_e5m2(float f) {
  const uint32_t fp32_inf = 255u << 23;
  const uint32_t fp8_max = 143u << 23;
  const uint32_t denorm_mask = 134u << 23;
  uint32_t f_bits = bits_of(f);
  uint8_t result = 0;
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  if (f_bits >= fp8_max) {
    result = f_bits > fp32_inf ? 0x7F : 0x7C;
  } else if (f_bits < (113u << 23)) {  // below 2**-14, the smallest normal: subnormal result
    f_bits = bits_of(float_of(f_bits) + float_of(denorm_mask));
    result = static_cast<uint8_t>(f_bits - denorm_mask);
  } else {
    const uint32_t mant_odd = (f_bits >> 21) & 1;
    f_bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu;
    f_bits += mant_odd;
    result = static_cast<uint8_t>(f_bits >> 21);
  }
  return static_cast<uint8_t>(result | static_cast<uint8_t>(sign >> 24));
}

// Storage types: the bits, converted through float for arithmetic (implicitly, as torch's
// own types, which the reduction templates are written for).
struct Half {
  uint16_t x;
  Half() = default;
  Half(float f) : x(float_to_half(f)) {}
  operator float() const { return half_to_float(x); }
};
struct BFloat16 {
  uint16_t x;
  BFloat16() = default;
  BFloat16(float f) : x(float_to_bf16(f)) {}
  operator float() const { return bf16_to_float(x); }
};
struct Float8_e4m3fn {
  uint8_t x;
  Float8_e4m3fn() = default;
  Float8_e4m3fn(float f) : x(float_to_e4m3fn(f)) {}
  operator float() const { return e4m3fn_to_float(x); }
};
struct Float8_e5m2 {
  uint8_t x;
  Float8_e5m2() = default;
  Float8_e5m2(float f) : x(float_to_e5m2(f)) {}
  operator float() const { return e5m2_to_float(x); }
};
static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2 && sizeof(Float8_e4m3fn) == 1 &&
                  sizeof(Float8_e5m2) == 1,
              "storage types are their bits");

// complex<float>/complex<double> with the operations a SUM/AVG reduction and PREMUL_SUM's
// scaling use; the layout of std::complex and c10::complex (real, imaginary).
template <typename T>
struct Complex {
  using value_type = T;
  T re, im;
  Complex() = default;
  Complex(T r, T i = T(0)) : re(r), im(i) {}
  friend Complex operator+(Complex a, Complex b) { return {a.re + b.re, a.im + b.im}; }
  friend Complex operator*(Complex a, T s) { return {a.re * s, a.im * s}; }
  // numpy's complex division (c10::complex's: Smith's method with its scaling)
  friend Complex operator/(Complex a, Complex b) {
    const T c = b.re, d = b.im;
    const T abs_c = std::abs(c), abs_d = std::abs(d);
    if (abs_c >= abs_d) {
      if (abs_c == T(0) && abs_d == T(0)) return {a.re / abs_c, a.im / abs_d};
      const T rat = d / c;
      const T scl = T(1.0) / (c + d * rat);
      return {(a.re + a.im * rat) * scl, (a.im - a.re * rat) * scl};
    }
    const T rat = c / d;
    const T scl = T(1.0) / (d + c * rat);
    return {(a.re * rat + a.im) * scl, (a.im * rat - a.re) * scl};
  }
};
static_assert(sizeof(Complex<float>) == 8 && sizeof(Complex<double>) == 16, "complex layout");

}  // namespace mooncake::num
