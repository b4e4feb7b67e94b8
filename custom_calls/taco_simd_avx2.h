// AVX2+FMA+F16C helpers shared by the AVX2 and AVX-512 kernels of the TACO group codec
// (taco_kernel_avx2.cc, taco_kernel_avx512.cc): element types, prefetch, the per-block scale math
// of the encoders on 8-lane vectors, their exact path, and the choice of a kernel instantiation by
// FP8 format, group size and message dtype. Compiled for the AVX2 target function by
// function (__attribute__((target))); GCC inlines them into AVX-512 callers too (their ISA is a
// subset), so both kernels run the same operations in the same order: bit-identical results.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "taco_cpu_common.h"
#include "taco_kernel_avx2.h"
#include "taco_kernel_scalar.h"

#if TACO_X86
#include <immintrin.h>

#define TACO_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace taco {
namespace simd {

constexpr int64_t kPrefetchBytes = 8192;  // the encoders' software prefetch distance (G <= 256)

// Element type of a message dtype (MsgDtype): float, or the 16-bit pattern of bfloat16 / float16.
template <int DT>
using Elem = std::conditional_t<DT == kF32, float, uint16_t>;

// Whether vector j (8 elements from the group's start) begins a 64-byte cache line: prefetch there.
template <int DT>
constexpr bool LineStart(int j) {
  return (j * 8 * static_cast<int>(sizeof(Elem<DT>))) % 64 == 0;
}

TACO_AVX2 inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

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

// 8 x n / (double(c) * double(d)) rounded to float: k = a / (sqrt(G) s) of the fused encoders.
TACO_AVX2 inline __m256 ratio_pd(__m256 n, __m256 c, __m256 d) {
  const __m256d lo = _mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(n)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(c)),
                                                 _mm256_cvtps_pd(_mm256_castps256_ps128(d))));
  const __m256d hi = _mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(n, 1)),
                                   _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)),
                                                 _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1))));
  return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
}

// Steps 2-3 of the encoders for a block of up to 8 groups, one group per lane: from the sums of
// squares acc[8], lane-wise absmax mxv[8] and element counts cnt (32-byte aligned), the adaptive
// scales av, quantization scales sv and factors kv = a / (sqrt(G) s) (each 8 floats, 32-byte
// aligned). Returns the bit mask of the first nb groups whose sum of squares is not finite: those
// take the exact path (encode_group_slow). Always inlined: the acc and mxv vectors stay in
// registers, and GCC's unit-growth limit would otherwise leave a call in the larger encoders.
TACO_AVX2 __attribute__((always_inline)) inline int block_scales(const __m256* acc, const __m256* mxv, const float* cnt, int nb,
                                  const EncodeParams& p, float* av, float* sv, float* kv) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256 vr = _mm256_set1_ps(p.range);
  // 2. adaptive scales a (spec §2 steps 1-2, the reference's ops in the same order)
  const __m256 ss = hsum8x8(acc);
  const __m256 m = _mm256_div_ps(ss, _mm256_load_ps(cnt));
  const __m256 v = nan_max_c(_mm256_add_ps(m, _mm256_set1_ps(p.lam)), _mm256_set1_ps(EPS));
  const __m256 a = nan_min_c(nan_max_c(_mm256_div_ps(_mm256_set1_ps(p.fmax), _mm256_sqrt_ps(v)), _mm256_set1_ps(ADAPTIVE_SCALE_MIN)),
                             _mm256_set1_ps(ADAPTIVE_SCALE_MAX));
  _mm256_store_ps(av, a);
  // A non-finite sum of squares: the group holds NaN/Inf, or finite values overflowed it.
  const int slow =
      _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign_mask, ss), _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)) &
      ((1 << nb) - 1);
  // 3. quantization scales s from y_max = a M / sqrt(G); factors k = a / (sqrt(G) s)
  const __m256 vsq = _mm256_set1_ps(p.sqrt_g);
  const __m256 ymax = _mm256_div_ps(_mm256_mul_ps(hmax8x8(mxv), a), vsq);
  const __m256 s = _mm256_min_ps(_mm256_set1_ps(SCALE_MAX),
                                 _mm256_max_ps(_mm256_set1_ps(EPS), _mm256_div_ps(_mm256_max_ps(_mm256_set1_ps(EPS), ymax), vr)));
  _mm256_store_ps(sv, s);
  _mm256_store_ps(kv, ratio_pd(a, vsq, s));
  return slow;
}

