"""The orthonormal Walsh-Hadamard transform of a group (TACO spec §2 step 3), shared by every codec kind."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg


@functools.cache
def hadamard(g: int) -> np.ndarray:
    """Sylvester-order Hadamard matrix H_g, float32 [g, g] with entries ±1 (`scipy.linalg.hadamard`).
    Raises: ValueError if `g` is not a positive power of two (from scipy)."""
    return scipy.linalg.hadamard(g).astype(np.float32)


@functools.partial(jax.jit, inline=True)
def wht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform over the last axis: x @ H_G / sqrt(G) (its own inverse).
    x: float32 [..., G], G a power of two. Returns: float32 [..., G]."""
    g = x.shape[-1]
    h = jnp.asarray(hadamard(g))
    return jnp.matmul(x, h, precision=jax.lax.Precision.HIGHEST) / np.float32(math.sqrt(g))
