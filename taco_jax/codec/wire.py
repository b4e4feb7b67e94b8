"""Wire rows: the generic wire codec (group math of the backend + byte packing) and the choice of a wire codec.

Each message travels as ONE uint8 row (`pack_rows`: codes, s, a as little-endian bytes): one
collective rather than one per buffer, since over gloo each collective costs a rendezvous. Contract
in `taco_jax.codec.backends`; the generic codec serves every kind and backend."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax.codec.backends import WireCodec, get_wire, register_wire
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.dispatch import Encoded, decode, decode_sum, encode, reduce_encoded, resolve_codec, wire_layout
from taco_jax.codec.reference import sum_fp32  # noqa: F401  (the rank-order sum, `codec.wire.sum_fp32`)


def pack_rows(enc: Encoded, batch_dims: int) -> jax.Array:
    """The wire buffers of `enc` as bytes, one uint8 row per message: [*batch, row_bytes] (the
    leading `batch_dims` axes of the buffers kept), buffers in `Encoded`'s leaf order."""
    leaves = jax.tree.leaves(enc)
    lead = leaves[0].shape[:batch_dims]
    rows = [lax.bitcast_convert_type(leaf, jnp.uint8).reshape(*lead, -1) for leaf in leaves]
    return jnp.concatenate(rows, axis=-1) if len(rows) > 1 else rows[0]


def unpack_rows(rows: jax.Array, cfg: CodecConfig, shape: tuple[int, ...], dtype) -> Encoded:
    """Inverse of `pack_rows`: uint8 rows [*lead, row_bytes] of messages of `shape` and `dtype` encoded with `cfg`
    (its `scale_layout` says whether rows hold a) -> an `Encoded` with batch axes `lead`."""
    out, start = [], 0
    for leaf_shape, leaf_dtype in wire_layout(cfg, tuple(shape)):
        n = math.prod(leaf_shape) * leaf_dtype.itemsize
        piece = lax.slice_in_dim(rows, start, start + n, axis=rows.ndim - 1)
        start += n
        full = (*rows.shape[:-1], *leaf_shape, *((leaf_dtype.itemsize,) if leaf_dtype.itemsize > 1 else ()))
        out.append(lax.bitcast_convert_type(piece.reshape(full), leaf_dtype))
    codes, s, *a = out
    return Encoded(codes, s, a[0] if a else None, tuple(shape), np.dtype(dtype))


def block_messages(x: jax.Array, dim: int, p: int) -> jax.Array:
    """x [*pre, P*s, *post] -> [P, *pre, s, *post]: message r is x's block r along `dim`."""
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    return jnp.moveaxis(x.reshape(*pre, p, x.shape[dim] // p, *post), dim, 0)


def encode_rows(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0, blocks=None, per_rank: bool = False):
    """Messages -> packed rows (contract: `taco_jax.codec.backends`): `encode`, then `pack_rows`."""
    del per_rank  # one [P, row_bytes] buffer either way
    if blocks is not None:
        x, batch_dims = block_messages(x, *blocks), 1
    return pack_rows(encode(x, cfg, batch_dims=batch_dims), batch_dims)


def decode_rows(rows: jax.Array, cfg: CodecConfig, shape, dtype, *, axis: int = 0, overflow: bool = False) -> jax.Array:
    """Packed rows -> messages in `dtype` (contract: `taco_jax.codec.backends`)."""
    y = decode(unpack_rows(rows, cfg, shape, dtype), cfg, dtype, overflow=overflow)
    return jnp.moveaxis(y, 0, axis) if axis else y


def decode_sum_rows(rows, cfg: CodecConfig, shape, dtype) -> jax.Array:
    """P ranks' rows -> their decoded FP32 sum in rank order, in `dtype` [*shape]."""
    if isinstance(rows, (list, tuple)):
        rows = jnp.stack(rows)
    return decode_sum(unpack_rows(rows, cfg, shape, dtype), cfg, dtype)


def reduce_rows(rows, cfg: CodecConfig, shape, dtype, domain: str) -> jax.Array:
    """The two-shot all-reduce's middle step on P ranks' rows -> this rank's row of the sum (signal
    domain: a group in which the sum overflowed `dtype` becomes an overflow group, `dispatch.overflow_groups`)."""
    if domain == "hadamard":
        if isinstance(rows, (list, tuple)):
            rows = jnp.stack(rows)
        return pack_rows(reduce_encoded(unpack_rows(rows, cfg, shape, dtype), cfg), 0)
    return pack_rows(encode(decode_sum_rows(rows, cfg, shape, dtype), cfg, overflow=True), 0)


GENERIC = WireCodec(encode_rows, decode_rows, decode_sum_rows, reduce_rows, per_source=False)
register_wire("generic", lambda: GENERIC)


def wire_for(cfg: CodecConfig, x: jax.Array) -> WireCodec:
    """The wire codec that moves message `x` with codec `cfg` (kind not "none"): `cfg.wire`
    (resolved here if still "auto", `dispatch.resolve_codec`), or "generic" for a message no
    packed kernel takes (zero-size or not floating point: the generic path raises the clear error)."""
    name = cfg.wire if cfg.wire != "auto" else resolve_codec(cfg).wire
    if name != "generic" and (x.size == 0 or not jnp.issubdtype(x.dtype, jnp.floating)):
        name = "generic"
    return get_wire(name)
