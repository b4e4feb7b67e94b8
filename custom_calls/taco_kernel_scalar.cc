// Portable scalar CPU kernels of the TACO group codec (see taco_kernel_scalar.h).

#include "taco_kernel_scalar.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace taco {
namespace {

// Sum of 8 lane accumulators in the order of the AVX2 8x8 `hadd` tree (hsum8x8 below).
inline float hsum8(const float* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

inline void wht_scalar(float* y, int g) {
  for (int h = 1; h < g; h <<= 1) {
    for (int i0 = 0; i0 < g; i0 += 2 * h) {
      for (int i = i0; i < i0 + h; ++i) {
        const float u = y[i], w = y[i + h];
        y[i] = u + w;
        y[i + h] = u - w;
      }
    }
  }
}

}  // namespace

void encode_group_exact(const float* x, uint8_t* q, float* s_out, float a, const EncodeParams& p) {
  const int g = p.g;
  float y[MAX_GROUP_SIZE];
  float m = 0.0f;
  for (int i = 0; i < g; ++i) y[i] = a * x[i];
  wht_scalar(y, g);
  for (int i = 0; i < g; ++i) m = std::max(m, std::fabs(y[i]));
  float k;
  *s_out = quant_scale(m, p, &k);
  for (int i = 0; i < g; ++i) q[i] = f32_to_fp8(std::min(std::max(y[i] * k, -p.range), p.range), p.fmt);
}

// One group, in the AVX2 kernel's order: sum of squares in 8 lanes; raw = WHT(x); the adaptive
// scale a folded into the quantization (s from a * max|raw|, codes = fp8(raw * a / (sqrt(G) s))).
void encode_group_scalar(const float* x, uint8_t* q, float* s_out, float* a_out, float count,
                         const EncodeParams& p) {
  const int g = p.g;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  bool finite = true;
  if (g == 128) {  // the G = 128 kernel's order: fused squares of each half, then the halves added
    float acc2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 64; i += 8) {
      for (int l = 0; l < 8; ++l) {
        const float u = x[i + l], w = x[64 + i + l];
        acc[l] = std::fma(u, u, acc[l]);
        acc2[l] = std::fma(w, w, acc2[l]);
        finite &= std::isfinite(u) && std::isfinite(w);
      }
    }
    for (int l = 0; l < 8; ++l) acc[l] = acc[l] + acc2[l];
  } else {
    for (int i = 0; i < g; i += 8) {
      for (int l = 0; l < 8; ++l) {
        const float v = x[i + l];
        acc[l] = acc[l] + v * v;
        finite &= std::isfinite(v);
      }
    }
  }
  const float ss = hsum8(acc);
  const float a = adaptive_scale(ss, count, p);
  *a_out = a;
  if (!finite) {
    *s_out = std::nanf("");
    std::memset(q, fp8_nan(p.fmt), g);
    return;
  }
  if (!std::isfinite(ss)) return encode_group_exact(x, q, s_out, a, p);
  float y[MAX_GROUP_SIZE];
  float m = 0.0f;
  if (g == 128) {  // the G = 128 kernel's butterfly order: stride 64 first, then each half
    for (int i = 0; i < 64; ++i) {
      y[i] = x[i] + x[i + 64];
      y[i + 64] = x[i] - x[i + 64];
    }
    wht_scalar(y, 64);
    wht_scalar(y + 64, 64);
  } else {
    for (int i = 0; i < g; ++i) y[i] = x[i];
    wht_scalar(y, g);
  }
  for (int i = 0; i < g; ++i) m = std::max(m, std::fabs(y[i]));
  float k;
  *s_out = fused_quant_scale(m, a, p, &k);
  for (int i = 0; i < g; ++i) {
    const float v = std::min(std::max(y[i] * k, -p.range), p.range);
    q[i] = f32_to_fp8(v, p.fmt);
  }
}

