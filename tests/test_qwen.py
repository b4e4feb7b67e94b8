"""Qwen2.5 / Qwen3: published parameter counts, RoPE, config errors, tensor (± sequence) parallel == unsharded."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tp_value_and_grad
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.collectives import CommPolicy
from taco_jax.models import Qwen, QwenConfig, get_config, make_model
from taco_jax.models.qwen import rope
from taco_jax.parallel import param_specs

pytestmark = pytest.mark.slow


def _n_params(cfg):
    model = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0)))  # allocates nothing
    return sum(x.size for x in jax.tree.leaves(nnx.split(model, nnx.Param)[1]))


# Published sizes (HF model pages, safetensors parameter count) with the HF `config.json` of each.
@pytest.mark.parametrize("name,count", [
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-1.5b", 1_543_714_304),
    ("qwen2.5-7b", 7_615_616_512),  # vocab 152,064, untied
    ("qwen3-0.6b", 596_049_920),
    ("qwen3-4b", 4_022_468_096),
    ("qwen3-8b", 8_190_735_360),  # untied
])
def test_published_parameter_count(name, count):
    assert _n_params(get_config(name)) == count


def test_qwen3_1_7b_count_is_tied_checkpoint_minus_stored_lm_head():
    """Qwen3-1.7B's config ties the embeddings, but its checkpoint also stores lm_head.weight:
    the published 2,031,739,904 = our 1,720,574,976 unique parameters + V · D."""
    cfg = get_config("qwen3-1.7b")
    assert cfg.tie_word_embeddings
    assert _n_params(cfg) == 1_720_574_976
    assert _n_params(cfg) + cfg.vocab_size * cfg.emb_dim == 2_031_739_904
    assert _n_params(dataclasses.replace(cfg, tie_word_embeddings=False)) == 2_031_739_904


def test_rope_matches_hf_formula_and_is_relative():
    x = jax.random.normal(jax.random.key(0), (1, 9, 2, 16))
    theta = 10_000.0
    # HF: inv_freq = 1/θ^(2i/d); emb = cat(freqs, freqs); x·cos + rotate_half(x)·sin
    inv = 1.0 / theta ** (np.arange(0, 16, 2) / 16)
    emb = np.concatenate([np.outer(np.arange(9), inv)] * 2, axis=-1)[None, :, None]
    xn = np.asarray(x, np.float64)
    want = xn * np.cos(emb) + np.concatenate([-xn[..., 8:], xn[..., :8]], -1) * np.sin(emb)
    np.testing.assert_allclose(rope(x, theta), want, rtol=1e-5, atol=1e-5)
    # <rope(q)_i, rope(k)_j> depends on i - j only
    q = jnp.broadcast_to(x[:, :1], x.shape)
    k = jnp.broadcast_to(x[:, 1:2], x.shape)
    dots = jnp.einsum("btnh,bsnh->bnts", rope(q, theta), rope(k, theta))[0, 0]
    np.testing.assert_allclose(dots[5, 2], dots[8, 5], rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(num_heads=6, num_kv_heads=4), "num_heads=6"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(head_dim=31), "head_dim=31"),
])
def test_bad_model_config_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        get_config("qwen3-tiny", **bad)


@pytest.mark.parametrize("tp,overrides,match", [
    (4, dict(num_heads=6, num_kv_heads=3), "num_heads=6"),
    (4, dict(num_heads=12, num_kv_heads=3), "num_kv_heads=3"),  # 3 KV heads: neither split nor replicated
    (8, dict(num_heads=24, num_kv_heads=12), "num_kv_heads=12"),  # 12 KV heads on 8 ranks
])
def test_tensor_parallel_kv_heads_checked(tp, overrides, match):
    cfg = get_config("qwen3-tiny", **overrides)
    with pytest.raises(ValueError, match=match):
        cfg.check_tensor_parallel(tp)


def test_kv_heads_split_or_replicated_by_tensor_size():
    cfg = get_config("qwen3-tiny")  # 4 query heads, 2 KV heads
    for tp, kv_spec in ((2, "tensor"), (4, None)):
        m = nnx.eval_shape(lambda tp=tp: Qwen(cfg, rngs=nnx.Rngs(0), tensor_size=tp))
        specs = param_specs(nnx.split(m, nnx.Param)[1], ("data", "tensor"))
        assert specs["layers"][0]["self_attn"]["k_proj"]["kernel"] == P(None, kv_spec, None)
        assert specs["layers"][0]["self_attn"]["q_proj"]["kernel"] == P(None, "tensor", None)


def _mesh(tp):
    return Mesh(np.asarray(jax.devices()).reshape(8 // tp, tp), ("data", "tensor"))


def _setup(name, **overrides):
    cfg = get_config(name, num_layers=2, vocab_size=512, **overrides)
    model = make_model(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)

    def ref(p):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(graphdef, st).loss(ids, tgt)

    return cfg, params, ids, tgt, jax.value_and_grad(ref)(params)


@pytest.mark.parametrize("name,tp,sp,overrides", [
    ("qwen3-tiny", 4, True, {}),  # 2 KV heads on 4 ranks: replicated, each rank slices its head; SP
    ("qwen2.5-tiny", 2, False, dict(tie_word_embeddings=False)),  # KV heads split; QKV bias; untied head
])
def test_tensor_parallel_matches_unsharded(name, tp, sp, overrides):
    cfg, params, ids, tgt, (want_loss, want_grads) = _setup(name, **overrides)
    loss, grads = tp_value_and_grad(_mesh(tp), cfg, CommPolicy.none(), sp)(params, ids, tgt)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(g, flat_want[path], rtol=2e-3, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_compressed_model_loss_close():
    cfg, params, ids, tgt, (want_loss, _) = _setup("qwen3-tiny")
    loss, _ = tp_value_and_grad(_mesh(4), cfg, CommPolicy.taco(), True)(params, ids, tgt)
    assert 0 < abs(float(loss) - float(want_loss)) / float(want_loss) < 1e-2


def test_qwen_config_is_frozen_and_hashable():
    cfg = QwenConfig.qwen3_0_6b()
    assert hash(cfg) == hash(QwenConfig.qwen3_0_6b())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.emb_dim = 1


def test_rmsnorm_keeps_precision_on_rows_with_a_large_mean():
    """RMSNorm's mean square is a sum of squares (no cancellation): rows 2000 + N(0, 1) of width 128
    match a float64 RMSNorm to 1e-6 relative."""
    from taco_jax.models.qwen import RMSNorm

    x = 2000 + jax.random.normal(jax.random.key(0), (64, 128))
    xd = np.asarray(x, np.float64)
    want = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(RMSNorm(128, 1e-6, "embed")(x), want, rtol=1e-6)
