// Scalar pieces of the TACO group math (spec §2) shared by the CPU kernels (scalar and AVX2) and
// the CPU FFI handlers: parameters, NaN-propagating max/min, and the scale formulas.
#pragma once

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
