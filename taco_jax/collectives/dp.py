"""Data-parallel gradient synchronisation inside `shard_map` (policy site `dp_grads`).

- codec kind "none": `lax.psum` per leaf, what `shard_map`'s transpose would insert.
- any other codec: leaves packed into one flat bucket per (dtype, varying axes) and summed with
  the two-shot compressed all-reduce (the ZeRO++ / SDP4Bit gradient path).
A bucket never mixes varying axes, so gradients replicated over the tensor axis (norms, biases)
get identical quantized sums on every tensor rank and cannot drift apart.
Source: ZeRO++ (arXiv 2306.10209) §"qgZ"; SDP4Bit (arXiv 2410.15526); TACO spec §3-4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax.codec.vma import pvary, vma_of
from taco_jax.collectives import compressed
from taco_jax.collectives.hlo import site_scope
from taco_jax.collectives.policy import CommPolicy


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside `shard_map` (empty outside)."""
    return vma_of(x)


def sync_gradients(grads, axis_name: str | None, policy: CommPolicy):
    """Sum of per-shard gradients over `axis_name` (the data axis; None: `grads` returned), with
    codec `policy.dp_grads` and its `min_bytes` per bucket. grads: pytree of float arrays varying
    over `axis_name`. Returns: pytree like `grads`, invariant over `axis_name`.
    Derivative: `lax.psum`'s per leaf; forward mode is undefined when `dp_grads` compresses."""
    if axis_name is None:
        return grads
    with site_scope("dp_grads"):
        return _sync(grads, axis_name, policy)


def _sync(grads, axis_name, policy):
    """`sync_gradients` inside its site scope (`collectives.hlo.site_scope`)."""
    if policy.dp_grads.kind == "none":  # `lax.psum`, or bf16 moved as bf16 under gloo (transport "gloo")
        return jax.tree.map(lambda g: compressed.psum(g, axis_name, codec=policy.dp_grads), grads)
    if lax.axis_size(axis_name) == 1:
        return jax.tree.map(lambda g: lax.psum(g, axis_name), grads)
    leaves, treedef = jax.tree.flatten(grads)
    buckets: dict[tuple, list[int]] = {}
    for i, g in enumerate(leaves):
        buckets.setdefault((jnp.dtype(g.dtype).name, tuple(sorted(varying_axes(g)))), []).append(i)
    out = list(leaves)
    for idx in buckets.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
        codec = policy.codec_for("dp_grads", flat)
        total = compressed.psum(flat, axis_name, codec=codec, algorithm="two_shot")
        offsets = np.cumsum([0] + [leaves[i].size for i in idx])
        for j, i in enumerate(idx):
            out[i] = total[offsets[j] : offsets[j + 1]].reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


def vary(x: jax.Array, axes) -> jax.Array:
    """`x` made varying over each of `axes` (None entries skipped) it is not varying over yet (identity forward)."""
    return pvary(x, frozenset(a for a in axes if a is not None))
