// Scalar pieces of the TACO group math (spec §2) shared by the CPU kernels (scalar and AVX2) and
// the CPU FFI handlers: parameters, NaN-propagating max/min, the scale formulas, and the message
// dtypes (float32, bfloat16, float16) with their conversions to and from float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "taco_constants.h"
#include "taco_fp8.h"

#if defined(__x86_64__) || defined(_M_X64)
#define TACO_X86 1
#else
#define TACO_X86 0
#endif

namespace taco {

// jnp.maximum / jnp.minimum semantics: NaN in -> NaN out.
inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
inline float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }

// Message dtypes the kernels read (encode) and write (decode) as they are: no convert in XLA.
enum MsgDtype : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline int64_t DtypeBytes(int dt) { return dt == kF32 ? 4 : 2; }

// bfloat16 / float16 bits -> float32: exact (XLA's convert; vcvtph2ps for float16, NaN quieted).
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_f32(sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  if (e == 0) return bits_f32(sign | f32_bits(static_cast<float>(m) * 5.9604644775390625e-08f));  // m * 2^-24, exact
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// float32 -> bfloat16 bits, round to nearest even, as XLA's convert: subnormals kept, overflow to
// +-Inf, NaN -> the quiet NaN 0x7FC0 with its sign.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits, round to nearest even, as XLA's convert (vcvtps2ph): overflow to
// +-Inf, NaN -> sign | 0x7E00 | the top 10 bits of its payload.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, ab = u & 0x7FFFFFFFu;
  if (ab > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ab >> 13) & 0x3FFu));
  if (ab >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to Inf
  if (ab >= 0x38800000u) {  // normal float16 (>= 2^-14): rebias, round off 13 mantissa bits
    const uint32_t r = ab - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  const uint32_t e = ab >> 23;  // subnormal float16: ab = m * 2^(e - 150), code = round(m * 2^(e - 126))
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
  return static_cast<uint16_t>(sign | shift_rne((ab & 0x7FFFFFu) | 0x800000u, 126u - e));
}

// Largest finite value of a message dtype (float32: no clipping needed).
inline float DtypeMax(int dt) { return dt == kBF16 ? 3.38953139e38f : 65504.0f; }

// Decoded float32 -> message dtype: clipped to the dtype's finite range first when `clip` (NaN
// kept; `codec.dispatch.clip_to_dtype`), then rounded as XLA's convert.
inline uint16_t f32_to_narrow(float v, int dt, bool clip) {
  if (clip && v == v) v = std::min(std::max(v, -DtypeMax(dt)), DtypeMax(dt));
  return dt == kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

inline float narrow_to_f32(uint16_t h, int dt) { return dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h); }

struct EncodeParams {
  int fmt;
  int g;
  float lam, fmax, range;
  int64_t n_groups;    // groups per message (the last of each is partial)
  float last_count;    // real elements in a message's last group
  float sqrt_g;        // np.float32(sqrt(G)), as the reference divides by it
};

// Spec §2 steps 1-2: adaptive scale from the group's sum of squares (same ops as reference).
inline float adaptive_scale(float ss, float count, const EncodeParams& p) {
  const float m = ss / count;
  const float v = nan_max(m + p.lam, EPS);
  return nan_min(nan_max(p.fmax / std::sqrt(v), ADAPTIVE_SCALE_MIN), ADAPTIVE_SCALE_MAX);
}

// Spec §2 step 4 from M = max|WHT(a x)| (before the 1/sqrt(G)); returns s, and via k the
// factor 1/(sqrt(G) s) applied to the raw transform (codes = fp8(clamp(raw * k, -R, R))).
inline float quant_scale(float raw_absmax, const EncodeParams& p, float* k) {
  const float ymax = raw_absmax / p.sqrt_g;
  const float s = nan_min(nan_max(nan_max(ymax, EPS) / p.range, EPS), SCALE_MAX);
  *k = static_cast<float>(1.0 / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
  return s;
}

// The same for the fused order, from M = max|WHT(x)| of the raw group: y_max = a M / sqrt(G)
// and k = a / (sqrt(G) s) (in exact arithmetic WHT(a x) = a WHT(x); only rounding differs).
inline float fused_quant_scale(float raw_absmax, float a, const EncodeParams& p, float* k) {
  const float ymax = (raw_absmax * a) / p.sqrt_g;
  const float s = nan_min(nan_max(nan_max(ymax, EPS) / p.range, EPS), SCALE_MAX);
  *k = static_cast<float>(static_cast<double>(a) / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
  return s;
}

// Decode factor: 1 / (sqrt(G) * max(a, eps)) (or 1/sqrt(G) for the folded layout).
inline float decode_factor(float sqrt_g, const float* a, int64_t i) {
  double d = sqrt_g;
  if (a != nullptr) d *= static_cast<double>(nan_max(a[i], EPS));
  return static_cast<float>(1.0 / d);
}

}  // namespace taco
