// Portable scalar CPU kernels of the TACO group codec. Their operation order mirrors the AVX2
// kernels (taco_kernel_avx2.cc) exactly -- 8 lane accumulators, the same horizontal-sum tree, the
// same butterfly stages -- so both give bit-identical results (compiled with -ffp-contract=off).
#pragma once

#include <cstdint>

#include "taco_cpu_common.h"

namespace taco {

// Overflow path (sum of squares overflowed although every element is finite; |x| > ~1e19):
// the reference's order, y = WHT(a x), so the transform cannot overflow. Shared by both kernels.
void encode_group_exact(const float* x, uint8_t* q, float* s_out, float a, const EncodeParams& p);

// One group of p.g elements, `count` of them real: codes q, scales s_out and a_out.
void encode_group_scalar(const float* x, uint8_t* q, float* s_out, float* a_out, float count, const EncodeParams& p);

// One group: out = WHT(fp8(q) * s) * k, k the decode factor.
void decode_group_scalar(const uint8_t* q, float s, float k, int g, int fmt, float* out);

// The same for a message dtype: x holds p.g elements of dtype dt (widened exactly to float32 first).
void encode_group_scalar_dt(const void* x, int dt, uint8_t* q, float* s_out, float* a_out, float count,
                            const EncodeParams& p);

// The same for a message dtype: out receives p.g elements of dtype dt, clipped to its finite range
// and rounded as XLA's convert (`f32_to_narrow`); acc (dt float32 only): out = out + decoded.
void decode_group_scalar_dt(const uint8_t* q, float s, float k, int g, int fmt, void* out, int dt, bool acc);

// Elementwise float32 -> dt (f32_to_narrow without clipping; a copy for float32).
void convert_from_f32_scalar(const float* x, void* out, int64_t n, int dt);
// x = float32(dt(x)) in place: the rounding of a float32 value to the message dtype.
void round_through_scalar(float* x, int64_t n, int dt);

// Transform-domain reduction of group gi (taco_jax.codec.reference.reduce_groups) of P ranks' codes
// q[r] [N, G] and scales s[r], a[r] [N] (a null: folded layout):
// z_r = fp8(q_r) * k_r with k_r = s_r / max(a_r, EPS) (s_r when a is null), acc = sum over r in rank
// order (float32), s' = min(max(max(max|acc|, EPS) / range, EPS), SCALE_MAX), codes' =
// fp8(clamp(acc * (1 / s'), -range, range)); a non-finite acc gives s' = NaN and NaN codes.
void reduce_group_scalar(const uint8_t* const* q, const float* const* s, const float* const* a, int64_t P, int64_t gi,
                         int g, int fmt, float range, uint8_t* q_out, float* s_out);

}  // namespace taco
