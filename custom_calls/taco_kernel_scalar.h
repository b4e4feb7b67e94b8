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

}  // namespace taco
