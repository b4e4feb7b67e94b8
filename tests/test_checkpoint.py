"""Orbax checkpoints of a training run: restore onto another mesh, bad checkpoints refused with a named
reason, unfinished / failed saves never taking a good checkpoint's place, SIGKILL during an asynchronous
save + --resume bit for bit, SIGTERM -> checkpoint and a clean exit. Process tests run real `taco_jax.cli`
processes (bounded)."""

import json
import os
import pathlib
import shutil
import signal

import jax
import numpy as np
import pytest
from _procs import TINY, cli, metrics, run, start, wait_for

from taco_jax.testing.faults import ENV_SLOW_SAVE
from taco_jax.train.checkpoint import CheckpointError, Checkpoints
from taco_jax.train.config import TrainConfig
from taco_jax.train.step import make_trainer

pytestmark = pytest.mark.slow

# -----------------------------------------------------------------------------
# in-process: the Checkpoints API on the 8-device test mesh


def _state(mesh: str):
    cfg = TrainConfig.from_flags(mesh=mesh, steps=4, batch_size=8, seq_len=32, comm="none")
    trainer = make_trainer(cfg)
    params, opt_state = trainer.init()
    return cfg, trainer, params, opt_state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 3 of gpt2-tiny on data=2,tensor=4 (parameters perturbed so that every leaf
    differs from a fresh init), and those arrays on the host."""
    cfg, trainer, params, opt_state = _state("data=2,tensor=4")
    params = jax.jit(lambda p: jax.tree.map(lambda a: a + 0.01 * a.size % 7, p))(params)
    d = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ck = Checkpoints(d, keep=2)
    ck.save(3, params, opt_state, {"data": {"position": 3}, "config": cfg.to_dict()}, wait=True)
    ck.close()
    return d, cfg, jax.device_get(params), jax.device_get(opt_state)


def test_sample_reads_a_run_checkpoint_without_orbax_warnings(saved, tmp_path, caplog):
    """`sample --from RUN` loads the latest checkpoint's parameters onto one device, equal to the saved
    ones, and logs no warning (the step-level _CHECKPOINT_METADATA is not asked for at the item level)."""
    from taco_jax.train.sample import _checkpoint_params

    d, cfg, params0, _ = saved
    shutil.copytree(d, tmp_path / "checkpoints")
    with caplog.at_level("WARNING"):
        _, params = _checkpoint_params(tmp_path, cfg.to_dict())
    assert not [r.getMessage() for r in caplog.records if r.levelno >= 30]
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(params0), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_sample_reads_the_checkpoint_of_a_run_with_microbatches(tmp_path, capsys):
    """A run with --microbatches 2 on one stage keeps its layers stacked, as with stages
    (`pipelined_layout`: one predicate for the trainer and `sample`): `sample --from` the run's
    checkpoint gets the model's layers back, equal to the saved ones, and says which checkpoint it read."""
    from taco_jax.parallel.pipeline import pipelined_layout
    from taco_jax.train.sample import _checkpoint_params

    cfg = TrainConfig.from_flags(mesh="data=2,tensor=4", microbatches=2, steps=4, batch_size=8, seq_len=32,
                                 comm="none")
    trainer = make_trainer(cfg)
    assert trainer.staged is not None and cfg.parallelism.pipelined and pipelined_layout(1, 2)
    assert not pipelined_layout(1, 1) and pipelined_layout(2, 2)
    params, opt_state = trainer.init()
    ck = Checkpoints(tmp_path / "checkpoints", keep=1)
    ck.save(4, params, opt_state, {"data": {"position": 4}, "config": cfg.to_dict()}, wait=True)
    ck.close()
    model, got = _checkpoint_params(tmp_path, cfg.to_dict())
    jax.tree.map(np.testing.assert_array_equal, got, trainer.staged.unstack_layers(jax.device_get(params)))
    assert np.isfinite(np.asarray(model.logits(got, np.zeros((1, 4), np.int32)))).all()
    assert f"sample: the weights of {tmp_path / 'checkpoints' / '4'} (the run's latest checkpoint, step 4)" in \
        capsys.readouterr().err


