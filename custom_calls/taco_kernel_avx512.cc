// AVX-512 CPU encoder and decoder of the TACO group codec (see taco_kernel_avx512.h and README.md).
//
// Layout: a 512-bit vector is [8 floats of group b | the same 8 floats of group b + 1], so the
// encoder and decoder of taco_kernel_avx2.cc run on two groups per instruction with each lane's
// operations (loads, squares, butterflies, maxima, quantizer, stores) unchanged. The per-block
// scale math works on 8-lane vectors, as there.

// GCC 12 flags the intrinsics' own `__Y = __Y` (an intentionally undefined vector) under a
// function-level AVX-512 target as -Wmaybe-uninitialized; the warning is about the header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "taco_kernel_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "taco_kernel_scalar.h"
#include "taco_simd_avx2.h"

namespace taco {

#if TACO_X86
namespace {

#define TACO_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

using namespace simd;  // the shared AVX2 helpers (taco_simd_avx2.h), inlined here

// 8 message values at p0 (low half) and 8 at p1 (high half) -> 16 floats, exact. bfloat16: the
// 16-bit halves placed in the high half of each float by one zero-masked word permutation.
template <int DT>
TACO_AVX512 inline __m512 load2x8(const Elem<DT>* p0, const Elem<DT>* p1) {
  if constexpr (DT == kF32) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1);
  } else {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
    if constexpr (DT == kBF16) {
      const __m512i idx = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 16);
      return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(h)));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// In-register butterflies over element strides 1, 2, 4 of each 8-float half:
// out = x * sign + swapped (u + w in the lower element of each pair, u - w in the upper).
TACO_AVX512 inline __m512 wht8x2(__m512 x) {
  const __m512 sg1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 sg2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 sg4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  x = _mm512_fmadd_ps(x, sg1, _mm512_permute_ps(x, 0xB1));
  x = _mm512_fmadd_ps(x, sg2, _mm512_permute_ps(x, 0x4E));
  x = _mm512_fmadd_ps(x, sg4, _mm512_shuffle_f32x4(x, x, 0xB1));
  return x;
}

// max |y[j]| over N vectors (lane-wise) as a tree: max is exact, so any order gives the same
// result (for the finite values the encoder uses it on); the first level takes the maximum of
// absolute values in one VRANGEPS (imm 0b1011: max of |a|, |b|, sign cleared).
template <int N>
TACO_AVX512 inline __m512 abs_max_tree(const __m512* y) {
  if constexpr (N == 1) {
    return _mm512_abs_ps(y[0]);
  } else if constexpr (N == 2) {
    return _mm512_range_ps(y[0], y[1], 0xB);
  } else {
    return _mm512_max_ps(abs_max_tree<N / 2>(y), abs_max_tree<N / 2>(y + N / 2));
  }
}

// Butterflies across vectors (element strides 8, 16, ..., 8 (V/2)).
template <int V>
TACO_AVX512 inline void wht_cross(__m512* y) {
#pragma GCC unroll 16
  for (int h = 1; h < V; h <<= 1) {
#pragma GCC unroll 64
    for (int j0 = 0; j0 < V; j0 += 2 * h) {
#pragma GCC unroll 64
      for (int j = j0; j < j0 + h; ++j) {
        const __m512 u = y[j], w = y[j + h];
        y[j] = _mm512_add_ps(u, w);
        y[j + h] = _mm512_sub_ps(u, w);
      }
    }
  }
}

// Butterflies over vector strides 8 .. V/2 of a pair of groups held in L1 (16 floats per
// vector), after the 64-element blocks were transformed in registers; folds in the absmax.
template <int V, bool ABSMAX = true>
TACO_AVX512 inline void wht_cross_mem(float* yb, __m512* absmax) {
  for (int h = 8; h < V; h <<= 1) {
    const bool last = 2 * h == V;
    for (int i0 = 0; i0 < V; i0 += 2 * h) {
#pragma GCC unroll 8
      for (int j = i0; j < i0 + h; ++j) {
        const __m512 u = _mm512_load_ps(yb + 16 * j), w = _mm512_load_ps(yb + 16 * (j + h));
        const __m512 sum = _mm512_add_ps(u, w), diff = _mm512_sub_ps(u, w);
        _mm512_store_ps(yb + 16 * j, sum);
        _mm512_store_ps(yb + 16 * (j + h), diff);
        if (ABSMAX && last) *absmax = _mm512_max_ps(*absmax, _mm512_max_ps(_mm512_abs_ps(sum), _mm512_abs_ps(diff)));
      }
    }
  }
}

