"""GPT-2: published parameter counts, and tensor-parallel (± sequence-parallel) == unsharded."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tp_value_and_grad
from flax import nnx

from taco_jax.collectives import CommPolicy
from taco_jax.models import GPT, get_config

pytestmark = pytest.mark.slow


def _n_params(cfg):
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))  # allocates nothing
    return sum(x.size for x in jax.tree.leaves(nnx.split(model, nnx.Param)[1]))


def test_gpt2_small_has_published_parameter_count():
    assert _n_params(get_config("gpt2-124m")) == 124_439_808  # HF model card `gpt2`


def test_gpt2_medium_has_published_parameter_count():
    assert _n_params(get_config("gpt2-350m")) == 354_823_168  # HF model card `gpt2-medium`


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match="model='gpt5'"):
        get_config("gpt5")


@pytest.mark.parametrize("bad,match", [(dict(n_embd=100, n_head=3), "n_embd=100"), (dict(n_layer=0), "n_layer=0")])
def test_bad_model_config_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        get_config("gpt2-tiny", **bad)


@pytest.mark.parametrize("tp,sp,match", [(3, False, "n_head=4"), (4, True, "seq_len=30")])
def test_tensor_parallel_divisibility(tp, sp, match):
    with pytest.raises(ValueError, match=match):
        get_config("gpt2-tiny").check_tensor_parallel(tp, sequence_parallel=sp, seq_len=30)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_matches_unsharded(mesh, sp):
    cfg = dataclasses.replace(get_config("gpt2-tiny"), n_layer=2, vocab_size=512)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)

    def ref(p):
        st = nnx.split(model, nnx.Param)[1]
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(nnx.split(model, nnx.Param)[0], st).loss(ids, tgt)

    want_loss, want_grads = jax.value_and_grad(ref)(params)
    loss, grads = tp_value_and_grad(mesh, cfg, CommPolicy.none(), sp)(params, ids, tgt)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_compressed_model_loss_close(mesh):
    cfg = dataclasses.replace(get_config("gpt2-tiny"), n_layer=2, vocab_size=512)
    params = nnx.to_pure_dict(nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)
    exact, _ = tp_value_and_grad(mesh, cfg, CommPolicy.none())(params, ids, tgt)
    taco, _ = tp_value_and_grad(mesh, cfg, CommPolicy.taco())(params, ids, tgt)
    assert 0 < abs(float(taco) - float(exact)) / float(exact) < 1e-2


def _two_pass_layernorm(x, eps=1e-5):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def test_layernorm_keeps_precision_on_rows_with_a_large_mean():
    """Rows 2000 + N(0, 1) of width 128 through `ln_f` and `h[0].ln_1` of a fresh gpt2-tiny: std 1.000
    and max error < 1e-3 against a float64 two-pass LayerNorm (E[x²] − E[x]² cancels: std 0.88..1.90)."""
    model = GPT(get_config("gpt2-tiny"), rngs=nnx.Rngs(0))
    x = 2000 + jax.random.normal(jax.random.key(0), (64, 128))
    want = _two_pass_layernorm(x)  # fresh LayerNorm: scale 1, bias 0
    for ln in (model.ln_f, model.h[0].ln_1):
        y = np.asarray(ln(x), np.float64)
        np.testing.assert_allclose(y.std(-1), 1.0, atol=1e-3)
        assert np.abs(y - want).max() < 1e-3, np.abs(y - want).max()


@pytest.mark.parametrize("multiple,rows", [(1, 50257), (128 * 2, 50432), (128 * 4, 50688)])
def test_vocab_padding_keeps_published_count(multiple, rows):
    """gpt2-124m's real 50,257-token vocabulary padded Megatron-style (128 × tp rows): the table grows,
    the reported count stays the published 124,439,808, and tensor=2 / 4 are accepted."""
    from taco_jax.models import count_params

    cfg = get_config("gpt2-124m", vocab_multiple=multiple)
    assert cfg.padded_vocab_size == rows
    assert count_params(cfg) == 124_439_808
    assert _n_params(cfg) == 124_439_808 + (rows - 50257) * 768
    cfg.check_tensor_parallel(multiple // 128 if multiple > 1 else 1)
    with pytest.raises(ValueError, match="vocab_size=50257.*make-vocab-size-divisible-by"):
        get_config("gpt2-124m").check_tensor_parallel(4)


def test_padded_vocabulary_gets_no_probability(mesh):
    """Vocabulary 500 padded to 512 on tensor=4: same loss and gradients as the unpadded model on one
    device, the padded logits are the lowest float (zero probability), padded rows get zero gradient."""
    cfg = dataclasses.replace(get_config("gpt2-tiny"), n_layer=1, vocab_size=500)
    padded = dataclasses.replace(cfg, vocab_multiple=128 * 4)
    model, model_p = GPT(cfg, rngs=nnx.Rngs(0)), GPT(padded, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
    params_p = nnx.to_pure_dict(nnx.split(model_p, nnx.Param)[1])
    np.testing.assert_array_equal(params_p["wte"]["embedding"][:500], params["wte"]["embedding"])
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)
    logits = model_p(ids)
    assert logits.shape[-1] == 512 and bool(jnp.all(logits[..., 500:] == jnp.finfo(jnp.float32).min))
    np.testing.assert_allclose(logits[..., :500], model(ids), atol=2e-6)  # matmul blocking differs
    want_loss, want = jax.value_and_grad(lambda p: nnx.merge(nnx.split(model, nnx.Param)[0], _state(model, p))
                                         .loss(ids, tgt))(params)
    loss, grads = tp_value_and_grad(mesh, padded, CommPolicy.none())(params_p, ids, tgt)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert not np.any(grads["wte"]["embedding"][500:])
    np.testing.assert_allclose(grads["wte"]["embedding"][:500], want["wte"]["embedding"], rtol=2e-3, atol=2e-6)


def _state(model, p):
    st = nnx.split(model, nnx.Param)[1]
    nnx.replace_by_pure_dict(st, p)
    return st
