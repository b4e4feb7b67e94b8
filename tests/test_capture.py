"""`train --capture N`: the saved messages are the real messages of the real run (checked against an
unsharded recomputation), for the plain and the sequence-parallel tensor sites."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taco_jax.data import TokenStream
from taco_jax.models import GPT
from taco_jax.train.capture import capture_steps, gpt_roles, load_captures
from taco_jax.train.config import TrainConfig
from taco_jax.train.loop import train

pytestmark = pytest.mark.slow

SMALL = dict(model="gpt2-tiny", dtype="float32", vocab_size=512, batch_size=8, seq_len=32, warmup_steps=1,
             eval_every=50, eval_batches=1, comm="none")  # FP32: messages compared with an FP32 reference


@pytest.fixture(scope="module")
def dataset(shakespeare512):
    return shakespeare512


def _first_batch(cfg, ds):
    return next(TokenStream(ds.train, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.training.seed))


def _unsharded_h_and_grad(cfg, ids, targets):
    """Initial GPT without a mesh: final-LayerNorm output h and d(mean loss)/dh (the lm head's input)."""
    model = GPT(cfg.model_config, rngs=nnx.Rngs(cfg.training.seed))
    x = model.wte(jnp.asarray(ids)) + model.wpe[...][: ids.shape[1]][None]
    for block in model.h:
        x = block(x)
    h = model.ln_f(x)
    table = model.wte.embedding[...]

    def loss(h):
        logits = h @ table.T
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(targets)[..., None], -1))

    return np.asarray(table), np.asarray(jax.grad(loss)(h))


def test_capture_saves_the_real_messages(dataset, tmp_path):
    cfg = TrainConfig.from_flags(steps=2, capture=2, out=str(tmp_path), **SMALL)
    summary = train(cfg, dataset=dataset, progress=False)
    meta, msgs = load_captures(tmp_path / "captures")
    assert summary["captures"]["files"] == ["step00001.npz", "step00002.npz"]
    # the twin's loss is the real step's loss, bit for bit
    for s in ("1", "2"):
        assert meta["losses"][s]["capture_twin"] == meta["losses"][s]["train_step"]
    assert meta["captured_steps"] == [1, 2] and meta["kept"] == "all tensor ranks, data rank 0"
    n_layer = cfg.model_config.n_layer
    roles = gpt_roles(n_layer)
    keys = {f"{m.site}__{m.role}" for m in msgs}
    assert keys == {f"ar_fwd__exit{i:02d}" for i in range(2 * n_layer + 1)} | \
        {f"ar_bwd__enter{i:02d}" for i in range(2 * n_layer + 1)}
    assert {m.what for m in msgs if m.site == "ar_fwd"} >= {"embed", "h0.attn", "h0.mlp", "h3.mlp"}
    assert all(m.x.shape == (4, 32, 128) for m in msgs)  # [B / data, T, D] per tensor rank
    assert len({m.rank for m in msgs}) == 4

    ids, targets = _first_batch(cfg, dataset)
    table, dh = _unsharded_h_and_grad(cfg, ids, targets)
    step1 = [m for m in msgs if m.step == 1]
    # forward: the embedding all-reduce's partial sums add up to the embedding rows (data rank 0's sequences)
    embed = sum(m.x for m in step1 if m.role == "exit00")
    np.testing.assert_array_equal(embed, table[ids[:4]])
    owners = sum(np.any(m.x != 0, axis=-1).astype(int) for m in step1 if m.role == "exit00")
    assert np.all(owners == 1)  # each token's row comes from the one rank holding its vocabulary shard
    # backward: the lm-head input's cotangents add up to d(global mean loss)/dh
    lm = sum(m.x for m in step1 if roles[m.role] == "lm_head_in")
    np.testing.assert_allclose(lm, dh[:4], rtol=1e-3, atol=1e-4 * np.abs(dh).max())


def test_capture_sequence_parallel_sites(dataset, tmp_path):
    cfg = TrainConfig.from_flags(steps=1, capture=1, sequence_parallel=True, out=str(tmp_path),
                                 **{**SMALL, "warmup_steps": 0})
    train(cfg, dataset=dataset, progress=False)
    meta, msgs = load_captures(tmp_path / "captures")
    assert meta["sequence_parallel"] and {m.site for m in msgs} == {"all_gather", "reduce_scatter"}
    fwd_rs = [m for m in msgs if m.site == "reduce_scatter" and m.role.startswith("exit")]
    fwd_ag = [m for m in msgs if m.site == "all_gather" and m.role.startswith("enter")]
    bwd_ag = [m for m in msgs if m.site == "all_gather" and m.role.startswith("exit")]
    assert fwd_rs and all(m.x.shape == (4, 32, 128) for m in fwd_rs)  # partial sums over the whole sequence
    assert fwd_ag and all(m.x.shape == (4, 8, 128) for m in fwd_ag)  # this rank's sequence shard
    assert bwd_ag and all(m.x.shape == (4, 8, 128) for m in bwd_ag)
    ids, _ = _first_batch(cfg, dataset)
    table, _ = _unsharded_h_and_grad(cfg, ids, ids)
    np.testing.assert_array_equal(sum(m.x for m in fwd_rs if m.role == "exit00"), table[ids[:4]])


def test_capture_steps_are_evenly_spaced_and_end_at_the_last():
    assert capture_steps(300, 8) == [38, 75, 112, 150, 188, 225, 262, 300]
    assert capture_steps(3, 5) == [1, 2, 3]



def test_nonfinite_error_policy_stops_training_naming_the_site(dataset, tmp_path):
    """A diverging run (absurd learning rate) with nonfinite="error": the loop raises after the step."""
    cfg = TrainConfig.from_flags(steps=2, out=str(tmp_path), nonfinite="error", lr=1e30,
                      **{**SMALL, "comm": "taco", "warmup_steps": 0})
    with pytest.raises(FloatingPointError, match=r"site\(s\) \['ar_"):
        train(cfg, dataset=dataset, progress=False)
    recs = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(recs) == 1  # step 1 blew the parameters up; step 2's messages held NaN/Inf and it stopped there