// The codec's quantizer in its pre-packed form (taco_kernel_avx2.cc, fp8_quantize_pre_avx), 16 lanes,
// for finite v (a group holding NaN/Inf is written apart): min(|v|, r) is one VRANGEPS (imm 0b1010:
// the operand of smaller magnitude, sign cleared), the same value as ANDNOT + MINPS there.
template <int FMT>
struct Fp8Pre {
  static constexpr int kM = FMT == kE4M3 ? 3 : 2;
  static constexpr int kMinE = FMT == kE4M3 ? 121 : 113;
  static constexpr int kShift = 7 - kM;
  static constexpr int kOff = (kMinE + 23 - kM) << kM;
};

template <int FMT>
TACO_AVX512 inline __m512i fp8_quantize_pre(__m512 v, __m512 r) {
  using P = Fp8Pre<FMT>;
  const __m512 av = _mm512_range_ps(v, r, 0xA);
  const __m512i e = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(av), _mm512_set1_epi32(0x7F800000)),
                                     _mm512_set1_epi32(P::kMinE << 23));
  const __m512i c = _mm512_add_epi32(e, _mm512_set1_epi32((23 - P::kM) << 23));
  const __m512i t = _mm512_castps_si512(_mm512_add_ps(av, _mm512_castsi512_ps(c)));
  return _mm512_madd_epi16(t, _mm512_set1_epi32((1 << 16) | (1 << P::kShift)));
}

// Packs 4 quantizer outputs of a pair of groups into 64 codes, the 32 of group b then the 32 of
// group b + 1, signs from the bit 31 of f (pack4_signed_fp8 of the AVX2 kernel on each half).
template <int FMT>
TACO_AVX512 inline __m512i pack4_signed_fp8x2(const __m512i* c, const __m512i* f) {
  using P = Fp8Pre<FMT>;
  const __m512i off = _mm512_set1_epi16(P::kOff);
  const __m512i m01 = _mm512_sub_epi16(_mm512_srli_epi16(_mm512_packs_epi32(c[0], c[1]), P::kShift), off);
  const __m512i m23 = _mm512_sub_epi16(_mm512_srli_epi16(_mm512_packs_epi32(c[2], c[3]), P::kShift), off);
  const __m512i mag = _mm512_packus_epi16(m01, m23);
  const __m512i sgn = _mm512_packs_epi16(_mm512_packs_epi32(f[0], f[1]), _mm512_packs_epi32(f[2], f[3]));
  // mag | (sgn & 0x80)
  const __m512i b = _mm512_ternarylogic_epi32(mag, sgn, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), b);
}

