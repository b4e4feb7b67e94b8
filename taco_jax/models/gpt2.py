"""GPT-2 (learned positions, pre-LN, GELU MLP, tied embeddings) with Megatron tensor parallelism.

Source: Radford et al. 2019 / OpenAI `gpt-2` model.py and the HF `gpt2` model card (124,439,808
parameters for GPT-2 small); layer layout after nanoGPT `model.py`. No dropout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.parallel import (
    ColumnParallel,
    ParallelContext,
    RowParallel,
    VocabParallelEmbed,
    residual_std,
    vocab_parallel_cross_entropy,
)
from taco_jax.parallel.layers import check_compute, layer_norm, remat_call


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT-2 architecture hyper-parameters.

    Attributes:
      vocab_size: token vocabulary V (50257 for the OpenAI tokenizer).
      block_size: maximum sequence length (learned position table rows).
      n_layer, n_head, n_embd: depth, attention heads, hidden size D (D % n_head == 0).
      mlp_ratio: MLP hidden size = mlp_ratio · D (4 in GPT-2).
      init_std: std of the normal initialiser (0.02 in GPT-2).
      dtype: compute dtype of activations and tensor-parallel messages, "float32" or "bfloat16"
        (parameters stay float32; norms, softmax and the loss compute in float32).
      remat: rematerialisation of each block, "none" | "block" | "full" (`parallel.layers.REMAT_POLICIES`).
      vocab_multiple: the embedding table's rows are padded to a multiple of this (Megatron's
        make_vocab_size_divisible_by × tp); padded rows are zeros whose logits are masked out.
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp_ratio: int = 4
    init_std: float = 0.02
    dtype: str = "float32"
    vocab_multiple: int = 1
    remat: str = "none"

    def __post_init__(self):
        check_compute(self.dtype, self.remat)
        for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "vocab_multiple"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None):
        """Raises ValueError if this model cannot be split over `tp` tensor ranks."""
        for name, n in (("n_head", self.n_head), ("mlp hidden size", self.mlp_ratio * self.n_embd)):
            if n % tp:
                raise ValueError(f"{name}={n} is not divisible by the tensor axis size {tp}")
        _check_vocab(self, tp)
        if sequence_parallel and seq_len is not None and seq_len % tp:
            raise ValueError(f"seq_len={seq_len} is not divisible by the tensor axis size {tp} (sequence parallelism)")


def _check_vocab(cfg, tp: int) -> None:
    """Raises ValueError if the (padded) vocabulary cannot be split over `tp` tensor ranks."""
    if cfg.padded_vocab_size % tp:
        raise ValueError(f"vocab_size={cfg.vocab_size} (padded to {cfg.padded_vocab_size} rows, vocab_multiple="
                         f"{cfg.vocab_multiple}) is not divisible by the tensor axis size {tp}; pad the vocabulary "
                         f"(--make-vocab-size-divisible-by, Megatron style)")


#: Named presets. `gpt2-124m`/`gpt2-350m` are GPT-2 small/medium (published sizes); the small
#: ones are for CPU runs and take their vocabulary from the tokenizer.
PRESETS: dict[str, GPTConfig] = {
    "gpt2-tiny": GPTConfig(vocab_size=2048, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "gpt2-mini": GPTConfig(vocab_size=4096, block_size=512, n_layer=6, n_head=8, n_embd=256),
    # narrow: per token, compute (~36·D² + 6·T·D FLOPs a layer per TP rank) is small beside the TP
    # all-reduces (4·D values a layer), so communication dominates a CPU step over a real transport
    # (the end-to-end measurement of README "Real transport, end to end").
    "gpt2-narrow": GPTConfig(vocab_size=2048, block_size=256, n_layer=4, n_head=2, n_embd=32),
    "gpt2-124m": GPTConfig(),
    "gpt2-350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
}


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads split over the tensor axis."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, rngs: nnx.Rngs):
        d, h, hd = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.qkv = ColumnParallel(d, (3, h, hd), ("embed", "qkv", "heads", "head_dim"),
                                  use_bias=True, std=cfg.init_std, rngs=rngs)
        self.proj = RowParallel((h, hd), d, ("heads", "head_dim", "embed"), ctx=ctx, use_bias=True,
                                std=residual_std(cfg.n_layer, cfg.init_std), rngs=rngs)

    def __call__(self, x):  # x [B, T, D], inside the TP region
        q, k, v = jnp.moveaxis(self.qkv(x), 2, 0)  # each [B, T, H/tp, hd]
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H/tp, hd]
        return self.proj(y)


class MLP(nnx.Module):
    """D -> mlp_ratio·D (GELU, tanh approximation as GPT-2) -> D; hidden split over the tensor axis."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, rngs: nnx.Rngs):
        d, f = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
        self.fc = ColumnParallel(d, (f,), ("embed", "mlp"), use_bias=True, std=cfg.init_std, rngs=rngs)
        self.proj = RowParallel((f,), d, ("mlp", "embed"), ctx=ctx, use_bias=True,
                                std=residual_std(cfg.n_layer, cfg.init_std), rngs=rngs)

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, rngs: nnx.Rngs):
        self.ctx, self.remat = ctx, cfg.remat
        self.ln_1 = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)
        self.attn = Attention(cfg, ctx, rngs=rngs)
        self.ln_2 = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)
        self.mlp = MLP(cfg, ctx, rngs=rngs)

    def __call__(self, x):  # [B, T(/tp with SP), D] in cfg.dtype
        return remat_call(self, Block.forward, x, self.remat)

    def forward(self, x):
        x = x + self.attn(self.ctx.enter(self.ln_1(x)))
        return x + self.mlp(self.ctx.enter(self.ln_2(x)))


