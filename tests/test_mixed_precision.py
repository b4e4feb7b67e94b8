"""Mixed precision (`--dtype`) and rematerialisation (`--remat`): bf16 compute with FP32 master weights,
norms and loss; bf16 tensor-parallel messages in the issued HLO; remat lowers the compiled temp memory
without changing the loss or the gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from taco_jax.collectives import CommPolicy
from taco_jax.collectives.hlo import collective_bytes
from taco_jax.models import get_config, make_model
from taco_jax.models.qwen import RMSNorm
from taco_jax.parallel.layers import layer_norm
from taco_jax.train.config import TrainConfig
from taco_jax.train.step import compiled_memory, make_steps, make_trainer, shard_batch

pytestmark = pytest.mark.slow


def test_norms_compute_in_f32_and_return_the_compute_dtype():
    """GPT-2's LayerNorm and Qwen's RMSNorm take bf16 rows with a mean far from 0 (the cancellation case,
    at a mean bf16 still resolves) and give bf16 (not flax's promoted f32: the TP message
    after a norm stays bf16), equal to the float32 norm rounded to bf16."""
    x = (30 + jax.random.normal(jax.random.key(0), (4, 128))).astype(jnp.bfloat16)
    ln16, ln32 = layer_norm(128, "bfloat16", rngs=nnx.Rngs(0)), layer_norm(128, "float32", rngs=nnx.Rngs(0))
    for norm16, norm32 in ((ln16, ln32), (RMSNorm(128, 1e-6, "embed"), RMSNorm(128, 1e-6, "embed"))):
        y = norm16(x)
        assert y.dtype == jnp.bfloat16
        want = norm32(x.astype(jnp.float32))
        assert want.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
    assert 0.97 < float(jnp.std(ln16(x).astype(jnp.float32), axis=-1).min())  # no cancellation


@pytest.mark.parametrize("model", ["gpt2-tiny", "qwen2.5-tiny"])
def test_bf16_parameters_and_loss_stay_float32(model):
    cfg = get_config(model, vocab_size=256, dtype="bfloat16")
    m = make_model(cfg, rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.split(m, nnx.Param)[1])} == {jnp.dtype(jnp.float32)}
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    assert m(ids).dtype == jnp.bfloat16  # logits (cast to f32 inside the cross-entropy)
    loss = m.loss(ids, jnp.roll(ids, -1, axis=1))
    assert loss.dtype == jnp.float32
    want = make_model(get_config(model, vocab_size=256), rngs=nnx.Rngs(0)).loss(ids, jnp.roll(ids, -1, axis=1))
    assert abs(float(loss) - float(want)) < 0.02 * float(want)  # bf16 rounding, not a different model


def _issued(comm, dtype):
    cfg = TrainConfig.from_flags(comm=comm, dtype=dtype, batch_size=8, seq_len=32, vocab_size=512, steps=2)
    tr = make_trainer(cfg)
    params, opt = tr.init()
    ids = np.random.default_rng(0).integers(0, 512, (8, 32))
    lowered = tr.train_step.lower(params, opt, *shard_batch(tr, ids, ids))
    return {(r["axis"], r["op"], r["dtype"]): r for r in collective_bytes(lowered.as_text(dialect="hlo"),
                                                                          tr.mesh)["detail"]}


def test_bf16_tensor_messages_and_fp32_gradient_all_reduce():
    """--dtype bfloat16, --comm none on data=2,tensor=4: every TP activation all-reduce is bf16 (the
    three f32 ones of [B, T] are the vocab-parallel cross-entropy's), the data-axis gradient
    all-reduce is FP32; the bf16 TP bytes are half the float32 run's. (Read off the issued HLO:
    XLA:CPU has no bf16 all-reduce and promotes it to f32 when compiling.)"""
    b16, f32 = _issued("none", "bfloat16"), _issued("none", "float32")
    act = b16[("tensor", "all-reduce", "bf16")]
    ce = b16[("tensor", "all-reduce", "f32")]
    assert ce["count"] == 3 and ce["bytes"] < act["bytes"] / 100
    assert act["bytes"] + ce["bytes"] == pytest.approx(f32[("tensor", "all-reduce", "f32")]["bytes"] / 2,
                                                       rel=0.01)
    assert ("data", "all-reduce", "f32") in b16 and not [k for k in b16 if k[0] == "data" and k[2] != "f32"]
    # the codec encodes the bf16 messages: FP8 payload (u8) on the tensor axis, no activation all-reduce left
    taco = _issued("taco", "bfloat16")
    assert ("tensor", "all-to-all", "u8") in taco and ("tensor", "all-reduce", "bf16") not in taco


def _value_and_grad(remat, mesh):
    cfg = get_config("gpt2-tiny", vocab_size=256, n_layer=2, remat=remat)
    params = nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (8, 64), 0, 256)
    fn = jax.jit(make_steps(cfg, mesh, CommPolicy.none()).value_and_grad)
    compiled = fn.lower(params, ids, jnp.roll(ids, -1, axis=1)).compile()
    return compiled(params, ids, jnp.roll(ids, -1, axis=1)), compiled_memory(compiled)["temp"]


def test_remat_lowers_temp_memory_and_keeps_loss_and_gradients():
    """One device (activations dominate): block remat lowers the compiled temp memory; block and full
    give the no-remat loss and gradients (recomputation repeats the same float ops). (XLA:CPU's
    scheduler does not lower the temp memory of `full`, measured in the README; not asserted here.)"""
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    (loss, grads), temp = _value_and_grad("none", mesh)
    for remat in ("block", "full"):
        (loss_r, grads_r), temp_r = _value_and_grad(remat, mesh)
        if remat == "block":
            assert temp_r < 0.97 * temp, (remat, temp_r, temp)
        assert abs(float(loss_r) - float(loss)) <= 1e-6 * abs(float(loss))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_r, grads)


@pytest.mark.parametrize("kwargs,match", [(dict(dtype="float16"), "dtype='float16'"),
                                          (dict(remat="some"), "remat='some'")])
def test_bad_dtype_or_remat_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**kwargs)
    with pytest.raises(ValueError, match=match):
        get_config("qwen3-tiny", **kwargs)


def test_train_config_sets_model_dtype_and_remat():
    assert TrainConfig().model.dtype == "bfloat16" and TrainConfig().model_config.dtype == "bfloat16"
    cfg = TrainConfig.from_flags(model="qwen3-tiny", dtype="float32", remat="block", mesh="data=8")
    assert (cfg.model_config.dtype, cfg.model_config.remat) == ("float32", "block")
