// Scalar FP8 <-> float32 conversions, bit-exact with ml_dtypes (float8_e4m3fn, float8_e5m2).
//
// float -> fp8 is round-to-nearest-even on the bits (integer arithmetic only, so the result
// does not depend on the FPU's rounding mode or on flush-to-zero / denormals-are-zero).
// Out-of-range values behave as ml_dtypes does (not saturating): E4M3FN overflows to NaN
// (0x7F | sign; the format has no infinity), E5M2 to +-Inf. The TACO codec clamps to +-R <= F
// before converting, which is the spec's saturation. NaN keeps its sign and becomes the
// canonical quiet NaN (0x7F / 0x7E | sign).
//
// Shared by taco_codec_cpu.cc and taco_codec_cuda.cu (TACO_HD marks host+device functions).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TACO_HD __host__ __device__ __forceinline__
#else
#define TACO_HD inline
#endif

namespace taco {

enum Fp8Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

TACO_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

TACO_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Shifts a right by `sh` bits (sh >= 1) rounding to nearest, ties to even.
TACO_HD uint32_t shift_rne(uint32_t m, uint32_t sh) {
  if (sh >= 32) return 0;  // m < 2^24 here, so the value is < 0.5
  uint32_t r = m >> sh;
  uint32_t rem = m & ((1u << sh) - 1u);
  uint32_t half = 1u << (sh - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return r;
}

// float -> FP8 with `mbits` mantissa bits and exponent bias `bias`: magnitude code (no sign),
// where the code may exceed the largest finite one on overflow (caller maps it).
TACO_HD uint32_t f32_to_fp8_mag(uint32_t ab, int mbits, int bias) {
  const int e = static_cast<int>(ab >> 23);  // biased f32 exponent (ab finite here)
  const int min_normal_e = 127 - bias + 1;   // f32 exponent of the FP8's smallest normal
  if (e >= min_normal_e) {
    // Normal in FP8: round the mantissa to mbits, rebias. A carry bumps the exponent.
    const uint32_t sh = 23u - static_cast<uint32_t>(mbits);
    const uint32_t r = shift_rne(ab, sh);  // exponent+mantissa, rounded
    return r - (static_cast<uint32_t>(127 - bias) << mbits);
  }
  // Subnormal (or zero) in FP8: value / 2^(1 - bias - mbits), rounded to an integer.
  // value = m * 2^(e - 150) with m the 24-bit significand (implicit bit only if e > 0).
  const uint32_t m = (ab & 0x7FFFFFu) | (e > 0 ? 0x800000u : 0u);
  const int ee = e > 0 ? e : 1;
  // code = m * 2^(ee - 150 - (1 - bias - mbits)) = m >> (150 + 1 - bias - mbits - ee)
  const int sh = 151 - bias - mbits - ee;  // >= 1 for these exponents
  return shift_rne(m, static_cast<uint32_t>(sh));
}

TACO_HD uint8_t f32_to_e4m3(float f) {
  const uint32_t b = f32_bits(f);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t ab = b & 0x7FFFFFFFu;
  if (ab > 0x43E80000u) return static_cast<uint8_t>(sign | 0x7Fu);  // > 464 (or Inf/NaN) -> NaN
  return static_cast<uint8_t>(sign | f32_to_fp8_mag(ab, 3, 7));
}

TACO_HD uint8_t f32_to_e5m2(float f) {
  const uint32_t b = f32_bits(f);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t ab = b & 0x7FFFFFFFu;
  if (ab > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Eu);   // NaN
  if (ab >= 0x47700000u) return static_cast<uint8_t>(sign | 0x7Cu);  // >= 61440 (or Inf) -> Inf
  return static_cast<uint8_t>(sign | f32_to_fp8_mag(ab, 2, 15));
}

TACO_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7Fu;
  if (em == 0x7Fu) return bits_f32(sign | 0x7FC00000u);
  if (em < 8u) return bits_f32(sign | f32_bits(static_cast<float>(em) * 0.001953125f));  // *2^-9
  return bits_f32(sign | ((em << 20) + (120u << 23)));
}

TACO_HD float e5m2_to_f32(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7Fu;
  if (em > 0x7Cu) return bits_f32(sign | 0x7FC00000u);
  if (em == 0x7Cu) return bits_f32(sign | 0x7F800000u);
  if (em < 4u) return bits_f32(sign | f32_bits(static_cast<float>(em) * 1.52587890625e-05f));  // *2^-16
  return bits_f32(sign | ((em << 21) + (112u << 23)));
}

TACO_HD uint8_t f32_to_fp8(float f, int fmt) { return fmt == kE4M3 ? f32_to_e4m3(f) : f32_to_e5m2(f); }
TACO_HD float fp8_to_f32(uint8_t c, int fmt) { return fmt == kE4M3 ? e4m3_to_f32(c) : e5m2_to_f32(c); }

// Canonical positive NaN code written for a group holding NaN/Inf (its scale is NaN anyway).
TACO_HD uint8_t fp8_nan(int fmt) { return fmt == kE4M3 ? 0x7Fu : 0x7Eu; }

}  // namespace taco
