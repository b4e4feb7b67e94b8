// TACO group codec as XLA FFI handlers for the CPU (TACO spec §2; TACO (arXiv 2604.24088)).
//
// One pass over the input: load, sum of squares and in-register Walsh-Hadamard butterflies,
// absmax; adaptive and quantization scales batched over 8 groups; quantize to FP8, store;
// decode likewise (see README.md). Groups are split in dynamic chunks over the calling thread
// and the library's own spinning helper threads (SpinPool below). On x86-64 an AVX2+FMA+F16C
// kernel is chosen at run time when the CPU has it; a portable scalar kernel with the *same*
// operation order is the fallback (and `impl=1` forces it, for tests), so the two give
// bit-identical results.
//
// Targets (all take x / codes of shape [..., G] with G in {32, 64, ..., 512}):
//   taco_encode(x f32[..., G]) -> (codes fp8[..., G], s f32[...], a f32[...])
//       attrs: fmt (0 = e4m3, 1 = e5m2), lam, fmax, target_range (f32), n_groups, last_count
//       (i64: groups per message and the real size of each message's last group), impl (i32).
//       Extra (aliased) arguments after x are ignored: they let the caller donate buffers.
//   taco_decode(codes fp8[..., G], s f32[...], [a f32[...]], ...) -> x f32[..., G]
//       attrs: has_a (i32: 1 dual layout, 0 folded), impl (i32).
//   taco_fp8_cast(f32 -> fp8 or fp8 -> f32, elementwise; attrs clamp (f32: > 0 clamps to
//       +-clamp and uses the codec's quantizer), impl): for conformance tests.
//
// Build: see custom_calls/Makefile (`make -C custom_calls`).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cfenv>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "taco_fp8.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TACO_X86 1
#else
#define TACO_X86 0
#endif

namespace ffi = xla::ffi;

namespace taco {
namespace {

constexpr float kEps = 1e-12f;
constexpr int64_t kChunkBytes = 64 * 1024;    // f32 input bytes per parallel work item
constexpr int64_t kStreamBytes = 8 << 20;     // outputs at least this big use streaming stores
constexpr int kPrefetchFloats = 2048;         // encoder's software prefetch distance (G <= 256)

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
  const float v = nan_max(m + p.lam, kEps);
  return nan_min(nan_max(p.fmax / std::sqrt(v), 1e-3f), 1e3f);
}

// Spec §2 step 4 from M = max|WHT(a x)| (before the 1/sqrt(G)); returns s, and via k the
// factor 1/(sqrt(G) s) applied to the raw transform (codes = fp8(clamp(raw * k, -R, R))).
inline float quant_scale(float raw_absmax, const EncodeParams& p, float* k) {
  const float ymax = raw_absmax / p.sqrt_g;
  const float s = nan_min(nan_max(nan_max(ymax, kEps) / p.range, kEps), 1e6f);
  *k = static_cast<float>(1.0 / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
  return s;
}

// The same for the fused order, from M = max|WHT(x)| of the raw group: y_max = a M / sqrt(G)
// and k = a / (sqrt(G) s) (in exact arithmetic WHT(a x) = a WHT(x); only rounding differs).
inline float fused_quant_scale(float raw_absmax, float a, const EncodeParams& p, float* k) {
  const float ymax = (raw_absmax * a) / p.sqrt_g;
  const float s = nan_min(nan_max(nan_max(ymax, kEps) / p.range, kEps), 1e6f);
  *k = static_cast<float>(static_cast<double>(a) / (static_cast<double>(p.sqrt_g) * static_cast<double>(s)));
  return s;
}

// Decode factor: 1 / (sqrt(G) * max(a, eps)) (or 1/sqrt(G) for the folded layout).
inline float decode_factor(float sqrt_g, const float* a, int64_t i) {
  double d = sqrt_g;
  if (a != nullptr) d *= static_cast<double>(nan_max(a[i], kEps));
  return static_cast<float>(1.0 / d);
}

// ------------------------------------------------------------------------------------------
// Portable scalar kernels. Operation order mirrors the AVX2 kernels exactly (8 lane
// accumulators, the same horizontal-sum tree, the same butterfly stages), so both agree
// bit for bit.
// ------------------------------------------------------------------------------------------

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

// Overflow path (sum of squares overflowed although every element is finite; |x| > ~1e19):
// the reference's order, y = WHT(a x), so the transform cannot overflow. Shared by both kernels.
void encode_group_exact(const float* x, uint8_t* q, float* s_out, float a, const EncodeParams& p) {
  const int g = p.g;
  float y[512];
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
  float y[512];
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

void decode_group_scalar(const uint8_t* q, float s, float k, int g, int fmt, float* out) {
  const float* lut = kFp8Table.v[fmt];
  float y[512];
  for (int i = 0; i < g; ++i) y[i] = lut[q[i]] * s;
  wht_scalar(y, g);
  for (int i = 0; i < g; ++i) out[i] = y[i] * k;
}

// ------------------------------------------------------------------------------------------
// AVX2 + FMA kernels (compiled for that target, chosen at run time).
// ------------------------------------------------------------------------------------------
#if TACO_X86
#define TACO_AVX2 __attribute__((target("avx2,fma,f16c")))

// Eight 8-lane accumulators -> one vector of their eight sums (order: see hsum8).
TACO_AVX2 inline __m256 hsum8x8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Eight vectors -> one vector of their eight horizontal maxima (max is exact: any order).
TACO_AVX2 inline __m256 hmax8x8(const __m256* m) {
  __m256 b[2];
  for (int h = 0; h < 2; ++h) {
    const __m256* v = m + 4 * h;
    const __m256 a01 = _mm256_max_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 a23 = _mm256_max_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    b[h] = _mm256_max_ps(_mm256_shuffle_ps(a01, a23, 0x44), _mm256_shuffle_ps(a01, a23, 0xEE));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// NaN-propagating max/min against a constant c (MAXPS returns its 2nd operand on NaN).
TACO_AVX2 inline __m256 nan_max_c(__m256 x, __m256 c) { return _mm256_max_ps(c, x); }
TACO_AVX2 inline __m256 nan_min_c(__m256 x, __m256 c) { return _mm256_min_ps(c, x); }

// 8 x 1 / (double(c) * double(d)) rounded to float: the decode factor and 1/(sqrt(G) s).
TACO_AVX2 inline __m256 recip_prod_pd(__m256 c, __m256 d) {
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d lo = _mm256_div_pd(one, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(c)),
                                                      _mm256_cvtps_pd(_mm256_castps256_ps128(d))));
  const __m256d hi = _mm256_div_pd(one, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)),
                                                      _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1))));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

