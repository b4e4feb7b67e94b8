"""Compressed collectives inside `jax.shard_map` (TACO spec §3), shaped and differentiated like `lax`'s.

Algorithms (P = size of the named axis):
- all-reduce, two-shot: encode P chunks -> all-to-all -> sum the P received versions of the chunk
  this rank owns in FP32 -> requantize the sum -> all-gather -> decode. Two quantizations
  whatever P is; ≈ 2(P-1)/P of the compressed message on the wire per rank. The sum runs in the
  signal domain by default ("signal": decode, sum, re-encode) or in the Hadamard domain
  (`reduce_domain="hadamard"`: no inverse transform before the sum, no forward transform after
  it; `codec.reference.reduce_groups`). `chunks=K` splits the message into K independent chains
  (encode -> all-to-all -> reduce -> all-gather -> decode) that XLA may overlap.
- all-reduce, one-shot: encode -> all-gather -> decode P copies -> sum in FP32 in rank order.
  One quantization; (P-1)× the compressed message.
- reduce-scatter: the first half of two-shot. all-gather: encode -> all-gather -> decode.
- ppermute (pipeline send/recv): encode -> ppermute -> decode.
FP8 codes only ever move as data (all-to-all, all-gather, ppermute); sums are FP32.
Wire format: codes and scales of a message travel packed as one uint8 row ([codes][s][a], or
[codes][s/a] folded; `_packed`). Fused wire path (`FUSED_WIRE`, `_fused_wire`): with the C++ FFI
codec on CPU (backend "ffi", or "auto" resolving to it; group_axis "hidden", nonfinite
"propagate") the kernels write and read these rows themselves (`ffi_codec.encode_packed`,
`decode_packed`, `decode_sum_packed`, `reduce_packed`, `reduce_hadamard_packed`: decode, FP32
rank-order sum and re-encode in one pass), so XLA adds no concatenation, slice or FP32 temporary
around the transfers; the values are bit-identical to the unfused path (tests/test_fused_wire.py).
With a codec of kind "none" (forward and backward) each function *is* the `lax` collective
(bit-for-bit, derivatives included). Every function returns its input unchanged on an axis of
size 1, and a zero-size message gives the empty result of the right shape and dtype without
any communication (nothing is encoded).

Derivatives (reverse mode, `jax.grad` / `jax.vjp`): each compressed collective has the
derivative of the exact collective it stands for — its transpose, as `lax` defines it under
`shard_map(check_vma=True)`:

| collective    | backward (cotangent)                                         |
|---------------|--------------------------------------------------------------|
| psum          | identity, made varying over the axis (no communication)      |
| all_gather    | psum_scatter of the cotangent along the gathered axis        |
| psum_scatter  | all_gather of the cotangent along the scattered axis         |
| ppermute      | ppermute of the cotangent with the inverse permutation       |

The backward message goes through `bwd_codec` (default: the forward `codec`; `NONE` for an
exact backward). The forward rule calls the differentiable function itself and the backward is
a compressed collective too (the two codecs swapped), so higher-order reverse mode
(grad of grad) is the exact collective's as well. Autodiff never goes through the quantizer: the
codecs are `jax.custom_vjp` functions. Consequence: forward mode (`jax.jvp`, `jax.linearize`,
`jax.jacfwd`) is NOT defined for a compressing codec and raises jax's `TypeError` ("can't apply
forward-mode autodiff (jvp) to a custom_vjp function"); with kind "none" on both directions
the function is the `lax` collective and forward mode works (under gloo on CPU the exact
reduce-scatter is an all-to-all + sum and the exact all-gather a custom_jvp, both still
differentiable in either mode: GLOO_REDUCE_SCATTER_WORKAROUND).
An input that is not varying over the axis is first made varying (`lax.pcast`), as `lax`'s
collectives do, so its gradient is the sum over ranks, as with `lax`.
Limits: the chunking of two-shot is along the leading axis when it divides by P, else over the
flattened message zero-padded to a multiple of P (padding is removed). Reduce-scatter along
dimension d of x [*pre, P*s, *post]: rank r's message from each rank is the block x viewed as
[outer, P, inner] (outer = prod(pre), inner = s * prod(post)) at [:, r, :], i.e. [*pre, s, *post]
flattened row-major (for d = 0 the leading-axis chunk); the result is the FP32 sum of the P
messages r, already in [*pre, s, *post] order. On the fused path (inner % G == 0) the encoder
reads these strided blocks in place and all-gather along an axis a != 0 decodes straight into
its [outer, P, inner] result, so no transpose surrounds the codec.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.codec import CodecConfig, decode, encode, reduce_encoded
from taco_jax.codec.backends import resolve_auto
from taco_jax.codec.reference import Encoded, clip_to_dtype
from taco_jax.kernels import ffi_codec
from taco_jax.kernels._platform import default_platform
from taco_jax.kernels._vma import pvary, vma_of

ALGORITHMS = ("two_shot", "one_shot")
#: Where the two-shot all-reduce sums the ranks' chunks: "signal" (decode, sum, re-encode) or
#: "hadamard" (sum in the transform domain, requantize, one inverse transform at the end).
REDUCE_DOMAINS = ("signal", "hadamard")
#: `chunks="auto"`: one pipeline chunk per this many uncompressed bytes of the message, at most
#: AUTO_MAX_CHUNKS (see `auto_chunks`).
AUTO_CHUNK_BYTES = 8 << 20
AUTO_MAX_CHUNKS = 4


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name` (default: choices[0]); ValueError naming it otherwise."""
    v = os.environ.get(name, choices[0])
    if v not in choices:
        raise ValueError(f"{name}={v!r} must be one of {choices}")
    return v


