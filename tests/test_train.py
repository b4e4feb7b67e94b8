"""Training: a short run's loss falls, the compiled step's TP traffic is FP8, bad configs fail early."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from taco_jax.collectives.hlo import collective_bytes
from taco_jax.train.config import TrainConfig
from taco_jax.train.loop import train
from taco_jax.train.step import make_trainer, shard_batch

pytestmark = pytest.mark.slow

SMALL = dict(model="gpt2-tiny", vocab_size=512, batch_size=8, seq_len=32, steps=30, warmup_steps=3, eval_every=15,
             eval_batches=2, lr=3e-3)


@pytest.fixture(scope="module")
def dataset(shakespeare512):
    return shakespeare512


def test_short_taco_run_loss_falls(dataset, tmp_path):
    cfg = TrainConfig.from_flags(comm="taco", out=str(tmp_path), **SMALL)
    summary = train(cfg, dataset=dataset, progress=False)
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(recs) == cfg.training.steps
    first, last = recs[0]["loss"], np.mean([r["loss"] for r in recs[-3:]])  # step 1's loss: untrained model
    assert last < first - 0.8, (first, last)
    assert summary["final_val_loss"] < np.log(512)  # better than uniform over the vocabulary
    assert summary["wire_bytes_per_step"]["tensor"] > 0


#: The first step's loss (same weights, same batch: only the codec differs) of two backends that both
#: meet the conformance contract of `taco_jax.kernels` (`conformance.assert_conforms`: at most
#: max_code_frac = 1e-3 of the codes one FP8 step apart, s and a within 2^-23 * G relative) may differ by
#: what that contract allows. Measured by injecting exactly that into the reference (`conformance.step_codes`,
#: 1e-3 of the codes one step off; `test_first_step_rule_covers_the_contract` does it on every host), on this
#: configuration's first step: 1.0e-5 to 1.7e-4 relative over 8 placements (rms 9e-5; AMD EPYC Zen 4, -O0).
#: The rule is twice the largest. The loss is chaotic at the 1e-5 level: an FP8 quantizer turns any one-ulp
#: change upstream (a scale off by one ulp, an FMA contracted or not, a sum reordered) into a few codes
#: flipped downstream, each moving this loss by ~1e-5. So two hosts' XLA:CPU code generation alone move
#: the reference-vs-ffi difference by that much (-O0: 6.9e-7; -O3: 9.6e-6; -O3 for SSE4.2: 4.4e-6 on
#: this host; 2.36e-5 reported on an Intel Sapphire Rapids host), and no loss rule can see a one-ulp codec
#: fault: `check_messages` on the step's real messages is the tight check.
FIRST_STEP_RTOL = 3.5e-4


def _first_batch(cfg, ds):
    from taco_jax.data import TokenStream

    return next(TokenStream(ds.train, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.training.seed))


def _losses(cfg, dataset):
    train(cfg, dataset=dataset, progress=False)
    return np.array([json.loads(line)["loss"] for line in open(pathlib.Path(cfg.checkpoint.out) / "metrics.jsonl")])


def test_ffi_backend_training_tracks_reference(dataset, tmp_path):
    """Training-level rule (taco_jax.kernels), same config and seed: (1) the FFI encoder conforms to the
    reference on the first step's real tensor-parallel messages (forward activations and backward
    cotangents, `train.capture`), the tight, host-independent check; (2) the first step's loss agrees within
    `FIRST_STEP_RTOL`, what the contract allows; (3) the first six steps' within 1e-3: from the first update
    on, AdamW's sign(gradient) step turns rare code flips into whole-lr weight differences (measured up to
    2.7e-4 over six steps at -O0 and -O3 on AMD EPYC Zen 4); the run-level check is against seed noise
    (docs/results.md)."""
    from taco_jax import kernels
    from taco_jax.kernels.conformance import check_messages
    from taco_jax.train.capture import make_capture_fn

    if "ffi" not in kernels.available_backends():
        pytest.skip("FFI library not built (make ffi)")
    cfgs = {b: TrainConfig.from_flags(comm="taco", backend=b, dtype="float32", out=str(tmp_path / b),  # FP32 sums
                                      **dict(SMALL, steps=6, eval_every=6)) for b in ("reference", "ffi")}
    tr = make_trainer(cfgs["reference"])
    params, _ = tr.init()
    _, messages = make_capture_fn(tr)(params, *shard_batch(tr, *_first_batch(cfgs["reference"], dataset)))
    assert len(messages) == 2 * (2 * cfgs["reference"].model_config.n_layer + 1)
    codec = dataclasses.replace(cfgs["reference"].communication.policy.ar_fwd, backend="ffi")
    frac = check_messages("ffi", list(messages.values()), codec)
    losses = {b: _losses(c, dataset) for b, c in cfgs.items()}
    np.testing.assert_allclose(losses["ffi"][0], losses["reference"][0], rtol=FIRST_STEP_RTOL,
                               err_msg=f"{frac:.1e} of the first step's codes differ")
    np.testing.assert_allclose(losses["ffi"], losses["reference"], rtol=1e-3)


def _with_reference_encoder(monkeypatch, change, name="reference"):
    """Registers backend `name` for this test: the reference whose encoder's (codes, s, a) pass through
    change(codes, s, a) (`name` "reference" replaces the reference itself). Returns `name`."""
    from taco_jax.codec import backends, reference

    def encode(xg, cfg, *, last_count):
        return change(*reference.encode_groups(xg, cfg, last_count=last_count))

    monkeypatch.setitem(backends._LOADED, name, backends.GroupBackend(encode, reference.decode_groups))
    return name


@pytest.mark.slow
def test_first_step_rule_covers_the_contract(dataset, tmp_path, monkeypatch):
    """`FIRST_STEP_RTOL` on this host: the reference with the contract's deviation injected (1e-3 of the
    codes one FP8 step off, two placements) stays within it; a scale whose exponent is off by one
    (every decoded message twice as large: a real fault) falls outside it."""
    from taco_jax.kernels.conformance import step_codes

    cfg = TrainConfig.from_flags(comm="taco", backend="reference", dtype="float32",
                                 **dict(SMALL, steps=1, warmup_steps=0, eval_every=1))
    base = _losses(cfg.replace(out=str(tmp_path / "base")), dataset)[0]
    for seed in (0, 1):
        _with_reference_encoder(monkeypatch, lambda q, s, a, seed=seed: (step_codes(q, 1e-3, seed), s, a))
        got = _losses(cfg.replace(out=str(tmp_path / f"flips{seed}")), dataset)[0]
        assert abs(got / base - 1) <= FIRST_STEP_RTOL, (seed, got / base - 1)
    _with_reference_encoder(monkeypatch, lambda q, s, a: (q, s * 2, a))
    got = _losses(cfg.replace(out=str(tmp_path / "scale")), dataset)[0]
    assert abs(got / base - 1) > FIRST_STEP_RTOL, got / base - 1


def test_check_messages_catches_what_the_contract_does_not_allow(monkeypatch):
    """The message-level rule passes the reference against itself and a scale one ulp off (inside the
    contract: reordering the G-term sums moves s by that much), and fails codes moved one step at twice
    the allowed rate, codes moved two steps anywhere, and a scale off by 2^-14 (beyond 2^-23 * G)."""
    import jax.numpy as jnp

    from taco_jax.codec.config import CodecConfig
    from taco_jax.kernels.conformance import check_messages, step_codes

    cfg = CodecConfig(backend="reference")
    msg = [np.random.default_rng(0).standard_normal((8, 32, 128)).astype(np.float32)]
    assert check_messages("reference", msg, cfg) == 0.0

    def faulty(change):
        return _with_reference_encoder(monkeypatch, change, name="faulty")

    assert check_messages(faulty(lambda q, s, a: (q, s * jnp.float32(1 + 2.0**-23), a)), msg, cfg) == 0.0
    for change, what in ((lambda q, s, a: (step_codes(q, 2e-3, 3), s, a), "of codes differ"),
                         (lambda q, s, a: (step_codes(q, 1e-4, 3, steps=2), s, a), "differ by up to 2 steps"),
                         (lambda q, s, a: (q, s * jnp.float32(1 + 2.0**-14), a), "Not equal to tolerance")):
        with pytest.raises(AssertionError, match=what):
            check_messages(faulty(change), msg, cfg)


def _step_hlo(comm, dataset):
    cfg = TrainConfig.from_flags(comm=comm, **SMALL)
    tr = make_trainer(cfg)
    params, opt = tr.init()
    x = np.asarray(dataset.train[: 8 * 32]).reshape(8, 32)
    return tr, tr.compiled_hlo(params, opt, *shard_batch(tr, x, x))


def test_taco_step_moves_tensor_activations_as_fp8(dataset):
    """No hidden-sized all-reduce over the tensor axis; all-to-all / all-gather of u8 FP8 codes instead."""
    b_local, t, d = 8 // 2, 32, 128
    activation_bytes = b_local * t * d * 4
    tr, hlo = _step_hlo("taco", dataset)
    rows = collective_bytes(hlo, tr.mesh)["detail"]
    tensor = [r for r in rows if r["axis"] == "tensor"]
    assert {(r["op"], r["dtype"]) for r in tensor} >= {("all-to-all", "u8"), ("all-gather", "u8")}
    # the only tensor-axis all-reduces left are the [B, T] cross-entropy statistics and scalars
    for r in tensor:
        if r["op"] == "all-reduce":
            assert r["bytes"] / r["count"] < activation_bytes / 4, r
    fp8_bytes = sum(r["bytes"] for r in tensor if r["dtype"] == "u8")
    assert fp8_bytes > 0.8 * sum(r["bytes"] for r in tensor)

    tr, hlo_none = _step_hlo("none", dataset)  # the check above can fail: exact TP has big f32 all-reduces
    big = [r for r in collective_bytes(hlo_none, tr.mesh)["detail"]
           if r["axis"] == "tensor" and r["op"] == "all-reduce" and r["bytes"] / r["count"] >= activation_bytes]
    assert big


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=100), "group_size=100"),
        (dict(fmt="e2m1"), "fmt='e2m1'"),
        (dict(mesh="data=2,tensor=3"), "n_head=4"),
        (dict(mesh="data=3,tensor=2"), "batch_size=16"),
        (dict(mesh="data=2,tensor=4", sequence_parallel=True, seq_len=30), "seq_len=30"),
        (dict(mesh="data=2,pipe=4"), "'pipe'"),
        (dict(comm="zip"), "comm='zip'"),
        (dict(seq_len=4096), "seq_len=4096"),
    ],
)
def test_bad_config_raises_before_compile(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(**kwargs)


def test_mesh_device_mismatch_raises():
    cfg = TrainConfig.from_flags(mesh="data=4,tensor=4")
    with pytest.raises(ValueError, match="needs 16 devices but 8"):
        make_trainer(cfg)


def test_cli_help_and_bad_input(capsys):
    from taco_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0 and "--comm" in capsys.readouterr().out
    assert main(["train", "--group-size", "48"]) == 2
    assert "group_size=48" in capsys.readouterr().err
    assert main(["train", "--backend", "nosuch"]) == 2  # rejected by the config, before jax runs anything
    assert "backend='nosuch'" in capsys.readouterr().err


def test_pallas_backend_refused_for_multi_device_cpu_training():
    """The Pallas TPU interpreter stalls inside a multi-device CPU train step: a clear error instead."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the refusal is for the CPU interpreter")
    with pytest.raises(ValueError, match="backend='pallas'.*Pallas interpreter on CPU.*'ffi'"):
        make_trainer(TrainConfig.from_flags(comm="taco", backend="pallas", **SMALL))
    with pytest.warns(UserWarning, match="backend='pallas' has no effect"):  # no taco site: nothing to refuse
        make_trainer(TrainConfig.from_flags(comm="none", backend="pallas", **SMALL))