// 8 x n / (double(c) * double(d)) rounded to float: k = a / (sqrt(G) s) of the fused encoder.
TACO_AVX2 inline __m256 ratio_pd(__m256 n, __m256 c, __m256 d) {
  const __m256d lo = _mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(n)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(c)),
                                                 _mm256_cvtps_pd(_mm256_castps256_ps128(d))));
  const __m256d hi = _mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(n, 1)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)),
                                                 _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1))));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

// In-register butterflies over element strides 1, 2, 4 of one 8-float vector:
// out = x * sign + swapped, i.e. u + w in the lower half of each pair, u - w in the upper.
TACO_AVX2 inline __m256 wht8(__m256 x) {
  const __m256 sg1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 sg2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 sg4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  x = _mm256_fmadd_ps(x, sg1, _mm256_permute_ps(x, 0xB1));
  x = _mm256_fmadd_ps(x, sg2, _mm256_permute_ps(x, 0x4E));
  x = _mm256_fmadd_ps(x, sg4, _mm256_permute2f128_ps(x, x, 0x01));
  return x;
}

// Butterflies across vectors (element strides 8, 16, ..., 8 (V/2)).
template <int V>
TACO_AVX2 inline void wht_cross(__m256* y) {
#pragma GCC unroll 16
  for (int h = 1; h < V; h <<= 1) {
#pragma GCC unroll 64
    for (int j0 = 0; j0 < V; j0 += 2 * h) {
#pragma GCC unroll 64
      for (int j = j0; j < j0 + h; ++j) {
        const __m256 u = y[j], w = y[j + h];
        y[j] = _mm256_add_ps(u, w);
        y[j + h] = _mm256_sub_ps(u, w);
      }
    }
  }
}

// Butterflies over vector strides 8 .. V/2 on a group held in memory (L1), after the
// 64-element blocks were transformed in registers; folds the absmax into the last stage.
template <int V>
TACO_AVX2 inline void wht_cross_mem(float* yb, __m256* absmax) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int h = 8; h < V; h <<= 1) {
    const bool last = 2 * h == V;
    for (int i0 = 0; i0 < V; i0 += 2 * h) {
#pragma GCC unroll 8
      for (int j = i0; j < i0 + h; ++j) {
        const __m256 u = _mm256_load_ps(yb + 8 * j), w = _mm256_load_ps(yb + 8 * (j + h));
        const __m256 sum = _mm256_add_ps(u, w), diff = _mm256_sub_ps(u, w);
        _mm256_store_ps(yb + 8 * j, sum);
        _mm256_store_ps(yb + 8 * (j + h), diff);
        if (absmax != nullptr && last) {
          *absmax = _mm256_max_ps(*absmax, _mm256_max_ps(_mm256_andnot_ps(sign_mask, sum), _mm256_andnot_ps(sign_mask, diff)));
        }
      }
    }
  }
}

// float -> FP8 for any input (same rules as f32_to_e4m3 / f32_to_e5m2: ml_dtypes-exact,
// overflow to NaN / Inf), 8 lanes -> int32 codes 0..255. Used by the cast target.
template <int FMT>
TACO_AVX2 inline __m256i f32_to_fp8_avx(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
  const __m256i ab = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
  constexpr int kM = FMT == kE4M3 ? 3 : 2;
  constexpr int kBias = FMT == kE4M3 ? 7 : 15;
  constexpr int kSh = 23 - kM;
  // Normal: round the mantissa to kM bits (ties to even), rebias the exponent.
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ab, kSh), _mm256_set1_epi32(1));
  const __m256i rnd = _mm256_add_epi32(ab, _mm256_add_epi32(lsb, _mm256_set1_epi32((1 << (kSh - 1)) - 1)));
  __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(rnd, kSh), _mm256_set1_epi32((127 - kBias) << kM));
  // Subnormal: |v| / 2^(1 - bias - m) rounded to an integer (exact power-of-two scaling).
  const float sub_unit_inv = FMT == kE4M3 ? 512.0f : 65536.0f;
  const __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(ab), _mm256_set1_ps(sub_unit_inv));
  const __m256i sub = _mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const int min_normal_bits = (127 - kBias + 1) << 23;
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(min_normal_bits), ab);
  code = _mm256_blendv_epi8(code, sub, is_sub);
  if (FMT == kE4M3) {
    const __m256i ovf = _mm256_cmpgt_epi32(ab, _mm256_set1_epi32(0x43E80000));  // > 464, Inf, NaN
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), ovf);
  } else {
    code = _mm256_min_epi32(code, _mm256_set1_epi32(0x7C));  // >= 61440 and Inf -> Inf
    const __m256i nan = _mm256_cmpgt_epi32(ab, _mm256_set1_epi32(0x7F800000));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E), nan);
  }
  return _mm256_or_si256(code, sign);
}

