"""Message codecs: TACO (spec §2), per-tensor / per-group FP8, int8, int4, TAH-style tiles, and the identity.

Floor plan (nothing here imports `taco_jax.kernels` or anything above it): `constants` (spec
numbers), `config` (CodecConfig), `hadamard` (the WHT), `family` (group math of the non-TACO
kinds), `backends` (registry of the taco group math implementations), `reference` (the jnp
specification and `encode` / `decode`), `nonfinite` (host-side "error"-policy reports),
`metrics` (fidelity numbers).
"""

from taco_jax.codec.backends import GroupBackend, get_backend, register_backend
from taco_jax.codec.config import CODEC_KINDS, NONE, TACO, CodecConfig, fp8_max
from taco_jax.codec.hadamard import hadamard, wht
from taco_jax.codec.metrics import cosine, max_rel_error, sqnr_db
from taco_jax.codec.nonfinite import check_finite, nonfinite_sites, raise_if_nonfinite
from taco_jax.codec.reference import (
    Encoded,
    decode,
    decode_groups,
    encode,
    encode_groups,
    reduce_encoded,
    reduce_groups,
    roundtrip,
)

__all__ = ["CODEC_KINDS", "NONE", "TACO", "CodecConfig", "Encoded", "GroupBackend", "check_finite", "cosine",
           "decode", "decode_groups", "encode", "encode_groups", "fp8_max", "get_backend", "hadamard",
           "max_rel_error", "nonfinite_sites", "raise_if_nonfinite", "reduce_encoded", "reduce_groups",
           "register_backend", "roundtrip", "sqnr_db", "wht"]