def test_every_train_flag_has_help():
    from taco_jax.train.config import FIELD_FLAGS, SECTIONS, flags

    missing = [fl.name for fl in flags() if not fl.text.strip()]
    assert not missing, missing
    stored = {FIELD_FLAGS[s, f.name] for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert stored - {fl.name for fl in flags()} == {"policy"}  # the one field that is no flag
    orders = [fl.order for fl in flags() if fl.stored]
    assert len(set(orders)) == len(orders), "two settings share an `order` (their place in --help)"



# --- optimizer: weight decay by role, learning-rate schedule


def _set_biases(params, value):
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda path, p: np.full_like(p, value) if getattr(path[-1], "key", None) == "bias" else p, params)


@pytest.mark.parametrize("model,stages", [("gpt2-tiny", 1), ("qwen2.5-tiny", 1), ("qwen2.5-tiny", 2)])
def test_weight_decay_by_role_not_rank(model, stages):
    """Biases set to 1.0, all-zero gradients, one AdamW update (warmup 0, lr 1e-2, wd 0.1): biases
    (GPT-2's fused QKV bias [3, H, hd], Qwen2.5's q/k/v biases [H, hd]) and norm scales stay exactly
    1.0; kernels and embeddings shrink by lr · wd. With stages=2: the pipeline's stacked layers."""
    import jax
    from flax import nnx

    from taco_jax.models import get_config, make_model
    from taco_jax.parallel import pipeline as pp
    from taco_jax.train.step import _decay_mask, make_optimizer

    cfg = TrainConfig.from_flags(model=model, mesh="data=1", steps=10, warmup_steps=0, lr=1e-2, weight_decay=0.1,
                      vocab_size=256)
    m = make_model(get_config(model, vocab_size=256), rngs=nnx.Rngs(0))
    state = nnx.split(m, nnx.Param)[1]
    params = _set_biases(nnx.to_pure_dict(state), 1.0)
    mask = None
    if stages > 1:
        staged = pp.StagedModel.from_model(m)
        params = staged.stack_layers(params)
        mask = _decay_mask(state, staged)
    tx = make_optimizer(cfg, mask)
    updates, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
    new = jax.tree.map(lambda p, u: np.asarray(p + u), params, updates)
    seen = set()
    for (path, p), q in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(new)):
        name = path[-1].key
        seen.add(name)
        if name in ("bias", "scale"):
            np.testing.assert_array_equal(q, p, err_msg=jax.tree_util.keystr(path))  # 1.000000
        else:
            np.testing.assert_allclose(q, p * (1 - 1e-2 * 0.1), rtol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert {"bias", "kernel", "embedding"} <= seen
    layer0 = params["h"][0]["attn"]["qkv"] if model.startswith("gpt") else \
        (params["layers"] if stages > 1 else params["layers"][0])["self_attn"]["q_proj"]
    qkv_bias = layer0["bias"]
    assert qkv_bias.ndim >= 2  # the case rank-based decay got wrong


def test_unclassified_parameter_name_raises():
    from taco_jax.models import decays

    with pytest.raises(ValueError, match="'blk/gamma'.*no weight-decay rule"):
        decays(("blk", "gamma"))


def test_lr_schedule_starts_at_step_one_and_ends_at_min():
    """steps=10, warmup 3, lr 1e-2, min_lr_ratio 0.1: lr·k/3 for steps 1..3 (peak at step 3), then the
    cosine down to exactly 1e-3 at step 10 (optax counts from 0 at step 1)."""
    from taco_jax.train.step import lr_schedule

    cfg = TrainConfig.from_flags(mesh="data=1", steps=10, warmup_steps=3, lr=1e-2, min_lr_ratio=0.1)
    got = np.array([float(lr_schedule(cfg)(c)) for c in range(10)])
    k = np.arange(1, 11)
    cos = 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + np.cos(np.pi * (k - 3) / 7))
    want = np.where(k <= 3, 1e-2 * k / 3, cos)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got[:3], [1e-2 / 3, 2e-2 / 3, 1e-2], rtol=1e-6)
    assert got[0] > 0 and got.argmax() == 2 and abs(got[-1] - 1e-3) < 1e-9
    no_warmup = lr_schedule(TrainConfig.from_flags(mesh="data=1", steps=10, warmup_steps=0, lr=1e-2))
    assert float(no_warmup(0)) == pytest.approx(1e-2)


