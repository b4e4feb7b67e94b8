// AVX2+FMA+F16C CPU kernels of the TACO group codec, compiled for that target function by function
// (__attribute__((target))) and chosen at run time, so the library runs on any x86-64 (and builds
// elsewhere, where HaveAvx2() is false). Bit-identical to the scalar kernels (taco_kernel_scalar.h).
#pragma once

#include <cstdint>

#include "taco_cpu_common.h"

namespace taco {

// Whether this CPU has AVX2, FMA and F16C (read once).
bool HaveAvx2();

// Encodes groups [g0, g1) of x (G elements per group, of the message dtype the function was chosen
// for) into codes q and scales s_out, a_out; `stream`: use streaming stores for the codes (q 32-byte aligned).
using EncodeFn = void (*)(const void* x, uint8_t* q, float* s_out, float* a_out, int64_t g0, int64_t g1,
                          const EncodeParams& p, bool stream);
// Decodes groups [g0, g1) (a = nullptr for the folded layout) into out, of the function's dtype
// (clipped and rounded as f32_to_narrow), or adds them to a float32 out (the accumulating variant).
using DecodeFn = void (*)(const uint8_t* q, const float* s, const float* a, float sqrt_g, void* out, int64_t g0,
                          int64_t g1, bool stream);

// Transform-domain reduction of groups [g0, g1) (see reduce_group_scalar): P ranks' codes q[r]
// [N, G], scales s[r], a[r] [N] (a = nullptr: folded) -> codes q_out [N, G], scales s_out [N].
using ReduceFn = void (*)(const uint8_t* const* q, const float* const* s, const float* const* a, int64_t P,
                          float range, uint8_t* q_out, float* s_out, int64_t g0, int64_t g1);

#if TACO_X86
ReduceFn ReduceAvx(int fmt, int g);
// The kernels for FP8 format `fmt`, group size g and message dtype dt (MsgDtype) (nullptr for a G
// outside 32..512); acc: the decoder that adds to a float32 output (dt must be kF32).
EncodeFn EncodeAvx(int fmt, int g, int dt);
DecodeFn DecodeAvx(int fmt, int g, int dt, bool acc = false);
// Elementwise float32 -> FP8 (clamp > 0: through the encoder's quantizer, clamped to +-clamp) and back.
void cast_to_fp8_avx(const float* x, uint8_t* q, int64_t n, int fmt, float clamp);
void cast_from_fp8_avx(const uint8_t* q, float* x, int64_t n, int fmt);
// Elementwise float32 -> dt (clip: to dt's finite range first; the decoder's store) and dt -> float32
// (the encoder's load), and x = float32(dt(x)) in place; bit-identical to the scalar versions.
void convert_from_f32_avx(const float* x, void* out, int64_t n, int dt, bool clip);
void convert_to_f32_avx(const void* x, float* out, int64_t n, int dt);
void round_through_avx(float* x, int64_t n, int dt);
#endif

}  // namespace taco
