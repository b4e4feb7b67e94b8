"""`--tp-overlap collective-matmul`: the SP all-gather / reduce-scatter as ppermute rings under the
matmuls gives the non-overlapped layer's values and gradients (exact codec, up to float summation
order), stays within the codec's error bound with TACO, trains, and refuses bad settings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tp_value_and_grad
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.collectives import CommPolicy, gather_from_sp
from taco_jax.models import get_config, make_model
from taco_jax.parallel.context import ParallelContext, PendingGather

pytestmark = pytest.mark.slow

EPS32 = float(np.finfo(np.float32).eps)
#: Exact codec: the overlapped block differs from the non-overlapped one only in summation order
#: (XLA:CPU's dot over a [B, T/P, D] block accumulates differently from one over [B, T, D], and the
#: ring sums the P partial results in ring order, not rank order; the weight gradients add P
#: per-block products). Each output is a sum of rounded terms of at most the output's magnitude,
#: reassociated: we allow 16 ulps of the largest entry (measured: 2-4 ulps).
REASSOCIATION_ULPS = 16
#: E4M3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself,
#: and TACO's Hadamard transform is orthonormal, so one quantization changes a message by at most
#: 2^-4 of its L2 norm (the group scale maps each group's largest value to E4M3's largest).
E4M3_REL = 2.0 ** -4
B, T, D, F = 2, 32, 64, 128


def _tensor_mesh(p):
    return Mesh(np.asarray(jax.devices()[:p]), ("tensor",))


def _block(policy, overlap, p):
    """Jitted (x [B, T, D] sequence-sharded, wc [D, F] column-sharded, wr [F, D] row-sharded) ->
    SP MLP block out [B, T, D] sequence-sharded: enter, ColumnParallel matmul, GELU, RowParallel exit."""
    ctx = ParallelContext("tensor", policy, True, tp_overlap=overlap)

    def f(x, wc, wr):
        h = ctx.enter(x)
        col = (lambda b: jnp.tensordot(b, wc, axes=1))
        y = h.apply(col) if isinstance(h, PendingGather) else col(h)
        return ctx.exit_matmul(lambda b: jnp.tensordot(b, wr, axes=1), jax.nn.gelu(y))

    spec = P(None, "tensor")
    return jax.jit(jax.shard_map(f, mesh=_tensor_mesh(p), in_specs=(spec, spec, P("tensor")), out_specs=spec))


def _inputs():
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (B, T, D)), jax.random.normal(ks[1], (D, F)) / np.sqrt(D),
            jax.random.normal(ks[2], (F, D)) / np.sqrt(F), jax.random.normal(ks[3], (B, T, D)))


def _value_and_grads(policy, overlap, p):
    x, wc, wr, ct = _inputs()
    fn = _block(policy, overlap, p)
    return jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2))(x, wc, wr), fn(x, wc, wr)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_gathers_the_exact_blocks(p):
    """Codec none: the sequence the ring received, reordered, is bit for bit `gather_from_sp`'s."""
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    ctx = ParallelContext("tensor", CommPolicy.none(), True, tp_overlap="collective-matmul")

    def f(x):
        h = ctx.enter(x)
        h.apply(lambda b: b * 2.0)
        return h.gathered(), gather_from_sp(x, "tensor", ctx.policy, 1)

    ring, plain = jax.jit(jax.shard_map(f, mesh=_tensor_mesh(p), in_specs=P(None, "tensor"),
                                        out_specs=(P("tensor"), P("tensor"))))(x)
    np.testing.assert_array_equal(ring, plain)
    np.testing.assert_array_equal(ring.reshape(p, B, T, D)[0], x)


