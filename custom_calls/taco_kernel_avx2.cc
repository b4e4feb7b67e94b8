// AVX2+FMA+F16C CPU kernels of the TACO group codec (see taco_kernel_avx2.h and README.md).

#include "taco_kernel_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "taco_kernel_scalar.h"
#include "taco_simd_avx2.h"

namespace taco {

#if TACO_X86
namespace {

using namespace simd;  // the shared helpers (taco_simd_avx2.h)

// 8 bfloat16 / float16 values -> 8 floats, exact (bfloat16: a shift; float16: vcvtph2ps).
template <int DT>
TACO_AVX2 inline __m256 widen8(__m128i h) {
  if constexpr (DT == kBF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

// 8 message values -> 8 floats, exact. bfloat16: the 16 bytes broadcast to both 128-bit lanes
// (a load, no ALU uop) and one in-lane byte shuffle into each float's high half (rather than
// vpmovzxwd, a lane-crossing shuffle, plus a shift).
template <int DT>
TACO_AVX2 inline __m256 load8(const Elem<DT>* p) {
  if constexpr (DT == kF32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (DT == kBF16) {
    const __m256i hi16 = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,
                                          -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(b, hi16));
  } else {
    return widen8<DT>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// 8 floats -> 8 bfloat16 / float16 values, bit-identical to f32_to_narrow(v, DT, CLIP): clipped to
// the dtype's finite range first (CLIP; NaN kept), then rounded to nearest even as XLA's convert
// (bfloat16: integer rounding, NaN -> sign | 0x7FC0; float16: vcvtps2ph).
template <int DT, bool CLIP>
TACO_AVX2 inline __m128i narrow8(__m256 v) {
  if constexpr (CLIP) {
    const __m256 big = _mm256_set1_ps(DtypeMax(DT));
    v = nan_min_c(nan_max_c(v, _mm256_sub_ps(_mm256_setzero_ps(), big)), big);
  }
  if constexpr (DT == kF16) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  } else {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i rne = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, rne), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7FC0));
    const __m256i out = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
  }
}

TACO_AVX2 inline void store8(float* p, __m256 v, bool stream) {
  if (stream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

// Stores 8 decoded floats as the message dtype (narrow8 with CLIP); ACC (float32 only): p += v.
template <int DT, bool ACC, bool CLIP = true>
TACO_AVX2 inline void put8(Elem<DT>* p, __m256 v, bool stream) {
  if constexpr (ACC) {
    static_assert(DT == kF32, "the accumulating decoder writes float32");
    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v));
  } else if constexpr (DT == kF32) {
    store8(p, v, stream);
  } else {
    const __m128i h = narrow8<DT, CLIP>(v);
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    }
  }
}

// 8 x 1 / (double(c) * double(d)) rounded to float: the decode factor and 1/(sqrt(G) s).
TACO_AVX2 inline __m256 recip_prod_pd(__m256 c, __m256 d) {
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d lo = _mm256_div_pd(one, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(c)),
                                                      _mm256_cvtps_pd(_mm256_castps256_ps128(d))));
  const __m256d hi = _mm256_div_pd(one, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)),
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