template <bool STREAM>
TACO_AVX512 inline void store32(uint8_t* p, __m256i v) {
  if constexpr (STREAM) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

// Encodes groups [g0, g1) in blocks of 8 (4 for G = 512) as encode_range_t of the AVX2 kernel,
// two groups per vector: (1) per pair, load both once: sums of squares, raw WHT, absmax, the
// transforms spilled to an L1 scratch; (2)-(3) the block's scales as 8-lane vectors; (4) quantize
// and store each pair. Groups whose sum of squares is not finite take the exact path.
template <int V, int FMT, int DT, bool STREAM>
TACO_AVX512 void encode_range_t(const void* x_v, uint8_t* q, float* s_out, float* a_out, int64_t g0,
                                int64_t g1, const EncodeParams& p) {
  constexpr int G = 8 * V;
  const Elem<DT>* x = static_cast<const Elem<DT>*>(x_v);
  constexpr int kB = V >= 64 ? 4 : 8;
  alignas(64) float ybuf[kB / 2][2 * G];  // pair b / 2: vector j of groups b and b + 1 at 16 j
  alignas(32) float cnt[8], av[8], sv[8], kv[8];
  const __m256 zero8 = _mm256_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  const __m512 vr16 = _mm512_set1_ps(p.range);
  for (int64_t b0 = g0; b0 < g1; b0 += kB) {
    const int nb = static_cast<int>(std::min<int64_t>(kB, g1 - b0));
    __m256 acc[8], mxv[8];
    int64_t r = b0 % p.n_groups;  // position of group b0 in its message
    for (int b = 0; b < 8; ++b) {
      acc[b] = zero8;
      mxv[b] = zero8;
      cnt[b] = 1.0f;
      if (b >= nb) continue;
      cnt[b] = r == p.n_groups - 1 ? p.last_count : static_cast<float>(G);
      r = r + 1 == p.n_groups ? 0 : r + 1;
    }
    // 1. one pass per pair of groups (an odd last group is paired with itself)
    for (int b = 0; b < nb; b += 2) {
      const Elem<DT>* x0 = x + (b0 + b) * G;
      const Elem<DT>* x1 = b + 1 < nb ? x0 + G : x0;
      float* yb = ybuf[b / 2];
      __m512 sq = zero, mx = zero;
      if constexpr (V <= 8) {  // both groups in registers
        __m512 y[V];
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) {
          if (LineStart<DT>(j)) {
            prefetch_ahead(x0 + 8 * j);
            prefetch_ahead(x1 + 8 * j);
          }
          const __m512 v = load2x8<DT>(x0 + 8 * j, x1 + 8 * j);
          sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
          y[j] = wht8x2(v);
        }
        wht_cross<V>(y);
        mx = abs_max_tree<V>(y);
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j) _mm512_store_ps(yb + 16 * j, y[j]);
      } else if constexpr (V == 16) {
        // G = 128: the stride-64 butterfly first, straight from the loads, x[i] - x[i + 64] kept
        // in the scratch's upper half; then each 64-element half in registers. Squares: FMAs over
        // each half, then the two added.
        __m512 sq2 = zero;
        __m512 y[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          if (LineStart<DT>(j)) {
            prefetch_ahead(x0 + 8 * j);
            prefetch_ahead(x0 + 64 + 8 * j);
            prefetch_ahead(x1 + 8 * j);
            prefetch_ahead(x1 + 64 + 8 * j);
          }
          const __m512 u = load2x8<DT>(x0 + 8 * j, x1 + 8 * j), w = load2x8<DT>(x0 + 64 + 8 * j, x1 + 64 + 8 * j);
          sq = _mm512_fmadd_ps(u, u, sq);
          sq2 = _mm512_fmadd_ps(w, w, sq2);
          y[j] = wht8x2(_mm512_add_ps(u, w));
          _mm512_store_ps(yb + 16 * (8 + j), _mm512_sub_ps(u, w));
        }
        sq = _mm512_add_ps(sq, sq2);
        wht_cross<8>(y);
        mx = abs_max_tree<8>(y);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm512_store_ps(yb + 16 * j, y[j]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) y[j] = wht8x2(_mm512_load_ps(yb + 16 * (8 + j)));
        wht_cross<8>(y);
        mx = _mm512_max_ps(mx, abs_max_tree<8>(y));
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) _mm512_store_ps(yb + 16 * (8 + j), y[j]);
      } else {  // 64-element blocks in registers, then the wider strides through L1
        for (int j0 = 0; j0 < V; j0 += 8) {
          __m512 y[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            if (V <= 32 && LineStart<DT>(j)) {
              prefetch_ahead(x0 + 8 * (j0 + j));
              prefetch_ahead(x1 + 8 * (j0 + j));
            }
            const __m512 v = load2x8<DT>(x0 + 8 * (j0 + j), x1 + 8 * (j0 + j));
            sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
            y[j] = wht8x2(v);
          }
          wht_cross<8>(y);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) _mm512_store_ps(yb + 16 * (j0 + j), y[j]);
        }
        wht_cross_mem<V>(yb, &mx);
      }
      acc[b] = _mm512_castps512_ps256(sq);
      mxv[b] = _mm512_castps512_ps256(mx);
      if (b + 1 < nb) {
        acc[b + 1] = _mm512_extractf32x8_ps(sq, 1);
        mxv[b + 1] = _mm512_extractf32x8_ps(mx, 1);
      }
    }
    // 2-3. adaptive and quantization scales, factors k; groups for the exact path
    const int slow = block_scales(acc, mxv, cnt, nb, p, av, sv, kv);
    // 4. codes, a pair of groups per vector; a group on the slow path is written apart
    for (int b = 0; b < nb; b += 2) {
      const bool two = b + 1 < nb;
      const bool put0 = !((slow >> b) & 1), put1 = two && !((slow >> (b + 1)) & 1);
      const float* yb = ybuf[b / 2];
      uint8_t* qp0 = q + (b0 + b) * G;
      uint8_t* qp1 = qp0 + G;
      if (put0 || put1) {
        const __m512 vk = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcast_ss(kv + b)),
                                             _mm256_broadcast_ss(kv + b + 1), 1);