// The codec's quantizer, |fp8(clamp(v, -r, r))| for finite (non-NaN) v and 0 < r <= F, in a
// pre-packed form. Rounds |v| to the FP8 grid by adding a magic number C = 2^(E + 23 - kM) whose
// ulp is the grid step at |v|'s binade E (at least the subnormal step): t = |v| + C rounds to
// nearest even in the FPU's default mode, and t's bits are ((E + 23 - kM) << 23) + steps, steps
// <= 2^(kM+1). So t's high 16 bits are (E + 23 - kM) << 7 and its low 16 bits are steps, and one
// multiply-add of the 16-bit halves, lo * 2^(7 - kM) + hi, gives 2^(7 - kM) * (code + kOff) as an
// int32 below 2^15; pack4_signed_fp8 shifts and subtracts kOff after the first pack, on 16 lanes.
// Same result as f32_to_fp8_avx on the clamped value (tested exhaustively against ml_dtypes
// through the cast target's `clamp` attribute, which runs this quantizer and packing).
template <int FMT>
struct Fp8Pre {
  static constexpr int kM = FMT == kE4M3 ? 3 : 2;
  static constexpr int kMinE = FMT == kE4M3 ? 121 : 113;  // f32 biased exponent of the min normal
  static constexpr int kShift = 7 - kM;
  static constexpr int kOff = (kMinE + 23 - kM) << kM;  // 1128 (E4M3), 536 (E5M2)
};

template <int FMT>
TACO_AVX2 inline __m256i fp8_quantize_pre_avx(__m256 v, __m256 r) {
  using P = Fp8Pre<FMT>;
  const __m256 av = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), r);
  const __m256i e = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(av), _mm256_set1_epi32(0x7F800000)),
                                     _mm256_set1_epi32(P::kMinE << 23));
  const __m256i c = _mm256_add_epi32(e, _mm256_set1_epi32((23 - P::kM) << 23));
  const __m256i t = _mm256_castps_si256(_mm256_add_ps(av, _mm256_castsi256_ps(c)));
  return _mm256_madd_epi16(t, _mm256_set1_epi32((1 << 16) | (1 << P::kShift)));
}

// Packs 4 vectors of int32 codes (0..255) into 32 bytes in element order.
TACO_AVX2 inline __m256i pack4(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i p01 = _mm256_packs_epi32(c0, c1);
  const __m256i p23 = _mm256_packs_epi32(c2, c3);
  const __m256i b = _mm256_packus_epi16(p01, p23);
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Packs 4 outputs of fp8_quantize_pre_avx into 32 codes in element order, with the sign bits
// (bit 31) of 4 more vectors f: packing int32 -> int16 -> int8 with signed saturation keeps each
// sign in the byte's bit 7, so one AND + OR per 32 codes sets all the signs.
template <int FMT>
TACO_AVX2 inline __m256i pack4_signed_fp8(const __m256i* c, const __m256i* f) {
  using P = Fp8Pre<FMT>;
  const __m256i off = _mm256_set1_epi16(P::kOff);
  const __m256i m01 = _mm256_sub_epi16(_mm256_srli_epi16(_mm256_packs_epi32(c[0], c[1]), P::kShift), off);
  const __m256i m23 = _mm256_sub_epi16(_mm256_srli_epi16(_mm256_packs_epi32(c[2], c[3]), P::kShift), off);
  const __m256i mag = _mm256_packus_epi16(m01, m23);
  const __m256i sgn = _mm256_packs_epi16(_mm256_packs_epi32(f[0], f[1]), _mm256_packs_epi32(f[2], f[3]));
  const __m256i b = _mm256_or_si256(mag, _mm256_and_si256(sgn, _mm256_set1_epi8(static_cast<char>(0x80))));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 8 FP8 codes (low 8 bytes of c) -> 8 floats (exact; NaN / Inf codes included).
template <int FMT>
TACO_AVX2 inline __m256 fp8_to_f32_avx(__m128i c8) {
  if (FMT == kE5M2) {  // E5M2 is the top byte of an IEEE half: exact, Inf/NaN included.
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(c8), 8));
  }
  const __m256i c = _mm256_cvtepu8_epi32(c8);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i em = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f)));
  __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
  return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

