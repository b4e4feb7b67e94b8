// AVX-512 (F, BW, DQ, VL) CPU encoder and decoder of the TACO group codec, compiled for that
// target function by function (__attribute__((target))) and chosen at run time before the AVX2
// kernels (taco_kernel_avx2.h), so the library still runs on any x86-64 (the reduction, casts and
// conversions stay AVX2). Each 512-bit vector holds the same 8-element vector of two groups side
// by side, so every lane runs the AVX2 kernel's operations in the same order: bit-identical to
// the AVX2 and scalar kernels.
#pragma once

#include <cstdint>

#include "taco_cpu_common.h"
#include "taco_kernel_avx2.h"

namespace taco {

// Whether this CPU has AVX-512 F, BW, DQ and VL besides AVX2, FMA and F16C (read once).
bool HaveAvx512();

#if TACO_X86
// The encoder for FP8 format `fmt`, group size g and message dtype dt (MsgDtype); nullptr for a
// G outside 32..512. Same contract as EncodeAvx.
EncodeFn EncodeAvx512(int fmt, int g, int dt);
// The decoder likewise (same contract as DecodeAvx; acc: adds to a float32 output).
DecodeFn DecodeAvx512(int fmt, int g, int dt, bool acc = false);
#endif

}  // namespace taco
