"""Compressed collectives for use inside `jax.shard_map` (TACO spec §3), shaped like `lax`'s.

Algorithms (P = size of the named axis):
- all-reduce, two-shot: encode P chunks -> all-to-all -> decode and sum the chunk this rank
  owns in FP32 (reduce-scatter) -> encode the sum -> all-gather -> decode. Two quantizations
  whatever P is; ≈ 2(P-1)/P of the compressed message on the wire per rank.
- all-reduce, one-shot: encode -> all-gather -> decode P copies -> sum in FP32 in rank order.
  One quantization; (P-1)× the compressed message.
- reduce-scatter: the first half of two-shot. all-gather: encode -> all-gather -> decode.
- ppermute (pipeline send/recv): encode -> ppermute -> decode.
FP8 codes only ever move as data (all-to-all, all-gather, ppermute); sums are FP32.
With a codec of kind "none" each function *is* the `lax` collective (bit-for-bit).
Every function returns its input unchanged on an axis of size 1.
Limits: the chunking of two-shot and reduce-scatter is along the leading axis when it divides
by P, else over the flattened message zero-padded to a multiple of P (padding is removed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.codec import CodecConfig, decode, encode


def _tree(fn, enc):
    """Applies a data-movement collective to every wire buffer of `enc`.

    FP8 codes travel bitcast to uint8: the bytes are the FP8 codes, and no backend may
    widen them (XLA:CPU otherwise converts FP8 collectives to f16).
    """

    def move(leaf):
        if leaf.dtype.itemsize == 1 and jnp.issubdtype(leaf.dtype, jnp.floating):
            return lax.bitcast_convert_type(fn(lax.bitcast_convert_type(leaf, jnp.uint8)), leaf.dtype)
        return fn(leaf)

    return jax.tree.map(move, enc)


def _split_chunks(x: jax.Array, p: int) -> jax.Array:
    """x -> [P, *chunk]: along the leading axis if it divides by P, else flattened and padded."""
    if x.ndim >= 1 and x.shape[0] % p == 0:
        return x.reshape(p, x.shape[0] // p, *x.shape[1:])
    c = -(-x.size // p)
    return jnp.pad(x.reshape(-1), (0, p * c - x.size)).reshape(p, c)


def _sum_fp32(x: jax.Array, dtype) -> jax.Array:
    """Sum over the leading (rank) axis in FP32, in rank order, then cast."""
    acc = x[0].astype(jnp.float32)
    for i in range(1, x.shape[0]):
        acc = acc + x[i].astype(jnp.float32)
    return acc.astype(dtype)


def reduce_scatter_chunks(x: jax.Array, axis_name: str, codec: CodecConfig) -> jax.Array:
    """[P, *chunk] per rank -> this rank's chunk of the sum over ranks ([*chunk], FP32 sum)."""
    enc = encode(x, codec, batch_dims=1)
    enc = _tree(lambda b: lax.all_to_all(b, axis_name, 0, 0), enc)
    return _sum_fp32(decode(enc, codec, jnp.float32), x.dtype)


def all_gather_encoded(x: jax.Array, axis_name: str, codec: CodecConfig, *, to: str = "varying") -> jax.Array:
    """x [*shape] -> [P, *shape] decoded copies of every rank's x."""
    enc = encode(x, codec)
    enc = _tree(lambda b: lax.all_gather(b, axis_name, axis=0, to=to), enc)
    return decode(enc, codec)


def psum(x: jax.Array, axis_name: str, *, codec: CodecConfig, algorithm: str = "two_shot") -> jax.Array:
    """All-reduce (sum) of `x` over `axis_name`; result replicated (invariant) over the axis.

    Args:
      x: float array, varying over `axis_name` (partial sums).
      axis_name: a manual mesh axis of the enclosing `shard_map`.
      codec: message codec; kind "none" gives exactly `lax.psum`.
      algorithm: "two_shot" or "one_shot" (module docstring).
    Returns: array of x's shape and dtype, equal on every rank.
    Raises: ValueError for an unknown algorithm.
    """
    if codec.kind == "none":
        return lax.psum(x, axis_name)
    p = lax.axis_size(axis_name)
    if p == 1:
        return x
    if algorithm == "one_shot":
        return _sum_fp32(all_gather_encoded(x, axis_name, codec, to="invarying"), x.dtype)
    if algorithm != "two_shot":
        raise ValueError(f"algorithm={algorithm!r} is not supported; choose 'two_shot' or 'one_shot'")
    mine = reduce_scatter_chunks(_split_chunks(x, p), axis_name, codec)
    full = all_gather_encoded(mine, axis_name, codec, to="invarying")  # [P, *chunk]
    return full.reshape(-1)[: x.size].reshape(x.shape)  # drops only the padding, if any


def all_gather(x: jax.Array, axis_name: str, *, codec: CodecConfig, axis: int = 0, tiled: bool = False) -> jax.Array:
    """`lax.all_gather` with each rank's block sent through `codec` (result varying)."""
    if codec.kind == "none":
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    if lax.axis_size(axis_name) == 1:
        return jnp.expand_dims(x, axis) if not tiled else x
    g = jnp.moveaxis(all_gather_encoded(x, axis_name, codec), 0, axis)
    if tiled:
        g = g.reshape(*x.shape[:axis], -1, *x.shape[axis + 1 :])
    return g


def psum_scatter(
    x: jax.Array, axis_name: str, *, codec: CodecConfig, scatter_dimension: int = 0, tiled: bool = True
) -> jax.Array:
    """Reduce-scatter: `lax.psum_scatter(..., tiled=True)` with FP8 all-to-all and FP32 sums.

    Raises: ValueError if x.shape[scatter_dimension] is not divisible by the axis size, or
    `tiled=False` with a compressed codec.
    """
    if codec.kind == "none":
        return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)
    p = lax.axis_size(axis_name)
    if not tiled:
        raise ValueError("compressed psum_scatter supports tiled=True only")
    if x.shape[scatter_dimension] % p:
        raise ValueError(f"x.shape[{scatter_dimension}]={x.shape[scatter_dimension]} is not divisible by axis size {p}")
    if p == 1:
        return x
    xm = jnp.moveaxis(x, scatter_dimension, 0)
    out = reduce_scatter_chunks(xm.reshape(p, xm.shape[0] // p, *xm.shape[1:]), axis_name, codec)
    return jnp.moveaxis(out, 0, scatter_dimension)


def ppermute(x: jax.Array, axis_name: str, perm, *, codec: CodecConfig) -> jax.Array:
    """`lax.ppermute` of the encoded message (pipeline send/recv)."""
    if codec.kind == "none":
        return lax.ppermute(x, axis_name, perm)
    enc = _tree(lambda b: lax.ppermute(b, axis_name, perm), encode(x, codec))
    return decode(enc, codec)