#pragma GCC unroll 16
        for (int j = 0; j < V; j += 4) {
          __m512i c[4], sgn[4];
          for (int t = 0; t < 4; ++t) {
            const __m512 yv = _mm512_load_ps(yb + 16 * (j + t));
            sgn[t] = _mm512_castps_si512(yv);  // k > 0: the code's sign is y's
            c[t] = fp8_quantize_pre<FMT>(_mm512_mul_ps(yv, vk), vr16);
          }
          const __m512i packed = pack4_signed_fp8x2<FMT>(c, sgn);
          if (put0) store32<STREAM>(qp0 + 8 * j, _mm512_castsi512_si256(packed));
          if (put1) store32<STREAM>(qp1 + 8 * j, _mm512_extracti64x4_epi64(packed, 1));
        }
      }
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const int bb = b + h;
        const int64_t gi = b0 + bb;
        uint8_t* qp = q + gi * G;
        a_out[gi] = av[bb];
        if (!((slow >> bb) & 1)) {
          s_out[gi] = sv[bb];
          continue;
        }
        encode_group_slow<G, FMT, DT>(x + gi * G, qp, s_out + gi, av[bb], p);
      }
    }
  }
  if constexpr (STREAM) _mm_sfence();  // streaming stores are weakly ordered: fence on this thread
}

// 8 x 1 / (double(c) * double(d)) rounded to float: the decode factor (recip_prod_pd of the AVX2 kernel).
TACO_AVX512 inline __m256 recip_prod_pd(__m256 c, __m256 d) {
  const __m512d q = _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_mul_pd(_mm512_cvtps_pd(c), _mm512_cvtps_pd(d)));
  return _mm512_cvtpd_ps(q);
}

