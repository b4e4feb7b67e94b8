"""Numerical constants of the TACO codec (TACO_SPEC.md §2), float32, named once for every
implementation (the C++/CUDA ones through `custom_calls/taco_constants.h`, checked by tests)."""

from __future__ import annotations

#: Floor of the regularised mean square (step 2), of the absmax and of s (step 4), and of a in
#: decode, so no division by zero.
EPS = 1e-12
#: Clip range of the adaptive scale a = F / sqrt(max(m + λ, EPS)) (step 2).
ADAPTIVE_SCALE_MIN = 1e-3
ADAPTIVE_SCALE_MAX = 1e3
#: Upper clip of the quantization scale s = absmax / R (step 4).
SCALE_MAX = 1e6
#: Largest finite FP8 values F (OCP FP8: E4M3FN 448, E5M2 57344); `config.fp8_max` reads ml_dtypes.
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
#: Default λ added to a group's mean square before the adaptive scale.
DEFAULT_LAM = 1e-6
#: Group sizes G: powers of two (for the WHT) from MIN_GROUP_SIZE to MAX_GROUP_SIZE.
MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 512
GROUP_SIZES = (32, 64, 128, 256, 512)
