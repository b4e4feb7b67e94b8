"""Logits and text generation from loaded weights, on one device (no mesh):

    from taco_jax.models import generate, load_hf
    model, params = load_hf("runs/qwen/hf")               # an HF checkpoint folder
    logits = model.logits(params, tokens)                 # [B, T] int32 -> [B, T, vocab_size] float32
    out = generate(model, params, prompt, 32, temperature=0.8, top_k=50, seed=0)

`generate` is one jit-compiled loop that recomputes the whole (fixed-size) sequence at every new
token (no KV cache: simple and exact; cost grows with prompt + new tokens squared). Greedy decoding
(temperature 0) equals `transformers`' `generate(do_sample=False)` on the same weights (test_generate.py)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class InferenceModel:
    """A model config (`CausalLMConfig`: GPT-2 / Qwen) with its module graph, to run on parameter dicts."""

    config: object
    graphdef: object
    abstract_state: object

    @classmethod
    def from_config(cls, cfg) -> InferenceModel:
        from flax import nnx

        from taco_jax.models.registry import make_model

        def build():  # one device: no tensor-parallel context (as models.make_model without a mesh)
            return make_model(cfg, None, rngs=nnx.Rngs(0), tensor_size=1)

        model = nnx.eval_shape(build)
        graphdef, state = nnx.split(model, nnx.Param)
        return cls(cfg, graphdef, state)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def logits(self, params, tokens) -> jax.Array:
        """Next-token logits float32 [B, T, vocab_size] (vocabulary padding dropped) of int32 token
        ids [B, T] (T <= block_size), for the model's pure-dict `params` (`load_hf`, or a run's)."""
        return _logits(self, params, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: InferenceModel, params, tokens):
    from flax import nnx

    state = jax.tree.map(lambda v: v, model.abstract_state)
    nnx.replace_by_pure_dict(state, params)
    out = nnx.merge(model.graphdef, state)(tokens)
    return out[..., :model.vocab_size].astype(jnp.float32)


def load_hf(path, *, dtype: str = "float32") -> tuple[InferenceModel, dict]:
    """(model, params) of the Hugging Face checkpoint folder `path` (GPT-2, Qwen2.5, Qwen3;
    `models.hf.config_from_hf`), parameters as float32 jax arrays on the default device; `dtype` is the compute
    dtype. Raises ValueError as `models.hf.load_checkpoint` (unknown architecture, tensor mismatch)."""
    from taco_jax.models.hf import load_checkpoint

    cfg, params = load_checkpoint(path, dtype=dtype)
    return InferenceModel.from_config(cfg), jax.tree.map(jnp.asarray, params)


def generate(model: InferenceModel, params, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, allowed=None) -> np.ndarray:
    """`prompt` (int token ids [B, T0] or [T0]) followed by `max_new_tokens` generated ones: int32
    [B, T0 + max_new_tokens] (or [T0 + N] for a 1-D prompt).

    temperature 0: greedy (argmax); > 0: sample from softmax(logits / temperature), restricted to
    the `top_k` most likely tokens when top_k > 0; `seed` fixes the samples (jax.random key).
    `allowed`: bool [vocab_size], the ids that may be generated (e.g. those the tokenizer has); None:
    every id. Raises ValueError for an empty prompt, a negative or non-finite count / temperature / top_k, a seed
    outside [0, 2**63), ids outside the vocabulary, a total length over the model's block_size, or an `allowed` of
    another shape or with no id."""
    ids = np.asarray(prompt)
    one = ids.ndim == 1
    ids = ids[None] if one else ids
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt must be token ids [B, T] or [T] with T >= 1, got shape {np.shape(prompt)}")
    for name, v in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name}={v} must be a finite number >= 0")
    if not 0 <= seed < 2**63:  # jax.random.key raises OverflowError beyond
        raise ValueError(f"seed={seed!r} must be in [0, 2**63) (JAX's seeds)")
    if ids.min() < 0 or ids.max() >= model.vocab_size:
        raise ValueError(f"prompt ids must be in [0, {model.vocab_size}), got [{ids.min()}, {ids.max()}]")
    total = ids.shape[1] + max_new_tokens
    if total > model.block_size:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens={max_new_tokens} = {total} exceeds "
                         f"the model's block_size={model.block_size}")
    allowed = np.ones(model.vocab_size, bool) if allowed is None else np.asarray(allowed, bool)
    if allowed.shape != (model.vocab_size,) or not allowed.any():
        raise ValueError(f"allowed must be bool [{model.vocab_size}] with at least one id, got shape "
                         f"{allowed.shape} with {int(allowed.sum())} ids")
    buf = jnp.zeros((ids.shape[0], total), jnp.int32).at[:, :ids.shape[1]].set(jnp.asarray(ids, jnp.int32))
    out = _generate(model, params, buf, ids.shape[1], jnp.float32(temperature), min(top_k, int(allowed.sum())),
                    jax.random.key(seed), jnp.asarray(allowed))
    out = np.asarray(out)
    return out[0] if one else out


@functools.partial(jax.jit, static_argnums=(0, 3, 5))
def _generate(model: InferenceModel, params, buf, start: int, temperature, top_k: int, key, allowed):
    def step(pos, carry):
        buf, key = carry
        logits = jax.lax.dynamic_index_in_dim(_logits(model, params, buf), pos - 1, axis=1, keepdims=False)
        logits = jnp.where(allowed, logits, -jnp.inf)  # [B, V]: ids outside the tokenizer are never chosen
        key, sub = jax.random.split(key)
        if top_k:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits_k = jnp.where(logits < kth, -jnp.inf, logits)
        else:
            logits_k = logits
        sampled = jax.random.categorical(sub, logits_k / jnp.maximum(temperature, 1e-6), axis=-1)
        token = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
        return jax.lax.dynamic_update_index_in_dim(buf, token, pos, axis=1), key

    return jax.lax.fori_loop(start, buf.shape[1], step, (buf, key))[0]