// max |y[j]| over N vectors (lane-wise), as a tree of depth log2(N) rather than a chain of N
// dependent maxima: max is exact, so any order gives the same result (for the non-NaN values
// the encoder uses it on).
template <int N>
TACO_AVX2 inline __m256 abs_max_tree(const __m256* y) {
  if constexpr (N == 1) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y[0]);
  } else {
    return _mm256_max_ps(abs_max_tree<N / 2>(y), abs_max_tree<N / 2>(y + N / 2));
  }
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
template <int V, int FMT, int DT, bool STREAM>
TACO_AVX2 void encode_range_t(const void* x_v, uint8_t* q, float* s_out, float* a_out, int64_t g0,
                              int64_t g1, const EncodeParams& p) {
  constexpr int G = 8 * V;
  const Elem<DT>* x = static_cast<const Elem<DT>*>(x_v);
  // Groups per block: 8 (one vector lane each), 4 for G = 512 so that the block's transforms
  // (4 x 2 KiB) and input stay in L1.
  constexpr int kB = V >= 64 ? 4 : 8;
  alignas(32) float ybuf[kB][G];
  alignas(32) float cnt[8], av[8], sv[8], kv[8];
  const __m256 zero = _mm256_setzero_ps();
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
      const Elem<DT>* xp = x + (b0 + b) * G;
      __m256 sq = zero, mx = zero;
      if constexpr (V <= 8) {  // whole group in registers
        __m256 y[V];
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) {
          if (LineStart<DT>(j)) prefetch_ahead(xp + 8 * j);
          const __m256 v = load8<DT>(xp + 8 * j);
          sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
          y[j] = wht8(v);
        }
        wht_cross<V>(y);
        mx = abs_max_tree<V>(y);
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) _mm256_store_ps(ybuf[b] + 8 * j, y[j]);
      } else if constexpr (V == 16) {
        // G = 128: the stride-64 butterfly first, straight from the loads (x[i] +- x[i + 64]),
        // then each 64-element half in registers; absmax from registers, one store per vector.
        // Sums of squares: two accumulators (first and second half of x), then added.
        float* yb = ybuf[b];
        __m256 sq2 = zero;
        __m256 y[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          if (LineStart<DT>(j)) {
            prefetch_ahead(xp + 8 * j);
            prefetch_ahead(xp + 64 + 8 * j);
          }
          const __m256 u = load8<DT>(xp + 8 * j), w = load8<DT>(xp + 64 + 8 * j);
          sq = _mm256_fmadd_ps(u, u, sq);
          sq2 = _mm256_fmadd_ps(w, w, sq2);
          y[j] = wht8(_mm256_add_ps(u, w));
          // 16-bit dtypes: keep u - w in the scratch's upper half (overwritten below) rather than
          // load and widen x a second time
          if constexpr (DT != kF32) _mm256_store_ps(yb + 64 + 8 * j, _mm256_sub_ps(u, w));
        }
        sq = _mm256_add_ps(sq, sq2);
        wht_cross<8>(y);
        mx = abs_max_tree<8>(y);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm256_store_ps(yb + 8 * j, y[j]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          if constexpr (DT == kF32) {
            y[j] = wht8(_mm256_sub_ps(load8<DT>(xp + 8 * j), load8<DT>(xp + 64 + 8 * j)));
          } else {
            y[j] = wht8(_mm256_load_ps(yb + 64 + 8 * j));
          }
        }
        wht_cross<8>(y);
        mx = _mm256_max_ps(mx, abs_max_tree<8>(y));
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm256_store_ps(yb + 64 + 8 * j, y[j]);
      } else {  // 64-element blocks in registers, then the wider strides through L1
        float* yb = ybuf[b];
        for (int j0 = 0; j0 < V; j0 += 8) {
          __m256 y[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            if (V <= 32 && LineStart<DT>(j)) prefetch_ahead(xp + 8 * (j0 + j));
            const __m256 v = load8<DT>(xp + 8 * (j0 + j));
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
    // 2-3. adaptive and quantization scales, factors k; groups for the exact path
    const int slow = block_scales(acc, mxv, cnt, nb, p, av, sv, kv);
    // 4. codes
    for (int b = 0; b < nb; ++b) {
      const int64_t gi = b0 + b;
      uint8_t* qp = q + gi * G;
      a_out[gi] = av[b];
      if ((slow >> b) & 1) {
        encode_group_slow<G, FMT, DT>(x + gi * G, qp, s_out + gi, av[b], p);
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
        if constexpr (STREAM) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(qp + 8 * j), packed);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + 8 * j), packed);
        }
      }
    }
  }
  if constexpr (STREAM) _mm_sfence();  // streaming stores are weakly ordered: fence on this thread
}

// The encoder with the store kind fixed at compile time, so that no branch splits the unrolled
// quantize-and-pack loop (and its constants stay in registers).
template <int V, int FMT, int DT>
TACO_AVX2 void encode_range_avx(const void* x, uint8_t* q, float* s_out, float* a_out, int64_t g0, int64_t g1,
                                const EncodeParams& p, bool stream) {
  if (stream) {
    encode_range_t<V, FMT, DT, true>(x, q, s_out, a_out, g0, g1, p);
  } else {
    encode_range_t<V, FMT, DT, false>(x, q, s_out, a_out, g0, g1, p);
  }
}

