"""Megatron's conjugate TP operators with `custom_vjp`, so forward AND backward traffic is compressed.

Source: Megatron-LM `tensor_parallel/mappings.py` (copy_to / reduce_from / gather_from / scatter_to
tensor-model-parallel region); TACO spec §1 for which site is compressed. All four run inside
`jax.shard_map(check_vma=True)`; `axis_name` is the tensor axis and `policy` a `CommPolicy` (both static).

| op                 | forward                 | backward                 |
|--------------------|-------------------------|--------------------------|
| copy_to_tp ("f")   | identity (-> varying)   | all-reduce   (ar_bwd)    |
| reduce_from_tp ("g") | all-reduce (ar_fwd)   | identity (-> varying)    |
| gather_from_sp     | all-gather (all_gather) | reduce-scatter (reduce_scatter) |
| scatter_to_sp      | reduce-scatter          | all-gather               |

Each backward collective runs only when the operator's input is differentiated."""

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
    """Megatron "f" (module table): x [..., D], invariant over `axis_name` (a ColumnParallel layer's
    input) -> x unchanged, typed varying over `axis_name`."""
    return _copy_to_tp(x, axis_name, policy)


def reduce_from_tp(x: jax.Array, axis_name: str, policy: CommPolicy) -> jax.Array:
    """Megatron "g" (module table): partial sums x [..., D] varying over `axis_name` (a RowParallel
    layer's output) -> their sum, x's shape and dtype, invariant over `axis_name`."""
    return _reduce_from_tp(x, axis_name, policy)


def gather_from_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism (module table): this rank's sequence shard x, e.g. [B, T/tp, D] with the
    sequence dimension `dim`=1 -> the whole sequence, x.shape[dim] multiplied by the axis size."""
    return _gather_from_sp(x, axis_name, policy, dim)


def site_collective(x: jax.Array, site: str, axis_name: str, policy: CommPolicy, dim: int = 1) -> jax.Array:
    """The forward value of the collective a tensor-axis `site` (ar_fwd, ar_bwd: all-reduce;
    all_gather / reduce_scatter: along `dim`, tiled) applies to `x`, with `policy`'s codec for it
    (`min_bytes` applies). For the fidelity monitor. Raises: ValueError for another site."""
    if site in ("ar_fwd", "ar_bwd"):
        return _all_reduce(x, axis_name, policy, site)
    if site == "all_gather":
        return _gather(x, axis_name, policy, dim)
    if site == "reduce_scatter":
        return _scatter(x, axis_name, policy, dim)
    raise ValueError(f"site={site!r} is not a tensor-axis site (ar_fwd, ar_bwd, all_gather, reduce_scatter)")


def scatter_to_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism (module table): partial sums x over the whole sequence, e.g. [B, T, D]
    with `dim`=1 -> this rank's shard of the sum, x.shape[dim] divided by the axis size.
    Raises: ValueError if x.shape[dim] does not divide by the axis size."""
    return _scatter_to_sp(x, axis_name, policy, dim)


# --- Collective matmul: the sequence-parallel all-gather / reduce-scatter as P - 1 ppermute steps
# interleaved with the partial matmuls (`--tp-overlap collective-matmul`)


def _ring(axis_name, step: int) -> tuple[int, jax.Array, tuple[tuple[int, int], ...]]:
    """(P, this rank, the ring permutation sending rank s to s + step mod P)."""
    p = lax.axis_size(axis_name)
    return p, lax.axis_index(axis_name), tuple((s, (s + step) % p) for s in range(p))


def _full_message(x: jax.Array, dim: int, factor: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of x with x.shape[dim] multiplied by `factor` (for `CommPolicy.codec_for`)."""
    return jax.ShapeDtypeStruct(x.shape[:dim] + (x.shape[dim] * factor,) + x.shape[dim + 1:], x.dtype)


def _in_sequence_order(steps: list[jax.Array], rank, dim: int) -> jax.Array:
    """Ring-step outputs (step i: block (rank - i) mod P) -> concatenated along `dim` in sequence order."""
    p = len(steps)
    stacked = jnp.stack(steps)  # [P, *block]
    ordered = jnp.take(stacked, (rank - jnp.arange(p)) % p, axis=0)  # sequence block j = step (rank - j) mod P
    moved = jnp.moveaxis(ordered, 0, dim)  # [..., P, t, ...]
    return moved.reshape(moved.shape[:dim] + (p * moved.shape[dim + 1],) + moved.shape[dim + 2:])


def all_gather_matmul(x: jax.Array, fn, axis_name: str, policy: CommPolicy, dim: int) -> tuple[jax.Array, jax.Array]:
    """`fn(gather_from_sp(x))` with the all-gather split into P - 1 ring steps that overlap `fn`.

    The collective matmul of jax's shard_map docs ("Matrix multiplies"): step i (1 <= i < P) receives the left
    neighbour's previous block (`compressed.ppermute`) while `fn` runs on the last one. Sites as `gather_from_sp`.

    Args:
      x: this rank's sequence block, e.g. [B, T/P, D] with `dim` = 1, varying over `axis_name` (size P).
      fn: a function of one sequence block that treats positions along `dim` independently
        (`fn(concat(blocks)) == concat(fn(block) ...)`, e.g. `lambda b: b @ W`); traced P times.
    Returns: (fn of the whole sequence in sequence order, e.g. [B, T, F]; the gathered x [B, T, D]).
    Derivative: autodiff of the ring (a ring reduce-scatter interleaved with the transposed matmuls).
    Fidelity: a block is re-encoded at every hop and the backward accumulator requantized at every
      hop (P - 1 quantizations); docs/training.md "Overlapping TP communication with matmuls".
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

    The collective matmul of jax's shard_map docs ("psum_scatter the result"): at step i rank r
    receives the running sum from its right neighbour and adds `fn` of block r + i + 1. The sum
    travels in x's dtype (FP32 add, rounded at each hop) in ring order. Sites as `scatter_to_sp`.

    Args: x: the input over the whole sequence, e.g. [B, T, F/P] with `dim` = 1; fn: as `all_gather_matmul`.
    Returns: this rank's block of the sum over ranks of fn(x), e.g. [B, T/P, D], varying.
    Raises: ValueError if x.shape[dim] does not divide by P.
    Fidelity: the running sum is requantized at every hop (P - 1 quantizations, vs one in
      `scatter_to_sp`); docs/training.md "Overlapping TP communication with matmuls".
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