def test_sample_names_the_export_it_reads_and_a_newer_checkpoint(saved, tmp_path, capsys):
    """`sample --from RUN` reads the run's export (recorded in config.json inside the run folder as
    {out}/hf) and says so with the export's step; a checkpoint of a later step in the run is warned
    about (the export is read). An export without its record says that it records no step."""
    from taco_jax.models.hf import EXPORT_RECORD, save_hf
    from taco_jax.train.sample import load_for_sampling

    d, cfg, params0, _ = saved  # checkpoint 3
    shutil.copytree(d, tmp_path / "checkpoints")
    (tmp_path / "config.json").write_text(json.dumps(cfg.replace(out=str(tmp_path),
                                                                 export_hf=str(tmp_path / "hf")).to_dict()))
    (tmp_path / "tokenizer.json").write_text("{}")
    save_hf(tmp_path / "hf", cfg.model_config, params0, record={"step": 2, "run": str(tmp_path)})
    assert json.loads((tmp_path / "config.json").read_text())["checkpoint"]["export_hf"] == "{out}/hf"
    _, got, _ = load_for_sampling(tmp_path)
    np.testing.assert_array_equal(got["wpe"], params0["wpe"])
    err = capsys.readouterr().err
    assert f"[taco-jax] sample: the weights of {tmp_path / 'hf'} (the run's --export-hf, step 2)" in err
    assert f"[taco-jax] warning: the run's checkpoint {tmp_path / 'checkpoints' / '3'} (step 3) is newer than its " \
           f"export (step 2); sample reads the export: move {tmp_path / 'hf'} aside to sample the checkpoint" in err
    (tmp_path / "hf" / EXPORT_RECORD).unlink()
    load_for_sampling(tmp_path)
    err = capsys.readouterr().err
    assert f"(the run's --export-hf, no training step recorded: no {EXPORT_RECORD})" in err
    assert "(step 3) may be newer than its export" in err


def test_restore_names_another_codec_and_learning_rate(saved):
    """Restored by a run with other flags (they hold from then on): each change is named, the
    communication policy by the sites whose codec changed (grouped) and its other settings, and a
    changed learning-rate schedule says so."""
    from taco_jax.codec import CodecConfig
    from taco_jax.collectives.policy import CommPolicy

    d, cfg, _, _ = saved
    _, _, params, opt_state = _state("data=2,tensor=4")
    other = cfg.replace(lr=0.5, policy=CommPolicy.taco(CodecConfig(kind="int8"), chunks=2))
    ck = Checkpoints(d, keep=2)
    *_, notes = ck.restore(3, other.to_dict(), params, opt_state)
    ck.close()
    assert f"lr: checkpoint {cfg.training.lr!r}, now 0.5" in notes
    assert f"the learning-rate schedule is recomputed for steps={cfg.training.steps} (warmup and cosine): from " \
           "here on it differs from the checkpointed run's" in notes
    assert "communication (checkpoint -> now): ar_fwd/ar_bwd/all_gather/reduce_scatter none -> int8-G128; " \
           "chunks 1 -> 2" in notes, notes


