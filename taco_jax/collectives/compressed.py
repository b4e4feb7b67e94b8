"""Compressed collectives inside `jax.shard_map` (TACO spec §3), shaped and differentiated like `lax`'s.

Algorithms (P = size of the named axis; FP8 codes only move as data, every sum is FP32):
- all-reduce, two-shot: encode P chunks -> all-to-all -> FP32 sum of the chunk this rank owns ->
  requantize -> all-gather -> decode. Two quantizations, ≈ 2(P-1)/P of the compressed message per
  rank. The sum runs in the signal domain ("signal") or, for kind "taco", in the Hadamard domain
  ("hadamard", `codec.reference.reduce_groups`). `chunks=K`: K independent chains XLA may overlap.
- all-reduce, one-shot: encode -> all-gather -> decode P copies -> FP32 rank-order sum. One
  quantization, (P-1)× the compressed message.
- reduce-scatter: the first half of two-shot. all-gather: encode -> all-gather -> decode.
  ppermute: encode -> ppermute -> decode.
Overflow: a finite sum beyond the dtype's range (float16: 65520) is ±Inf in that element only, as
in the exact collective; a two-shot group holding ±Inf travels as an overflow group
(`codec.dispatch.overflow_groups`). Every decode clips to the dtype's range (float16: ±65504).
Wire format: one uint8 row per message, made and read by the codec's wire codec (`taco_jax.codec.wire_for`, contract
in `taco_jax.codec.backends`). Every function runs inside `shard_map` over a manual mesh axis `axis_name` (size P).
Kind "none" (forward and backward) is the `lax` collective bit for bit, derivatives included. An axis of size 1
returns the input; a zero-size message returns the empty result without communication.

Derivatives: each collective's is its exact counterpart's transpose under `shard_map(check_vma=True)` (each function's
"Derivative:"), with `bwd_codec` (default: `codec`) on the backward wire, itself a compressed collective (grad of grad
works). Forward mode raises jax's `TypeError` for a compressing codec and for a narrow float moved as its own bytes
under transport "gloo" (custom_vjp). An input not varying over the axis is first made varying, as `lax` does.
Layout: two-shot chunks along the leading axis when it divides by P, else the flattened message
zero-padded to a multiple of P. Reduce-scatter along d of x [*pre, P*s, *post]: rank r receives from
every rank the block x viewed as [outer, P, inner] at [:, r, :] (flattened row-major) and returns
their FP32 sum as [*pre, s, *post]; a wire codec may read those blocks in place.
A codec with a field still "auto" is resolved at trace time (`taco_jax.codec.resolve_codec`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.codec import CodecConfig, get_kind
from taco_jax.codec.dispatch import is_resolved, resolve_codec
from taco_jax.codec.vma import pvary, vma_of
from taco_jax.codec.wire import sum_fp32, wire_for

ALGORITHMS = ("two_shot", "one_shot")
#: Where the two-shot all-reduce sums the ranks' chunks (`psum`'s `reduce_domain`).
REDUCE_DOMAINS = ("signal", "hadamard")
#: `chunks="auto"`: one chunk per this many uncompressed bytes, at most AUTO_MAX_CHUNKS.
AUTO_CHUNK_BYTES = 8 << 20
AUTO_MAX_CHUNKS = 4


def _resolved(codec: CodecConfig) -> CodecConfig:
    """`codec` with its "auto" fields resolved (unchanged if already resolved)."""
    return codec if is_resolved(codec) else resolve_codec(codec)


def _gloo(codec: CodecConfig) -> bool:
    """Transport "gloo" or "gloo_widened": the exact reduce-scatter is then `_exact_psum_scatter`."""
    return codec.transport in ("gloo", "gloo_widened")


def _own_bytes(codec: CodecConfig, x) -> bool:
    """Transport "gloo" and a float narrower than 32 bits: the exact collective moves x's own bytes."""
    return codec.transport == "gloo" and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def _move_bits(fn, x: jax.Array) -> jax.Array:
    """`fn` (a data-movement collective) applied to x bit-cast to uint of x's width, so XLA:CPU
    cannot widen it to float32. Not differentiable: callers are custom_vjp rules."""
    bits = jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")
    return lax.bitcast_convert_type(fn(lax.bitcast_convert_type(x, bits)), x.dtype)