def test_adam_betas_reach_the_optimizer():
    """--adam-b1 / --adam-b2 are AdamW's β1, β2: the second update of the same gradients equals
    optax.adamw's with those betas (and differs from the defaults'), and a beta outside [0, 1) is refused."""
    import jax.numpy as jnp
    import optax

    from taco_jax.train.step import lr_schedule, make_optimizer

    params, grads = {"kernel": jnp.ones((4, 4))}, [{"kernel": jnp.full((4, 4), g)} for g in (0.3, -0.1)]

    def second_update(opt):
        state = opt.init(params)
        for g in grads:
            upd, state = opt.update(g, state, params)
        return np.asarray(upd["kernel"])

    cfg = TrainConfig.from_flags(mesh="data=1", steps=10, adam_b1=0.5, adam_b2=0.7, weight_decay=0.0)
    want = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr_schedule(cfg), b1=0.5, b2=0.7, weight_decay=0.0))
    np.testing.assert_allclose(second_update(make_optimizer(cfg)), second_update(want), rtol=1e-6)
    default = make_optimizer(cfg.replace(adam_b1=0.9, adam_b2=0.95))
    assert not np.allclose(second_update(default), second_update(want))
    with pytest.raises(ValueError, match=r"adam_b2=1.0 must be in \[0, 1\); set by --adam-b2 or \[training\] adam_b2"):
        cfg.replace(adam_b2=1.0)