// The encoder as a type, for EncoderFor.
template <int V, int FMT, int DT>
struct EncodeK {
  static constexpr EncodeFn kFn = &encode_range_avx<V, FMT, DT>;
};

template <int V, int FMT, int DT, bool ACC>
TACO_AVX2 void decode_range_avx(const uint8_t* q, const float* s, const float* a, float sqrt_g,
                                void* out_v, int64_t g0, int64_t g1, bool stream) {
  constexpr int G = 8 * V;
  Elem<DT>* out = static_cast<Elem<DT>*>(out_v);
  alignas(32) float kv[8], amax[8];
  alignas(32) float ybuf[V > 16 ? G : 8];
  for (int64_t b0 = g0; b0 < g1; b0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, g1 - b0));
    for (int b = 0; b < 8; ++b) amax[b] = (a != nullptr && b < nb) ? nan_max(a[b0 + b], EPS) : 1.0f;
    _mm256_store_ps(kv, recip_prod_pd(_mm256_set1_ps(sqrt_g), _mm256_load_ps(amax)));
    for (int b = 0; b < nb; ++b) {
      const int64_t gi = b0 + b;
      const uint8_t* qp = q + gi * G;
      Elem<DT>* op = out + gi * G;
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
        for (int j = 0; j < V; ++j) put8<DT, ACC>(op + 8 * j, _mm256_mul_ps(y[j], vk), stream);
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
        for (int j = 0; j < V; ++j) put8<DT, ACC>(op + 8 * j, _mm256_mul_ps(_mm256_load_ps(ybuf + 8 * j), vk), stream);
      }
    }
  }
  if (stream) _mm_sfence();
}

// The decoder as a type, for DecoderFor.
template <int V, int FMT, int DT, bool ACC>
struct DecodeK {
  static constexpr DecodeFn kFn = &decode_range_avx<V, FMT, DT, ACC>;
};

// Transform-domain reduction (reduce_group_scalar's operations, in the same order per element).
template <int V, int FMT>
TACO_AVX2 void reduce_range_avx(const uint8_t* const* q, const float* const* s, const float* const* a, int64_t P,
                                float range, uint8_t* q_out, float* s_out, int64_t g0, int64_t g1) {
  constexpr int G = 8 * V;
  alignas(32) float acc[G] = {};  // P >= 1 (checked by the handler): overwritten by rank 0
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 vr = _mm256_set1_ps(range);
  for (int64_t gi = g0; gi < g1; ++gi) {
    for (int64_t r = 0; r < P; ++r) {
      const float k = a != nullptr ? s[r][gi] / nan_max(a[r][gi], EPS) : s[r][gi];
      // k * 2^8 for E4M3 (fp8x16_to_f32_scaled gives q * 2^-8): exact, so q * k is unchanged.
      const __m256 vk = _mm256_set1_ps(FMT == kE4M3 ? k * 256.0f : k);
      const uint8_t* qp = q[r] + gi * G;
      if (r + 1 < P) _mm_prefetch(reinterpret_cast<const char*>(q[r + 1] + gi * G), _MM_HINT_T0);
      for (int j = 0; j < V; j += 2) {
        __m256 lo, hi;
        fp8x16_to_f32_scaled<FMT>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 8 * j)), &lo, &hi);
        lo = _mm256_mul_ps(lo, vk);
        hi = _mm256_mul_ps(hi, vk);
        if (r == 0) {
          _mm256_store_ps(acc + 8 * j, lo);
          _mm256_store_ps(acc + 8 * j + 8, hi);
        } else {
          _mm256_store_ps(acc + 8 * j, _mm256_add_ps(_mm256_load_ps(acc + 8 * j), lo));
          _mm256_store_ps(acc + 8 * j + 8, _mm256_add_ps(_mm256_load_ps(acc + 8 * j + 8), hi));
        }
      }
    }
    __m256 mx = _mm256_setzero_ps(), chk = _mm256_setzero_ps();
    for (int j = 0; j < V; ++j) {
      const __m256 v = _mm256_load_ps(acc + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_mask, v));
      chk = _mm256_add_ps(chk, _mm256_mul_ps(v, _mm256_setzero_ps()));  // NaN iff some v is Inf / NaN
    }
    uint8_t* qo = q_out + gi * G;
    if (_mm256_movemask_ps(_mm256_cmp_ps(chk, chk, _CMP_UNORD_Q))) {
      s_out[gi] = std::nanf("");
      std::memset(qo, fp8_nan(FMT), G);
      continue;
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mx);
    float m = m8[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);
    const float s2 = std::min(std::max(std::max(m, EPS) * (1.0f / range), EPS), SCALE_MAX);  // XLA: x / c -> x * (1 / c)
    s_out[gi] = s2;
    const __m256 vinv = _mm256_set1_ps(1.0f / s2);
    for (int j = 0; j < V; j += 4) {
      __m256i c[4], sgn[4];
      for (int t = 0; t < 4; ++t) {
        const __m256 v = _mm256_load_ps(acc + 8 * (j + t));
        sgn[t] = _mm256_castps_si256(v);
        c[t] = fp8_quantize_pre_avx<FMT>(_mm256_mul_ps(v, vinv), vr);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo + 8 * j), pack4_signed_fp8<FMT>(c, sgn));
    }
  }
}

