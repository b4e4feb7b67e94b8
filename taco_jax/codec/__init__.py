"""Message codecs: TACO (spec §2), per-tensor / per-group FP8, int8, int4, TAH-style tiles, and the identity."""

from taco_jax.codec.config import CODEC_KINDS, NONE, TACO, CodecConfig, fp8_max
from taco_jax.codec.metrics import cosine, max_rel_error, sqnr_db
from taco_jax.codec.reference import (
    Encoded,
    check_finite,
    decode,
    decode_groups,
    encode,
    encode_groups,
    hadamard,
    nonfinite_sites,
    raise_if_nonfinite,
    roundtrip,
    wht,
)

__all__ = ["CODEC_KINDS", "NONE", "TACO", "CodecConfig", "Encoded", "check_finite", "cosine", "decode",
           "decode_groups", "encode", "encode_groups", "fp8_max", "hadamard", "max_rel_error", "nonfinite_sites",
           "raise_if_nonfinite", "roundtrip", "sqnr_db", "wht"]
