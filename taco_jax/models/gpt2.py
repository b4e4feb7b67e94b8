"""GPT-2 (learned positions, pre-LN, GELU MLP, tied embeddings) with Megatron tensor parallelism.

Source: Radford et al. 2019 / OpenAI `gpt-2` model.py and the HF `gpt2` model card (124,439,808
parameters for GPT-2 small); layer layout after nanoGPT `model.py`. No dropout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.base import CausalLM, CausalLMConfig, PreNormBlock, check_divisible
from taco_jax.parallel import ColumnParallel, ParallelContext, RowParallel, VocabParallelEmbed, residual_std
from taco_jax.parallel.layers import layer_norm


@dataclasses.dataclass(frozen=True)
class GPTConfig(CausalLMConfig):
    """GPT-2 architecture hyper-parameters (the `CausalLMConfig` interface, family "gpt2").

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

    family = "gpt2"
    POSITIVE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "vocab_multiple")
    DEPTH_FIELD, WIDTH_FIELD, HEADS_FIELD = "n_layer", "n_embd", "n_head"
    tied_embeddings = True  # GPT-2's LM head is the token embedding, always

    def _check_shape(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    def _check_split(self, tp: int) -> None:
        check_divisible(tp, ("n_head", self.n_head), ("mlp hidden size", self.mlp_hidden))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """MLP hidden size F = mlp_ratio · D."""
        return self.mlp_ratio * self.n_embd

    def param_sizes(self) -> tuple[int, int, int]:
        """Per layer: QKV D·3D + output projection D·D + MLP 2·D·F weights; two LayerNorms (scale and bias) 4·D and
        the biases of QKV 3·D, projections 2·D and MLP F. Outside: positions T·D and the final LayerNorm 2·D."""
        d, f = self.n_embd, self.mlp_hidden
        return 4 * d * d + 2 * d * f, 9 * d + f, self.block_size * d + 2 * d


#: Named presets. `gpt2-124m`/`gpt2-350m` are GPT-2 small/medium (published sizes); the small
#: ones are for CPU runs and take their vocabulary from the tokenizer.
PRESETS: dict[str, GPTConfig] = {
    "gpt2-tiny": GPTConfig(vocab_size=2048, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "gpt2-mini": GPTConfig(vocab_size=4096, block_size=512, n_layer=6, n_head=8, n_embd=256),
    # narrow: per token, compute (~36·D² + 6·T·D FLOPs a layer per TP rank) is small beside the TP
    # all-reduces (4·D values a layer): communication dominates (docs/results.md "Real transport, end to end").
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


class Block(PreNormBlock):
    """Pre-LN transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    PARTS = ("ln_1", "attn", "ln_2", "mlp")

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, rngs: nnx.Rngs):
        self.ctx, self.remat = ctx, cfg.remat
        self.ln_1 = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)
        self.attn = Attention(cfg, ctx, rngs=rngs)
        self.ln_2 = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)
        self.mlp = MLP(cfg, ctx, rngs=rngs)


class GPT(CausalLM):
    """GPT-2 language model: the `CausalLM` skeleton with learned positions and a tied LM head.
    `tensor_size` is accepted for the families' common signature (GPT-2 does not depend on it)."""

    pipeline_layers, token_embed, final_norm = "h", "wte", "ln_f"

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext | None = None, *, rngs: nnx.Rngs, tensor_size: int = 1):
        ctx = ctx or ParallelContext()  # unsharded
        self.cfg, self.ctx = cfg, ctx
        self.wte = VocabParallelEmbed(cfg.vocab_size, cfg.n_embd, ctx=ctx, std=cfg.init_std, rngs=rngs,
                                      padded_size=cfg.padded_vocab_size)
        self.wpe = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (cfg.block_size, cfg.n_embd), jnp.float32),
                             axes=("position", "embed"))
        self.h = nnx.List([Block(cfg, ctx, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = layer_norm(cfg.n_embd, cfg.dtype, rngs=rngs)

    def positions(self, x: jax.Array, t: int, dtype) -> jax.Array:
        """x [B, T(/tp with SP), D] plus the learned positions of its tokens (this rank's slice of
        the sequence under sequence parallelism)."""
        pos = self.wpe[...][:t].astype(dtype)
        if self.ctx.sequence_parallel and self.ctx.tensor_axis is not None:
            t_local = x.shape[1]
            pos = jax.lax.dynamic_slice_in_dim(pos, self.ctx.tp_rank() * t_local, t_local)
        return x + pos[None]