def test_restore_onto_another_mesh_is_exact(saved):
    """Saved on data=2,tensor=4, restored on data=4,tensor=2: Orbax reshards to the target's
    shardings; every array equal bit for bit; the mesh change is reported."""
    d, _, params0, opt0 = saved
    cfg, trainer, params, opt_state = _state("data=4,tensor=2")
    ck = Checkpoints(d, keep=2)
    assert ck.steps() == [3]
    p, o, meta, notes = ck.restore(3, cfg.to_dict(), params, opt_state)
    assert meta["step"] == 3 and meta["data"] == {"position": 3}
    assert notes == ["mesh: checkpoint 'data=2,tensor=4', now 'data=4,tensor=2' (resharded)"]
    for got, want, like in zip(jax.tree.leaves(p), jax.tree.leaves(params0), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding == like.sharding  # the new mesh's layout
    for got, want in zip(jax.tree.leaves(o), jax.tree.leaves(opt0)):
        np.testing.assert_array_equal(np.asarray(got), want)
    ck.close()


def _with(cfg, **model):
    """`cfg.to_dict()` with these `[model]` fields replaced (unchecked, as a recorded config.json)."""
    d = cfg.to_dict()
    return {**d, "model": {**d["model"], **model}}


def test_other_model_or_vocab_refused_naming_it(saved, tmp_path):
    d, cfg, _, _ = saved
    _, _, params, opt_state = _state("data=2,tensor=4")
    ck = Checkpoints(d, keep=2)
    with pytest.raises(CheckpointError, match=r"is of model='gpt2-tiny', this run has model='gpt2-mini'"):
        ck.restore(3, _with(cfg, name="gpt2-mini"), params, opt_state)
    with pytest.raises(CheckpointError, match=r"vocab_size=2048, this run has vocab_size=4096"):
        ck.restore(3, _with(cfg, vocab_size=4096), params, opt_state)
    # same names, other shapes (e.g. a preset edited in between): the parameter is named
    wide = TrainConfig.from_flags(mesh="data=2,tensor=4", batch_size=8, seq_len=32, comm="none", vocab_size=4096)
    p2, o2 = make_trainer(wide).init()
    with pytest.raises(CheckpointError, match=r"\['wte'\]\['embedding'\]: checkpoint \[\[2048, 128\]"):
        ck.restore(3, cfg.to_dict(), p2, o2)
    ck.close()


def test_pipelined_and_unpipelined_layouts_are_refused_naming_the_layouts(saved):
    """The saved unpipelined checkpoint into a pipelined run (stage = 2, 2 microbatches): refused, naming both
    layouts and a parameter first; an array the checkpoint lacks is said so (not "None")."""
    d, _, _, _ = saved
    cfg = TrainConfig.from_flags(mesh="data=2,stage=2,tensor=2", microbatches=2, steps=4, batch_size=8, seq_len=32,
                                 comm="none")
    params, opt_state = make_trainer(cfg).init()
    ck = Checkpoints(d, keep=2)
    with pytest.raises(CheckpointError) as e:
        ck.check(3, cfg.to_dict(), params, opt_state)
    ck.close()
    msg = str(e.value)
    assert "the checkpoint's layout is unpipelined, this run's pipelined (stage > 1 or microbatches > 1)" in msg, msg
    assert "e.g. ['params']" in msg and "has no such array" in msg and "None" not in msg, msg


def _copy(d, tmp_path) -> pathlib.Path:
    dst = tmp_path / "checkpoints"
    shutil.copytree(d, dst)
    return dst


def test_truncated_or_corrupt_checkpoint_refused(saved, tmp_path):
    d, cfg, _, _ = saved
    _, _, params, opt_state = _state("data=2,tensor=4")
    files = lambda root: sorted((f for f in (root / "3" / "state").rglob("*") if f.is_file() and  # noqa: E731
                                 f.parent.name == "d"), key=lambda f: -f.stat().st_size)
    truncated = _copy(d, tmp_path / "t")
    for f in files(truncated):  # every data file cut to half
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    ck = Checkpoints(truncated, keep=2)
    with pytest.raises(CheckpointError, match=r"checkpoints/3: .*corrupt"):
        ck.restore(3, cfg.to_dict(), params, opt_state)
    ck.close()
    corrupt = _copy(d, tmp_path / "c")
    big = files(corrupt)[0]
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)  # zeroed bytes in the middle of the largest file
    big.write_bytes(bytes(raw))
    ck = Checkpoints(corrupt, keep=2)
    with pytest.raises(CheckpointError, match=r"checkpoints/3: .*corrupt"):
        ck.restore(3, cfg.to_dict(), params, opt_state)
    ck.close()
    no_meta = _copy(d, tmp_path / "m")
    for f in (no_meta / "3" / "meta").iterdir():
        f.unlink()
    ck = Checkpoints(no_meta, keep=2)
    with pytest.raises(CheckpointError, match=r"meta cannot be read"):
        ck.restore(3, cfg.to_dict(), params, opt_state)
    ck.close()


def test_unfinished_and_failed_saves_keep_the_good_checkpoint(saved, tmp_path):
    """A save interrupted mid-way (its temporary folder left behind) is not a checkpoint; a save
    that fails does not remove or replace the previous one, even with keep=1."""
    d, cfg, params0, _ = saved
    root = _copy(d, tmp_path)
    shutil.copytree(root / "3", root / "5.orbax-checkpoint-tmp-1234")  # a crash during the save of step 5
    _, _, params, opt_state = _state("data=2,tensor=4")
    ck = Checkpoints(root, keep=1)
    assert ck.steps() == [3]
    with pytest.raises(TypeError):  # a meta value JSON cannot hold: Orbax's write of step 7 fails
        ck.save(7, params, opt_state, {"data": object()}, wait=True)
    assert ck.steps() == [3]
    p, _, meta, _ = ck.restore(3, cfg.to_dict(), params, opt_state)
    assert meta["step"] == 3
    np.testing.assert_array_equal(np.asarray(p["wte"]["embedding"]), params0["wte"]["embedding"])
    ck.close()