#: Fused wire path (`_fused_wire`): with the C++ FFI codec on CPU, encode straight into the packed
#: uint8 wire rows and decode / reduce straight from them (`ffi_codec.encode_packed` ...), so no
#: XLA concatenation, slice or FP32 temporary surrounds the transfers. Bit-identical to the
#: unfused path (tests/test_fused_wire.py, which flips this switch to compare the two).
FUSED_WIRE = True
#: Exact reduce-scatter over gloo: XLA:CPU's reduce-scatter with `jax.distributed` initialized
#: (gloo's ReduceScatterHalvingDoubling) intermittently returns wrong values at the end of rank 0's
#: block, with no error (jax-ml/jax#40830; measured here on jax 0.10.2, 2 processes, 64 MB per
#: rank: 6 of 48 calls wrong on rank 0, rel. error up to 0.71, experiments/gloo_reduce_scatter_check.py).
#: While True, the exact reduce-scatter
#: (codec "none", and the transpose of the exact all-gather) is an all-to-all plus a local sum in
#: rank order (`_exact_psum_scatter`) whenever the CPU backend runs gloo collectives; the exact
#: all-gather keeps `lax.all_gather` forward but its derivative is transposed the same way
#: (`_exact_all_gather`). None (default): from the environment at trace time,
#: TACO_GLOO_REDUCE_SCATTER=all_to_all (default, on) | lax (off: XLA's own reduce-scatter).
GLOO_REDUCE_SCATTER_WORKAROUND: bool | None = None


def _gloo_collectives() -> bool:
    """True at trace time when XLA:CPU runs this program's collectives through gloo (`jax.distributed`
    initialized and the default backend is CPU: the setting of jax-ml/jax#40830) and the workaround
    is on. Raises ValueError naming a TACO_GLOO_REDUCE_SCATTER value that is not all_to_all / lax."""
    on = GLOO_REDUCE_SCATTER_WORKAROUND
    if on is None:
        on = _env_choice("TACO_GLOO_REDUCE_SCATTER", ("all_to_all", "lax")) == "all_to_all"
    return bool(on) and jax.default_backend() == "cpu" and jax.distributed.is_initialized()