// The exact path of one group x (G elements of dtype DT) whose sum of squares is not finite:
// encode_group_exact with adaptive scale a if every value is finite (finite values overflowed
// the sum), else a NaN scale *s_out and NaN codes q.
template <int G, int FMT, int DT>
TACO_AVX2 inline void encode_group_slow(const Elem<DT>* x, uint8_t* q, float* s_out, float a, const EncodeParams& p) {
  alignas(32) float xf[G];  // the group in float32 (exact)
  const float* xp = xf;
  if constexpr (DT == kF32) {
    xp = x;
  } else {
    for (int i = 0; i < G; ++i) xf[i] = narrow_to_f32(x[i], DT);
  }
  if (std::all_of(xp, xp + G, [](float t) { return std::isfinite(t); })) {
    encode_group_exact(xp, q, s_out, a, p);
  } else {
    *s_out = std::nanf("");
    std::memset(q, fp8_nan(FMT), G);
  }
}

template <int N>
using IntC = std::integral_constant<int, N>;

// make(IntC<V>{}) for group size g = 8 V (32, 64, 128, 256 or 512); nullptr for another g.
template <typename Fn, typename Make>
Fn ByGroupSize(int g, Make make) {
  switch (g) {
    case 32: return make(IntC<4>{});
    case 64: return make(IntC<8>{});
    case 128: return make(IntC<16>{});
    case 256: return make(IntC<32>{});
    case 512: return make(IntC<64>{});
    default: return nullptr;
  }
}

// The kernel instantiation make(IntC<V>{}, IntC<FMT>{}, IntC<DT>{}) for FP8 format fmt (kE4M3,
// else kE5M2), group size g = 8 V and message dtype dt (kF32, kBF16, else kF16); nullptr for a g
// outside 32..512.
template <typename Fn, typename Make>
Fn ByKernel(int fmt, int g, int dt, Make make) {
  const auto by_fmt = [&](auto f) -> Fn {
    const auto by_dt = [&](auto d) -> Fn { return ByGroupSize<Fn>(g, [&](auto v) -> Fn { return make(v, f, d); }); };
    return dt == kF32 ? by_dt(IntC<kF32>{}) : dt == kBF16 ? by_dt(IntC<kBF16>{}) : by_dt(IntC<kF16>{});
  };
  return fmt == kE4M3 ? by_fmt(IntC<kE4M3>{}) : by_fmt(IntC<kE5M2>{});
}

// The encoder K<V, FMT, DT>::kFn for fmt, g = 8 V and dt (ByKernel); nullptr for a g outside 32..512.
template <template <int, int, int> class K>
EncodeFn EncoderFor(int fmt, int g, int dt) {
  return ByKernel<EncodeFn>(fmt, g, dt, [](auto v, auto f, auto d) -> EncodeFn {
    return K<decltype(v)::value, decltype(f)::value, decltype(d)::value>::kFn;
  });
}

// The decoder K<V, FMT, DT, ACC>::kFn likewise; acc: the one that adds to a float32 output
// (nullptr for another dt).
template <template <int, int, int, bool> class K>
DecodeFn DecoderFor(int fmt, int g, int dt, bool acc) {
  if (acc) {
    if (dt != kF32) return nullptr;
    return ByKernel<DecodeFn>(fmt, g, kF32, [](auto v, auto f, auto) -> DecodeFn {
      return K<decltype(v)::value, decltype(f)::value, kF32, true>::kFn;
    });
  }
  return ByKernel<DecodeFn>(fmt, g, dt, [](auto v, auto f, auto d) -> DecodeFn {
    return K<decltype(v)::value, decltype(f)::value, decltype(d)::value, false>::kFn;
  });
}

}  // namespace simd
}  // namespace taco

#endif  // TACO_X86
