"""Resume anywhere, fail cleanly: a busy coordinator port, flag abbreviations, a corrupt
latest checkpoint, another vocabulary padding, x64, another process count (SIGKILL during an async save:
test_checkpoint.py). Process tests run real `taco_jax.cli` processes (bounded by timeouts; `_procs`)."""

import functools
import re
import socket
import sys
import time

import pytest
from _procs import ROOT, TEST_XLA_FLAGS, TINY, cli, run

from taco_jax.cli import _parser, config_from_argv, main

pytestmark = pytest.mark.slow

# -----------------------------------------------------------------------------
# flags: no abbreviations; --policy FILE is the flag (--policy-file its other name)


def test_flag_abbreviations_are_refused(capsys):
    """A typo or a prefix never selects another flag (argparse allow_abbrev=False on every parser)."""
    for argv, why in ((["train", "--checkpoint-e", "2"], "unrecognized arguments: --checkpoint-e"),
                      (["train", "--pol", "p.json"], "unrecognized arguments: --pol"),
                      (["launch", "--proc", "2"], "unrecognized arguments: --proc"),
                      (["calibrate", "--captures", "c", "--budg", "1"], "unrecognized arguments: --budg"),
                      (["sample", "--from", "r", "--prompt", "a", "--max-new", "5"], "arguments: --max-new"),
                      (["prepare-data", "in.txt", "--out", "d", "--vocab", "300"], "arguments: --vocab")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert why in capsys.readouterr().err
    for flag in ("--policy", "--policy-file"):
        assert _parser().parse_args(["train", flag, "p.json"]).policy_file == "p.json"


# -----------------------------------------------------------------------------
# a busy coordinator port


def _listener(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


def test_busy_coordinator_port_is_one_clear_error(tmp_path, cache):
    """Something listens on 127.0.0.1:PORT: exit 2 with one `taco-jax: error:` line naming the address
    (checked before JAX's gRPC service starts: it crashed by SIGSEGV or a raw traceback)."""
    with _listener("127.0.0.1") as busy:
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        t = time.monotonic()
        r = run(cli("train", *TINY, "--steps", "1", "--out", tmp_path / "run", "--coordinator", addr,
                    "--num-processes", "1", "--process-id", "0"), cache, timeout=120)
        took = time.monotonic() - t
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines == [f"taco-jax: error: coordinator {addr} is in use (another process listens on it); "
                     "stop it or give --coordinator another port"], r.stderr[-3000:]
    assert not (tmp_path / "run").exists() and took < 60


# -----------------------------------------------------------------------------
# a corrupt newest checkpoint: named, the newest intact one used (or named), nothing deleted


@functools.cache
def _state(mesh: str, **flags):
    """(config, initial params, initial optimizer state) of gpt2-tiny on `mesh`: built once per mesh and
    flags in this process (the tests only read them: no step donates them)."""
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.step import make_trainer

    cfg = TrainConfig.from_flags(mesh=mesh, steps=4, batch_size=8, seq_len=32, comm="none", **flags)
    params, opt_state = make_trainer(cfg).init()
    return cfg, params, opt_state


def _data_files(step_dir):
    return sorted((f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
                  key=lambda f: -f.stat().st_size)


def _truncate(step_dir):
    for f in _data_files(step_dir):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(step_dir):
    big = _data_files(step_dir)[0]
    raw = bytearray(big.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 64):
        raw[i] ^= 0xFF
    big.write_bytes(bytes(raw))


def _no_meta(step_dir):
    for f in (step_dir / "meta").iterdir():
        f.unlink()


#: corruption -> (how, what the error says); flipped bytes are caught by the fingerprints, or by the
#: decoder when they land in compressed chunk data (which one depends on the file layout)
CORRUPTIONS = {"truncated": (_truncate, "its arrays cannot be read"),
               "flipped": (_flip, "(1 arrays differ from what|its arrays cannot be read)"),
               "no-meta": (_no_meta, "its meta cannot be read")}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints 3 and 5 of gpt2-tiny on data=2,tensor=4 (5's parameters shifted by +0.01)."""
    import jax
    import numpy as np

    from taco_jax.train.checkpoint import Checkpoints

    cfg, params, opt_state = _state("data=2,tensor=4")
    d = tmp_path_factory.mktemp("two") / "checkpoints"
    ck = Checkpoints(d, keep=3)
    data = {"position": 3, "bit_generator": np.random.default_rng(3).bit_generator.state}  # a data stream's state
    ck.save(3, params, opt_state, {"data": data, "config": cfg.to_dict()}, wait=True)
    later = jax.jit(lambda p: jax.tree.map(lambda a: a + 0.01, p))(params)
    ck.save(5, later, opt_state, {"data": {**data, "position": 5}, "config": cfg.to_dict()}, wait=True)
    ck.close()
    return d, cfg, jax.device_get(params)


@pytest.mark.parametrize("raw, want", [
    ('DATA_LOSS: Error reading "opt_state.1.0.count/.zarray": Error decoding b-tree node: value_kind[0]=116 is '
     "outside valid range [0, 1] [tensorstore_spec='{\"driver\": \"zarr\"}']",
     "opt_state.1.0.count: Error decoding b-tree node: value_kind[0]=116 is outside valid range [0, 1]"),
    # a spec cut short and a Python object's repr inside the cause: cut before them, never shown
    ('Error reading "params.wpe/.zarray": Future failed <bound method pybind11_detail_function_record_v1_x of '
     "<object at 0x7f>> [tensorstore_spec='{\"driver\": \"zarr\", \"kvstore\": ",
     "params.wpe: Future failed ..."),
    ("INTERNAL: decoding failed: pybind11::error_already_set at 0x7f", "decoding failed ..."),
])
def test_restore_errors_are_one_short_line(raw, want):
    """`_why` keeps the array and the innermost cause of a TensorStore error; JSON specs, status
    codes and Python object reprs (e.g. pybind11's) are dropped, also when a spec is cut short."""
    from taco_jax.train.checkpoint import _why

    assert _why(RuntimeError(raw)) == want


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(two_checkpoints, tmp_path, kind):
    """Checkpoint 5 truncated / with flipped bytes / without its meta: `resume` names it, restores 3
    bit for bit with a warning, renames 5 to 5.corrupt (its files kept); without fallback it refuses,
    naming both. The messages are one readable line (no TensorStore spec / pybind text)."""
    import shutil

    import numpy as np

    from taco_jax.train.checkpoint import Checkpoints, CorruptCheckpointError

    src, cfg, params3 = two_checkpoints
    d = tmp_path / "checkpoints"
    shutil.copytree(src, d)
    corrupt, what = CORRUPTIONS[kind]
    corrupt(d / "5")
    files = sorted(str(f.relative_to(d / "5")) for f in (d / "5").rglob("*"))
    _, params, opt_state = _state("data=2,tensor=4")
    ck = Checkpoints(d, keep=3)
    with pytest.raises(CorruptCheckpointError) as e:
        ck.resume(cfg.to_dict(), params, opt_state, fallback=False)
    msg = str(e.value)
    assert re.search(f"checkpoint {re.escape(str(d / '5'))}: {what}", msg), msg
    assert f"newest intact checkpoint is {d / '3'} (step 3)" in msg
    assert "tensorstore_spec" not in msg and "pybind" not in msg and "\n" not in msg and len(msg) < 1200
    assert ck.steps() == [3, 5]  # refused: nothing renamed or deleted
    step, p, _, meta, _, warnings = ck.resume(cfg.to_dict(), params, opt_state)
    assert step == 3 and meta["step"] == 3
    np.testing.assert_array_equal(np.asarray(p["wte"]["embedding"]), params3["wte"]["embedding"])
    assert len(warnings) == 1 and re.search(f"checkpoint {re.escape(str(d / '5'))}: {what}", warnings[0])
    assert f"renamed to {d / '5.corrupt'}" in warnings[0]
    # one short line: the two paths and a few words of why (TensorStore's chain of files dropped)
    assert "\n" not in warnings[0] and len(warnings[0].replace(str(d), "")) < 320, warnings[0]
    assert ck.steps() == [3]
    assert sorted(str(f.relative_to(d / "5.corrupt")) for f in (d / "5.corrupt").rglob("*")) == files
    ck.close()


def test_every_checkpoint_corrupt_is_refused_naming_each(two_checkpoints, tmp_path):
    import shutil

    from taco_jax.train.checkpoint import Checkpoints, CorruptCheckpointError

    src, cfg, _ = two_checkpoints
    d = tmp_path / "checkpoints"
    shutil.copytree(src, d)
    _truncate(d / "5")
    _no_meta(d / "3")
    _, params, opt_state = _state("data=2,tensor=4")
    ck = Checkpoints(d, keep=3)
    with pytest.raises(CorruptCheckpointError, match=rf"no intact checkpoint in {d}: checkpoint {d / '5'}: .*"
                                                     rf"checkpoint {d / '3'}: its meta cannot be read"):
        ck.resume(cfg.to_dict(), params, opt_state)
    assert ck.steps() == [3, 5]
    ck.close()


def test_cli_resume_with_a_corrupt_newest_checkpoint(two_checkpoints, tmp_path, capsys):
    """`train --resume`: --no-resume-fallback exits 2 before compiling, naming the corrupt checkpoint
    and the intact one; by default the run continues from the intact one with a warning. With
    --tensorboard, the events the abandoned run wrote past step 3 are purged: each step once."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboardX import SummaryWriter

    from taco_jax.util import jsonio

    src, _, _ = two_checkpoints
    shutil.copytree(src, tmp_path / "checkpoints")
    _no_meta(tmp_path / "checkpoints" / "5")
    with SummaryWriter(logdir=str(tmp_path / "tensorboard")) as abandoned:  # the run that saved 3 and 5
        for step in range(1, 6):
            abandoned.add_scalar("train/loss", 10.0 + step, step)
    args = ["train", "--batch-size", "8", "--seq-len", "32", "--steps", "4", "--comm", "none", "--no-progress",
            "--eval-batches", "1", "--mesh", "data=2,tensor=4", "--out", str(tmp_path), "--resume", "--tensorboard"]
    t = time.monotonic()
    assert main([*args, "--no-resume-fallback"]) == 2
    took = time.monotonic() - t
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith(f"taco-jax: error: checkpoint {tmp_path / 'checkpoints' / '5'}: its "
                                               "meta cannot be read") and "(step 3)" in err[0], err
    assert took < 60
    assert main(args) == 0  # steps 4 after 3
    err = capsys.readouterr().err
    assert f"[taco-jax] warning: checkpoint {tmp_path / 'checkpoints' / '5'}: its meta cannot be read" in err
    assert "resumed from" in err and "(step 3)" in err
    # the corrupt one set aside, the run's final checkpoint beside the intact one it resumed from
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "4", "5.corrupt"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (rec,) = jsonio.read_metrics(tmp_path / "metrics.jsonl")
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(1, 11.0), (2, 12.0), (3, 13.0), (4, pytest.approx(rec["loss"]))]


# -----------------------------------------------------------------------------
# another tensor size: the vocabulary padding changes (512 rows on tensor=2, 384 on tensor=1)


def test_restore_trims_or_pads_the_vocabulary_padding(tmp_path):
    """vocab 300 saved on data=4,tensor=2 (padded to 512 rows), restored on data=8,tensor=1 (384) and
    back (the 8-device test mesh): the real rows and their Adam moments equal, the padding rows zero;
    a non-zero row that would be trimmed is refused, naming the leaf and both row counts."""
    import jax
    import numpy as np

    from taco_jax.train.checkpoint import CheckpointError, Checkpoints, _paths

    cfg2, params, opt_state = _state("data=4,tensor=2", vocab_size=300)
    cfg1, params1, opt1 = _state("data=8,tensor=1", vocab_size=300)
    assert params["wte"]["embedding"].shape == (512, 128) and params1["wte"]["embedding"].shape == (384, 128)
    # Adam moments with non-zero real rows (as after a few steps); padding rows stay zero
    real_rows = jax.numpy.pad(jax.numpy.ones((300, 128)), ((0, 212), (0, 0)))
    opt_state = jax.tree_util.tree_map_with_path(lambda k, a: a + real_rows if "wte" in jax.tree_util.keystr(k)
                                                 else a, opt_state)
    ck = Checkpoints(tmp_path / "checkpoints", keep=3)
    ck.save(2, params, opt_state, {"data": {}, "config": cfg2.to_dict()}, wait=True)
    vocab1 = (cfg1.model_config.vocab_size, cfg1.model_config.padded_vocab_size)
    with pytest.raises(CheckpointError, match=r"\[512, 128\], 'float32'\] vs this run \[\[384, 128\]"):
        ck.restore(2, cfg1.to_dict(), params1, opt1)  # without the vocabulary: shapes must match
    p, o, _, notes = ck.restore(2, cfg1.to_dict(), params1, opt1, vocab=vocab1)
    assert "vocabulary padding: checkpoint 512 rows, now 384 (zero rows trimmed; 3 arrays)" in notes
    host = jax.device_get({"params": params, "opt_state": opt_state})
    got = _paths({"params": p, "opt_state": o})
    vocab_leaves = [k for k in got if "wte" in k]
    assert len(vocab_leaves) == 3  # the embedding (tied LM head) and its two Adam moments
    for k, want in _paths(host).items():
        want = want[:384] if k in vocab_leaves else want
        np.testing.assert_array_equal(np.asarray(got[k]), want)
        assert k not in vocab_leaves or (not want[300:].any() and want[:300].any())
    assert p["wte"]["embedding"].sharding == params1["wte"]["embedding"].sharding
    # back to 512 rows: zero rows added
    ck.save(4, p, o, {"data": {}, "config": cfg1.to_dict()}, wait=True)
    vocab2 = (cfg2.model_config.vocab_size, cfg2.model_config.padded_vocab_size)
    p2, _, _, notes = ck.restore(4, cfg2.to_dict(), params, opt_state, vocab=vocab2)
    assert "now 512 (zero rows added; 3 arrays)" in notes[-1]
    np.testing.assert_array_equal(np.asarray(p2["wte"]["embedding"]), host["params"]["wte"]["embedding"])
    # a row past 384 that is not zero: not padding -> refused
    bad = jax.tree_util.tree_map_with_path(lambda k, a: a.at[400].set(1.0) if "wte" in jax.tree_util.keystr(k)
                                           else a, params)
    ck.save(6, bad, opt_state, {"data": {}, "config": cfg2.to_dict()}, wait=True)
    with pytest.raises(CheckpointError, match=r"\['wte'\]\['embedding'\] has non-zero rows in \[384, 512\) .*"
                                              r"checkpoint's 512 rows cannot become this run's 384"):
        ck.restore(6, cfg1.to_dict(), params1, opt1, vocab=vocab1)
    ck.close()


VOCAB_RUN = ["train", *TINY, "--vocab-size", "300", "--steps", "4", "--checkpoint-every", "2", "--comm", "none",
             "--dtype", "float32", "--no-progress"]


def test_resume_on_another_tensor_size_with_other_vocabulary_padding(tmp_path, cache):
    """Vocab 300, saved on data=2,tensor=2 (512 rows), resumed on data=4,tensor=1 (384 rows: the zero
    padding rows trimmed, not refused as "checkpoint [512, 128] vs this run [384, 128]"). The resumed
    steps 3-4 equal the uninterrupted run on the saving mesh (= a resume there: bit-exact, test_checkpoint.py)
    to <= 1e-6 relative (float32, exact collectives: only the mesh's summation order differs)."""
    import json
    import shutil

    from _procs import losses

    ref = tmp_path / "ref"
    r = run(cli(*VOCAB_RUN, "--mesh", "data=2,tensor=2", "--out", ref), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "other"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / "4")  # resume from step 2
    r = run(cli(*VOCAB_RUN, "--mesh", "data=4,tensor=1", "--out", out, "--resume"), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vocabulary padding: checkpoint 512 rows, now 384 (zero rows trimmed" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2  # and what differs from the checkpointed run, beside config.json's
    assert "mesh: checkpoint 'data=2,tensor=2', now 'data=4,tensor=1' (resharded)" in summary["resumed_with_changes"]
    want, got = losses(ref), losses(out)
    assert [s for s, _, _ in got] == [1, 2, 3, 4] and got[:2] == want[:2]
    for (_, lw, gw), (_, lg, gg) in zip(want[2:], got[2:]):
        assert abs(lg - lw) <= 1e-6 * abs(lw) and abs(gg - gw) <= 1e-5 * abs(gw), (want, got)


# -----------------------------------------------------------------------------
# JAX_ENABLE_X64=1: the same dtypes and wire bytes


def _dtypes_and_wire(model: str = "gpt2-tiny") -> dict:
    """Every parameter / optimizer-state leaf's dtype, the compiled train step's collectives (axis,
    dtype, bytes) and wire bytes per axis, and the step's loss dtype, of `model` on data=2,tensor=4
    with --comm taco (FP8 codes + float32 scales on the tensor axis)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from taco_jax.collectives.hlo import collective_bytes
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.step import make_trainer

    cfg = TrainConfig.from_flags(model=model, mesh="data=2,tensor=4", steps=4, batch_size=8, seq_len=32, comm="taco")
    trainer = make_trainer(cfg)
    params, opt_state = trainer.init()
    leaves = {jax.tree_util.keystr(k): str(v.dtype) for k, v in
              jax.tree_util.tree_flatten_with_path((params, opt_state))[0]}
    batch = jax.ShapeDtypeStruct((8, 32), np.int32, sharding=NamedSharding(trainer.mesh, PartitionSpec("data")))
    step = trainer.train_step.lower(params, opt_state, batch, batch).compile()
    wire = collective_bytes(step.as_text(), trainer.mesh)
    out = jax.eval_shape(trainer.train_step, params, opt_state, batch, batch)
    return {"x64": bool(jax.config.jax_enable_x64), "leaves": leaves, "by_axis": wire["by_axis"],
            "detail": sorted([r["axis"], r["dtype"], r["bytes"]] for r in wire["detail"]),
            "outputs": sorted({str(a.dtype) for a in jax.tree.leaves(out)})}


def test_x64_changes_no_dtype_and_no_wire_byte(cache):
    """With JAX_ENABLE_X64=1 (a subprocess) gpt2-tiny's parameters and optimizer state, the train step's
    collectives (FP8 codes as u8 + float32 scales) and its outputs have the dtypes of an x64-off run,
    and the wire bytes per axis are identical (no float64 leaf, no f64 collective operand)."""
    import json

    code = "import json; import test_resume_faults as t; print('RESULT ' + json.dumps(t._dtypes_and_wire()))"
    import os

    path = os.pathsep.join((str(ROOT / "tests"), str(ROOT)))
    r = run([sys.executable, "-c", code], cache, timeout=300, JAX_ENABLE_X64="1", PYTHONPATH=path,
            XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=8")
    assert r.returncode == 0, r.stderr[-3000:]
    on = json.loads(r.stdout.split("RESULT ", 1)[1])
    off = _dtypes_and_wire()
    assert on["x64"] and not off["x64"]
    assert set(on["leaves"].values()) <= {"float32", "int32"}
    assert on["leaves"] == off["leaves"] and on["outputs"] == off["outputs"]
    assert on["detail"] == off["detail"] and on["by_axis"] == off["by_axis"]
    assert {d for _, d, _ in on["detail"]} == {"f32", "u8"}


# -----------------------------------------------------------------------------
# resume with another number of processes (same global mesh)

PROC_ARGS = ["train", *TINY, "--steps", "4", "--checkpoint-every", "2", "--comm", "taco", "--mesh", "data=2,tensor=2",
             "--no-progress"]


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory, cache):
    """data=2,tensor=2 over 2 processes × 2 devices, 4 steps, checkpoints 2 and 4 (written by both)."""
    out = tmp_path_factory.mktemp("two") / "run"
    r = run(cli(*PROC_ARGS, "--out", out, processes=2), cache)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (out / "checkpoints" / "2" / "state").iterdir()}
    return out


def _launch_on_a_taken_port(argv, cache, monkeypatch) -> str:
    """`taco-jax launch --processes 1 -- argv` in this process, whose first port is taken (127.0.0.1:P1
    listened on): it starts the process again on the next, P2, which is listened on at 127.0.0.2 only,
    so the run succeeds only if the coordinator binds 127.0.0.1:P2 (the address given), not every
    interface ([::]:P2). Returns the launcher's output after checking the retry was said."""
    import io

    from _procs import env

    from taco_jax import launch

    with _listener("127.0.0.1") as taken, _listener("127.0.0.2") as other:
        ports = [taken.getsockname()[1], other.getsockname()[1]]
        busy = ports[0]
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop(0))
        out = io.StringIO()
        # launch.launch has no deadline of its own: the run's watchdog bounds a hung step (a timeout flag:
        # the same compiled program, from the cache), JAX's distributed runtime its start
        status = launch.launch(1, [*map(str, argv), "--step-timeout", "300"], config_of=config_from_argv,
                               env=env(cache), out=out)
    text = out.getvalue()
    assert status == 0, text[-3000:]
    assert f"coordinator 127.0.0.1:{busy} is in use" in text
    assert "retrying with another (attempt 2 of 3)" in text and not ports
    return text


@pytest.mark.parametrize("processes", [1, 4])
def test_resume_with_another_process_count(tmp_path, cache, saved_by_two, processes, monkeypatch):
    """Checkpoint 2 of the 2-process run resumed by 1 process × 4 devices and by 4 processes × 1 device:
    steps 3-4 equal the 2-process run's (= its own resume: bit-exact, test_checkpoint.py) bit for bit
    (the same global mesh: the collectives sum in the same order whatever the process count). The
    1-process resume is launched on a taken port (`_launch_on_a_taken_port`: the launcher retries)."""
    import json
    import shutil

    from _procs import losses

    out = tmp_path / "run"
    shutil.copytree(saved_by_two, out)
    shutil.rmtree(out / "checkpoints" / "4")
    argv = [*PROC_ARGS, "--out", out, "--resume"]
    if processes == 1:
        stdout = _launch_on_a_taken_port(argv, cache, monkeypatch)
    else:
        r = run(cli(*argv, processes=processes), cache)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        stdout = r.stdout
    assert "[0] [taco-jax] resumed from checkpoints/2 (step 2)" in stdout  # named relative to the run folder
    assert json.loads((out / "summary.json").read_text())["processes"] == processes
    assert losses(out) == losses(saved_by_two)  # steps 1-2 kept, 3-4 recomputed: bit for bit
