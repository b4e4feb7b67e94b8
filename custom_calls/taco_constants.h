// Numerical constants of the TACO codec specification (TACO_SPEC.md §2), float32, for the C++ and
// CUDA handlers. Same names and values as taco_jax/codec/constants.py (tests/test_codec.py parses
// this file and checks that they agree).
#pragma once

namespace taco {

constexpr float EPS = 1e-12f;                 // floor of the mean square, absmax, s, and a in decode
constexpr float ADAPTIVE_SCALE_MIN = 1e-3f;   // clip range of the adaptive scale a
constexpr float ADAPTIVE_SCALE_MAX = 1e3f;
constexpr float SCALE_MAX = 1e6f;             // upper clip of the quantization scale s
constexpr float E4M3_MAX = 448.0f;            // largest finite FP8 values F
constexpr float E5M2_MAX = 57344.0f;
constexpr int MIN_GROUP_SIZE = 32;            // G: a power of two in [MIN_GROUP_SIZE, MAX_GROUP_SIZE]
constexpr int MAX_GROUP_SIZE = 512;

}  // namespace taco
