"""Plain-jnp specification of TACO's group math (TACO spec §2): what every group backend must match.

Source: TACO (arXiv 2604.24088) §"Adaptive Scale-Hadamard Transform" and "Dual-Scale
Quantization"; the COCCL taco plugin. Differences from the plugin are explicit options
(`CodecConfig.nonfinite`). The group functions are `jax.jit(inline=True)`: traced in place inside
a jitted program, one compiled program when called eagerly. Registered as the "reference" backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import constants as C
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.hadamard import wht


def sum_fp32(x: jax.Array, dtype, acc_dtype=jnp.float32) -> jax.Array:
    """Sum over the leading (rank) axis in rank order (acc = x[0]; acc = acc + x[1]; ...), accumulated
    in `acc_dtype` (FP32 unless given), then cast to `dtype`: the one rank-order sum of the codec and
    the collectives (`reduce_groups`, `dispatch.decode_sum`, the exact and decoded all-reduce sums)."""
    acc = x[0].astype(acc_dtype)
    for i in range(1, x.shape[0]):
        acc = acc + x[i].astype(acc_dtype)
    return acc.astype(dtype)


# --- Group math: [..., n_groups, G] float32 <-> codes + scales. Kernel backends implement these two.


@functools.partial(jax.jit, inline=True, static_argnames=("cfg", "last_count"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int):
    """Encodes groups (spec §2 steps 1-5).

    Args:
      xg: float32 [..., n_groups, G], the last group zero-padded past `last_count`.
      cfg: codec configuration (fmt, group_size, lam, target_range).
      last_count: real element count of the last group (1..G); its mean square uses it.
    Returns: (codes fp8 [..., n_groups, G], s float32 [..., n_groups], a float32 [..., n_groups]);
      a group holding NaN/±Inf gets s = NaN (so it decodes to NaN).
    """
    g = cfg.group_size
    n_groups = xg.shape[-2]
    counts = np.full((n_groups,), g, np.float32)
    counts[-1] = last_count
    m = jnp.sum(xg * xg, axis=-1) / counts  # 1. mean square over real elements
    v = jnp.maximum(m + np.float32(cfg.lam), C.EPS)
    a = jnp.clip(np.float32(cfg.fmax) / jnp.sqrt(v), C.ADAPTIVE_SCALE_MIN, C.ADAPTIVE_SCALE_MAX)  # 2. adaptive scale
    y = wht(a[..., None] * xg)  # 3. orthonormal WHT per group
    r = np.float32(cfg.target_range)
    s = jnp.clip(jnp.maximum(jnp.max(jnp.abs(y), axis=-1), C.EPS) / r, C.EPS, C.SCALE_MAX)  # 4.
    finite = jnp.all(jnp.isfinite(xg), axis=-1)
    s = jnp.where(finite, s, np.float32(np.nan))  # non-finite group -> NaN scale
    codes = jnp.clip(y / s[..., None], -r, r).astype(cfg.code_dtype)  # 5. RNE, saturating
    return codes, s, a


@functools.partial(jax.jit, inline=True)
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None) -> jax.Array:
    """Decodes groups: x' = WHT(fp8(q) * s) / max(a, EPS); `a=None` for the folded layout.
    codes fp8 [..., n_groups, G]; s, a float32 [..., n_groups] -> float32 [..., n_groups, G]."""
    x = wht(codes.astype(jnp.float32) * s[..., None])
    if a is not None:
        x = x / jnp.maximum(a, C.EPS)[..., None]
    return x


@functools.partial(jax.jit, inline=True, static_argnames=("cfg",))
def reduce_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, cfg: CodecConfig):
    """Transform-domain reduction (`reduce_domain="hadamard"`): P ranks' groups summed in the
    Hadamard domain and requantized.

    The WHT is linear: with z_r = q_r * (s_r / max(a_r, EPS)) ≈ WHT(x_r), Σ_r z_r ≈ WHT(Σ_r x_r). The
    FP32 rank-order sum is quantized with an absmax scale, no transform: s' = clip(max(max|Σz|, EPS)
    / R, EPS, SCALE_MAX), codes' = fp8(clip(Σz * (1 / s'), -R, R)) (RNE, saturating), so
    `decode_groups(codes', s', None)` is the sum. Two transforms fewer per group than decode-sum-encode.

    Args: codes [P, ..., n_groups, G]; s, a float32 [P, ..., n_groups] (a=None: folded); cfg.
    Returns: (codes' [..., n_groups, G], s' float32 [..., n_groups]); s' = NaN for a non-finite sum."""
    k = s if a is None else s / jnp.maximum(a, C.EPS)
    acc = sum_fp32(codes.astype(jnp.float32) * k[..., None], jnp.float32)
    r = np.float32(cfg.target_range)
    s2 = jnp.clip(jnp.maximum(jnp.max(jnp.abs(acc), axis=-1), C.EPS) / r, C.EPS, C.SCALE_MAX)
    s2 = jnp.where(jnp.all(jnp.isfinite(acc), axis=-1), s2, np.float32(np.nan))
    codes2 = jnp.clip(acc * (np.float32(1) / s2)[..., None], -r, r).astype(cfg.code_dtype)
    return codes2, s2
