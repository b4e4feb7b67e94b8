"""Group math of the non-TACO codecs: per-tensor / per-group FP8, int8, int4 (SDP4Bit-style), TAH-style tiles.

Every function maps float32 groups `[..., n_groups, G]` (the last zero-padded) to the wire buffers
`(codes, scale, prescale)` or back; `cfg` is a `CodecConfig` (not imported: config imports the
registry, which imports this). A group holding NaN/±Inf gets a NaN scale, so it decodes to NaN.

Sources: per-tensor FP8 with an absmax scale as TransformerEngine's current scaling; block-wise absmax int8 as EQuARX
(arXiv 2506.17615) and ZeRO++ (arXiv 2306.10209); 4-bit groups with Hadamard smoothing as SDP4Bit (arXiv 2410.15526);
Hadamard + low-bit tiles as TAH-Quant (arXiv 2506.01352) without its entropy-guided bit allocation and pivot swapping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec.hadamard import wht as _wht

#: Smallest scale: the smallest normal float32, so x / s never divides by a flushed denormal
#: (XLA:CPU flushes float32 denormals to zero).
S_MIN = np.float32(2.0**-126)
INT_LEVELS = {"int8": 127, "int4": 7}  # symmetric levels -L..L (int4: -8 unused, grid symmetric)
TAH_LEVELS = 15  # asymmetric: 16 levels 0..15 between the tile's min and max


def _finite(xg: jax.Array, axis=-1) -> jax.Array:
    return jnp.all(jnp.isfinite(xg), axis=axis)


def pack4(q: jax.Array) -> jax.Array:
    """uint8 nibbles [..., G] (values 0..15) -> bytes [..., G/2]: element 2i low nibble, 2i+1 high."""
    q = q.astype(jnp.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack4(b: jax.Array) -> jax.Array:
    """Inverse of `pack4`: bytes [..., G/2] -> uint8 nibbles [..., G]."""
    lo, hi = b & 0xF, b >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


# ----------------------------------- FP8 with an absmax scale -----------------------------------


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def encode_fp8(xg: jax.Array, cfg):
    """FP8 codes with s = max(absmax / R, 2^-126) per group: xg float32 [..., n_groups, G]
    (fp8_tensor: [..., 1, n], the message) -> (codes fp8 like xg, s float32 [..., n_groups], None)."""
    y = _wht(xg) if cfg.hadamard else xg
    r = np.float32(cfg.target_range)
    s = jnp.maximum(jnp.max(jnp.abs(y), axis=-1) / r, S_MIN)
    s = jnp.where(_finite(xg), s, np.float32(np.nan))
    codes = jnp.clip(y / s[..., None], -r, r).astype(cfg.code_dtype)  # RNE, saturating
    return codes, s, None


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def decode_fp8(codes, s, prescale, cfg):
    y = codes.astype(jnp.float32) * s[..., None]
    return _wht(y) if cfg.hadamard else y


# ------------------------------- symmetric int8 / int4 (absmax) -------------------------------


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def encode_int(xg: jax.Array, cfg):
    """Symmetric integer codes q = round(y / s) in [-L, L] (ties to even), s = max(absmax / L, 2^-126);
    L = 127 (int8, codes int8) or 7 (int4, codes q + 8 packed two per byte, uint8 [..., G/2])."""
    levels = INT_LEVELS[cfg.kind]
    y = _wht(xg) if cfg.hadamard else xg
    finite = _finite(xg)
    s = jnp.maximum(jnp.max(jnp.abs(y), axis=-1) / np.float32(levels), S_MIN)
    q = jnp.clip(jnp.round(y / s[..., None]), -levels, levels)
    q = jnp.where(finite[..., None], q, 0.0)  # defined codes; the NaN scale marks the group
    s = jnp.where(finite, s, np.float32(np.nan))
    if cfg.kind == "int8":
        return q.astype(jnp.int8), s, None
    return pack4((q + 8).astype(jnp.uint8)), s, None


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def decode_int(codes, s, prescale, cfg):
    if cfg.kind == "int8":
        q = codes.astype(jnp.float32)
    else:
        q = unpack4(codes).astype(jnp.float32) - 8.0
    y = q * s[..., None]
    return _wht(y) if cfg.hadamard else y


# ------------------------------- TAH-style asymmetric 4-bit tiles -------------------------------


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def encode_tah(xg: jax.Array, cfg):
    """Tile = group of G: y = WHT(x); z = min(y), s = max((max(y) - z) / 15, 2^-126);
    q = round((y - z) / s) in [0, 15], packed two per byte. Wire: codes, s, z (FP32)."""
    y = _wht(xg)
    finite = _finite(xg)
    lo, hi = jnp.min(y, axis=-1), jnp.max(y, axis=-1)
    s = jnp.maximum((hi - lo) / np.float32(TAH_LEVELS), S_MIN)
    q = jnp.clip(jnp.round((y - lo[..., None]) / s[..., None]), 0, TAH_LEVELS)
    q = jnp.where(finite[..., None], q, 0.0)
    s = jnp.where(finite, s, np.float32(np.nan))
    return pack4(q.astype(jnp.uint8)), s, lo


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def decode_tah(codes, s, zero, cfg):
    y = zero[..., None] + unpack4(codes).astype(jnp.float32) * s[..., None]
    return _wht(y)