// 16 FP8 codes -> 16 values scaled by 2^-8 (E4M3) or 1 (E5M2), as IEEE halves widened to
// float: E4M3's bits shifted into a half's exponent/mantissa give the value times 2^-8
// (subnormals included, since both formats put the subnormal point at the same place); the
// NaN code 0x7F is mapped to a half NaN. The decoder multiplies by s * 2^8, which is exact.
template <int FMT>
TACO_AVX2 inline void fp8x16_to_f32_scaled(__m128i c16, __m256* lo, __m256* hi) {
  const __m256i c = _mm256_cvtepu8_epi16(c16);
  __m256i h;
  if (FMT == kE5M2) {
    h = _mm256_slli_epi16(c, 8);
  } else {
    const __m256i em7 = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(0x3F80));
    const __m256i sgn = _mm256_and_si256(_mm256_slli_epi16(c, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(em7, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x7E00));
    h = _mm256_or_si256(_mm256_or_si256(em7, sgn), nan);
  }
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Encodes groups [g0, g1) in blocks of 8 (4 for G = 512), one pass over the input:
// (1) per group, load x once: sum of squares (8 lanes) and the raw transform WHT(x) in
// registers (G = 128: stride 64 first, then two 64-element halves; G >= 256: wider strides
// through an L1 scratch), absmax, spilled to the scratch;
// (2) for the block, the adaptive scales a and quantization scales s as vectors (div / sqrt off
// each group's critical path), with a folded into k = a / (sqrt(G) s); (3) quantize and store.
// Groups whose sum of squares is not finite take the exact path (NaN codes, or y = WHT(a x)).
template <int V, int FMT>
TACO_AVX2 void encode_range_avx(const float* x, uint8_t* q, float* s_out, float* a_out, int64_t g0,
                                int64_t g1, const EncodeParams& p, bool stream) {
  constexpr int G = 8 * V;
  // Groups per block: 8 (one vector lane each), 4 for G = 512 so that the block's transforms
  // (4 x 2 KiB) and input stay in L1.
  constexpr int kB = V >= 64 ? 4 : 8;
  alignas(32) float ybuf[kB][G];
  alignas(32) float cnt[8], av[8], sv[8], kv[8];
  const __m256 zero = _mm256_setzero_ps();
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 vr = _mm256_set1_ps(p.range);
  for (int64_t b0 = g0; b0 < g1; b0 += kB) {
    const int nb = static_cast<int>(std::min<int64_t>(kB, g1 - b0));
    // 1. one pass per group: sum of squares, raw WHT, absmax
    __m256 acc[8], mxv[8];
    int64_t r = b0 % p.n_groups;  // position of group b0 in its message
    for (int b = 0; b < 8; ++b) {
      acc[b] = zero;
      mxv[b] = zero;
      cnt[b] = 1.0f;
      if (b >= nb) continue;
      const float* xp = x + (b0 + b) * G;
      __m256 sq = zero, mx = zero;
      if constexpr (V <= 8) {  // whole group in registers
        __m256 y[V];
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) {
          if (j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(xp + 8 * j + kPrefetchFloats), _MM_HINT_T0);
          const __m256 v = _mm256_loadu_ps(xp + 8 * j);
          sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
          y[j] = wht8(v);
        }
        wht_cross<V>(y);
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) {
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_mask, y[j]));
          _mm256_store_ps(ybuf[b] + 8 * j, y[j]);
        }
      } else if constexpr (V == 16) {
        // G = 128: the stride-64 butterfly first, straight from the loads (x[i] +- x[i + 64]),
        // then each 64-element half in registers; absmax from registers, one store per vector.
        // Sums of squares: two accumulators (first and second half of x), then added.
        float* yb = ybuf[b];
        __m256 sq2 = zero;
        __m256 y[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(xp + 8 * j + kPrefetchFloats), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(xp + 64 + 8 * j + kPrefetchFloats), _MM_HINT_T0);
          const __m256 u = _mm256_loadu_ps(xp + 8 * j), w = _mm256_loadu_ps(xp + 64 + 8 * j);
          sq = _mm256_fmadd_ps(u, u, sq);
          sq2 = _mm256_fmadd_ps(w, w, sq2);
          y[j] = wht8(_mm256_add_ps(u, w));
        }
        sq = _mm256_add_ps(sq, sq2);
        wht_cross<8>(y);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_mask, y[j]));
          _mm256_store_ps(yb + 8 * j, y[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) y[j] = wht8(_mm256_sub_ps(_mm256_loadu_ps(xp + 8 * j), _mm256_loadu_ps(xp + 64 + 8 * j)));
        wht_cross<8>(y);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_mask, y[j]));
          _mm256_store_ps(yb + 64 + 8 * j, y[j]);
        }
      } else {  // 64-element blocks in registers, then the wider strides through L1
        float* yb = ybuf[b];
        for (int j0 = 0; j0 < V; j0 += 8) {
          __m256 y[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            if (V <= 32 && j % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(xp + 8 * (j0 + j) + kPrefetchFloats), _MM_HINT_T0);
            const __m256 v = _mm256_loadu_ps(xp + 8 * (j0 + j));
            sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
            y[j] = wht8(v);
          }
          wht_cross<8>(y);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) _mm256_store_ps(yb + 8 * (j0 + j), y[j]);
        }
        wht_cross_mem<V>(yb, &mx);
      }
      acc[b] = sq;
      mxv[b] = mx;
      cnt[b] = r == p.n_groups - 1 ? p.last_count : static_cast<float>(G);
      r = r + 1 == p.n_groups ? 0 : r + 1;
    }
    // 2. adaptive scales a (spec §2 steps 1-2, the reference's ops in the same order)
    const __m256 ss = hsum8x8(acc);
    const __m256 m = _mm256_div_ps(ss, _mm256_load_ps(cnt));
    const __m256 v = nan_max_c(_mm256_add_ps(m, _mm256_set1_ps(p.lam)), _mm256_set1_ps(kEps));
    const __m256 a = nan_min_c(nan_max_c(_mm256_div_ps(_mm256_set1_ps(p.fmax), _mm256_sqrt_ps(v)), _mm256_set1_ps(1e-3f)),
                               _mm256_set1_ps(1e3f));
    _mm256_store_ps(av, a);
    // A non-finite sum of squares: the group holds NaN/Inf, or finite values overflowed it.
    const int slow =
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign_mask, ss), _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)) &
        ((1 << nb) - 1);
    // 3. quantization scales s from y_max = a M / sqrt(G); factors k = a / (sqrt(G) s)
    const __m256 vsq = _mm256_set1_ps(p.sqrt_g);
    const __m256 ymax = _mm256_div_ps(_mm256_mul_ps(hmax8x8(mxv), a), vsq);
    const __m256 s = _mm256_min_ps(_mm256_set1_ps(1e6f),
                                   _mm256_max_ps(_mm256_set1_ps(kEps), _mm256_div_ps(_mm256_max_ps(_mm256_set1_ps(kEps), ymax), vr)));
    _mm256_store_ps(sv, s);
    _mm256_store_ps(kv, ratio_pd(a, vsq, s));
    // 4. codes
    for (int b = 0; b < nb; ++b) {
      const int64_t gi = b0 + b;
      uint8_t* qp = q + gi * G;
      a_out[gi] = av[b];
      if ((slow >> b) & 1) {
        const float* xp = x + gi * G;
        if (std::all_of(xp, xp + G, [](float t) { return std::isfinite(t); })) {
          encode_group_exact(xp, qp, s_out + gi, av[b], p);
        } else {
          s_out[gi] = std::nanf("");
          std::memset(qp, fp8_nan(FMT), G);
        }
        continue;
      }
      s_out[gi] = sv[b];
      const __m256 vk = _mm256_broadcast_ss(kv + b);
#pragma GCC unroll 16
      for (int j = 0; j < V; j += 4) {
        __m256i c[4], sgn[4];
        for (int t = 0; t < 4; ++t) {
          const __m256 yv = _mm256_load_ps(ybuf[b] + 8 * (j + t));
          sgn[t] = _mm256_castps_si256(yv);  // k > 0: the code's sign is y's
          c[t] = fp8_quantize_pre_avx<FMT>(_mm256_mul_ps(yv, vk), vr);
        }
        const __m256i packed = pack4_signed_fp8<FMT>(c, sgn);
        if (stream) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(qp + 8 * j), packed);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + 8 * j), packed);
        }
      }
    }
  }
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: fence on this thread
}

