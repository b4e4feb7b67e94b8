"""The causal-LM skeleton both model families share, and the config interface they expose.

`CausalLMConfig` is the only way the rest of taco_jax (trainer, pipeline, HF conversion, cost model) reads a model
config. `CausalLM` owns embed -> layers -> final norm -> LM head, the vocab-parallel loss and the pipeline's pieces;
`PreNormBlock` is the shared residual block. Each family keeps its HF-like submodule names."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.parallel import vocab_parallel_cross_entropy
from taco_jax.parallel.layers import check_compute, mask_vocab_padding, remat_call


class CausalLMConfig:
    """The config interface of a causal-LM family: a frozen dataclass with the fields vocab_size, block_size,
    init_std, dtype, vocab_multiple and remat; it sets `family` ("gpt2" | "qwen"), `POSITIVE` and the *_FIELD names,
    provides `head_dim` and `tied_embeddings`, and implements `param_sizes`, `_check_shape` and `_check_split`."""

    family: ClassVar[str]
    #: Integer fields that must be positive.
    POSITIVE: ClassVar[tuple[str, ...]]
    #: The family's names of the fields holding the depth L, the hidden size D and the query heads H.
    DEPTH_FIELD: ClassVar[str]
    WIDTH_FIELD: ClassVar[str]
    HEADS_FIELD: ClassVar[str]

    @property
    def n_layers(self) -> int:
        """Depth L: decoder layers."""
        return getattr(self, self.DEPTH_FIELD)

    @property
    def d_model(self) -> int:
        """Hidden size D: the width of the residual stream and of every tensor-parallel message."""
        return getattr(self, self.WIDTH_FIELD)

    @property
    def attn_width(self) -> int:
        """Query heads x head size (H·hd): the width of the attention output."""
        return getattr(self, self.HEADS_FIELD) * self.head_dim

    def param_sizes(self) -> tuple[int, int, int]:
        """(matmul weights of one layer, the layer's other parameters (norms, biases), the
        parameters outside the layers other than the token embedding and an untied LM head)."""
        raise NotImplementedError

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights of one layer (2 FLOP per weight and token forward)."""
        return self.param_sizes()[0]

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad field: compute dtype / remat mode, a field of
        `POSITIVE` that is <= 0, then the family's own shape rules."""
        check_compute(self.dtype, self.remat)
        for f in self.POSITIVE:
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        self._check_shape()

    def _check_shape(self) -> None:
        raise NotImplementedError

    def _check_split(self, tp: int) -> None:
        raise NotImplementedError

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table (and of an untied LM head): vocab_size rounded up to a multiple of vocab_multiple
        (Megatron's make_vocab_size_divisible_by x tp); the padded rows are zeros whose logits are masked out."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def n_params(self) -> int:
        """Parameters of this config's model, without the vocabulary padding (so a model padded for
        tensor parallelism reports the checkpoint's count): L layers, the token embedding, an untied
        LM head, and the family's other non-layer parameters (`param_sizes`). Allocates nothing."""
        matmul, other, outer = self.param_sizes()
        heads = 1 if self.tied_embeddings else 2
        return self.n_layers * (matmul + other) + heads * self.vocab_size * self.d_model + outer

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None):
        """Raises ValueError (naming the value) if this model cannot be split over `tp` tensor ranks:
        the family's heads / hidden sizes, the padded vocabulary, and with sequence parallelism the
        sequence length must divide."""
        self._check_split(tp)
        if self.padded_vocab_size % tp:
            raise ValueError(f"vocab_size={self.vocab_size} (padded to {self.padded_vocab_size} rows, vocab_multiple="
                             f"{self.vocab_multiple}) is not divisible by the tensor axis size {tp}; pad the "
                             f"vocabulary (--make-vocab-size-divisible-by, Megatron style)")
        if sequence_parallel and seq_len is not None and seq_len % tp:
            raise ValueError(f"seq_len={seq_len} is not divisible by the tensor axis size {tp} (sequence parallelism)")


def check_divisible(tp: int, *sizes: tuple[str, int]) -> None:
    """Raises ValueError naming the first (name, size) of `sizes` that `tp` does not divide."""
    for name, n in sizes:
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by the tensor axis size {tp}")


class PreNormBlock(nnx.Module):
    """Pre-norm residual block: x + attn(norm1(x)); x + mlp(norm2(x)), each sublayer entered through
    the tensor-parallel region (`ctx.enter`) and left by its row-parallel projection. A family sets
    `PARTS` to the names of its (norm1, attn, norm2, mlp) submodules and `self.ctx`, `self.remat`.
    `__call__(x)`: [B, T(/tp with SP), D] in the config's dtype -> the same shape and dtype."""

    PARTS: ClassVar[tuple[str, str, str, str]]

    def __call__(self, x):
        return remat_call(self, type(self).forward, x, self.remat)

    def forward(self, x):
        norm1, attn, norm2, mlp = (getattr(self, n) for n in self.PARTS)
        x = x + attn(self.ctx.enter(norm1(x)))
        return x + mlp(self.ctx.enter(norm2(x)))


class CausalLM(nnx.Module):
    """Causal language model skeleton: token embedding (+ the family's positions) -> the layers of
    `pipeline_layers` -> final norm -> LM head (the embedding transposed when tied, else `lm_head`).

    A family sets `pipeline_layers` (the nnx.List of identical layers a pipeline stacks over stages), `token_embed`
    and `final_norm` (attribute names), and `self.cfg`, `self.ctx`. `__call__(ids)`: int32 [B, T] -> this rank's
    vocab slice of the logits, [B, T, V / tp] (all of V when unsharded). `loss(ids, targets)`: mean next-token
    cross-entropy (float32 scalar) over this rank's batch, computed vocab-parallel. Raises ValueError if T exceeds
    the config's `block_size`."""

    pipeline_layers: ClassVar[str]
    token_embed: ClassVar[str]
    final_norm: ClassVar[str]

    def embed(self, ids: jax.Array) -> jax.Array:
        """Token embeddings (plus the family's `positions`): int32 [B, T] -> [B, T(/tp with SP), D]
        in `cfg.dtype`. Raises ValueError if T exceeds `block_size`."""
        t = ids.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        dtype = jnp.dtype(self.cfg.dtype)
        return self.positions(getattr(self, self.token_embed)(ids, dtype), t, dtype)

    def positions(self, x: jax.Array, t: int, dtype) -> jax.Array:
        """x [B, T(/tp with SP), D] with position information added (none by default: RoPE is applied in attention)."""
        return x

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: [B, T(/tp), D] -> this rank's vocab slice [B, T, V/tp]."""
        h = self.ctx.enter(getattr(self, self.final_norm)(x))
        if self.cfg.tied_embeddings:
            return getattr(self, self.token_embed).attend(h)
        return mask_vocab_padding(self.lm_head(h), self.cfg.vocab_size, self.ctx)

    def head_loss(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean cross-entropy (float32 scalar) of the final hidden states x [B, T(/tp), D] against
        targets int32 [B, T]."""
        return jnp.mean(vocab_parallel_cross_entropy(self.logits(x), targets, self.ctx))

    def _hidden(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for layer in getattr(self, self.pipeline_layers):
            x = layer(x)
        return x

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.logits(self._hidden(ids))

    def loss(self, ids: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean cross-entropy of the next-token predictions for ids, targets: int32 [B, T]."""
        return self.head_loss(self._hidden(ids), targets)