// 16 codes of group b (vectors j, j + 1) at c0 and 16 of group b + 1 at c1 -> the pair vectors j
// (lo) and j + 1 (hi), scaled by 2^-8 (E4M3) or 1 (E5M2): fp8x16_to_f32_scaled of the AVX2 kernel
// on 32 codes at once.
template <int FMT>
TACO_AVX512 inline void fp8x2x16_to_f32_scaled(const uint8_t* c0, const uint8_t* c1, __m512* lo, __m512* hi) {
  const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c1)), 1);
  const __m512i c = _mm512_cvtepu8_epi16(b);  // words: b's 16 codes, then b + 1's
  __m512i h;
  if constexpr (FMT == kE5M2) {
    h = _mm512_slli_epi16(c, 8);
  } else {
    const __m512i em7 = _mm512_and_si512(_mm512_slli_epi16(c, 7), _mm512_set1_epi16(0x3F80));
    const __m512i sgn = _mm512_and_si512(_mm512_slli_epi16(c, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)));
    const __m512i base = _mm512_or_si512(em7, sgn);
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(em7, _mm512_set1_epi16(0x3F80));
    h = _mm512_or_si512(base, _mm512_maskz_mov_epi16(nan, _mm512_set1_epi16(0x7E00)));
  }
  // qwords [b: j | b: j+1 | b+1: j | b+1: j+1] (2 each) -> [b: j, b+1: j | b: j+1, b+1: j+1]
  h = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), h);
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// Stores a pair vector: its low half (group b) at p0, its high half (group b + 1) at p1 (each if
// non-null), as put8<DT, ACC> of the AVX2 kernel (CLIP: clipped to the dtype's range, NaN kept).
template <int DT, bool ACC>
TACO_AVX512 inline void put2x8(Elem<DT>* p0, Elem<DT>* p1, __m512 v, bool stream) {
  if constexpr (ACC) {
    static_assert(DT == kF32, "the accumulating decoder writes float32");
    const __m512 o = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0 != nullptr ? p0 : p1)),
                                        _mm256_loadu_ps(p1 != nullptr ? p1 : p0), 1);
    const __m512 sum = _mm512_add_ps(o, v);
    if (p0 != nullptr) _mm256_storeu_ps(p0, _mm512_castps512_ps256(sum));
    if (p1 != nullptr) _mm256_storeu_ps(p1, _mm512_extractf32x8_ps(sum, 1));
  } else if constexpr (DT == kF32) {
    if (stream) {
      if (p0 != nullptr) _mm256_stream_ps(p0, _mm512_castps512_ps256(v));
      if (p1 != nullptr) _mm256_stream_ps(p1, _mm512_extractf32x8_ps(v, 1));
    } else {
      if (p0 != nullptr) _mm256_storeu_ps(p0, _mm512_castps512_ps256(v));
      if (p1 != nullptr) _mm256_storeu_ps(p1, _mm512_extractf32x8_ps(v, 1));
    }
  } else {
    const __m512 big = _mm512_set1_ps(DtypeMax(DT));
    v = _mm512_min_ps(big, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), big), v));
    __m256i h;
    if constexpr (DT == kF16) {
      h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i hi = _mm512_srli_epi32(u, 16);
      const __m512i rne = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, rne), 16);
      const __m512i qnan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7FC0));
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, qnan));
    }
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p0), _mm256_castsi256_si128(h));
      if (p1 != nullptr) _mm_stream_si128(reinterpret_cast<__m128i*>(p1), _mm256_extracti128_si256(h, 1));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p0), _mm256_castsi256_si128(h));
      if (p1 != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(p1), _mm256_extracti128_si256(h, 1));
    }
  }
}