template <int DT, bool CLIP>
TACO_AVX2 void from_f32_t(const float* x, Elem<DT>* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) put8<DT, false, CLIP>(out + i, _mm256_loadu_ps(x + i), false);
  for (; i < n; ++i) out[i] = f32_to_narrow(x[i], DT, CLIP);
}

template <int DT>
TACO_AVX2 void to_f32_t(const Elem<DT>* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8<DT>(x + i));
  for (; i < n; ++i) out[i] = narrow_to_f32(x[i], DT);
}

template <int DT>
TACO_AVX2 void round_through_t(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, widen8<DT>(narrow8<DT, false>(_mm256_loadu_ps(x + i))));
  for (; i < n; ++i) x[i] = narrow_to_f32(f32_to_narrow(x[i], DT, false), DT);
}

}  // namespace

EncodeFn EncodeAvx(int fmt, int g, int dt) { return EncoderFor<EncodeK>(fmt, g, dt); }
DecodeFn DecodeAvx(int fmt, int g, int dt, bool acc) { return DecoderFor<DecodeK>(fmt, g, dt, acc); }

void convert_from_f32_avx(const float* x, void* out, int64_t n, int dt, bool clip) {
  uint16_t* o = static_cast<uint16_t*>(out);
  if (dt == kF32) {
    std::memcpy(out, x, n * sizeof(float));
  } else if (dt == kBF16) {
    clip ? from_f32_t<kBF16, true>(x, o, n) : from_f32_t<kBF16, false>(x, o, n);
  } else {
    clip ? from_f32_t<kF16, true>(x, o, n) : from_f32_t<kF16, false>(x, o, n);
  }
}

void convert_to_f32_avx(const void* x, float* out, int64_t n, int dt) {
  const uint16_t* h = static_cast<const uint16_t*>(x);
  if (dt == kF32) {
    std::memcpy(out, x, n * sizeof(float));
  } else if (dt == kBF16) {
    to_f32_t<kBF16>(h, out, n);
  } else {
    to_f32_t<kF16>(h, out, n);
  }
}

void round_through_avx(float* x, int64_t n, int dt) {
  if (dt == kBF16) round_through_t<kBF16>(x, n);
  if (dt == kF16) round_through_t<kF16>(x, n);
}
ReduceFn ReduceAvx(int fmt, int g) {
  return ByKernel<ReduceFn>(fmt, g, kF32, [](auto v, auto f, auto) -> ReduceFn {
    return &reduce_range_avx<decltype(v)::value, decltype(f)::value>;
  });
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
#else
bool HaveAvx2() { return false; }
#endif  // TACO_X86

}  // namespace taco
