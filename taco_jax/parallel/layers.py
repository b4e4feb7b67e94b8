"""Megatron tensor-parallel layers in Flax NNX: ColumnParallel / RowParallel dense, vocab-parallel
embedding and cross-entropy. Parameters are created with their *global* shapes and logical axis
names (`axes` metadata, see `rules.py`); inside `shard_map` they hold local shards, and every
dimension is read off the parameter, so the same code runs sharded and unsharded.

Source: Megatron-LM `tensor_parallel/layers.py` and `cross_entropy.py`; TACO spec §1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.parallel.context import ParallelContext, PendingGather


def _normal(rngs: nnx.Rngs, shape, std: float, dtype=jnp.float32):
    return std * jax.random.normal(rngs.params(), shape, dtype)


class ColumnParallel(nnx.Module):
    """y = x @ W + b with W [in, *out_shape] sharded over the output axis named in `axes`.

    No communication: the caller enters the TP region once (`ctx.enter`, Megatron "f") for all
    ColumnParallel layers reading the same input. x [..., in] (replicated over the tensor axis, or a
    `PendingGather` with `--tp-overlap collective-matmul`) -> y [..., *out_shape_local].
    """

    def __init__(self, in_features: int, out_shape: tuple[int, ...], axes: tuple[str | None, ...], *,
                 use_bias: bool, std: float, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (in_features, *out_shape), std), axes=axes)
        self.bias = nnx.Param(jnp.zeros(out_shape, jnp.float32), axes=axes[1:]) if use_bias else None

    def __call__(self, x: jax.Array | PendingGather) -> jax.Array:
        kernel = self.kernel[...].astype(x.dtype)
        if isinstance(x, PendingGather):
            y = x.apply(lambda block: jnp.tensordot(block, kernel, axes=1))
        else:
            y = jnp.tensordot(x, kernel, axes=1)
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class RowParallel(nnx.Module):
    """y = g(x @ W) + b with W [*in_shape, out] sharded over an input axis; g = `ctx.exit`.

    x [..., *in_shape_local] (varying) -> y [..., out] (replicated, or sequence-sharded with
    sequence parallelism; overlapped: `ParallelContext.exit_matmul`). The bias is added after the g.
    """

    def __init__(self, in_shape: tuple[int, ...], out_features: int, axes: tuple[str | None, ...], *,
                 ctx: ParallelContext, use_bias: bool, std: float, rngs: nnx.Rngs):
        self.ctx = ctx
        self.kernel = nnx.Param(_normal(rngs, (*in_shape, out_features), std), axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32), axes=axes[-1:]) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel[...]
        kernel = k.astype(x.dtype)
        y = self.ctx.exit_matmul(lambda block: jnp.tensordot(block, kernel, axes=k.ndim - 1), x)
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class VocabParallelEmbed(nnx.Module):
    """Token embedding [vocab, embed] sharded over the vocabulary (Megatron VocabParallelEmbedding).

    `__call__`: ids int32 [B, T] -> [B, T, D] (each rank looks up its vocab rows, zeros elsewhere,
    then `ctx.exit` sums: all-reduce, or reduce-scatter over T with sequence parallelism).
    `attend`: h [B, T, D] (already through `ctx.enter`; with `--tp-overlap collective-matmul` its
    `PendingGather`, the all-gather then interleaved with the logits matmul) -> local logits [B, T, V / tp].
    """

    def __init__(self, vocab_size: int, features: int, *, ctx: ParallelContext, std: float, rngs: nnx.Rngs,
                 padded_size: int | None = None):
        self.ctx = ctx
        self.vocab_size = vocab_size  # real rows; rows [vocab_size, padded_size) are padding (zeros, masked)
        table = _normal(rngs, (vocab_size, features), std)  # same real rows whatever the padding
        if padded_size is not None and padded_size > vocab_size:
            table = jnp.pad(table, ((0, padded_size - vocab_size), (0, 0)))
        self.embedding = nnx.Param(table, axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        table = self.embedding[...]
        v_local = table.shape[0]
        start = self.ctx.tp_rank() * v_local
        local = ids - start
        inside = (local >= 0) & (local < v_local)
        x = jnp.take(table, jnp.where(inside, local, 0), axis=0).astype(dtype)
        return self.ctx.exit(jnp.where(inside[..., None], x, 0))

    def attend(self, h: jax.Array | PendingGather) -> jax.Array:
        table = self.embedding[...].astype(h.dtype)
        if isinstance(h, PendingGather):
            logits = h.apply(lambda block: jnp.einsum("btd,vd->btv", block, table))
        else:
            logits = jnp.einsum("btd,vd->btv", h, table)
        return mask_vocab_padding(logits, self.vocab_size, self.ctx)


def mask_vocab_padding(logits: jax.Array, vocab_size: int, ctx: ParallelContext) -> jax.Array:
    """Local logits [..., V_pad / tp] with the padded vocabulary columns (global id >= vocab_size)
    set to the dtype's lowest value, so they get no probability in the softmax / cross-entropy
    (Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × tp).
    No-op (same array) when the table is not padded."""
    v_local = logits.shape[-1]
    if v_local * ctx.tp_size <= vocab_size:
        return logits
    ids = ctx.tp_rank() * v_local + jnp.arange(v_local)
    return jnp.where(ids < vocab_size, logits, jnp.finfo(logits.dtype).min)


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, ctx: ParallelContext) -> jax.Array:
    """Per-token cross-entropy from vocab-sharded logits without gathering them (Megatron-LM
    `_VocabParallelCrossEntropy`: three exact FP32 all-reduces of [B, T]).
    logits [B, T, V / tp] (shard r holds ids [r·V/tp, (r+1)·V/tp)), targets int32 [B, T] in [0, V)
    -> float32 [B, T] negative log-likelihood, replicated over the tensor axis.
    """
    logits = logits.astype(jnp.float32)
    v_local = logits.shape[-1]
    m = ctx.pmax_exact(jax.lax.stop_gradient(jnp.max(logits, axis=-1)))
    z = logits - m[..., None]
    sum_exp = ctx.psum_exact(jnp.sum(jnp.exp(z), axis=-1))
    local = targets - ctx.tp_rank() * v_local
    inside = (local >= 0) & (local < v_local)
    picked = jnp.take_along_axis(z, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
    target_z = ctx.psum_exact(jnp.where(inside, picked, 0.0))
    return jnp.log(sum_exp) - target_z


def residual_std(n_layers: int, std: float = 0.02) -> float:
    """GPT-2's scaled init for projections into the residual stream: std / sqrt(2 · n_layers)."""
    return std / math.sqrt(2 * n_layers)


