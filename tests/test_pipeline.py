"""Pipeline parallelism: schedule arithmetic, compressed send/recv in both directions, GPipe and 1F1B == unpipelined,
and the layering of the pipeline modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.codec import NONE, TACO
from taco_jax.collectives import CommPolicy
from taco_jax.models import get_config, make_model
from taco_jax.parallel import pipeline as pp
from taco_jax.train.step import make_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh3d():
    """data=2 × stage=2 × tensor=2 over the 8 simulated CPU devices."""
    return Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "stage", "tensor"))


def test_bubble_fraction_and_schedule_stats():
    assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pp.bubble_fraction(1, 8) == 0.0
    g = pp.schedule_stats("gpipe", 2, 4)
    assert (g["ticks"], g["activations_kept"], g["spmd_bubble"]) == (5, 5, pytest.approx(1 / 5))
    f = pp.schedule_stats("1f1b", 2, 4)  # 6 ticks of (forward + recomputed forward + backward)
    assert (f["ticks"], f["activations_kept"]) == (6, 3)
    assert f["spmd_bubble"] == pytest.approx(1 - 12 / 24)
    assert pp.schedule_stats("1f1b", 2, 64)["activations_kept"] == 3  # O(S), not O(M)


@pytest.mark.parametrize("args,match", [
    ((4, 3, 4), "n_layer=4"),
    ((4, 4, 2), "microbatches=2"),
    ((4, 2, 0), "microbatches=0"),
    ((4, 2, 2, "zb-v"), "schedule='zb-v'"),
])
def test_check_pipeline_names_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        pp.check_pipeline(*args)


def _send_and_grad(mesh, policy):
    """Forward send of x (stage s -> s+1) and the gradient of sum(w · send(x)) w.r.t. x."""

    def local(x, w):
        y, vjp = jax.vjp(lambda v: pp.send(v, "stage", policy, 1), x)
        return y, vjp(w)[0]

    spec = P(("data", "stage", "tensor"))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))


def test_send_exact_and_compressed_both_directions(mesh3d):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 4, 256)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((8, 4, 256)).astype(np.float32))
    # device (d, s, t) holds row 4d + 2s + t; stage s+1 receives stage s's row, stage 0 receives zeros
    per = lambda a: np.asarray(a).reshape(2, 2, 2, 4, 256)  # noqa: E731
    y, gx = _send_and_grad(mesh3d, CommPolicy(pp_send=NONE))(x, w)
    np.testing.assert_array_equal(per(y)[:, 1], per(x)[:, 0])
    np.testing.assert_array_equal(per(y)[:, 0], 0)
    np.testing.assert_array_equal(per(gx)[:, 0], per(w)[:, 1])  # backward: s+1 -> s
    np.testing.assert_array_equal(per(gx)[:, 1], 0)

    yc, gc = _send_and_grad(mesh3d, CommPolicy(pp_send=TACO))(x, w)
    for got, want in ((per(yc)[:, 1], per(x)[:, 0]), (per(gc)[:, 0], per(w)[:, 1])):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 0 < err < 2.0**-4, err  # through the FP8 codec (one quantization), both directions


def _reference(cfg, ids, tgt):
    model = make_model(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)

    def loss(p):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(graphdef, st).loss(ids, tgt)

    return params, jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("name,schedule,microbatches,sp", [
    ("gpt2-tiny", "gpipe", 2, False),
    pytest.param("qwen3-tiny", "1f1b", 4, True, marks=pytest.mark.slow),  # ring of 3 stage inputs; SP (~30 s)
])
def test_pipeline_matches_unpipelined(mesh3d, name, schedule, microbatches, sp):
    overrides = dict(n_layer=2, n_embd=64, n_head=2) if name.startswith("gpt") else dict(num_layers=2, emb_dim=64)
    cfg = get_config(name, vocab_size=256, **overrides)
    ids = jax.random.randint(jax.random.key(1), (16, 16), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)
    params, (want_loss, want_grads) = _reference(cfg, ids, tgt)
    steps = make_steps(cfg, mesh3d, CommPolicy.none(), sequence_parallel=sp, microbatches=microbatches,
                       schedule=schedule)
    loss, grads = jax.jit(steps.value_and_grad)(steps.staged.stack_layers(params), ids, tgt)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(steps.staged.unstack_layers(grads)):
        np.testing.assert_allclose(g, flat_want[path], rtol=2e-3, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    eval_loss = jax.jit(steps.loss)(steps.staged.stack_layers(params), ids, tgt)
    np.testing.assert_allclose(eval_loss, want_loss, rtol=1e-5)


@pytest.mark.slow
def test_1f1b_memory_does_not_grow_with_microbatches():
    """Compiled temp memory (XLA buffer assignment): GPipe keeps every microbatch's activations,
    1F1B a ring of 2S-1 stage inputs — so 1F1B's memory stays flat from M = 4 to M = 8."""
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("data", "stage"))
    cfg = get_config("gpt2-tiny", vocab_size=256, n_layer=2, n_embd=64, n_head=2)
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            steps = make_steps(cfg, mesh, CommPolicy.none(), microbatches=m, schedule=schedule)
            params = jax.eval_shape(lambda st=steps.staged: st.stack_layers(
                nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])))
            ids = jax.ShapeDtypeStruct((4 * m, 64), jnp.int32)
            compiled = jax.jit(steps.value_and_grad).lower(params, ids, ids).compile()
            temp[schedule, m] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["gpipe", 8] > 1.6 * temp["gpipe", 4], temp
    assert temp["1f1b", 8] < 1.2 * temp["1f1b", 4], temp
    assert temp["1f1b", 8] < 0.5 * temp["gpipe", 8], temp


def test_staged_model_needs_the_pipeline_interface():
    class NoSplit(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])

    with pytest.raises(ValueError, match="NoSplit: its class lacks pipeline_layers, embed, head_loss"):
        pp.StagedModel.from_model(NoSplit())
    sm = pp.StagedModel.from_model(make_model(get_config("gpt2-tiny", n_layer=2), rngs=nnx.Rngs(0)))
    assert (sm.layer_key, sm.n_layers) == ("h", 2)
