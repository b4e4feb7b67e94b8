"""The fidelity measurement protocol: paired t-interval (experiments.fidelity.fidelity_runs) and the
deterministic gradient measure (experiments.fidelity.grad_fidelity)."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from scipy import stats

from experiments.fidelity import fidelity_runs, grad_fidelity


def test_paired_ci_matches_scipy_ttest_rel():
    rng = np.random.default_rng(3)
    a = rng.normal(4.8, 0.03, size=9)
    b = a + rng.normal(0.01, 0.004, size=9)
    ci = fidelity_runs.paired_ci(b - a)
    ref = stats.ttest_rel(b, a).confidence_interval(0.95)
    assert ci["n"] == 9 and ci["mean"] == pytest.approx(np.mean(b - a), rel=1e-12)
    assert (ci["lo"], ci["hi"]) == pytest.approx((ref.low, ref.high), rel=1e-10)
    assert ci["half_width"] == pytest.approx((ref.high - ref.low) / 2, rel=1e-10)
    # hand-checked case: d = 1, 2, 3 -> mean 2, std 1, t(0.975, 2) = 4.302652729911275
    ci = fidelity_runs.paired_ci([1.0, 2.0, 3.0])
    assert ci["std"] == pytest.approx(1.0) and ci["half_width"] == pytest.approx(4.302652729911275 / math.sqrt(3))


@pytest.mark.parametrize("bad", [[1.0], [1.0, float("nan")], [1.0, float("inf")]])
def test_paired_ci_rejects(bad):
    with pytest.raises(ValueError, match="deltas"):
        fidelity_runs.paired_ci(bad)
    with pytest.raises(ValueError, match="confidence"):
        fidelity_runs.paired_ci([1.0, 2.0], confidence=1.0)


def test_study_refuses_no_evaluation(tmp_path, capsys):
    """--eval-batches 0 leaves the study nothing to compare: refused before anything runs, naming it."""
    with pytest.raises(SystemExit):
        fidelity_runs.main(["--eval-batches", "0", "--out", str(tmp_path / "s")])
    assert "--eval-batches 0: the study compares validation losses; give 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_summary_and_markdown_format():
    """summarize() on synthetic records: paired Δ in %, CI, exact spread and validation noise."""
    recs = []
    for s in range(4):
        base = 5.0 + 0.01 * s
        for v, off in (("none", 0.0), ("taco", 0.005)):
            vb = [base + off + 0.001 * k for k in (-1, 0, 1)]
            recs.append({"model": "m", "variant": v, "seed": s, "codec": v, "final_val_loss": float(np.mean(vb)),
                         "val_batch_losses": vb, "tokens_per_batch": 10})
    out = fidelity_runs.summarize(recs, ["none", "taco"], ["m"])
    v = out["m"]["variants"]["taco"]
    expect = [100 * 0.005 / (5.0 + 0.01 * s) for s in range(4)]
    assert v["delta_pct"] == pytest.approx(expect)
    assert v["ci95"]["mean"] == pytest.approx(np.mean(expect))
    assert out["m"]["exact"]["seed_std"] == pytest.approx(np.std([5.0, 5.01, 5.02, 5.03], ddof=1))
    assert out["m"]["exact"]["val_tokens"] == 30
    assert out["m"]["exact"]["val_sem_mean"] == pytest.approx(0.001 / math.sqrt(3))
    md = fidelity_runs.markdown(out, {"steps": 1, "batch_size": 2, "seq_len": 3, "mesh": "x", "lr": 1, "dtype": "d",
                                      "backend": "b"})
    assert "| m | taco | 4 |" in md


def test_param_groups_cover_gpt_and_qwen():
    assert grad_fidelity.param_group("['h'][0]['attn']['qkv']['kernel']") == "attn_qkv"
    assert grad_fidelity.param_group("['h'][0]['attn']['proj']['kernel']") == "attn_out"
    assert grad_fidelity.param_group("['h'][0]['mlp']['fc']['bias']") == "mlp_in"
    assert grad_fidelity.param_group("['h'][0]['mlp']['proj']['kernel']") == "mlp_out"
    assert grad_fidelity.param_group("['h'][0]['ln_1']['scale']") == "norms"
    assert grad_fidelity.param_group("['wte']['embedding']") == "embed"
    assert grad_fidelity.param_group("['layers'][1]['self_attn']['o_proj']['kernel']") == "attn_out"
    assert grad_fidelity.param_group("['layers'][1]['self_attn']['k_norm']['scale']") == "norms"
    assert grad_fidelity.param_group("['layers'][1]['mlp']['gate_proj']['kernel']") == "mlp_in"
    assert grad_fidelity.param_group("['layers'][1]['mlp']['down_proj']['kernel']") == "mlp_out"
    assert grad_fidelity.param_group("['embed_tokens']['embedding']") == "embed"


def test_grad_compare_on_a_tiny_tp_model():
    """Exact codec: cosine 1, rel. error 0, SQNR ∞ in every group; a lossy codec (int4): finite values."""
    from flax import nnx
    from jax.sharding import NamedSharding

    from taco_jax.codec import CodecConfig
    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.models import get_config, make_model
    from taco_jax.parallel.mesh import make_mesh

    cfg = dataclasses.replace(get_config("gpt2-tiny"), n_layer=1, n_embd=64, n_head=2, vocab_size=256,
                              block_size=32)
    mesh = make_mesh({"data": 1, "tensor": 2}, jax.devices()[:2])
    exact = grad_fidelity.value_and_grad_fn(cfg, mesh, CommPolicy(), False)
    from taco_jax.train.step import make_steps

    specs = make_steps(cfg, mesh, CommPolicy()).specs
    params = nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 32 + 1)).astype(np.int32)
    x, y = ids[:, :-1], ids[:, 1:]
    l0, g0 = exact(params, x, y)
    l1, g1 = exact(params, x, y)  # the exact step again: bit-identical on CPU
    same = grad_fidelity.grad_compare(g0, g1)
    assert {"all", "embed", "attn_qkv", "attn_out", "mlp_in", "mlp_out", "norms", "layer0"} <= set(same)
    for g, r in same.items():
        assert r["cosine"] == pytest.approx(1.0) and r["rel_err"] == 0.0 and r["sqnr_db"] == math.inf, g
    assert float(l1) == float(l0)
    lossy = CommPolicy(ar_fwd=CodecConfig(kind="int4"), ar_bwd=CodecConfig(kind="int4"))
    l2, g2 = grad_fidelity.value_and_grad_fn(cfg, mesh, lossy, False)(params, x, y)
    diff = grad_fidelity.grad_compare(g0, g2)
    for g in ("all", "attn_qkv", "mlp_in", "embed"):
        r = diff[g]
        assert 0.0 < r["rel_err"] < 1.0 and 0.0 < r["sqnr_db"] < 60.0 and 0.5 < r["cosine"] < 1.0, (g, r)
        assert r["sqnr_db"] == pytest.approx(-20 * math.log10(r["rel_err"]), rel=1e-9)
    # the measure itself: a known perturbation of a numpy tree
    ref = {"a": np.ones(4), "b": np.zeros(2)}
    assert grad_fidelity.grad_compare(ref, {"a": np.ones(4) * 1.1, "b": np.zeros(2)})["all"]["rel_err"] == \
        pytest.approx(0.1)
    with pytest.raises(ValueError, match="structures"):
        grad_fidelity.grad_compare(ref, {"a": np.ones(4)})


@pytest.mark.slow
def test_fidelity_runs_quick_writes_report(tmp_path):
    rep = fidelity_runs.main(["--quick", "--out", str(tmp_path), "--models", "gpt2-tiny", "--variants", "none",
                              "taco"])
    assert rep["summary"]["gpt2-tiny"]["variants"]["taco"]["ci95"]["n"] == 2
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["meta"]["steps"] == 3 and (tmp_path / "paired_delta.png").exists()
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 4