#: Activation rematerialisation of each decoder layer (`--remat`), MaxText's `remat_policy` names
#: in brackets: "none" keeps every activation for the backward pass; "block" saves the outputs of
#: the layer's weight matmuls and recomputes the rest (norms, GELU/SwiGLU, attention scores and
#: softmax) [minimal]; "full" saves only the layer's input and recomputes the whole layer [full;
#: Megatron `--recompute-granularity full --recompute-method uniform`, 1 layer per group].
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}

#: Compute dtypes a model may run in (`--dtype`); parameters always stay float32.
COMPUTE_DTYPES = ("bfloat16", "float32")


def check_compute(dtype: str, remat: str) -> None:
    """Raises ValueError naming a compute dtype or remat mode that is not supported."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {COMPUTE_DTYPES}")
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not supported; choose one of {tuple(REMAT_POLICIES)}")


def remat_call(layer: nnx.Module, forward, x: jax.Array, remat: str) -> jax.Array:
    """forward(layer, x), rematerialised per `REMAT_POLICIES[remat]` (`nnx.remat`); the recomputation
    repeats the layer's forward all-reduces (as Megatron's does), the values are unchanged."""
    if remat == "none":
        return forward(layer, x)
    return nnx.remat(forward, policy=REMAT_POLICIES[remat])(layer, x)


def layer_norm(features: int, dtype: str, *, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm (ε 1e-5, two-pass variance) that computes its statistics in float32 and returns `dtype`
    (flax otherwise promotes bf16 input with the float32 scale to a float32 output, so the tensor-parallel
    message after the norm would be float32). Scale and bias are float32 parameters."""
    return nnx.LayerNorm(features, epsilon=1e-5, use_fast_variance=False, dtype=jnp.dtype(dtype),
                         param_dtype=jnp.float32, rngs=rngs)