@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_exact_overlap_equals_non_overlapped(p):
    """Codec none: output, loss and the gradients w.r.t. input and both weights equal the
    non-overlapped layer's up to REASSOCIATION_ULPS of each array's largest entry."""
    (loss0, grads0), y0 = _value_and_grads(CommPolicy.none(), "none", p)
    (loss1, grads1), y1 = _value_and_grads(CommPolicy.none(), "collective-matmul", p)
    for name, a, b in [("out", y0, y1), ("loss", loss0, loss1), ("dx", *[g[0] for g in (grads0, grads1)]),
                       ("dwc", grads0[1], grads1[1]), ("dwr", grads0[2], grads1[2])]:
        tol = REASSOCIATION_ULPS * EPS32 * float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(b, a, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("p", [2, 4])
def test_taco_overlap_within_codec_bound(p):
    """TACO: each ring hop quantizes its message once (error <= 2^-4 of the message's L2 norm), the
    forward output takes 2(P-1) quantizations (P-1 gather hops, P-1 reduce-scatter hops) of messages
    no larger than the exact partial sums summed over ranks. Check the output error against that
    bound (the whole input's norm bounding every gather message's), and that it is not zero."""
    x, wc, wr, _ = _inputs()
    exact = _block(CommPolicy.none(), "none", p)(x, wc, wr)
    taco = _block(CommPolicy.taco(), "collective-matmul", p)(x, wc, wr)
    h = jax.nn.gelu(x @ wc)  # exact hidden [B, T, F]; rank s's partial sum is h[..., block s] @ wr[block s]
    f_l = F // p
    cols = [slice(s * f_l, (s + 1) * f_l) for s in range(p)]
    partial_norm = sum(float(jnp.linalg.norm(h[..., c] @ wr[c])) for c in cols)
    # Rank s's gather error e_s (<= (P-1) hops × 2^-4 ||x||) reaches the output through its column
    # block of wc, GELU (Lipschitz <= 1.13) and its row block of wr.
    lip = sum(1.13 * float(jnp.linalg.norm(wc[:, c], 2) * jnp.linalg.norm(wr[c], 2)) for c in cols)
    bound = (p - 1) * E4M3_REL * (partial_norm + lip * float(jnp.linalg.norm(x)))
    err = float(jnp.linalg.norm(taco - exact))
    assert 0 < err <= bound, (err, bound)


def test_context_refuses_bad_overlap():
    with pytest.raises(ValueError, match="tp_overlap='ring'.*none.*collective-matmul"):
        ParallelContext("tensor", CommPolicy.none(), True, tp_overlap="ring")
    with pytest.raises(ValueError, match="tp_overlap='collective-matmul' needs sequence parallelism"):
        ParallelContext("tensor", CommPolicy.none(), False, tp_overlap="collective-matmul")


def test_cli_refuses_bad_overlap_before_compile(capsys):
    from taco_jax.cli import main

    assert main(["train", "--tp-overlap", "bogus", "--sequence-parallel"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("taco-jax: error:") and "tp_overlap='bogus'" in err
    assert main(["train", "--tp-overlap", "collective-matmul"]) == 2
    assert "needs sequence parallelism (--sequence-parallel)" in capsys.readouterr().err


@pytest.mark.parametrize("name", [pytest.param("gpt2-tiny", marks=pytest.mark.slow), "qwen3-tiny"])
def test_model_overlap_matches_non_overlapped(mesh, name):
    """Whole one-layer models, codec none, data=2 × tensor=4: GPT-2 (fused QKV, tied LM head through
    `attend`; slow: the training test below runs it too) and Qwen3 (q/k/v and gate/up read one
    entered input; 2 KV heads on 4 ranks read it as an array): same loss and gradients as without
    overlap, to float summation order."""
    tp = 4
    overrides = dict(n_layer=1) if name.startswith("gpt2") else dict(num_layers=1)
    cfg = dataclasses.replace(get_config(name, vocab_size=512), **overrides)
    params = nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0), tensor_size=tp), nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, cfg.vocab_size)
    tgt = jnp.roll(ids, -1, axis=1)
    loss0, g0 = tp_value_and_grad(mesh, cfg, CommPolicy.none(), True)(params, ids, tgt)
    loss1, g1 = tp_value_and_grad(mesh, cfg, CommPolicy.none(), True, "collective-matmul")(params, ids, tgt)
    np.testing.assert_allclose(loss1, loss0, rtol=REASSOCIATION_ULPS * EPS32)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        # Through a whole model the reassociation differences pass through layer norms and softmax:
        # relative to each gradient's largest entry, 1e-4 (measured: < 1e-5).
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(a))),
                                   err_msg=jax.tree_util.keystr(path))


def test_overlapped_training_tracks_non_overlapped():
    """`--tp-overlap collective-matmul --sequence-parallel` with TACO trains gpt2-tiny on data=2 ×
    tensor=4: 3 steps with finite losses within 1% of the non-overlapped run's (the ring requantizes);
    its compiled step moves the decoder layers' and LM head's tensor-axis activations as
    collective-permutes of FP8 codes (u8); only the embedding's reduce-scatter (an all-to-all; no
    matmul to overlap) and its backward all-gather stay."""
    from taco_jax.collectives.hlo import collective_bytes
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.step import make_trainer, shard_batch

    ids = np.asarray(jax.random.randint(jax.random.key(0), (3, 8, 33), 0, 512))
    losses, ops = {}, {}
    for overlap in ("none", "collective-matmul"):
        cfg = TrainConfig.from_flags(model="gpt2-tiny", vocab_size=512, batch_size=8, seq_len=32, steps=3,
                                     warmup_steps=1, sequence_parallel=True, tp_overlap=overlap, comm="taco")
        tr = make_trainer(cfg)
        params, opt = tr.init()
        batch = shard_batch(tr, ids[0, :, :-1], ids[0, :, 1:])
        step = tr.train_step.lower(params, opt, *batch).compile()
        ops[overlap] = {(r["op"], r["dtype"]): r["count"] for r in collective_bytes(step.as_text(), tr.mesh)["detail"]
                        if r["axis"] == "tensor" and r["dtype"] == "u8"}
        losses[overlap] = []
        for k in range(3):
            params, opt, m = step(params, opt, *shard_batch(tr, ids[k, :, :-1], ids[k, :, 1:]))
            losses[overlap].append(float(m["loss"]))
    assert np.all(np.isfinite(losses["collective-matmul"]))
    np.testing.assert_allclose(losses["collective-matmul"], losses["none"], rtol=1e-2)
    n_layer = 4  # gpt2-tiny; per layer 2 all-gathers and 2 reduce-scatters forward, 2 + 2 backward
    assert ops["none"] == {("all-to-all", "u8"): 1 + 4 * n_layer + 1, ("all-gather", "u8"): 1 + 4 * n_layer + 1}
    assert ops["collective-matmul"] == {("all-to-all", "u8"): 1, ("all-gather", "u8"): 1,
                                        ("collective-permute", "u8"): (8 * n_layer + 2) * 3}, ops