namespace {

struct Fp8Table {
  float v[2][256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      v[kE4M3][c] = e4m3_to_f32(static_cast<uint8_t>(c));
      v[kE5M2][c] = e5m2_to_f32(static_cast<uint8_t>(c));
    }
  }
};
const Fp8Table kFp8Table;

}  // namespace

void decode_group_scalar(const uint8_t* q, float s, float k, int g, int fmt, float* out) {
  const float* lut = kFp8Table.v[fmt];
  float y[MAX_GROUP_SIZE];
  for (int i = 0; i < g; ++i) y[i] = lut[q[i]] * s;
  wht_scalar(y, g);
  for (int i = 0; i < g; ++i) out[i] = y[i] * k;
}

void encode_group_scalar_dt(const void* x, int dt, uint8_t* q, float* s_out, float* a_out, float count,
                            const EncodeParams& p) {
  if (dt == kF32) return encode_group_scalar(static_cast<const float*>(x), q, s_out, a_out, count, p);
  const uint16_t* h = static_cast<const uint16_t*>(x);
  float xf[MAX_GROUP_SIZE];
  for (int i = 0; i < p.g; ++i) xf[i] = narrow_to_f32(h[i], dt);
  encode_group_scalar(xf, q, s_out, a_out, count, p);
}

void decode_group_scalar_dt(const uint8_t* q, float s, float k, int g, int fmt, void* out, int dt, bool acc) {
  if (dt == kF32 && !acc) return decode_group_scalar(q, s, k, g, fmt, static_cast<float*>(out));
  float y[MAX_GROUP_SIZE];
  decode_group_scalar(q, s, k, g, fmt, y);
  if (dt == kF32) {
    float* o = static_cast<float*>(out);
    for (int i = 0; i < g; ++i) o[i] = o[i] + y[i];
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int i = 0; i < g; ++i) o[i] = f32_to_narrow(y[i], dt, true);
}

void convert_from_f32_scalar(const float* x, void* out, int64_t n, int dt) {
  if (dt == kF32) {
    std::memcpy(out, x, n * sizeof(float));
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = f32_to_narrow(x[i], dt, false);
}

void round_through_scalar(float* x, int64_t n, int dt) {
  if (dt == kF32) return;
  for (int64_t i = 0; i < n; ++i) x[i] = narrow_to_f32(f32_to_narrow(x[i], dt, false), dt);
}

void reduce_group_scalar(const uint8_t* const* q, const float* const* s, const float* const* a, int64_t P, int64_t gi,
                         int g, int fmt, float range, uint8_t* q_out, float* s_out) {
  float acc[MAX_GROUP_SIZE] = {};  // P >= 1 (checked by the handler)
  for (int64_t r = 0; r < P; ++r) {
    const float k = a != nullptr ? s[r][gi] / nan_max(a[r][gi], EPS) : s[r][gi];
    const uint8_t* qp = q[r] + gi * g;
    for (int j = 0; j < g; ++j) {
      const float z = fp8_to_f32(qp[j], fmt) * k;
      acc[j] = r == 0 ? z : acc[j] + z;
    }
  }
  float mx = 0.0f;
  bool finite = true;
  for (int j = 0; j < g; ++j) {
    finite = finite && std::isfinite(acc[j]);
    mx = std::max(mx, std::fabs(acc[j]));
  }
  uint8_t* qo = q_out + gi * g;
  if (!finite) {
    s_out[gi] = std::nanf("");
    std::memset(qo, fp8_nan(fmt), g);
    return;
  }
  const float s2 = std::min(std::max(std::max(mx, EPS) * (1.0f / range), EPS), SCALE_MAX);  // as XLA computes x / R
  s_out[gi] = s2;
  const float inv = 1.0f / s2;
  for (int j = 0; j < g; ++j) qo[j] = f32_to_fp8(std::min(std::max(acc[j] * inv, -range), range), fmt);
}

}  // namespace taco