def _exact_psum_scatter(x, axis_name, dim, tiled, own_bytes: bool = False):
    """Exact `lax.psum_scatter` as an all-to-all of the P blocks and a rank-order sum (FP32 for
    narrower floats): XLA:CPU's gloo reduce-scatter avoided. `own_bytes`: blocks move as their own
    dtype's bytes (`_move_bits`; not differentiable, so only inside `_psum_scatter`)."""
    p = lax.axis_size(axis_name)
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    shape = (*pre, *((x.shape[dim] // p,) if tiled else ()), *post)
    if p == 1:
        return x.reshape(shape)
    xs = jnp.moveaxis(x.reshape(*pre, p, x.shape[dim] // p, *post), dim, 0)  # [P, *pre, s, *post]
    a2a = functools.partial(lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    got = _move_bits(a2a, xs) if own_bytes else a2a(xs)  # got[q]: rank q's block for this rank
    acc_t = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x.dtype
    return sum_fp32(got, x.dtype, acc_t).reshape(shape)


def _a2a_all_gather(x, axis_name, axis, tiled):
    """`lax.all_gather` as an all-to-all of P copies of x: its transpose avoids the reduce-scatter."""
    p = lax.axis_size(axis_name)
    g = lax.all_to_all(jnp.broadcast_to(x[None], (p, *x.shape)), axis_name, 0, 0)  # g[q]: rank q's x
    g = jnp.moveaxis(g, 0, axis)
    return g.reshape(*x.shape[:axis], p * x.shape[axis], *x.shape[axis + 1:]) if tiled else g


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _exact_all_gather(x, axis_name, axis, tiled):
    """`lax.all_gather` whose tangent map is `_a2a_all_gather`, so its transpose emits no gloo
    reduce-scatter; a custom_jvp, so forward mode, reverse mode and vmap work."""
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


@_exact_all_gather.defjvp
def _exact_all_gather_jvp(axis_name, axis, tiled, primals, tangents):
    (x,), (t,) = primals, tangents
    return _exact_all_gather(x, axis_name, axis, tiled), _a2a_all_gather(t, axis_name, axis, tiled)


def _wide(dtype) -> bool:
    """float32 or wider: a float32 value survives the round trip through `dtype` unchanged."""
    return jnp.finfo(dtype).bits >= 32


def _all_to_all_rows(x: jax.Array, axis_name, wire, codec: CodecConfig, *, blocks=None):
    """x [P, *shape] (or split along `blocks`=(dim, P)) -> the P rows this rank receives: one
    [P, row_bytes] array, or P [row_bytes] buffers for a `per_source` wire codec."""
    rows = wire.encode_rows(x, codec, batch_dims=1, blocks=blocks, per_rank=True)
    moved = lax.all_to_all(rows, axis_name, 0, 0)
    return [moved[r] for r in range(moved.shape[0])] if wire.per_source else moved


def _axes(axis_name) -> frozenset:
    """The mesh axes named by `axis_name` (one name or a tuple of names, as `lax` accepts)."""
    return frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))


def _vary(x: jax.Array, axis_name) -> jax.Array:
    """x made varying over `axis_name` (identity forward; its transpose is a psum)."""
    return pvary(x, _axes(axis_name))


def _empty(shape, dtype, vma) -> jax.Array:
    """A zero-size result of `shape` and `dtype`, varying over `vma`: built locally, nothing sent."""
    return pvary(jnp.zeros(shape, dtype), frozenset(vma))


def _split_chunks(x: jax.Array, p: int) -> jax.Array:
    """x -> [P, *chunk]: along the leading axis if it divides by P, else flattened and padded."""
    if x.ndim >= 1 and x.shape[0] % p == 0:
        return x.reshape(p, x.shape[0] // p, *x.shape[1:])
    c = -(-x.size // p)
    return jnp.pad(x.reshape(-1), (0, p * c - x.size)).reshape(p, c)


def _bwd_codec(codec: CodecConfig, bwd_codec: CodecConfig | None) -> CodecConfig:
    if bwd_codec is None:
        return codec
    if not isinstance(bwd_codec, CodecConfig):
        raise ValueError(f"bwd_codec={bwd_codec!r} must be a CodecConfig or None")
    return bwd_codec


def _norm_axis(axis: int, ndim: int, name: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


# --- all-reduce


def _scoped(name: str):
    """Runs the function under `jax.named_scope(name)` (names TACO's work in profiles and HLO)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args):
            with jax.named_scope(name):
                return fn(*args)

        return wrapped

    return deco


def auto_chunks(nbytes: int, platform: str | None = None) -> int:
    """Chunks for `chunks="auto"`: 1 on CPU (an extra gloo collective costs more than the overlap
    gains, docs/results.md); elsewhere one per AUTO_CHUNK_BYTES of the uncompressed message, in
    [1, AUTO_MAX_CHUNKS]. `platform` defaults to jax's default backend."""
    if (platform or jax.default_backend()) == "cpu":
        return 1
    return int(max(1, min(AUTO_MAX_CHUNKS, nbytes // AUTO_CHUNK_BYTES)))


def _two_shot(x, axis_name, codec, reduce_domain, p):
    """Two-shot all-reduce of one message: x [*shape] -> its flat sum over ranks [x.size]."""
    wire = wire_for(codec, x)
    xs = _split_chunks(x, p)
    if codec.group_axis == "hidden":  # groups cut the flattened chunk either way
        xs = xs.reshape(p, -1)
    shape = xs.shape[1:]
    domain = reduce_domain if get_kind(codec.kind).transform_reduce else "signal"  # taco: a transform domain
    mine = wire.reduce_rows(_all_to_all_rows(xs, axis_name, wire, codec), codec, shape, x.dtype, domain)
    gathered = lax.all_gather(mine, axis_name, axis=0, to="invarying")  # [P, row_bytes]
    if domain == "hadamard":
        full = wire.decode_rows(gathered, dataclasses.replace(codec, scale_layout="folded"), shape, x.dtype)
    else:  # an element whose sum overflowed x.dtype is ±Inf, its group's other elements finite
        full = wire.decode_rows(gathered, codec, shape, x.dtype, overflow=True)  # [P, *chunk]
    return full.reshape(-1)[: x.size]  # drops only the padding, if any


@_scoped("taco_psum")
def _psum_value(x, axis_name, codec, algorithm, reduce_domain="signal", chunks=1):
    """The compressed all-reduce's value (no derivative of its own); kind "none": the exact one."""
    if codec.kind == "none" and not _own_bytes(codec, x):
        return lax.psum(x, axis_name)
    p = lax.axis_size(axis_name)
    if p == 1:  # nothing to send; lax.psum of one rank is x, typed invariant over the axis as a sum is
        return lax.psum(x, axis_name)
    if x.size == 0:
        return _empty(x.shape, x.dtype, vma_of(x) - _axes(axis_name))
    if codec.kind == "none":  # exact, x's own bytes: all-to-all, FP32 rank-order sum, all-gather
        got = _move_bits(lambda b: lax.all_to_all(b, axis_name, 0, 0), _split_chunks(x, p))  # got[q]: rank q's
        mine = sum_fp32(got, x.dtype)
        full = _move_bits(lambda b: lax.all_gather(b, axis_name, axis=0, to="invarying"), mine)
        return full.reshape(-1)[: x.size].reshape(x.shape)
    if algorithm == "one_shot":
        wire = wire_for(codec, x)
        rows = lax.all_gather(wire.encode_rows(x, codec), axis_name, axis=0, to="invarying")
        if _wide(x.dtype):
            return wire.decode_sum_rows(rows, codec, x.shape, x.dtype)
        return sum_fp32(wire.decode_rows(rows, codec, x.shape, x.dtype), x.dtype)  # each copy cast first
    k = auto_chunks(x.size * x.dtype.itemsize) if chunks == "auto" else chunks
    unit = p * codec.group_size  # pieces hold whole groups on every rank
    k = max(1, min(k, x.size // unit))
    if k == 1 or codec.group_axis == "token":
        return _two_shot(x, axis_name, codec, reduce_domain, p).reshape(x.shape)
    # K independent chains: XLA may run one piece's codec work beside another's transfer.
    flat = x.reshape(-1)
    step = -(-flat.size // (k * unit)) * unit
    outs = [_two_shot(flat[i * step:(i + 1) * step], axis_name, codec, reduce_domain, p)
            for i in range(k) if i * step < flat.size]
    return jnp.concatenate(outs).reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _psum(x, axis_name, codec, algorithm, reduce_domain, chunks):
    return _psum_value(x, axis_name, codec, algorithm, reduce_domain, chunks)


_psum.defvjp(lambda x, a, c, alg, rd, k: (_psum(x, a, c, alg, rd, k), None),
             lambda a, c, alg, rd, k, _, ct: (_vary(ct, a),))


def psum(x: jax.Array, axis_name: str, *, codec: CodecConfig, algorithm: str = "two_shot",
         reduce_domain: str = "signal", chunks: int | str = 1) -> jax.Array:
    """All-reduce (sum) of `x` over `axis_name`; result replicated (invariant) over the axis.

    Args:
      x: float array of any shape, normally partial sums varying over the axis.
      algorithm: "two_shot" or "one_shot" (module docstring).
      reduce_domain: two-shot with kind "taco" only: "signal" (decode, FP32 sum, re-encode) or
        "hadamard" (`taco_jax.codec.reference.reduce_groups`; docs/results.md compares them).
      chunks: two-shot only: that many independent chains over contiguous pieces of whole groups
        (fewer for a small message; 1 for a "token"-grouped codec); "auto": `auto_chunks`.
    Returns: array of x's shape and dtype, equal on every rank.
    Derivative: `lax.psum`'s (the cotangent made varying, no communication, no backward codec).
    Raises: ValueError for an unknown algorithm or reduce_domain, or chunks not "auto" nor an integer >= 1."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; choose 'two_shot' or 'one_shot'")
    if reduce_domain not in REDUCE_DOMAINS:
        raise ValueError(f"reduce_domain={reduce_domain!r} is not supported; choose one of {REDUCE_DOMAINS}")
    if chunks != "auto" and not (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1):
        raise ValueError(f"chunks={chunks!r} must be 'auto' or an integer >= 1")
    codec = _resolved(codec)
    if codec.kind == "none" and not _own_bytes(codec, x):
        return lax.psum(x, axis_name)
    return _psum(_vary(x, axis_name), axis_name, codec, algorithm, reduce_domain, chunks)


# --- all-gather and reduce-scatter (each other's transpose)


@_scoped("taco_all_gather")
def _all_gather_value(x, axis_name, codec, axis, tiled):
    """The compressed all-gather's value (no derivative of its own); `axis` already normalized."""
    if codec.kind == "none":
        gather = functools.partial(lax.all_gather, axis_name=axis_name, axis=axis, tiled=tiled)
        return _move_bits(gather, x) if _own_bytes(codec, x) else gather(x)
    p = lax.axis_size(axis_name)
    if p == 1:
        return jnp.expand_dims(x, axis) if not tiled else x
    if x.size == 0:
        shape = (*x.shape[:axis], p * x.shape[axis], *x.shape[axis + 1:]) if tiled else \
            (*x.shape[:axis], p, *x.shape[axis:])
        return _empty(shape, x.dtype, vma_of(x) | _axes(axis_name))
    wire = wire_for(codec, x)
    rows = lax.all_gather(wire.encode_rows(x, codec), axis_name, axis=0, to="varying")  # [P, row_bytes]
    g = wire.decode_rows(rows, codec, x.shape, x.dtype, axis=axis)
    if tiled:
        g = g.reshape(*x.shape[:axis], -1, *x.shape[axis + 1 :])
    return g


@_scoped("taco_psum_scatter")
def _psum_scatter_value(x, axis_name, codec, dim, tiled):
    """The compressed reduce-scatter's value (no derivative of its own); `dim` already checked."""
    if codec.kind == "none":
        if _gloo(codec):
            return _exact_psum_scatter(x, axis_name, dim, tiled, own_bytes=_own_bytes(codec, x))
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    p = lax.axis_size(axis_name)
    if p == 1:
        return x if tiled else jnp.squeeze(x, dim)
    shape = (*x.shape[:dim], *((x.shape[dim] // p,) if tiled else ()), *x.shape[dim + 1:])
    if x.size == 0:
        return _empty(shape, x.dtype, vma_of(x) | _axes(axis_name))
    # rank r's message: block r of x along dim, [*pre, s, *post]
    wire = wire_for(codec, x)
    msg = (*x.shape[:dim], x.shape[dim] // p, *x.shape[dim + 1:])
    rows = _all_to_all_rows(x, axis_name, wire, codec, blocks=(dim, p))
    return wire.decode_sum_rows(rows, codec, msg, x.dtype).reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _all_gather(x, axis_name, codec, bwd_codec, axis, tiled):
    return _all_gather_value(x, axis_name, codec, axis, tiled)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _psum_scatter(x, axis_name, codec, bwd_codec, dim, tiled):
    return _psum_scatter_value(x, axis_name, codec, dim, tiled)


_all_gather.defvjp(
    lambda x, a, c, b, ax, t: (_all_gather(x, a, c, b, ax, t), None),
    lambda a, c, b, ax, t, _, ct: (psum_scatter(ct, a, codec=b, bwd_codec=c, scatter_dimension=ax, tiled=t),),
)
_psum_scatter.defvjp(
    lambda x, a, c, b, d, t: (_psum_scatter(x, a, c, b, d, t), None),
    lambda a, c, b, d, t, _, ct: (all_gather(ct, a, codec=b, bwd_codec=c, axis=d, tiled=t),),
)


def all_gather(x: jax.Array, axis_name: str, *, codec: CodecConfig, axis: int = 0, tiled: bool = False,
               bwd_codec: CodecConfig | None = None) -> jax.Array:
    """`lax.all_gather` with each rank's block sent through `codec` (result varying over the axis).

    Args:
      axis: where the ranks' blocks go (negative counts from the end of the result's rank).
      tiled: False: a new axis of size P at `axis`; True: the blocks concatenated along `axis`.
    Returns: x's dtype; shape x.shape with P inserted at `axis` (tiled=False) or x.shape[axis]
      multiplied by P (tiled=True).
    Derivative: `lax.all_gather`'s (`psum_scatter` of the cotangent along `axis`).
    Raises: ValueError for `axis` out of range or a `bwd_codec` that is not a CodecConfig."""
    codec, bwd = _resolved(codec), _resolved(_bwd_codec(codec, bwd_codec))
    axis = _norm_axis(axis, x.ndim + (0 if tiled else 1), "axis")
    if codec.kind == "none" and bwd.kind == "none" and not (_own_bytes(codec, x) or _own_bytes(bwd, x)):
        if _gloo(bwd):  # the transpose is the reduce-scatter
            return _exact_all_gather(_vary(x, axis_name), axis_name, axis, tiled)
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    return _all_gather(_vary(x, axis_name), axis_name, codec, bwd, axis, tiled)


def psum_scatter(x: jax.Array, axis_name: str, *, codec: CodecConfig, scatter_dimension: int = 0,
                 tiled: bool = True, bwd_codec: CodecConfig | None = None) -> jax.Array:
    """Reduce-scatter: `lax.psum_scatter` with the codec on the all-to-all and FP32 sums.

    Args:
      x: float array, partial sums varying over `axis_name`.
      scatter_dimension: the dimension split into P blocks (rank r keeps block r of the sum).
      tiled: True: the dimension shrinks P-fold; False: x.shape[scatter_dimension] must be P and
        the dimension is removed.
    Returns: x's dtype; x's shape with `scatter_dimension` divided by P (tiled) or removed.
    Derivative: `lax.psum_scatter`'s (`all_gather` of the cotangent along `scatter_dimension`).
    Raises: ValueError if x.shape[scatter_dimension] is not divisible by P (tiled) or not P
      (tiled=False), for a dimension out of range, or a `bwd_codec` that is not a CodecConfig.
    """
    codec, bwd = _resolved(codec), _resolved(_bwd_codec(codec, bwd_codec))
    dim = _norm_axis(scatter_dimension, x.ndim, "scatter_dimension")
    exact = codec.kind == "none" and bwd.kind == "none" and not (_own_bytes(codec, x) or _own_bytes(bwd, x))
    if exact and not _gloo(codec):
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    p = lax.axis_size(axis_name)
    if tiled and x.shape[dim] % p:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} is not divisible by axis size {p}")
    if not tiled and x.shape[dim] != p:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} must equal the axis size {p} with tiled=False")
    if exact:  # under gloo: plain jnp + all-to-all, differentiable in both modes without a reduce-scatter
        return _exact_psum_scatter(_vary(x, axis_name), axis_name, dim, tiled)
    return _psum_scatter(_vary(x, axis_name), axis_name, codec, bwd, dim, tiled)


# --- ppermute


@_scoped("taco_ppermute")
def _ppermute_value(x, axis_name, perm, codec):
    """The compressed ppermute's value (no derivative of its own)."""
    if codec.kind == "none":
        send = functools.partial(lax.ppermute, axis_name=axis_name, perm=perm)
        return _move_bits(send, x) if _own_bytes(codec, x) else send(x)
    if x.size == 0:
        return _empty(x.shape, x.dtype, vma_of(x) | _axes(axis_name))
    wire = wire_for(codec, x)
    rows = lax.ppermute(wire.encode_rows(x, codec), axis_name, perm)
    return wire.decode_rows(rows, codec, x.shape, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _ppermute(x, axis_name, perm, codec, bwd_codec):
    return _ppermute_value(x, axis_name, perm, codec)


_ppermute.defvjp(
    lambda x, a, perm, c, b: (_ppermute(x, a, perm, c, b), None),
    lambda a, perm, c, b, _, ct: (ppermute(ct, a, tuple((d, s) for s, d in perm), codec=b, bwd_codec=c),),
)


def ppermute(x: jax.Array, axis_name: str, perm, *, codec: CodecConfig,
             bwd_codec: CodecConfig | None = None) -> jax.Array:
    """`lax.ppermute` of the encoded message (pipeline send/recv).

    perm: (source, destination) pairs, as `lax.ppermute`; a rank nobody sends to gets zeros.
    Returns: x's shape and dtype.
    Derivative: `lax.ppermute`'s (the inverse permutation).
    Raises: ValueError for a `bwd_codec` that is not a CodecConfig (bad `perm`: `lax`'s error)."""
    codec, bwd = _resolved(codec), _resolved(_bwd_codec(codec, bwd_codec))
    perm = tuple((int(s), int(d)) for s, d in perm)
    if codec.kind == "none" and bwd.kind == "none" and not (_own_bytes(codec, x) or _own_bytes(bwd, x)):
        return lax.ppermute(x, axis_name, perm)
    return _ppermute(_vary(x, axis_name), axis_name, perm, codec, bwd)
