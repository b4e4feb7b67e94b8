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
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from taco_jax.collectives import compressed
from taco_jax.collectives.policy import CommPolicy


def _all_reduce(x, axis_name, policy: CommPolicy, site: str):
    return compressed.psum(x, axis_name, codec=policy.codec_for(site, x), algorithm=policy.all_reduce_algorithm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def copy_to_tp(x: jax.Array, axis_name: str, policy: CommPolicy) -> jax.Array:
    """Megatron "f": identity forward (replicated -> varying), all-reduce of the gradient backward."""
    return lax.pcast(x, axis_name, to="varying")


def _f_fwd(x, axis_name, policy):
    return copy_to_tp(x, axis_name, policy), None


def _f_bwd(axis_name, policy, _, ct):
    return (_all_reduce(ct, axis_name, policy, "ar_bwd"),)


copy_to_tp.defvjp(_f_fwd, _f_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_from_tp(x: jax.Array, axis_name: str, policy: CommPolicy) -> jax.Array:
    """Megatron "g": all-reduce forward (partial sums -> replicated), identity backward."""
    return _all_reduce(x, axis_name, policy, "ar_fwd")


def _g_fwd(x, axis_name, policy):
    return reduce_from_tp(x, axis_name, policy), None


def _g_bwd(axis_name, policy, _, ct):
    return (lax.pcast(ct, axis_name, to="varying"),)


reduce_from_tp.defvjp(_g_fwd, _g_bwd)


def _gather(x, axis_name, policy, dim):
    return compressed.all_gather(x, axis_name, codec=policy.codec_for("all_gather", x), axis=dim, tiled=True)


def _scatter(x, axis_name, policy, dim):
    return compressed.psum_scatter(x, axis_name, codec=policy.codec_for("reduce_scatter", x), scatter_dimension=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_from_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism: all-gather the sequence shards along `dim` (reduce-scatter backward)."""
    return _gather(x, axis_name, policy, dim)


gather_from_sp.defvjp(
    lambda x, a, p, d: (_gather(x, a, p, d), None),
    lambda a, p, d, _, ct: (_scatter(ct, a, p, d),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def scatter_to_sp(x: jax.Array, axis_name: str, policy: CommPolicy, dim: int) -> jax.Array:
    """Sequence parallelism: reduce-scatter partial sums along `dim` (all-gather backward)."""
    return _scatter(x, axis_name, policy, dim)


scatter_to_sp.defvjp(
    lambda x, a, p, d: (_scatter(x, a, p, d), None),
    lambda a, p, d, _, ct: (_gather(ct, a, p, d),),
)