class GPT(nnx.Module):
    """GPT-2 language model.

    `__call__(ids)`: int32 [B, T] -> this rank's vocab slice of the logits, [B, T, V / tp]
    (all of V when unsharded). `loss(ids, targets)`: mean next-token cross-entropy (float32
    scalar) over this rank's batch, computed vocab-parallel.
    Raises ValueError if T exceeds `block_size`.
    The pipeline (`parallel/staged.py`) uses the pieces: `embed`, `pipeline_layers`, `head_loss`.
    """

    pipeline_layers = "h"  # the nnx.List of identical blocks a pipeline stacks over stages

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext | None = None, *, rngs: nnx.Rngs):
        ctx = ctx or ParallelContext()  # unsharded
        self.cfg, self.ctx = cfg, ctx
        self.wte = VocabParallelEmbed(cfg.vocab_size, cfg.n_embd, ctx=ctx, std=cfg.init_std, rngs=rngs,
                                      padded_size=cfg.padded_vocab_size)
        self.wpe = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (cfg.block_size, cfg.n_embd), jnp.float32),
                             axes=("position", "embed"))
        self.h = nnx.List([Block(cfg, ctx, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)

    def embed(self, ids: jax.Array) -> jax.Array:
        """Token + learned position embeddings: int32 [B, T] -> [B, T(/tp with SP), D] in `cfg.dtype`.

        Raises ValueError if T exceeds `block_size`.
        """
        t = ids.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        dtype = jnp.dtype(self.cfg.dtype)
        x = self.wte(ids, dtype)  # [B, T(/tp with SP), D]
        pos = self.wpe[...][:t].astype(dtype)
        if self.ctx.sequence_parallel and self.ctx.tensor_axis is not None:
            t_local = x.shape[1]
            pos = jax.lax.dynamic_slice_in_dim(pos, self.ctx.tp_rank() * t_local, t_local)
        return x + pos[None]

    def logits(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and tied LM head: [B, T(/tp), D] -> this rank's vocab slice [B, T, V/tp]."""
        return self.wte.attend(self.ctx.enter(self.ln_f(x)))

    def head_loss(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean cross-entropy (float32 scalar) of the final hidden states x [B, T(/tp), D] against targets [B, T]."""
        return jnp.mean(vocab_parallel_cross_entropy(self.logits(x), targets, self.ctx))

    def _hidden(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for block in self.h:
            x = block(x)
        return x

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.logits(self._hidden(ids))  # tied LM head, [B, T, V/tp]

    def loss(self, ids: jax.Array, targets: jax.Array) -> jax.Array:
        return self.head_loss(self._hidden(ids), targets)