TACO_AVX2 inline void store8(float* p, __m256 v, bool stream) {
  if (stream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

template <int V, int FMT>
TACO_AVX2 void decode_range_avx(const uint8_t* q, const float* s, const float* a, float sqrt_g,
                                float* out, int64_t g0, int64_t g1, bool stream) {
  constexpr int G = 8 * V;
  alignas(32) float kv[8], amax[8];
  alignas(32) float ybuf[V > 16 ? G : 8];
  for (int64_t b0 = g0; b0 < g1; b0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, g1 - b0));
    for (int b = 0; b < 8; ++b) amax[b] = (a != nullptr && b < nb) ? nan_max(a[b0 + b], kEps) : 1.0f;
    _mm256_store_ps(kv, recip_prod_pd(_mm256_set1_ps(sqrt_g), _mm256_load_ps(amax)));
    for (int b = 0; b < nb; ++b) {
      const int64_t gi = b0 + b;
      const uint8_t* qp = q + gi * G;
      float* op = out + gi * G;
      // s * 2^8 for E4M3 (see fp8x16_to_f32_scaled): exact, so f32(q) * s is unchanged.
      const __m256 vs = _mm256_set1_ps(FMT == kE4M3 ? s[gi] * 256.0f : s[gi]);
      const __m256 vk = _mm256_broadcast_ss(kv + b);
      if constexpr (V <= 16) {  // whole group in registers
        __m256 y[V];
#pragma GCC unroll 64
        for (int j = 0; j < V; j += 2) {
          __m256 lo, hi;
          fp8x16_to_f32_scaled<FMT>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 8 * j)), &lo, &hi);
          y[j] = wht8(_mm256_mul_ps(lo, vs));
          y[j + 1] = wht8(_mm256_mul_ps(hi, vs));
        }
        wht_cross<V>(y);
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) store8(op + 8 * j, _mm256_mul_ps(y[j], vk), stream);
      } else {  // 64-element blocks in registers, the wider strides through an L1 scratch
        for (int j0 = 0; j0 < V; j0 += 8) {
          __m256 y[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; j += 2) {
            __m256 lo, hi;
            fp8x16_to_f32_scaled<FMT>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 8 * (j0 + j))), &lo, &hi);
            y[j] = wht8(_mm256_mul_ps(lo, vs));
            y[j + 1] = wht8(_mm256_mul_ps(hi, vs));
          }
          wht_cross<8>(y);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) _mm256_store_ps(ybuf + 8 * (j0 + j), y[j]);
        }
        wht_cross_mem<V>(ybuf, nullptr);
        for (int j = 0; j < V; ++j) store8(op + 8 * j, _mm256_mul_ps(_mm256_load_ps(ybuf + 8 * j), vk), stream);
      }
    }
  }
  if (stream) _mm_sfence();
}

TACO_AVX2 void cast_to_fp8_avx(const float* x, uint8_t* q, int64_t n, int fmt, float clamp) {
  const __m256 r = _mm256_set1_ps(clamp);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i c[4], sgn[4];
    for (int t = 0; t < 4; ++t) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * t);
      sgn[t] = _mm256_castps_si256(v);
      if (clamp > 0) {  // the encoder's quantizer and packing, so the exhaustive tests cover them
        c[t] = fmt == kE4M3 ? fp8_quantize_pre_avx<kE4M3>(v, r) : fp8_quantize_pre_avx<kE5M2>(v, r);
      } else {
        c[t] = fmt == kE4M3 ? f32_to_fp8_avx<kE4M3>(v) : f32_to_fp8_avx<kE5M2>(v);
      }
    }
    const __m256i packed = clamp <= 0 ? pack4(c[0], c[1], c[2], c[3])
                           : fmt == kE4M3 ? pack4_signed_fp8<kE4M3>(c, sgn)
                                          : pack4_signed_fp8<kE5M2>(c, sgn);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), packed);
  }
  for (; i < n; ++i) q[i] = f32_to_fp8(clamp > 0 ? std::min(std::max(x[i], -clamp), clamp) : x[i], fmt);
}

