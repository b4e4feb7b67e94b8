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
from jax import lax

from taco_jax.collectives import compressed
from taco_jax.collectives.policy import CommPolicy


def _all_reduce(x, axis_name, policy: CommPolicy, site: str):
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
    return compressed.all_gather(x, axis_name, codec=policy.codec_for("all_gather", x), axis=dim, tiled=True)


def _scatter(x, axis_name, policy, dim):
    return compressed.psum_scatter(x, axis_name, codec=policy.codec_for("reduce_scatter", x), scatter_dimension=dim)


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