def _device_bytes(*trees) -> dict:
    """Bytes each device holds of the arrays in `trees` (the sum of its addressable shards)."""
    held = {}
    for a in jax.tree.leaves(trees):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def _sharded_like_params(params, opt_state, trainer) -> None:
    """Every parameter has its spec, every optimizer-state tree of moments the shardings of the
    parameters, every other optimizer-state leaf (step counts) is replicated over the mesh."""
    from jax.sharding import NamedSharding, PartitionSpec

    assert jax.tree.map(lambda a: a.sharding, params) == trainer.shardings
    moments = [k for k in opt_state[1][0]._fields if k != "count"]
    assert moments == ["mu", "nu"], opt_state[1][0]._fields  # AdamW: the tree below is the one checked
    for name in moments:
        got = jax.tree.map(lambda a: a.sharding, getattr(opt_state[1][0], name))
        assert got == trainer.shardings, name
    replicated = NamedSharding(trainer.mesh, PartitionSpec())
    counts = [a for a in jax.tree.leaves(opt_state) if a.ndim == 0]
    assert counts and all(a.sharding == replicated for a in counts)
    assert jax.tree.map(lambda a: a.sharding, opt_state) == trainer.opt_shardings


def test_state_sharded_like_the_parameters_at_init_restore_and_export(tmp_path):
    """3D mesh with pipeline microbatches: right after `Trainer.init` and after a restore, the
    optimizer state has its parameters' shardings (step counts replicated); no device holds more
    than 1.1x the even share of the parameter and optimizer-state bytes; the parameters equal the
    eager `make_model(seed)` bit for bit. The HF export of the pipeline layout (layers cut from
    their stacks one at a time) equals the export of the model layout byte for byte."""
    from flax import nnx

    from taco_jax.models import hf, make_model

    cfg = TrainConfig.from_flags(mesh="data=2,stage=2,tensor=2", microbatches=2, steps=4, batch_size=8,
                                 seq_len=32, comm="none")
    trainer = make_trainer(cfg)
    params, opt_state = trainer.init()
    _sharded_like_params(params, opt_state, trainer)
    held = _device_bytes(params, opt_state)
    even = sum(held.values()) / len(jax.devices())
    assert len(held) == 8 and max(held.values()) <= 1.1 * even, {d.id: b for d, b in held.items()}
    eager = nnx.to_pure_dict(nnx.split(make_model(cfg.model_config, rngs=nnx.Rngs(cfg.training.seed)), nnx.Param)[1])
    jax.tree.map(np.testing.assert_array_equal, params, trainer.staged.stack_layers(eager))
    hf.save_hf(tmp_path / "stacked", cfg.model_config, params, stacked_key=trainer.staged.layer_key)
    hf.save_hf(tmp_path / "model", cfg.model_config, eager)
    assert (tmp_path / "stacked" / "model.safetensors").read_bytes() == \
        (tmp_path / "model" / "model.safetensors").read_bytes()

    ck = Checkpoints(tmp_path / "checkpoints", keep=1)
    params = jax.jit(lambda p: jax.tree.map(lambda a: a + 1, p))(params)  # differs from a fresh init
    ck.save(2, params, opt_state, {"data": {"position": 2}, "config": cfg.to_dict()}, wait=True)
    fresh = trainer.init()
    for shardings in (None, (trainer.shardings, trainer.opt_shardings)):
        p, o, _, _ = ck.restore(2, cfg.to_dict(), *fresh, shardings=shardings)
        _sharded_like_params(p, o, trainer)
        jax.tree.map(np.testing.assert_array_equal, (p, o), (params, opt_state))
    ck.close()


# -----------------------------------------------------------------------------
# real processes: kill and resume


ARGS = ["train", *TINY, "--eval-batches", "1", "--steps", "6", "--checkpoint-every", "2", "--comm", "taco"]  # val at 6