TACO_AVX2 void cast_from_fp8_avx(const uint8_t* q, float* x, int64_t n, int fmt) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
    _mm256_storeu_ps(x + i, fmt == kE4M3 ? fp8_to_f32_avx<kE4M3>(c8) : fp8_to_f32_avx<kE5M2>(c8));
  }
  for (; i < n; ++i) x[i] = fp8_to_f32(q[i], fmt);
}

bool HaveAvx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return ok;
}

using EncodeFn = void (*)(const float*, uint8_t*, float*, float*, int64_t, int64_t, const EncodeParams&,
                          bool);
using DecodeFn = void (*)(const uint8_t*, const float*, const float*, float, float*, int64_t, int64_t,
                          bool);

template <int FMT>
EncodeFn EncodeAvxFor(int g) {
  switch (g) {
    case 32: return &encode_range_avx<4, FMT>;
    case 64: return &encode_range_avx<8, FMT>;
    case 128: return &encode_range_avx<16, FMT>;
    case 256: return &encode_range_avx<32, FMT>;
    case 512: return &encode_range_avx<64, FMT>;
    default: return nullptr;
  }
}

template <int FMT>
DecodeFn DecodeAvxFor(int g) {
  switch (g) {
    case 32: return &decode_range_avx<4, FMT>;
    case 64: return &decode_range_avx<8, FMT>;
    case 128: return &decode_range_avx<16, FMT>;
    case 256: return &decode_range_avx<32, FMT>;
    case 512: return &decode_range_avx<64, FMT>;
    default: return nullptr;
  }
}
#else
bool HaveAvx2() { return false; }
#endif  // TACO_X86

// ------------------------------------------------------------------------------------------
// Parallel loop: the calling thread plus helper threads that spin briefly between calls.
// ------------------------------------------------------------------------------------------
//
// Why not XLA's intra-op pool: its threads sleep between tasks, and waking one costs tens of
// microseconds on a virtual machine -- as long as a whole 1 MB encode on one core. These
// helpers wait for the next job by spinning (with `pause`, yielding the core every few
// microseconds) for TACO_FFI_SPIN_US (default 200) after their last job, then sleep on a
// condition variable; back-to-back codec calls (one per layer and collective) find them awake,
// as OpenMP's and Eigen's spinning workers do. While callers contend for the pool (several XLA
// devices in one process keep the cores busy anyway) helpers sleep right after each job. Both
// knobs and the helper count are fixed at the first call.
//
// Protocol (one job at a time): the caller publishes the job's fields, then a 64-bit ticket
// (job id << 32 | next chunk). Everyone claims chunks by CAS on the ticket, which also checks the
// job id, so a helper can never run a chunk of a finished job: the caller closes a job (next =
// kClosed) only after all its chunks are done. A caller that finds the pool busy (concurrent
// calls, e.g. several XLA devices of one process) runs its whole loop itself.

// TACO_FFI_THREADS=k caps the threads at k (k = 1: the calling thread only).
int64_t MaxThreadsFromEnv() {
  static const int64_t cap = [] {
    const char* v = std::getenv("TACO_FFI_THREADS");
    return v != nullptr && std::atoi(v) > 0 ? static_cast<int64_t>(std::atoi(v)) : INT64_MAX;
  }();
  return cap;
}

int64_t SpinMicros() {
  static const int64_t us = [] {
    const char* v = std::getenv("TACO_FFI_SPIN_US");
    return v != nullptr && std::atoi(v) >= 0 ? static_cast<int64_t>(std::atoi(v)) : int64_t{200};
  }();
  return us;
}

inline void CpuRelax() {
#if TACO_X86
  _mm_pause();
#endif
}

// The floating-point control state a job runs under: XLA runs computations with denormals
// flushed (FTZ/DAZ) and round-to-nearest, and a helper runs the caller's chunks under the
// caller's state, so a chunk's result does not depend on the thread that ran it.
#if TACO_X86
using FpState = unsigned int;  // MXCSR
inline FpState GetFpState() { return _mm_getcsr(); }
inline void SetFpState(FpState s) {
  if (_mm_getcsr() != s) _mm_setcsr(s);
}
#else
using FpState = std::fenv_t;
inline FpState GetFpState() {
  FpState s;
  std::fegetenv(&s);
  return s;
}
inline void SetFpState(const FpState& s) { std::fesetenv(&s); }
#endif

class SpinPool {
 public:
  // The process-wide pool with `helpers` threads (fixed by the first call); never destroyed, so
  // its threads may outlive static destructors at exit.
  static SpinPool& Get(int helpers) {
    static SpinPool* pool = new SpinPool(helpers);
    return *pool;
  }

  int helpers() const { return helpers_; }

  // Called when a caller found the pool busy: helpers stop spinning between jobs for 50 ms.
  void MarkContended() {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    contended_until_.store(until.time_since_epoch().count(), std::memory_order_relaxed);
  }

