"""The "ffi" wire codec: packed wire rows written and read by the C++ FFI kernels (CPU).

The wire-codec contract of `taco_jax.codec.backends` on `ffi_codec`'s packed targets: the kernels
write and read the rows themselves, so XLA adds no concatenation, slice, transpose (strided blocks
with inner extent % G == 0), convert (native dtypes) or FP32 temporary around the transfers. Bytes
and values equal the generic wire codec's (tested byte for byte). Kind "taco", group_axis "hidden",
nonfinite "propagate", backend "ffi" only. All-to-all rows are one buffer per rank (`per_source`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from taco_jax.codec.backends import WireCodec
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.dispatch import clip_to_dtype, encode
from taco_jax.codec.wire import block_messages, pack_rows
from taco_jax.kernels import ffi_codec


def _native(dtype) -> bool:
    return jnp.dtype(dtype) in ffi_codec.NATIVE_DTYPES


def _decode(rows: jax.Array, cfg: CodecConfig, m: int, dtype, overflow: bool = False, **kw) -> jax.Array:
    """Decoded values in the message dtype, as `codec.dispatch.decode` casts them: written so by the kernel for a
    native dtype, else decoded to float32, clipped and cast (`overflow`: the ±Inf of overflow groups kept)."""
    if _native(dtype):
        return ffi_codec.decode_packed(rows, cfg, m, dtype=dtype, **kw)
    y = ffi_codec.decode_packed(rows, cfg, m, **kw)
    clipped = clip_to_dtype(y, dtype)
    return (jnp.where(jnp.isinf(y), y, clipped) if overflow else clipped).astype(dtype)


def _decode_sum(rows, cfg: CodecConfig, m: int, dtype) -> jax.Array:
    """The rank-order float32 sum of P ranks' decoded rows, rounded to the message dtype once."""
    if _native(dtype):
        return ffi_codec.decode_sum_packed(rows, cfg, m, dtype=dtype)
    return ffi_codec.decode_sum_packed(rows, cfg, m).astype(dtype)


def encode_rows(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0, blocks=None, per_rank: bool = False):
    interleaved = False
    if blocks is not None:
        dim, p = blocks
        outer = math.prod(x.shape[:dim])
        inner = x.size // (outer * p)
        if dim != 0 and inner % cfg.group_size == 0:  # read the blocks [outer, P, inner] in place
            x, interleaved = x.reshape(outer, p, inner), True
        else:
            x = block_messages(x, dim, p).reshape(p, -1)
    else:
        x = x.reshape(*x.shape[:batch_dims], -1)
    with jax.named_scope("taco_encode"):
        rows = ffi_codec.encode_packed(x, cfg, split=per_rank, interleaved=interleaved)
    return jnp.stack(rows) if per_rank else rows


def decode_rows(rows: jax.Array, cfg: CodecConfig, shape, dtype, *, axis: int = 0, overflow: bool = False) -> jax.Array:
    """`overflow`: the kernel decodes overflow groups (`codec.dispatch.overflow_groups`) whenever
    it meets one; the flag only keeps their ±Inf for a dtype it does not write (`_decode`)."""
    m = math.prod(shape)
    if axis:
        outer = math.prod(shape[:axis])
        if (m // outer) % cfg.group_size == 0:  # decode straight into [*shape[:axis], P, *shape[axis:]]
            with jax.named_scope("taco_decode"):
                y = _decode(rows, cfg, m, dtype, overflow, outer=outer)
            return y.reshape(*shape[:axis], rows.shape[0], *shape[axis:])
    with jax.named_scope("taco_decode"):
        y = _decode(rows, cfg, m, dtype, overflow)
    y = y.reshape(*rows.shape[:-1], *shape)
    return jnp.moveaxis(y, 0, axis) if axis else y


def decode_sum_rows(rows, cfg: CodecConfig, shape, dtype) -> jax.Array:
    with jax.named_scope("taco_decode"):
        return _decode_sum(rows, cfg, math.prod(shape), dtype).reshape(shape)


def reduce_rows(rows, cfg: CodecConfig, shape, dtype, domain: str) -> jax.Array:
    m = math.prod(shape)
    if domain == "hadamard":
        with jax.named_scope("taco_reduce"):
            return ffi_codec.reduce_hadamard_packed(rows, cfg, m)
    if jnp.finfo(dtype).bits >= 32 or _native(dtype):  # bfloat16 / float16: the sum rounded to it in the kernel
        with jax.named_scope("taco_reduce"):
            return ffi_codec.reduce_packed(rows, cfg, m, dtype=dtype if _native(dtype) else None)
    # another narrower dtype: the sum is rounded to it before it is encoded again (overflow groups
    # where it overflowed, as the kernel writes them)
    with jax.named_scope("taco_decode"):
        total = _decode_sum(rows, cfg, m, dtype)
    return pack_rows(encode(total, cfg, overflow=True), 0)


FFI_WIRE = WireCodec(encode_rows, decode_rows, decode_sum_rows, reduce_rows, per_source=True)
