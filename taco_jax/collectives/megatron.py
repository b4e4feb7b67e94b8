"""Megatron's conjugate TP operators with `custom_vjp`, so forward AND backward traffic is compressed.

Source: Megatron-LM `tensor_parallel/mappings.py` (copy_to / reduce_from / gather_from /
scatter_to tensor-model-parallel region); TACO spec §1 for which site is compressed.
All four run inside `jax.shard_map(check_vma=True)`; `axis_name` is the tensor axis and
`policy` a `CommPolicy` (both static).

| op                 | forward                 | backward                 |
|--------------------|-------------------------|--------------------------|
| copy_to_tp ("f")   | identity (-> varying)   | all-reduce   (ar_bwd)    |
| reduce_from_tp ("g") | all-reduce (ar_fwd)   | identity (-> varying)    |
| gather_from_sp     | all-gather (all_gather) | reduce-scatter (reduce_scatter) |
| scatter_to_sp      | reduce-scatter          | all-gather               |

Each backward collective runs only when the operator's input is differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.collectives import compressed
from taco_jax.collectives.hlo import site_scope
from taco_jax.collectives.policy import CommPolicy


def _all_reduce(x, axis_name, policy: CommPolicy, site: str):
    with site_scope(site):
        return compressed.psum(x, axis_name, codec=policy.codec_for(site, x), algorithm=policy.all_reduce_algorithm,
                               reduce_domain=policy.reduce_domain, chunks=policy.chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _copy_to_tp(x, axis_name, policy):
    return lax.pcast(x, axis_name, to="varying")


def _f_fwd(x, axis_name, policy):
    return _copy_to_tp(x, axis_name, policy), None


def _f_bwd(axis_name, policy, _, ct):
    return (_all_reduce(ct, axis_name, policy, "ar_bwd"),)


_copy_to_tp.defvjp(_f_fwd, _f_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reduce_from_tp(x, axis_name, policy):
    return _all_reduce(x, axis_name, policy, "ar_fwd")


def _g_fwd(x, axis_name, policy):
    return _reduce_from_tp(x, axis_name, policy), None


def _g_bwd(axis_name, policy, _, ct):
    return (lax.pcast(ct, axis_name, to="varying"),)


_reduce_from_tp.defvjp(_g_fwd, _g_bwd)


def _gather(x, axis_name, policy, dim):
    with site_scope("all_gather"):
        return compressed.all_gather(x, axis_name, codec=policy.codec_for("all_gather", x), axis=dim, tiled=True)


def _scatter(x, axis_name, policy, dim):
    with site_scope("reduce_scatter"):
        return compressed.psum_scatter(x, axis_name, codec=policy.codec_for("reduce_scatter", x),
                                       scatter_dimension=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_from_sp(x, axis_name, policy, dim):
    return _gather(x, axis_name, policy, dim)


_gather_from_sp.defvjp(
    lambda x, a, p, d: (_gather(x, a, p, d), None),
    lambda a, p, d, _, ct: (_scatter(ct, a, p, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _scatter_to_sp(x, axis_name, policy, dim):
    return _scatter(x, axis_name, policy, dim)


_scatter_to_sp.defvjp(
    lambda x, a, p, d: (_scatter(x, a, p, d), None),
    lambda a, p, d, _, ct: (_gather(ct, a, p, d),),
)


# Public operators: plain functions (so `help()` shows their signature) around the custom_vjp ones.


def copy_to_tp(x: jax.Array, axis_name: str, policy: CommPolicy) -> jax.Array:
    """Megatron "f": identity forward (replicated -> varying), all-reduce of the gradient backward.

    Args:
      x: activation [..., D], replicated (invariant) over `axis_name` — the input of a
        ColumnParallel layer.
      axis_name: the tensor axis of the enclosing `shard_map(check_vma=True)` (static).
      policy: `CommPolicy` (static); the backward all-reduce uses `policy.ar_bwd` and
        `policy.all_reduce_algorithm`.
    Returns: x unchanged, typed varying over `axis_name`.
    The backward all-reduce appears only when the input is differentiated (w.r.t. x or anything
    upstream of it): a gradient w.r.t. the layer's weights alone needs no communication here.
    """
    return _copy_to_tp(x, axis_name, policy)


def reduce_from_tp(x: jax.Array, axis_name: str, policy: CommPolicy) -> jax.Array:
    """Megatron "g": all-reduce forward (partial sums -> replicated), identity backward.

    Args:
      x: partial sums [..., D], varying over `axis_name` — the output of a RowParallel layer.
      axis_name: the tensor axis of the enclosing `shard_map(check_vma=True)` (static).
      policy: `CommPolicy` (static); the all-reduce uses `policy.ar_fwd` and
        `policy.all_reduce_algorithm`.
    Returns: the sum over the axis, x's shape and dtype, invariant over `axis_name`.
    Backward: the cotangent made varying (no communication).
    """
    return _reduce_from_tp(x, axis_name, policy)


def gather_from_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism: all-gather the sequence shards along `dim` (reduce-scatter backward).

    Args:
      x: this rank's sequence shard, e.g. [B, T/tp, D] with `dim`=1, varying over `axis_name`.
      axis_name, policy: as `copy_to_tp`; forward uses `policy.all_gather`, backward
        `policy.reduce_scatter`.
      dim: the sequence dimension (static).
    Returns: the whole sequence, x.shape[dim] multiplied by the axis size.
    The backward reduce-scatter appears only when the input is differentiated.
    """
    return _gather_from_sp(x, axis_name, policy, dim)