  // Runs fn(c) for every chunk c in [0, nchunks), on the caller and the helpers. Returns false
  // (running nothing) if another caller holds the pool.
  template <typename F>
  bool Run(int64_t nchunks, const F& fn) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    const uint32_t id = static_cast<uint32_t>(ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    fp_state_ = GetFpState();  // published by the ticket store below
    call_.store(&Trampoline<F>, std::memory_order_relaxed);
    ctx_.store(&fn, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(id) << 32, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    ClaimAndRun(id);
    // Chunks still running on helpers take at most one chunk's time (a few microseconds).
    for (int spins = 0; done_.load(std::memory_order_acquire) < nchunks; ++spins) {
      CpuRelax();
      if (spins % 256 == 255) std::this_thread::yield();
    }
    ticket_.store((static_cast<uint64_t>(id) << 32) | kClosed, std::memory_order_release);
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  static constexpr uint32_t kClosed = 0xFFFFFFFFu;
  using Call = void (*)(const void*, int64_t);

  template <typename F>
  static void Trampoline(const void* ctx, int64_t c) {
    (*static_cast<const F*>(ctx))(c);
  }

  explicit SpinPool(int helpers) : helpers_(helpers) {
    for (int t = 0; t < helpers_; ++t) std::thread([this] { HelperLoop(); }).detach();
  }

  // Claims and runs chunks of job `id` until none is left or the job changed; a helper
  // (`helper`) first takes the job's floating-point state.
  void ClaimAndRun(uint32_t id, bool helper = false) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(t >> 32) != id) return;
      const uint32_t c = static_cast<uint32_t>(t);
      if (c == kClosed || static_cast<int64_t>(c) >= nchunks_.load(std::memory_order_relaxed)) return;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        // Chunk c of job id is ours; the job cannot close before it is done, so its fields hold.
        if (helper) SetFpState(fp_state_);
        call_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), c);
        done_.fetch_add(1, std::memory_order_release);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void HelperLoop() {
    uint32_t seen = 0;  // job ids start at 1
    const auto spin = std::chrono::microseconds(SpinMicros());
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      // While callers contend for the pool (several XLA devices in one process, which already
      // keep the cores busy), a spinning helper only takes CPU from them: sleep at once.
      const auto now = std::chrono::steady_clock::now();
      const bool contended = now.time_since_epoch().count() < contended_until_.load(std::memory_order_relaxed);
      const auto deadline = contended ? now : now + spin;
      for (int spins = 0; static_cast<uint32_t>(t >> 32) == seen; ++spins) {
        CpuRelax();
        if (spins % 64 == 63) {
          if (std::chrono::steady_clock::now() >= deadline) {
            std::unique_lock<std::mutex> lock(mu_);
            sleeping_.fetch_add(1, std::memory_order_seq_cst);
            cv_.wait(lock, [&] { return static_cast<uint32_t>(ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
            sleeping_.fetch_sub(1, std::memory_order_relaxed);
          } else {
            std::this_thread::yield();  // let any other runnable thread have this core
          }
        }
        t = ticket_.load(std::memory_order_acquire);
      }
      seen = static_cast<uint32_t>(t >> 32);
      ClaimAndRun(seen, /*helper=*/true);
    }
  }

  const int helpers_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<Call> call_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> nchunks_{0};
  FpState fp_state_{};  // written by the pool's holder before it publishes the ticket
  std::atomic<int64_t> contended_until_{0};  // steady_clock ticks; see MarkContended
  std::atomic<int> sleeping_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

// CPUs this process may run on, read once (a system call).
int64_t AffinityCpus() {
  static const int64_t n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return INT64_MAX;
  }();
  return n;
}

// Threads for a call: XLA's intra-op pool size (about the cores it may use), capped by the CPUs
// this process may run on and TACO_FFI_THREADS.
int64_t ThreadCount(const ffi::ThreadPool* pool) {
  const int64_t n = std::min({pool != nullptr ? pool->num_threads() : int64_t{1}, AffinityCpus(), MaxThreadsFromEnv()});
  return std::max<int64_t>(1, n);
}

// Runs fn(begin, end) over [0, n) in chunks of `grain`, on the calling thread and the pool's
// helpers (or the calling thread alone, for one chunk or when the pool is busy).
template <typename F>
void ParallelFor(const ffi::ThreadPool* pool, int64_t n, int64_t grain, const F& fn) {
  const int64_t nchunks = (n + grain - 1) / grain;
  const int64_t threads = ThreadCount(pool);
  if (nchunks > 1 && threads > 1 && nchunks < (int64_t{1} << 31)) {  // chunk ids fit the ticket's 32 bits
    SpinPool& sp = SpinPool::Get(static_cast<int>(threads - 1));
    auto chunk = [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); };
    if (sp.helpers() > 0) {
      if (sp.Run(nchunks, chunk)) return;
      sp.MarkContended();
    }
  }
  if (n > 0) fn(0, n);
}

int64_t GroupsPerChunk(int g) { return std::max<int64_t>(1, kChunkBytes / (4 * g)); }

bool ValidGroupSize(int64_t g) { return g >= 32 && g <= 512 && (g & (g - 1)) == 0; }

int FmtOf(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return kE4M3;
  if (t == ffi::DataType::F8E5M2) return kE5M2;
  return -1;
}

bool Aligned32(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 31u) == 0; }

// ------------------------------------------------------------------------------------------
// FFI handlers.
// ------------------------------------------------------------------------------------------

ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs,
                      ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::Buffer<ffi::F32>> s,
                      ffi::Result<ffi::Buffer<ffi::F32>> a, int32_t fmt, float lam, float fmax,
                      float target_range, int64_t n_groups, int64_t last_count, int32_t impl) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_encode: x must have rank >= 1");
  const int64_t g = dims.back();
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_encode: G must be a power of 2 in [32, 512]");
  if (FmtOf(codes->element_type()) != fmt)
    return ffi::Error::InvalidArgument("taco_encode: codes dtype does not match fmt");
  const int64_t total = static_cast<int64_t>(x.element_count()) / g;
  if (static_cast<int64_t>(codes->element_count()) != total * g || static_cast<int64_t>(s->element_count()) != total ||
      static_cast<int64_t>(a->element_count()) != total)
    return ffi::Error::InvalidArgument("taco_encode: output shapes do not match x");
  if (n_groups < 1 || total % n_groups != 0 || last_count < 1 || last_count > g)
    return ffi::Error::InvalidArgument("taco_encode: bad n_groups / last_count");

  EncodeParams p;
  p.fmt = fmt;
  p.g = static_cast<int>(g);
  p.lam = lam;
  p.fmax = fmax;
  p.range = target_range;
  p.n_groups = n_groups;
  p.last_count = static_cast<float>(last_count);
  p.sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));

  const float* xp = x.typed_data();
  uint8_t* qp = static_cast<uint8_t*>(codes->untyped_data());
  float* sp = s->typed_data();
  float* ap = a->typed_data();

