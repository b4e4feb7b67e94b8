"""Qwen2.5 and Qwen3 (RMSNorm, SwiGLU, rotate-half RoPE, GQA) with Megatron tensor parallelism.

Source: HF `transformers` `models/qwen2/modeling_qwen2.py` and `models/qwen3/modeling_qwen3.py` and the published
`config.json` of each checkpoint; one-file layout after jax-ml/bonsai `models/qwen3/modeling.py`. Qwen2.5 has biases
on the q/k/v projections; Qwen3 has none but RMS-normalises each query and key head (over `head_dim`) before RoPE,
and sets `head_dim` explicitly. No dropout, no sliding window, no KV cache (training only).

Tensor parallelism (axis size tp): query heads, the MLP hidden size and the vocabulary are split. Key/value heads
are split when `num_kv_heads % tp == 0`; with fewer KV heads than ranks (`tp % num_kv_heads == 0`) the K/V
projections are replicated and each rank projects only the KV head its query heads read. RoPE is applied after
`ctx.enter` gathered the whole sequence, so sequence parallelism needs nothing model-specific."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.models.base import CausalLM, CausalLMConfig, PreNormBlock, check_divisible
from taco_jax.parallel import ColumnParallel, ParallelContext, RowParallel, VocabParallelEmbed


@dataclasses.dataclass(frozen=True)
class QwenConfig(CausalLMConfig):
    """Qwen2.5 / Qwen3 architecture hyper-parameters (HF `config.json` names in brackets; the
    `CausalLMConfig` interface, family "qwen").

    Attributes:
      vocab_size: V [vocab_size] (151,936; 152,064 for Qwen2.5-7B).
      emb_dim: hidden size D [hidden_size].
      mlp_dim: SwiGLU hidden size F [intermediate_size].
      num_layers: decoder layers [num_hidden_layers].
      num_heads: query heads H [num_attention_heads].
      num_kv_heads: key/value heads K, H % K == 0 [num_key_value_heads].
      head_dim: per-head size hd [head_dim]; Qwen2.5 has D / H.
      rope_theta: RoPE base θ [rope_theta].
      norm_eps: RMSNorm ε [rms_norm_eps].
      qkv_bias: biases on q/k/v (Qwen2.5) [attention_bias / implicit in Qwen2].
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
      tie_word_embeddings: LM head = embedding table transposed.
      block_size: longest sequence this trainer accepts (max_position_embeddings caps RoPE use).
      init_std: std of the normal initialiser [initializer_range].
      dtype: compute dtype of activations and tensor-parallel messages, "float32" or "bfloat16"
        (parameters stay float32; RMSNorm, RoPE angles, softmax and the loss compute in float32).
      remat: rematerialisation of each layer, "none" | "block" | "full" (`parallel.layers.REMAT_POLICIES`).
      vocab_multiple: embedding / LM-head rows padded to a multiple of this (as `GPTConfig`).
    """

    vocab_size: int = 151_936
    emb_dim: int = 1024
    mlp_dim: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = True
    tie_word_embeddings: bool = True
    block_size: int = 40_960
    init_std: float = 0.02
    dtype: str = "float32"
    vocab_multiple: int = 1
    remat: str = "none"

    family = "qwen"
    POSITIVE = ("vocab_size", "emb_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "block_size", "vocab_multiple")
    DEPTH_FIELD, WIDTH_FIELD, HEADS_FIELD = "num_layers", "emb_dim", "num_heads"

    def _check_shape(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotate-half RoPE)")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")

    def _check_split(self, tp: int) -> None:
        check_divisible(tp, ("num_heads", self.num_heads))
        k = self.num_kv_heads
        if (k >= tp and k % tp) or (k < tp and tp % k):
            raise ValueError(f"num_kv_heads={k} is not compatible with the tensor axis size {tp}: KV heads are "
                             f"split when num_kv_heads % tp == 0 and replicated when tp % num_kv_heads == 0")
        check_divisible(tp, ("mlp_dim", self.mlp_dim))

    def kv_replicated(self, tp: int) -> bool:
        """True when K/V heads are replicated over `tp` tensor ranks (fewer KV heads than ranks)."""
        return tp > 1 and self.num_kv_heads < tp

    @property
    def tied_embeddings(self) -> bool:
        return self.tie_word_embeddings

    def param_sizes(self) -> tuple[int, int, int]:
        """Per layer: q and o projections 2·D·H·hd + k and v 2·D·K·hd + SwiGLU 3·D·F weights; two
        RMSNorms 2·D, the q/k/v biases (Qwen2.5) H·hd + 2·K·hd and q/k norms (Qwen3) 2·hd. Outside:
        the final RMSNorm D."""
        d, q, kv = self.emb_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        other = 2 * d + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return d * (2 * q + 2 * kv) + 3 * d * self.mlp_dim, other, d

    # --- published checkpoints (HF `config.json`); parameter counts are checked in tests/test_qwen.py
    @classmethod
    def qwen2_5_0_5b(cls):
        return cls(emb_dim=896, mlp_dim=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                   qkv_bias=True, qk_norm=False, tie_word_embeddings=True, block_size=32_768)

    @classmethod
    def qwen2_5_1_5b(cls):
        return cls(emb_dim=1536, mlp_dim=8960, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                   qkv_bias=True, qk_norm=False, tie_word_embeddings=True, block_size=32_768)

    @classmethod
    def qwen2_5_7b(cls):
        return cls(vocab_size=152_064, emb_dim=3584, mlp_dim=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                   head_dim=128, qkv_bias=True, qk_norm=False, tie_word_embeddings=False, block_size=32_768)

    @classmethod
    def qwen3_0_6b(cls):
        return cls(emb_dim=1024, mlp_dim=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128)

    @classmethod
    def qwen3_1_7b(cls):
        return cls(emb_dim=2048, mlp_dim=6144, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128)

    @classmethod
    def qwen3_4b(cls):
        return cls(emb_dim=2560, mlp_dim=9728, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128)

    @classmethod
    def qwen3_8b(cls):
        return cls(emb_dim=4096, mlp_dim=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                   tie_word_embeddings=False)


#: Named presets. The tiny ones are for CPU runs (vocabulary from the tokenizer, θ = 10^4 for
#: short sequences); both use GQA with 2 KV heads, so tensor=4 exercises replicated KV heads.
PRESETS: dict[str, QwenConfig] = {
    "qwen2.5-tiny": QwenConfig(vocab_size=2048, emb_dim=128, mlp_dim=384, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=32, rope_theta=10_000.0, qkv_bias=True, qk_norm=False,
                               block_size=256),
    "qwen3-tiny": QwenConfig(vocab_size=2048, emb_dim=128, mlp_dim=384, num_layers=4, num_heads=4,
                             num_kv_heads=2, head_dim=32, rope_theta=10_000.0, block_size=256),
    # narrow: compute per token is small beside the TP traffic (as gpt2-narrow), for the emulated-link
    # study (docs/emulated.md); 4 heads, so it runs at tensor=4 too.
    "qwen3-narrow": QwenConfig(vocab_size=2048, emb_dim=32, mlp_dim=96, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=8, rope_theta=10_000.0, block_size=256),
    "qwen2.5-0.5b": QwenConfig.qwen2_5_0_5b(),
    "qwen2.5-1.5b": QwenConfig.qwen2_5_1_5b(),
    "qwen2.5-7b": QwenConfig.qwen2_5_7b(),
    "qwen3-0.6b": QwenConfig.qwen3_0_6b(),
    "qwen3-1.7b": QwenConfig.qwen3_1_7b(),
    "qwen3-4b": QwenConfig.qwen3_4b(),
    "qwen3-8b": QwenConfig.qwen3_8b(),
}


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x², last axis) + ε) · w, computed in float32 (HF `Qwen2RMSNorm`)."""

    def __init__(self, dim: int, eps: float, axis_name: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=(axis_name,))

    def __call__(self, x):  # [..., dim]
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary embedding of x [B, T, N, hd] at positions 0..T-1 (HF `apply_rotary_pos_emb`)."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)  # [hd/2]
    angles = jnp.einsum("t,f->tf", jnp.arange(t, dtype=jnp.float32), inv_freq)  # [T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # [1, T, 1, hd]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention; query heads (and KV heads, or their choice) per tensor rank."""

    def __init__(self, cfg: QwenConfig, ctx: ParallelContext, *, tensor_size: int, rngs: nnx.Rngs):
        d, h, k, hd, std = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.init_std
        self.cfg, self.ctx = cfg, ctx
        self.kv_replicated = cfg.kv_replicated(tensor_size)
        self.kv_ranks = tensor_size // k if self.kv_replicated else 1  # tensor ranks sharing one KV head
        kv_axis = None if self.kv_replicated else "kv_heads"
        self.q_proj = ColumnParallel(d, (h, hd), ("embed", "heads", "head_dim"), use_bias=cfg.qkv_bias, std=std,
                                     rngs=rngs)
        self.k_proj = ColumnParallel(d, (k, hd), ("embed", kv_axis, "head_dim"), use_bias=cfg.qkv_bias, std=std,
                                     rngs=rngs)
        self.v_proj = ColumnParallel(d, (k, hd), ("embed", kv_axis, "head_dim"), use_bias=cfg.qkv_bias, std=std,
                                     rngs=rngs)
        self.o_proj = RowParallel((h, hd), d, ("heads", "head_dim", "embed"), ctx=ctx, use_bias=False, std=std,
                                  rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, "head_dim")
            self.k_norm = RMSNorm(hd, cfg.norm_eps, "head_dim")

    def _kv(self, proj: ColumnParallel, x):  # x [B, T, D] -> [B, T, K_local, hd]
        if not (self.kv_replicated and self.ctx.tensor_axis is not None):
            return proj(x)
        head = self.ctx.tp_rank() // self.kv_ranks  # the KV head this rank's query heads read
        w = jax.lax.dynamic_slice_in_dim(proj.kernel[...], head, 1, axis=1)  # [D, 1, hd]
        y = jnp.einsum("btd,dkh->btkh", x, w.astype(x.dtype))
        if proj.bias is not None:
            y = y + jax.lax.dynamic_slice_in_dim(proj.bias[...], head, 1, axis=0).astype(x.dtype)
        return y

    def __call__(self, x):  # x [B, T, D], inside the TP region (whole sequence)
        q = self.q_proj(x)  # [B, T, H_l, hd]
        k, v = self._kv(self.k_proj, x), self._kv(self.v_proj, x)  # [B, T, K_l, hd]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, self.cfg.rope_theta), rope(k, self.cfg.rope_theta)
        b, t, h_l, hd = q.shape
        k_l = k.shape[2]
        q = q.reshape(b, t, k_l, h_l // k_l, hd)  # [B, T, K_l, G, hd]: G query heads per KV head
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(hd))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K_l, G, T, S]
        y = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, h_l, hd)
        return self.o_proj(y)  # [B, T(/tp with SP), D]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); hidden size F split over the tensor axis."""

    def __init__(self, cfg: QwenConfig, ctx: ParallelContext, *, rngs: nnx.Rngs):
        d, f, std = cfg.emb_dim, cfg.mlp_dim, cfg.init_std
        self.gate_proj = ColumnParallel(d, (f,), ("embed", "mlp"), use_bias=False, std=std, rngs=rngs)
        self.up_proj = ColumnParallel(d, (f,), ("embed", "mlp"), use_bias=False, std=std, rngs=rngs)
        self.down_proj = RowParallel((f,), d, ("mlp", "embed"), ctx=ctx, use_bias=False, std=std, rngs=rngs)

    def __call__(self, x):  # [B, T, D] -> [B, T(/tp), D]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, F/tp] inside


