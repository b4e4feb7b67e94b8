"""Message codecs: TACO (spec §2), per-tensor / per-group FP8, int8, int4, TAH-style tiles, and the identity.

Nothing here imports `taco_jax.kernels` or anything above it; `dispatch` (`encode` / `decode` /
`resolve_codec`) is the one interface to every kind and backend."""

from taco_jax.codec.backends import GroupBackend, WireCodec, get_backend, register_backend
from taco_jax.codec.config import NONE, TACO, CodecConfig, fp8_max
from taco_jax.codec.dispatch import Encoded, decode, encode, reduce_encoded, resolve_codec, roundtrip
from taco_jax.codec.hadamard import hadamard, wht
from taco_jax.codec.kinds import CodecKind, codec_kinds, get_kind, register_kind
from taco_jax.codec.metrics import cosine, max_rel_error, sqnr_db
from taco_jax.codec.nonfinite import check_finite, nonfinite_sites, raise_if_nonfinite
from taco_jax.codec.reference import decode_groups, encode_groups, reduce_groups
from taco_jax.codec.wire import wire_for

__all__ = ["NONE", "TACO", "CodecConfig", "CodecKind", "Encoded", "GroupBackend", "WireCodec", "check_finite",
           "codec_kinds", "cosine", "decode", "decode_groups", "encode", "encode_groups", "fp8_max", "get_backend",
           "get_kind", "hadamard", "max_rel_error", "nonfinite_sites", "raise_if_nonfinite", "reduce_encoded",
           "reduce_groups", "register_backend", "register_kind", "resolve_codec", "roundtrip", "sqnr_db", "wht",
           "wire_for"]
