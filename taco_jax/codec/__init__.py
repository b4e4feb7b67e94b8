"""Message codecs: the TACO FP8 group codec and the identity codec (TACO spec §2)."""

from taco_jax.codec.config import NONE, TACO, CodecConfig, fp8_max
from taco_jax.codec.reference import Encoded, decode, decode_groups, encode, encode_groups, hadamard, roundtrip, wht

__all__ = ["NONE", "TACO", "CodecConfig", "Encoded", "decode", "decode_groups", "encode", "encode_groups",
           "fp8_max", "hadamard", "roundtrip", "wht"]