class DecoderLayer(PreNormBlock):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

    PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")

    def __init__(self, cfg: QwenConfig, ctx: ParallelContext, *, tensor_size: int, rngs: nnx.Rngs):
        self.ctx, self.remat = ctx, cfg.remat
        self.input_layernorm = RMSNorm(cfg.emb_dim, cfg.norm_eps, "embed")
        self.self_attn = Attention(cfg, ctx, tensor_size=tensor_size, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.emb_dim, cfg.norm_eps, "embed")
        self.mlp = MLP(cfg, ctx, rngs=rngs)


class Qwen(CausalLM):
    """Qwen2.5 / Qwen3 causal language model: the `CausalLM` skeleton with RoPE in attention and a
    tied or separate (`lm_head`) LM head. `tensor_size`: the tensor-axis size the model will run on
    (it decides whether K/V heads are split or replicated; parameter values do not depend on it).
    Raises ValueError if the model cannot be split over `tensor_size` ranks."""

    pipeline_layers, token_embed, final_norm = "layers", "embed_tokens", "norm"

    def __init__(self, cfg: QwenConfig, ctx: ParallelContext | None = None, *, rngs: nnx.Rngs,
                 tensor_size: int = 1):
        ctx = ctx or ParallelContext()  # unsharded
        cfg.check_tensor_parallel(tensor_size)
        self.cfg, self.ctx = cfg, ctx
        self.embed_tokens = VocabParallelEmbed(cfg.vocab_size, cfg.emb_dim, ctx=ctx, std=cfg.init_std, rngs=rngs,
                                               padded_size=cfg.padded_vocab_size)
        self.layers = nnx.List([DecoderLayer(cfg, ctx, tensor_size=tensor_size, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.emb_dim, cfg.norm_eps, "embed")
        if not cfg.tie_word_embeddings:
            self.lm_head = ColumnParallel(cfg.emb_dim, (cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                                          std=cfg.init_std, rngs=rngs)
            if cfg.padded_vocab_size > cfg.vocab_size:  # zero columns, masked in `logits`
                pad = ((0, 0), (0, cfg.padded_vocab_size - cfg.vocab_size))
                self.lm_head.kernel = nnx.Param(jnp.pad(self.lm_head.kernel[...], pad), axes=("embed", "vocab"))