def site_collective(x: jax.Array, site: str, axis_name: str, policy: CommPolicy, dim: int = 1) -> jax.Array:
    """The collective a tensor-axis `site` applies to one message `x`, forward value only (no
    derivative): what the operators above run on it, with `policy`'s codec for `site` (`codec_for`:
    `min_bytes` applies) — with `CommPolicy.none()` the exact `lax` collective.

    | site                   | collective                     | message `x`                          |
    |------------------------|--------------------------------|--------------------------------------|
    | ar_fwd, ar_bwd         | all-reduce (`policy.all_reduce_algorithm`) | partial sums / cotangent |
    | all_gather             | all-gather along `dim`, tiled  | this rank's sequence shard           |
    | reduce_scatter         | reduce-scatter along `dim`, tiled | partial sums over the whole sequence |

    Used by the fidelity monitor (`taco_jax/train/monitor.py`). Raises: ValueError for a site that
    is not a tensor-axis site.
    """
    if site in ("ar_fwd", "ar_bwd"):
        return _all_reduce(x, axis_name, policy, site)
    if site == "all_gather":
        return _gather(x, axis_name, policy, dim)
    if site == "reduce_scatter":
        return _scatter(x, axis_name, policy, dim)
    raise ValueError(f"site={site!r} is not a tensor-axis site (ar_fwd, ar_bwd, all_gather, reduce_scatter)")


def scatter_to_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism: reduce-scatter partial sums along `dim` (all-gather backward).

    Args:
      x: partial sums over the whole sequence, e.g. [B, T, D] with `dim`=1.
      axis_name, policy: as `copy_to_tp`; forward uses `policy.reduce_scatter`, backward
        `policy.all_gather`.
      dim: the sequence dimension (static); x.shape[dim] must divide by the axis size.
    Returns: this rank's shard of the sum, x.shape[dim] divided by the axis size.
    Raises: ValueError (from `compressed.psum_scatter`) if x.shape[dim] does not divide.
    """
    return _scatter_to_sp(x, axis_name, policy, dim)


# --------------------------------------------------------------------------------------
# Collective matmul: the sequence-parallel all-gather / reduce-scatter as P - 1 ppermute steps
# interleaved with the partial matmuls (`--tp-overlap collective-matmul`)
# --------------------------------------------------------------------------------------


def _ring(axis_name, step: int) -> tuple[int, jax.Array, tuple[tuple[int, int], ...]]:
    """(P, this rank, the ring permutation sending rank s to s + step mod P)."""
    p = lax.axis_size(axis_name)
    return p, lax.axis_index(axis_name), tuple((s, (s + step) % p) for s in range(p))


def _full_message(x: jax.Array, dim: int, factor: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of x with x.shape[dim] multiplied by `factor` (for `CommPolicy.codec_for`)."""
    return jax.ShapeDtypeStruct(x.shape[:dim] + (x.shape[dim] * factor,) + x.shape[dim + 1:], x.dtype)


def _in_sequence_order(steps: list[jax.Array], rank, dim: int) -> jax.Array:
    """Ring-step outputs (step i holds sequence block (rank - i) mod P, each [..., t, ...] at `dim`)
    -> their concatenation along `dim` in sequence order."""
    p = len(steps)
    stacked = jnp.stack(steps)  # [P, *block]
    ordered = jnp.take(stacked, (rank - jnp.arange(p)) % p, axis=0)  # sequence block j = step (rank - j) mod P
    moved = jnp.moveaxis(ordered, 0, dim)  # [..., P, t, ...]
    return moved.reshape(moved.shape[:dim] + (p * moved.shape[dim + 1],) + moved.shape[dim + 2:])