def test_real_gpt2_vocabulary_runs_tensor_parallel_with_padding():
    """GPT-2's real 50,257-token vocabulary on data=2,tensor=4 (refused before padding existed): padded
    to 50,688 rows (128 × 4), and the mesh loss equals the unpadded one-device loss on the same weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from taco_jax.collectives import CommPolicy
    from taco_jax.models import get_config, make_model
    from taco_jax.train.step import make_steps

    cfg = TrainConfig.from_flags(model="gpt2-tiny", vocab_size=50257, mesh="data=2,tensor=4", seq_len=32)
    assert cfg.model_config.padded_vocab_size == 50688
    small = get_config("gpt2-tiny", vocab_size=50257, n_layer=1)
    padded = get_config("gpt2-tiny", vocab_size=50257, n_layer=1, vocab_multiple=128 * 4)
    params = nnx.to_pure_dict(nnx.split(make_model(small, rngs=nnx.Rngs(0)), nnx.Param)[1])
    params_p = nnx.to_pure_dict(nnx.split(make_model(padded, rngs=nnx.Rngs(0)), nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, 50257)
    tgt = jnp.roll(ids, -1, axis=1)
    one = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))
    want = float(jax.jit(make_steps(small, one, CommPolicy.none()).loss)(params, ids, tgt))
    got = float(jax.jit(make_steps(padded, mesh, CommPolicy.none()).loss)(params_p, ids, tgt))
    assert abs(got - want) / want <= 1e-5, (got, want)


def test_init_from_hf_checkpoint(dataset, tmp_path):
    """`--init-from DIR`: the model comes from DIR's config.json, the weights land on the mesh as stored
    (vocabulary padded on tensor=4), and a short run trains from them."""
    import jax
    from flax import nnx

    from taco_jax.models import count_params, get_config, hf, make_model

    src = get_config("gpt2-tiny", vocab_size=520, n_layer=2)
    params = nnx.to_pure_dict(nnx.split(make_model(src, rngs=nnx.Rngs(7)), nnx.Param)[1])
    hf.save_hf(tmp_path / "ckpt", src, params)
    run = dict(SMALL, model="", vocab_size=512, steps=2, warmup_steps=1, eval_every=2)  # the checkpoint's model
    cfg = TrainConfig.from_flags(init_from=str(tmp_path / "ckpt"), out=str(tmp_path / "run"), **run)
    assert cfg.model_config == get_config("gpt2-tiny", vocab_size=520, n_layer=2, vocab_multiple=512,
                                         dtype="bfloat16")
    got, _ = make_trainer(cfg).init()
    np.testing.assert_array_equal(np.asarray(got["wte"]["embedding"])[:520], params["wte"]["embedding"])
    assert got["wte"]["embedding"].shape == (1024, 128) and not np.any(np.asarray(got["wte"]["embedding"])[520:])
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in got.items() if k != "wte"},
                 {k: v for k, v in params.items() if k != "wte"})
    summary = train(cfg, dataset=dataset, progress=False)
    assert np.isfinite(summary["final_val_loss"]) and summary["n_params"] == count_params(src)
    small = get_config("gpt2-tiny", vocab_size=500, n_layer=2)
    hf.save_hf(tmp_path / "small", small, nnx.to_pure_dict(nnx.split(make_model(small, rngs=nnx.Rngs(7)),
                                                                      nnx.Param)[1]))
    with pytest.raises(ValueError, match="tokenizer vocab 512 exceeds the model's vocab_size=500"):
        train(TrainConfig.from_flags(init_from=str(tmp_path / "small"), out=str(tmp_path / "run2"), **run),
              dataset=dataset, progress=False)


def test_compressed_axes_reads_the_compiled_step():
    """summary["compressed_axes"]: an axis counts only if the compiled step moves codes on it (a site
    whose messages all fall under min_bytes stays exact)."""
    from taco_jax.codec import TACO
    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.train.loop import compressed_axes

    pol = CommPolicy.taco(TACO)
    assert compressed_axes(pol) == ["tensor"]  # from the policy alone
    exact = [dict(axis="tensor", op="all-reduce", dtype="f32", count=9, bytes=4096)]
    assert compressed_axes(pol, exact) == []  # every tensor message stayed exact
    moved = exact + [dict(axis="tensor", op="all-to-all", dtype="u8", count=1, bytes=1088)]
    assert compressed_axes(pol, moved) == ["tensor"]
    assert compressed_axes(CommPolicy(), moved) == []  # nothing compresses by policy