def _records(out) -> list[dict]:
    """Per-step records without the timing fields."""
    return [{k: v for k, v in r.items() if k not in ("step_s", "tokens_per_s")} for r in metrics(out)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run(cli(*ARGS, "--out", out), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "6"]  # keep 3
    return out, _records(out)


def _resume(out, cache) -> dict:
    r = run(cli(*ARGS, "--out", out, "--resume"), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoints/" in r.stderr  # the run folder's paths named relative to it
    return json.loads((out / "summary.json").read_text())


def test_sigkill_during_an_async_save_then_resume_is_bit_exact(tmp_path, cache, uninterrupted):
    """Saves slowed on purpose (`testing.faults.ENV_SLOW_SAVE`, a test-only hook: each background save
    sleeps 8 s before its meta is written). SIGKILL while the save of step 4 is in flight: its
    temporary folder is no checkpoint, checkpoint 2 is the latest complete one, and --resume from it
    reproduces the uninterrupted run bit for bit."""
    out, log = tmp_path / "run", tmp_path / "log"
    p = start(cli(*ARGS, "--out", out), cache, log, **{ENV_SLOW_SAVE: "8"})
    ck = out / "checkpoints"
    wait_for(lambda: (ck / "2").is_dir() and any(d.name.startswith("4.orbax-checkpoint-tmp") for d in ck.iterdir()),
             p, timeout=400, what="checkpoint 2 complete and the save of 4 in flight", log=log)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert sorted(d.name for d in ck.iterdir() if not d.name.startswith("4.orbax-checkpoint-tmp")) == ["2"]
    summary = _resume(out, cache)
    assert summary["resumed_from_step"] == 2
    assert _records(out) == uninterrupted[1]  # every step's loss, grad norm and val loss, bit for bit


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path, cache, uninterrupted):
    """SIGTERM: a checkpoint of the step the run stopped at and exit 0; the --export-hf written then
    is said with that step and records it; --resume completes the run as if uninterrupted."""
    from taco_jax.models.hf import EXPORT_RECORD, read_record

    out, log = tmp_path / "run", tmp_path / "log"
    p = start(cli(*ARGS, "--out", out, "--checkpoint-every", "0", "--export-hf", out / "hf"), cache, log)
    wait_for(lambda: "step 2/6" in log.read_text(), p, timeout=400, what="step 2", log=log)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    stopped = json.loads((out / "summary.json").read_text())["preempted_at_step"]
    assert 2 <= stopped < 6
    assert "SIGTERM: checkpoint" in text
    assert f"[taco-jax] HF export of step {stopped}, the step SIGTERM stopped the run at (of steps=6) written to hf " \
           f"(hf/{EXPORT_RECORD} records the step)" in text, text[-3000:]
    assert read_record(out / "hf") == {"step": stopped, "steps": 6, "preempted": True, "run": str(out.resolve())}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [str(stopped)]
    assert [r["step"] for r in metrics(out)] == list(range(1, stopped + 1))
    summary = _resume(out, cache)  # the remaining steps, --checkpoint-every 2 again
    assert summary["resumed_from_step"] == stopped
    assert _records(out) == uninterrupted[1]


def test_resume_of_a_finished_run_leaves_its_summary(uninterrupted, capsys):
    """`train --resume` of a run that reached its --steps trains nothing, says so and leaves
    summary.json (its tokens/s) as the run wrote it."""
    from taco_jax.cli import main

    out = uninterrupted[0]
    before = (out / "summary.json").read_bytes()
    assert json.loads(before)["tokens_per_s"] > 0
    assert main([*ARGS, "--out", str(out), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "checkpoints/6 is at step 6 of steps=6; the run is finished, nothing to do" in err
    assert (out / "summary.json").read_bytes() == before


def test_cli_refuses_a_checkpoint_of_another_model(saved, tmp_path, capsys):
    """`train --resume` on a checkpoint of another model exits with status 2 before compiling, naming
    the model; without --resume an --out holding checkpoints is refused (never overwritten)."""
    from taco_jax.cli import main

    d, _, _, _ = saved
    shutil.copytree(d, tmp_path / "checkpoints")
    args = ["train", "--batch-size", "8", "--seq-len", "32", "--steps", "4", "--comm", "none", "--no-progress",
            "--out", str(tmp_path)]
    assert main([*args, "--model", "gpt2-mini", "--vocab-size", "2048", "--resume"]) == 2
    assert "is of model='gpt2-tiny', this run has model='gpt2-mini'" in capsys.readouterr().err
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints (latest step 3); give --resume" in err
    assert "[taco-jax]" not in err  # refused before the run's start line
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["3"]
    # compare refuses before training either run when one of its two folders holds checkpoints
    shutil.copytree(d, tmp_path / "cmp" / "taco" / "checkpoints")
    compare = ["compare", *[a if a != "none" else "taco" for a in args[1:-1]], str(tmp_path / "cmp")]
    assert main(compare) == 2
    err = capsys.readouterr().err
    assert "cmp/taco/checkpoints holds checkpoints (latest step 3)" in err and "[taco-jax]" not in err, err
    assert not (tmp_path / "cmp" / "none" / "metrics.jsonl").exists()