def all_gather_matmul(x: jax.Array, fn, axis_name: str, policy: CommPolicy, dim: int) -> tuple[jax.Array, jax.Array]:
    """`fn(gather_from_sp(x))` with the all-gather split into P - 1 ring steps that overlap `fn`.

    The collective matmul of the shard_map docs (jax docs/notebooks/shard_map.md, "Matrix
    multiplies", all-gather on one side): step 0 applies `fn` to the local sequence block; step i
    (1 <= i < P) receives the block the left neighbour held at step i - 1 (`compressed.ppermute`,
    rank s -> s + 1) and applies `fn` to it, so each transfer can run while the previous block's
    matmul does. Every ppermute message goes through `policy`'s "all_gather" codec (chosen for
    the local block, as `gather_from_sp` chooses it: `min_bytes` applies) and its transpose
    through the "reduce_scatter" codec (chosen for the gathered size, as `gather_from_sp`'s
    backward does). With codec "none" the ring is `lax.ppermute`.

    Args:
      x: this rank's sequence block, e.g. [B, T/P, D] with `dim` = 1, varying over `axis_name`.
      fn: a function of one sequence block alone, e.g. `lambda b: b @ W`: it must treat the
        positions along `dim` independently (a matmul over the feature axes), so that
        `fn(concat(blocks)) == concat(fn(block) ...)`; traced P times.
      axis_name: the tensor axis of the enclosing `shard_map(check_vma=True)` (static, size P).
      policy: `CommPolicy` (static). dim: the sequence dimension (static).
    Returns: (y, gathered): y = fn of the whole sequence (fn's output per block concatenated along
      `dim` in sequence order, e.g. [B, T, F]) and gathered = the whole sequence x [B, T, D]
      itself (what `gather_from_sp` returns; free: the blocks the ring received, reordered).
    Derivative: autodiff of the ring: the transposed ppermutes (rank s -> s - 1) carry the
      cotangent blocks back and accumulate them, i.e. a ring reduce-scatter interleaved with the
      transposed matmuls.
    Fidelity: a compressed block is re-encoded at every hop after the first (it is forwarded as
      decoded), and the backward accumulator is requantized at every hop (P - 1 quantizations of a
      growing partial sum, where the two-shot reduce-scatter quantizes each rank's message once);
      docs/training.md "Overlapping TP communication with matmuls" gives the measured SQNR.
    """
    p, rank, right = _ring(axis_name, 1)
    codec = policy.codec_for("all_gather", x)
    bwd = policy.codec_for("reduce_scatter", _full_message(x, dim, p))
    blocks, outs = [x], [fn(x)]
    for _ in range(1, p):
        with site_scope("all_gather"):
            blocks.append(compressed.ppermute(blocks[-1], axis_name, right, codec=codec, bwd_codec=bwd))
        outs.append(fn(blocks[-1]))
    if p == 1:
        return outs[0], x
    return _in_sequence_order(outs, rank, dim), _in_sequence_order(blocks, rank, dim)


def matmul_reduce_scatter(x: jax.Array, fn, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """`scatter_to_sp(fn(x))` with the reduce-scatter split into P - 1 ring steps that overlap `fn`.

    The collective matmul of the shard_map docs ("psum_scatter the result"): rank r starts with
    `fn` of sequence block r + 1; at step i (1 <= i < P) it receives the running sum from its
    right neighbour (`compressed.ppermute`, rank s -> s - 1), adds `fn` of block r + i + 1 and
    passes it on; after P - 1 steps it holds the sum over ranks of block r. Each partial matmul
    is independent of the transfer before it, so the two can overlap. The running sum travels in
    x's dtype (a float32 add at each hop, rounded to the dtype, as a ring reduce-scatter in bf16
    does); it is summed in ring order (rank r + 1 first, r last), not rank order.
    Every ppermute message goes through `policy`'s "reduce_scatter" codec (chosen for the whole
    message fn(x), as `scatter_to_sp` chooses it) and its transpose through the "all_gather"
    codec (chosen for one block). With codec "none" the ring is `lax.ppermute`.

    Args:
      x: partial sums' input over the whole sequence, e.g. [B, T, F/P] with `dim` = 1.
      fn: a function of one sequence block alone (e.g. `lambda b: b @ W`), as `all_gather_matmul`.
      axis_name: the tensor axis (static, size P); x.shape[dim] must divide by P.
      policy: `CommPolicy` (static). dim: the sequence dimension (static).
    Returns: this rank's sequence block of the sum over ranks of fn(x), e.g. [B, T/P, D], varying.
    Raises: ValueError if x.shape[dim] does not divide by P.
    Derivative: autodiff of the ring: the transposed ppermutes (rank s -> s + 1) forward the
      cotangent block around the ring, an all-gather interleaved with the transposed matmuls.
    Fidelity: with a compressing codec the running sum is requantized at every hop, P - 1
      quantizations of a growing partial sum where the two-shot reduce-scatter (`scatter_to_sp`)
      quantizes each rank's message once and sums in FP32: a lower SQNR, measured in
      docs/training.md "Overlapping TP communication with matmuls".
    """
    p, rank, left = _ring(axis_name, -1)
    if x.shape[dim] % p:
        raise ValueError(f"x.shape[{dim}]={x.shape[dim]} is not divisible by axis size {p}")
    t = x.shape[dim] // p

    def partial(j):  # fn of sequence block j (traced index)
        return fn(lax.dynamic_slice_in_dim(x, (j % p) * t, t, axis=dim))

    acc = partial(rank + 1)
    if p == 1:
        return acc
    codec = policy.codec_for("reduce_scatter", _full_message(acc, dim, p))
    bwd = policy.codec_for("all_gather", acc)
    for i in range(1, p):
        with site_scope("reduce_scatter"):
            acc = compressed.ppermute(acc, axis_name, left, codec=codec, bwd_codec=bwd)
        acc = (acc.astype(jnp.float32) + partial(rank + i + 1).astype(jnp.float32)).astype(acc.dtype)
    return acc
