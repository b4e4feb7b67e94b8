"""Named codecs of the fidelity table and the ablation (docs/fidelity.md): spec defaults, fixed settings."""

from __future__ import annotations

from taco_jax.codec.config import CodecConfig

#: name -> codec; "taco" is the paper's setting (E4M3, G = 128, two FP32 scales per group).
NAMED = {
    "none": CodecConfig(kind="none"),
    "fp8_tensor": CodecConfig(kind="fp8_tensor"),
    "fp8_group": CodecConfig(kind="fp8_group"),
    "int8": CodecConfig(kind="int8"),
    "int4_had": CodecConfig(kind="int4", hadamard=True),
    "tah": CodecConfig(kind="tah"),
    "taco": CodecConfig(kind="taco"),
    "taco_folded": CodecConfig(kind="taco", scale_layout="folded"),
}