def _exact_psum_scatter(x, axis_name, dim, tiled):
    """`lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)`, exact, as an all-to-all
    of the P blocks and a sum in rank order (FP32 accumulation for narrower floats, as the compressed
    path). The same bytes on the wire as a reduce-scatter; used instead of XLA:CPU's gloo
    reduce-scatter (see GLOO_REDUCE_SCATTER_WORKAROUND)."""
    p = lax.axis_size(axis_name)
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    shape = (*pre, *((x.shape[dim] // p,) if tiled else ()), *post)
    if p == 1:
        return x.reshape(shape)
    xs = jnp.moveaxis(x.reshape(*pre, p, x.shape[dim] // p, *post), dim, 0)  # [P, *pre, s, *post]
    got = lax.all_to_all(xs, axis_name, 0, 0)  # got[q]: rank q's block for this rank
    acc_t = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x.dtype
    acc = got[0].astype(acc_t)
    for q in range(1, p):
        acc = acc + got[q].astype(acc_t)
    return acc.astype(x.dtype).reshape(shape)


def _a2a_all_gather(x, axis_name, axis, tiled):
    """`lax.all_gather(x, axis_name, axis=axis, tiled=tiled)` written as an all-to-all of P copies of
    x (the same bytes on the wire). Its transpose is an all-to-all + sum, not a reduce-scatter."""
    p = lax.axis_size(axis_name)
    g = lax.all_to_all(jnp.broadcast_to(x[None], (p, *x.shape)), axis_name, 0, 0)  # g[q]: rank q's x
    g = jnp.moveaxis(g, 0, axis)
    return g.reshape(*x.shape[:axis], p * x.shape[axis], *x.shape[axis + 1:]) if tiled else g


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _exact_all_gather(x, axis_name, axis, tiled):
    """Exact all-gather under gloo: `lax.all_gather` forward; its tangent map is `_a2a_all_gather`, so
    reverse mode (the transpose) never emits XLA:CPU's gloo reduce-scatter. Forward mode, reverse
    mode and vmap all work (a custom_jvp, not a custom_vjp)."""
    return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


@_exact_all_gather.defjvp
def _exact_all_gather_jvp(axis_name, axis, tiled, primals, tangents):
    (x,), (t,) = primals, tangents
    return _exact_all_gather(x, axis_name, axis, tiled), _a2a_all_gather(t, axis_name, axis, tiled)


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


def _packed(fn, enc, batch_dims: int):
    """Applies a data-movement collective ONCE to all wire buffers of `enc` (codes and scales),
    packed as bytes into one uint8 buffer [*batch, total] (`batch_dims` leading axes kept), then
    unpacked. One collective instead of one per buffer: over gloo each collective costs a
    rendezvous, which dominated the small scale buffers' transfer.
    """
    leaves, treedef = jax.tree.flatten(enc)
    lead = leaves[0].shape[:batch_dims]
    rows = []
    for leaf in leaves:
        b = lax.bitcast_convert_type(leaf, jnp.uint8)  # [..., itemsize] for wider types
        rows.append(b.reshape(*lead, -1))
    sizes = [r.shape[-1] for r in rows]
    moved = fn(jnp.concatenate(rows, axis=-1) if len(rows) > 1 else rows[0])
    out, start = [], 0
    for leaf, n in zip(leaves, sizes, strict=True):
        piece = lax.slice_in_dim(moved, start, start + n, axis=moved.ndim - 1)
        start += n
        shape = (*moved.shape[:-1], *leaf.shape[batch_dims:])
        if leaf.dtype.itemsize > 1:
            shape = (*shape, leaf.dtype.itemsize)
        out.append(lax.bitcast_convert_type(piece.reshape(shape), leaf.dtype))
    return jax.tree.unflatten(treedef, out)


def _fused_wire(codec: CodecConfig, x: jax.Array) -> bool:
    """Whether the collective's message `x` takes the fused wire path (`FUSED_WIRE`): a non-empty
    floating-point message, codec kind "taco" grouped along "hidden" with nonfinite "propagate",
    whose backend (with "auto" resolved as `encode` resolves it) is "ffi", traced for the CPU with
    the library built. Decided at trace time; otherwise the unfused path (encode, `_packed`,
    decode) runs."""
    if not (FUSED_WIRE and codec.kind == "taco" and codec.group_axis == "hidden"
            and codec.nonfinite == "propagate" and x.size > 0 and jnp.issubdtype(x.dtype, jnp.floating)):
        return False
    if default_platform() != "cpu":
        return False
    backend = resolve_auto() if codec.backend == "auto" else codec.backend
    return backend == "ffi" and ffi_codec.available("cpu")


def _cast_decoded(y: jax.Array, dtype) -> jax.Array:
    """Decoded float32 values in the message dtype, as `codec.reference.decode` casts them."""
    return clip_to_dtype(y, dtype).astype(dtype)


def _wide(dtype) -> bool:
    """float32 or wider: a float32 value survives the round trip through `dtype` unchanged."""
    return jnp.finfo(dtype).bits >= 32


def _encode_rows(x2: jax.Array, codec: CodecConfig) -> jax.Array:
    """[..., m] messages -> uint8 [..., row_bytes] packed wire rows (fused path)."""
    with jax.named_scope("taco_encode"):
        return ffi_codec.encode_packed(x2, codec)


def _all_to_all_rows(x2: jax.Array, axis_name, codec: CodecConfig, *, interleaved: bool = False) -> list[jax.Array]:
    """[P, m] messages (row r for rank r) -> the P packed rows this rank receives, one array
    [row_bytes] per source rank (fused path). The encoder writes one buffer per destination and
    the reducer reads one per source, so XLA's all-to-all (which moves P separate buffers) needs
    no slicing copy before it nor concatenation after it. `interleaved`: x2 is [outer, P, inner]
    (inner % G == 0) and message r is x2[:, r, :], read in place (`ffi_codec.encode_packed`)."""
    with jax.named_scope("taco_encode"):
        parts = ffi_codec.encode_packed(x2, codec, split=True, interleaved=interleaved)
    moved = lax.all_to_all(jnp.stack(parts), axis_name, 0, 0)
    return [moved[r] for r in range(len(parts))]


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


def _sum_fp32(x: jax.Array, dtype) -> jax.Array:
    """Sum over the leading (rank) axis in FP32, in rank order, then cast."""
    acc = x[0].astype(jnp.float32)
    for i in range(1, x.shape[0]):
        acc = acc + x[i].astype(jnp.float32)
    return acc.astype(dtype)


def reduce_scatter_chunks(x: jax.Array, axis_name: str, codec: CodecConfig) -> jax.Array:
    """[P, *chunk] per rank -> this rank's chunk of the sum over ranks ([*chunk], FP32 sum). Not differentiable."""
    if _fused_wire(codec, x):
        p, m = x.shape[0], x.size // x.shape[0]
        rows = _all_to_all_rows(x.reshape(p, m), axis_name, codec)
        with jax.named_scope("taco_decode"):
            return ffi_codec.decode_sum_packed(rows, codec, m).astype(x.dtype).reshape(x.shape[1:])
    enc = encode(x, codec, batch_dims=1)
    enc = _packed(lambda b: lax.all_to_all(b, axis_name, 0, 0), enc, 1)
    return _sum_fp32(decode(enc, codec, jnp.float32), x.dtype)


def reduce_scatter_hadamard(x: jax.Array, axis_name: str, codec: CodecConfig) -> Encoded:
    """[P, *chunk] per rank -> this rank's chunk of the sum over ranks, still encoded: the sum of
    the P received chunks in the Hadamard domain, requantized (`reduce_encoded`, folded layout).
    Not differentiable."""
    enc = encode(x, codec, batch_dims=1)
    enc = _packed(lambda b: lax.all_to_all(b, axis_name, 0, 0), enc, 1)
    return reduce_encoded(enc, codec)


def all_gather_encoded(x: jax.Array, axis_name: str, codec: CodecConfig, *, to: str = "varying") -> jax.Array:
    """x [*shape] -> [P, *shape] decoded copies of every rank's x. Not differentiable."""
    if _fused_wire(codec, x):
        rows = lax.all_gather(_encode_rows(x.reshape(-1), codec), axis_name, axis=0, to=to)
        with jax.named_scope("taco_decode"):
            y = _cast_decoded(ffi_codec.decode_packed(rows, codec, x.size), x.dtype)
        return y.reshape(rows.shape[0], *x.shape)
    enc = encode(x, codec)
    enc = _packed(lambda b: lax.all_gather(b, axis_name, axis=0, to=to), enc, 0)
    return decode(enc, codec)


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


# --------------------------------------------------------------------------------------
# all-reduce
# --------------------------------------------------------------------------------------


def _scoped(name: str):
    """Runs a compressed collective's value under `jax.named_scope(name)`, so profiles and HLO
    dumps (op_name metadata) name TACO's work; the computation is unchanged."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args):
            with jax.named_scope(name):
                return fn(*args)

        return wrapped

    return deco


def auto_chunks(nbytes: int, platform: str | None = None) -> int:
    """Pipeline chunks for `chunks="auto"`: on CPU (XLA:CPU + gloo) 1, because there each extra
    collective costs more than the overlap gains (measured: even the exact `lax.psum` of 16 MB
    split into 2 ordered or unordered pieces took 1.3-2.7x the single psum; README); elsewhere
    one per AUTO_CHUNK_BYTES of the (uncompressed) message, between 1 and AUTO_MAX_CHUNKS.
    `platform` defaults to jax's default backend."""
    if (platform or jax.default_backend()) == "cpu":
        return 1
    return int(max(1, min(AUTO_MAX_CHUNKS, nbytes // AUTO_CHUNK_BYTES)))


def _two_shot_fused(x, axis_name, codec, reduce_domain, p):
    """`_two_shot` on packed wire rows (`_fused_wire`): encode_packed [P rows] -> all-to-all ->
    reduce (signal: `reduce_packed`, or decode-sum, cast, encode for a narrower dtype; hadamard:
    `reduce_hadamard_packed`, folded) -> all-gather -> decode_packed."""
    xs = _split_chunks(x, p)
    m = xs.size // p
    rows = _all_to_all_rows(xs.reshape(p, m), axis_name, codec)  # P x [row_bytes]
    has_a = None
    if reduce_domain == "hadamard":
        with jax.named_scope("taco_reduce"):
            mine = ffi_codec.reduce_hadamard_packed(rows, codec, m)
        has_a = False
    elif _wide(x.dtype):
        with jax.named_scope("taco_reduce"):
            mine = ffi_codec.reduce_packed(rows, codec, m)
    else:  # the unfused path rounds the sum to x.dtype before re-encoding it
        with jax.named_scope("taco_decode"):
            total = ffi_codec.decode_sum_packed(rows, codec, m).astype(x.dtype)
        mine = _encode_rows(total, codec)
    gathered = lax.all_gather(mine, axis_name, axis=0, to="invarying")  # [P, row_bytes]
    with jax.named_scope("taco_decode"):
        full = _cast_decoded(ffi_codec.decode_packed(gathered, codec, m, has_a=has_a), x.dtype)  # [P, m]
    return full.reshape(-1)[: x.size]


def _two_shot(x, axis_name, codec, reduce_domain, p):
    """Two-shot all-reduce of one message: x [*shape] -> [x.size] flat sum over ranks."""
    if _fused_wire(codec, x):
        return _two_shot_fused(x, axis_name, codec, reduce_domain, p)
    if reduce_domain == "hadamard" and codec.kind == "taco":
        mine = reduce_scatter_hadamard(_split_chunks(x, p), axis_name, codec)  # encoded, folded layout
        gathered = _packed(lambda b: lax.all_gather(b, axis_name, axis=0, to="invarying"), mine, 0)
        full = decode(gathered, dataclasses.replace(codec, scale_layout="folded"))  # [P, *chunk]
    else:
        mine = reduce_scatter_chunks(_split_chunks(x, p), axis_name, codec)
        full = all_gather_encoded(mine, axis_name, codec, to="invarying")  # [P, *chunk]
    return full.reshape(-1)[: x.size]  # drops only the padding, if any


@_scoped("taco_psum")
def _psum_value(x, axis_name, codec, algorithm, reduce_domain="signal", chunks=1):
    """The compressed all-reduce's value (no derivative of its own)."""
    if codec.kind == "none":
        return lax.psum(x, axis_name)
    p = lax.axis_size(axis_name)
    if p == 1:  # nothing to send; lax.psum of one rank is x, typed invariant over the axis as a sum is
        return lax.psum(x, axis_name)
    if x.size == 0:
        return _empty(x.shape, x.dtype, vma_of(x) - _axes(axis_name))
    if algorithm == "one_shot":
        if _fused_wire(codec, x) and _wide(x.dtype):  # narrower: each decoded copy is cast first
            rows = lax.all_gather(_encode_rows(x.reshape(-1), codec), axis_name, axis=0, to="invarying")
            with jax.named_scope("taco_decode"):
                return ffi_codec.decode_sum_packed(rows, codec, x.size).astype(x.dtype).reshape(x.shape)
        return _sum_fp32(all_gather_encoded(x, axis_name, codec, to="invarying"), x.dtype)
    k = auto_chunks(x.size * x.dtype.itemsize) if chunks == "auto" else chunks
    unit = p * codec.group_size  # pieces hold whole groups on every rank
    k = max(1, min(k, x.size // unit))
    if k == 1 or codec.group_axis == "token":
        return _two_shot(x, axis_name, codec, reduce_domain, p).reshape(x.shape)
    # K independent two-shot chains over contiguous pieces of the flattened message: no data
    # dependence between chains, so XLA may run one piece's codec work beside another's transfer.
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
      x: float array of any shape (zero-size included), normally varying over `axis_name`
        (partial sums).
      axis_name: a manual mesh axis of the enclosing `shard_map`.
      codec: message codec; kind "none" gives exactly `lax.psum`.
      algorithm: "two_shot" or "one_shot" (module docstring).
      reduce_domain: two-shot only, codecs of kind "taco" only (other kinds have no transform
        domain and always reduce in the signal domain; so does one-shot):
        "signal": decode each received chunk, sum in FP32 in rank order, encode the sum (two
          transforms per chunk and rank between the wire hops);
        "hadamard": sum the chunks in the transform domain (z_r = q_r * s_r / a_r, FP32, rank
          order), requantize the sum with an absmax scale and no transform, all-gather, one
          inverse transform at the end (`taco_jax.codec.reference.reduce_groups`). As accurate
          as "signal" on captured TP messages (SQNR equal to within 3e-5 dB, either sign;
          experiments/fidelity_reduce_domain.py); not the default: no wall-time gain measured on
          the 2-core gloo machine, and the ffi-vs-reference training check (tests/test_train.py,
          1e-4 over 6 steps) lands at 1.5e-4 with it (README).
      chunks: two-shot only: split the flattened message into this many contiguous pieces (whole
        groups on every rank; fewer when the message is small; 1 for a codec grouping along
        "token", whose groups span the message), each its own two-shot chain, so
        that one piece's codec work can run beside another's transfer; "auto": `auto_chunks`
        of the message's bytes. 1 = one chain over the whole message (the chunking of the module
        docstring).
    Returns: array of x's shape and dtype, equal on every rank.
    Derivative: `lax.psum`'s — the cotangent made varying over the axis, no communication (so
      there is no backward codec). Forward mode is undefined for a compressing codec (module
      docstring).
    Raises: ValueError for an unknown algorithm or reduce_domain, or chunks not "auto" nor an
      integer >= 1.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; choose 'two_shot' or 'one_shot'")
    if reduce_domain not in REDUCE_DOMAINS:
        raise ValueError(f"reduce_domain={reduce_domain!r} is not supported; choose one of {REDUCE_DOMAINS}")
    if chunks != "auto" and not (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1):
        raise ValueError(f"chunks={chunks!r} must be 'auto' or an integer >= 1")
    if codec.kind == "none":
        return lax.psum(x, axis_name)
    return _psum(_vary(x, axis_name), axis_name, codec, algorithm, reduce_domain, chunks)


# --------------------------------------------------------------------------------------
# all-gather and reduce-scatter (each other's transpose)
# --------------------------------------------------------------------------------------


@_scoped("taco_all_gather")
def _all_gather_value(x, axis_name, codec, axis, tiled):
    """The compressed all-gather's value (no derivative of its own); `axis` already normalized."""
    if codec.kind == "none":
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    p = lax.axis_size(axis_name)
    if p == 1:
        return jnp.expand_dims(x, axis) if not tiled else x
    if x.size == 0:
        shape = (*x.shape[:axis], p * x.shape[axis], *x.shape[axis + 1:]) if tiled else \
            (*x.shape[:axis], p, *x.shape[axis:])
        return _empty(shape, x.dtype, vma_of(x) | _axes(axis_name))
    outer = math.prod(x.shape[:axis])
    if axis != 0 and _fused_wire(codec, x) and (x.size // outer) % codec.group_size == 0:
        # decode straight into the [outer, P, inner] result: no transpose after the decoder
        rows = lax.all_gather(_encode_rows(x.reshape(-1), codec), axis_name, axis=0, to="varying")
        with jax.named_scope("taco_decode"):
            g = _cast_decoded(ffi_codec.decode_packed(rows, codec, x.size, outer=outer), x.dtype)
        g = g.reshape(*x.shape[:axis], p, *x.shape[axis:])
    else:
        g = jnp.moveaxis(all_gather_encoded(x, axis_name, codec), 0, axis)
    if tiled:
        g = g.reshape(*x.shape[:axis], -1, *x.shape[axis + 1 :])
    return g


@_scoped("taco_psum_scatter")
def _psum_scatter_value(x, axis_name, codec, dim, tiled):
    """The compressed reduce-scatter's value (no derivative of its own); `dim` already checked."""
    if codec.kind == "none":
        if _gloo_collectives():
            return _exact_psum_scatter(x, axis_name, dim, tiled)
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    p = lax.axis_size(axis_name)
    if p == 1:
        return x if tiled else jnp.squeeze(x, dim)
    shape = (*x.shape[:dim], *((x.shape[dim] // p,) if tiled else ()), *x.shape[dim + 1:])
    if x.size == 0:
        return _empty(shape, x.dtype, vma_of(x) | _axes(axis_name))
    # rank r's message: x viewed as [outer, P, inner] (outer = prod(x.shape[:dim])), block [:, r, :]
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    s = x.shape[dim] // p
    outer, inner = math.prod(pre), s * math.prod(post)
    if dim != 0 and _fused_wire(codec, x) and inner % codec.group_size == 0:
        rows = _all_to_all_rows(x.reshape(outer, p, inner), axis_name, codec, interleaved=True)  # read in place
        with jax.named_scope("taco_decode"):
            out = ffi_codec.decode_sum_packed(rows, codec, outer * inner).astype(x.dtype)
        return out.reshape(shape)
    # [P, *pre, s, *post]: message r is [*pre, s, *post] (a codec grouping along "token" keeps x's
    # last axis as its channels)
    xs = jnp.moveaxis(x.reshape(*pre, p, s, *post), dim, 0)
    return reduce_scatter_chunks(xs, axis_name, codec).reshape(shape)


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
      x: array [*shape] (zero-size allowed).
      axis_name: a manual mesh axis of the enclosing `shard_map` (size P).
      codec: forward codec; kind "none" with an exact backward gives exactly `lax.all_gather`
        (under gloo its derivative avoids the reduce-scatter: `_exact_all_gather`).
      axis: where the ranks' blocks go (negative counts from the end of the result's rank).
      tiled: False: a new axis of size P at `axis`; True: the blocks concatenated along `axis`.
      bwd_codec: codec of the backward reduce-scatter of the cotangent (default: `codec`).
    Returns: x's dtype; shape x.shape with P inserted at `axis` (tiled=False) or x.shape[axis]
      multiplied by P (tiled=True).
    Derivative: `lax.all_gather`'s — `psum_scatter` of the cotangent along `axis` (FP32 sums,
      `bwd_codec` on the wire).
    Raises: ValueError for `axis` out of range or a `bwd_codec` that is not a CodecConfig.
    """
    bwd = _bwd_codec(codec, bwd_codec)
    axis = _norm_axis(axis, x.ndim + (0 if tiled else 1), "axis")
    if codec.kind == "none" and bwd.kind == "none":
        if _gloo_collectives():
            return _exact_all_gather(_vary(x, axis_name), axis_name, axis, tiled)
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)
    return _all_gather(_vary(x, axis_name), axis_name, codec, bwd, axis, tiled)


def psum_scatter(x: jax.Array, axis_name: str, *, codec: CodecConfig, scatter_dimension: int = 0,
                 tiled: bool = True, bwd_codec: CodecConfig | None = None) -> jax.Array:
    """Reduce-scatter: `lax.psum_scatter` with the codec on the all-to-all and FP32 sums.

    Args:
      x: float array, partial sums varying over `axis_name` (zero-size allowed).
      axis_name: a manual mesh axis of the enclosing `shard_map` (size P).
      codec: forward codec; kind "none" with an exact backward gives exactly `lax.psum_scatter`
        (under gloo: the same values from `_exact_psum_scatter`, GLOO_REDUCE_SCATTER_WORKAROUND).
      scatter_dimension: the dimension split into P blocks (rank r keeps block r of the sum).
      tiled: True: the dimension shrinks P-fold; False: x.shape[scatter_dimension] must be P and
        the dimension is removed.
      bwd_codec: codec of the backward all-gather of the cotangent (default: `codec`).
    Returns: x's dtype; x's shape with `scatter_dimension` divided by P (tiled) or removed.
    Message layout (what each codec group holds): with x [*pre, P*s, *post] viewed as
      [outer, P, inner] (outer = prod(pre), inner = s * prod(post)), the message every rank sends
      to rank r is x[:, r, :] flattened row-major, i.e. its [*pre, s, *post] block; rank r decodes
      the P messages it receives and sums them in FP32 in rank order. With the fused wire path and
      inner % G == 0 the encoder reads the blocks from x in place (no transpose).
    Derivative: `lax.psum_scatter`'s — `all_gather` of the cotangent along `scatter_dimension`
      (`bwd_codec` on the wire).
    Raises: ValueError if x.shape[scatter_dimension] is not divisible by P (tiled) or not P
      (tiled=False), for a dimension out of range, or a `bwd_codec` that is not a CodecConfig.
    """
    bwd = _bwd_codec(codec, bwd_codec)
    dim = _norm_axis(scatter_dimension, x.ndim, "scatter_dimension")
    exact = codec.kind == "none" and bwd.kind == "none"
    if exact and not _gloo_collectives():
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=tiled)
    p = lax.axis_size(axis_name)
    if tiled and x.shape[dim] % p:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} is not divisible by axis size {p}")
    if not tiled and x.shape[dim] != p:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} must equal the axis size {p} with tiled=False")
    if exact:  # under gloo: plain jnp + all-to-all, differentiable in both modes without a reduce-scatter
        return _exact_psum_scatter(_vary(x, axis_name), axis_name, dim, tiled)
    return _psum_scatter(_vary(x, axis_name), axis_name, codec, bwd, dim, tiled)


# --------------------------------------------------------------------------------------
# ppermute
# --------------------------------------------------------------------------------------


@_scoped("taco_ppermute")
def _ppermute_value(x, axis_name, perm, codec):
    """The compressed ppermute's value (no derivative of its own)."""
    if codec.kind == "none":
        return lax.ppermute(x, axis_name, perm)
    if x.size == 0:
        return _empty(x.shape, x.dtype, vma_of(x) | _axes(axis_name))
    if _fused_wire(codec, x):
        rows = lax.ppermute(_encode_rows(x.reshape(-1), codec), axis_name, perm)
        with jax.named_scope("taco_decode"):
            return _cast_decoded(ffi_codec.decode_packed(rows, codec, x.size), x.dtype).reshape(x.shape)
    return decode(_tree(lambda b: lax.ppermute(b, axis_name, perm), encode(x, codec)), codec)


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

    Args:
      x: array (zero-size allowed). axis_name: a manual mesh axis of the enclosing `shard_map`.
      perm: (source, destination) rank pairs, as `lax.ppermute`; a rank no pair sends to
        receives zeros.
      codec: forward codec; kind "none" with an exact backward gives exactly `lax.ppermute`.
      bwd_codec: codec of the backward ppermute of the cotangent (default: `codec`).
    Returns: x's shape and dtype.
    Derivative: `lax.ppermute`'s — ppermute of the cotangent with the inverse permutation.
    Raises: ValueError for a `bwd_codec` that is not a CodecConfig (bad `perm`: `lax`'s error).
    """
    bwd = _bwd_codec(codec, bwd_codec)
    perm = tuple((int(s), int(d)) for s, d in perm)
    if codec.kind == "none" and bwd.kind == "none":
        return lax.ppermute(x, axis_name, perm)
    return _ppermute(_vary(x, axis_name), axis_name, perm, codec, bwd)