// Decodes groups [g0, g1) as decode_range_avx of the AVX2 kernel, two groups per vector.
template <int V, int FMT, int DT, bool ACC>
TACO_AVX512 void decode_range_avx512(const uint8_t* q, const float* s, const float* a, float sqrt_g, void* out_v,
                                     int64_t g0, int64_t g1, bool stream) {
  constexpr int G = 8 * V;
  Elem<DT>* out = static_cast<Elem<DT>*>(out_v);
  alignas(32) float kv[8], amax[8];
  alignas(64) float ybuf[V > 16 ? 2 * G : 16];
  for (int64_t b0 = g0; b0 < g1; b0 += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, g1 - b0));
    for (int b = 0; b < 8; ++b) amax[b] = (a != nullptr && b < nb) ? nan_max(a[b0 + b], EPS) : 1.0f;
    _mm256_store_ps(kv, recip_prod_pd(_mm256_set1_ps(sqrt_g), _mm256_load_ps(amax)));
    for (int b = 0; b < nb; b += 2) {
      const bool two = b + 1 < nb;
      const int64_t gi = b0 + b;
      const uint8_t* qp0 = q + gi * G;
      const uint8_t* qp1 = two ? qp0 + G : qp0;
      Elem<DT>* op0 = out + gi * G;
      Elem<DT>* op1 = two ? op0 + G : nullptr;
      // s * 2^8 for E4M3 (see fp8x16_to_f32_scaled): exact, so f32(q) * s is unchanged.
      const float s0 = s[gi], s1 = two ? s[gi + 1] : s0;
      const __m512 vs = _mm512_insertf32x8(_mm512_set1_ps(FMT == kE4M3 ? s0 * 256.0f : s0),
                                           _mm256_set1_ps(FMT == kE4M3 ? s1 * 256.0f : s1), 1);
      const __m512 vk = _mm512_insertf32x8(_mm512_set1_ps(kv[b]), _mm256_set1_ps(kv[b + 1]), 1);
      if constexpr (V <= 16) {  // both groups in registers
        __m512 y[V];
#pragma GCC unroll 64
        for (int j = 0; j < V; j += 2) {
          __m512 lo, hi;
          fp8x2x16_to_f32_scaled<FMT>(qp0 + 8 * j, qp1 + 8 * j, &lo, &hi);
          y[j] = wht8x2(_mm512_mul_ps(lo, vs));
          y[j + 1] = wht8x2(_mm512_mul_ps(hi, vs));
        }
        wht_cross<V>(y);
#pragma GCC unroll 64
        for (int j = 0; j < V; ++j)
          put2x8<DT, ACC>(op0 + 8 * j, op1 != nullptr ? op1 + 8 * j : nullptr, _mm512_mul_ps(y[j], vk), stream);
      } else {  // 64-element blocks in registers, the wider strides through an L1 scratch
        for (int j0 = 0; j0 < V; j0 += 8) {
          __m512 y[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; j += 2) {
            __m512 lo, hi;
            fp8x2x16_to_f32_scaled<FMT>(qp0 + 8 * (j0 + j), qp1 + 8 * (j0 + j), &lo, &hi);
            y[j] = wht8x2(_mm512_mul_ps(lo, vs));
            y[j + 1] = wht8x2(_mm512_mul_ps(hi, vs));
          }
          wht_cross<8>(y);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) _mm512_store_ps(ybuf + 16 * (j0 + j), y[j]);
        }
        wht_cross_mem<V, false>(ybuf, nullptr);
        if constexpr (DT == kF32) {  // one group after the other: one output stream at a time
          for (int j = 0; j < V; ++j)
            put2x8<DT, ACC>(op0 + 8 * j, nullptr, _mm512_mul_ps(_mm512_load_ps(ybuf + 16 * j), vk), stream);
          if (op1 != nullptr)
            for (int j = 0; j < V; ++j)
              put2x8<DT, ACC>(nullptr, op1 + 8 * j, _mm512_mul_ps(_mm512_load_ps(ybuf + 16 * j), vk), stream);
        } else {
          for (int j = 0; j < V; ++j)
            put2x8<DT, ACC>(op0 + 8 * j, op1 != nullptr ? op1 + 8 * j : nullptr,
                            _mm512_mul_ps(_mm512_load_ps(ybuf + 16 * j), vk), stream);
        }
      }
    }
  }
  if (stream) _mm_sfence();
}

// The decoder as a type, for DecoderFor.
template <int V, int FMT, int DT, bool ACC>
struct DecodeK {
  static constexpr DecodeFn kFn = &decode_range_avx512<V, FMT, DT, ACC>;
};

template <int V, int FMT, int DT>
TACO_AVX512 void encode_range_avx512(const void* x, uint8_t* q, float* s_out, float* a_out, int64_t g0, int64_t g1,
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
  static constexpr EncodeFn kFn = &encode_range_avx512<V, FMT, DT>;
};

}  // namespace

EncodeFn EncodeAvx512(int fmt, int g, int dt) { return EncoderFor<EncodeK>(fmt, g, dt); }
DecodeFn DecodeAvx512(int fmt, int g, int dt, bool acc) { return DecoderFor<DecodeK>(fmt, g, dt, acc); }

bool HaveAvx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return HaveAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}
#else
bool HaveAvx512() { return false; }
#endif  // TACO_X86

}  // namespace taco