#if TACO_X86
  if (impl == 0 && HaveAvx2()) {
    EncodeFn fn = fmt == kE4M3 ? EncodeAvxFor<kE4M3>(p.g) : EncodeAvxFor<kE5M2>(p.g);
    const bool stream = total * g >= kStreamBytes && Aligned32(qp);
    ParallelFor(&pool, total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) { fn(xp, qp, sp, ap, b, e, p, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(&pool, total, GroupsPerChunk(p.g), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      const float count = (gi % n_groups == n_groups - 1) ? p.last_count : static_cast<float>(g);
      encode_group_scalar(xp + gi * g, qp + gi * g, sp + gi, ap + gi, count, p);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> s, ffi::RemainingArgs rest,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t has_a, int32_t impl) {
  const auto dims = codes.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("taco_decode: codes must have rank >= 1");
  const int64_t g = dims.back();
  if (!ValidGroupSize(g)) return ffi::Error::InvalidArgument("taco_decode: G must be a power of 2 in [32, 512]");
  const int fmt = FmtOf(codes.element_type());
  if (fmt < 0) return ffi::Error::InvalidArgument("taco_decode: codes must be float8_e4m3fn or float8_e5m2");
  const int64_t total = static_cast<int64_t>(codes.element_count()) / g;
  if (static_cast<int64_t>(s.element_count()) != total || static_cast<int64_t>(out->element_count()) != total * g)
    return ffi::Error::InvalidArgument("taco_decode: shapes of s / output do not match codes");
  const float* ap = nullptr;
  if (has_a) {
    auto a = rest.get<ffi::Buffer<ffi::F32>>(0);
    if (a.has_error()) return a.error();
    if (static_cast<int64_t>(a->element_count()) != total)
      return ffi::Error::InvalidArgument("taco_decode: shape of a does not match codes");
    ap = a->typed_data();
  }
  const uint8_t* qp = static_cast<const uint8_t*>(codes.untyped_data());
  const float* sp = s.typed_data();
  float* op = out->typed_data();
  const float sqrt_g = static_cast<float>(std::sqrt(static_cast<double>(g)));

#if TACO_X86
  if (impl == 0 && HaveAvx2()) {
    DecodeFn fn = fmt == kE4M3 ? DecodeAvxFor<kE4M3>(static_cast<int>(g)) : DecodeAvxFor<kE5M2>(static_cast<int>(g));
    const bool stream = total * g * 4 >= kStreamBytes && Aligned32(op);
    ParallelFor(&pool, total, GroupsPerChunk(static_cast<int>(g)),
                [&](int64_t b, int64_t e) { fn(qp, sp, ap, sqrt_g, op, b, e, stream); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(&pool, total, GroupsPerChunk(static_cast<int>(g)), [&](int64_t b, int64_t e) {
    for (int64_t gi = b; gi < e; ++gi) {
      decode_group_scalar(qp + gi * g, sp[gi], decode_factor(sqrt_g, ap, gi), static_cast<int>(g), fmt, op + gi * g);
    }
  });
  return ffi::Error::Success();
}

// clamp > 0: fp8(clamp(x, -clamp, clamp)) through the codec's quantizer (x must not be NaN).
ffi::Error CastImpl(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, float clamp, int32_t impl) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) return ffi::Error::InvalidArgument("taco_fp8_cast: size mismatch");
  const bool avx = impl == 0 && HaveAvx2();
  if (in.element_type() == ffi::DataType::F32) {
    const int fmt = FmtOf(out->element_type());
    if (fmt < 0) return ffi::Error::InvalidArgument("taco_fp8_cast: output must be an FP8 type");
    const float* x = static_cast<const float*>(in.untyped_data());
    uint8_t* q = static_cast<uint8_t*>(out->untyped_data());
#if TACO_X86
    if (avx) return cast_to_fp8_avx(x, q, n, fmt, clamp), ffi::Error::Success();
#endif
    for (int64_t i = 0; i < n; ++i) q[i] = f32_to_fp8(clamp > 0 ? std::min(std::max(x[i], -clamp), clamp) : x[i], fmt);
    return ffi::Error::Success();
  }
  const int fmt = FmtOf(in.element_type());
  if (fmt < 0 || out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("taco_fp8_cast: expects f32 -> fp8 or fp8 -> f32");
  const uint8_t* q = static_cast<const uint8_t*>(in.untyped_data());
  float* x = static_cast<float*>(out->untyped_data());
#if TACO_X86
  if (avx) return cast_from_fp8_avx(q, x, n, fmt), ffi::Error::Success();
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = fp8_to_f32(q[i], fmt);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace taco

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoEncodeCpu, taco::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<float>("lam")
                                  .Attr<float>("fmax")
                                  .Attr<float>("target_range")
                                  .Attr<int64_t>("n_groups")
                                  .Attr<int64_t>("last_count")
                                  .Attr<int32_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoDecodeCpu, taco::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("has_a")
                                  .Attr<int32_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoFp8CastCpu, taco::CastImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("clamp")
                                  .Attr<int32_t>("impl"));

// Plain C entry points (ctypes) for quick checks without JAX.
extern "C" {
int taco_cpu_has_avx2() { return taco::HaveAvx2() ? 1 : 0; }
}
