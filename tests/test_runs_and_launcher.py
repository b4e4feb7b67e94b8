"""What a finished run keeps and how `taco-jax launch` starts a run: the final checkpoint's opt-out
(the checkpoint itself and `sample --from` on it: test_distributed.py), a run on a caller's own token
arrays without a tokenizer,
the launcher started from a folder holding another `taco_jax`, the mesh of a `--config` file, and
`--step-timeout auto` guarding the evaluation (a peer SIGSTOPped there is named within the limit), an
exported XLA_FLAGS device count giving way to the flags, the commands launch refuses, and SIGTERM to a
one-process run while it compiles."""

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _procs import ROOT, TINY, cli, env, metrics, run, start, wait_for

from taco_jax import launch as launch_mod
from taco_jax.cli import config_from_argv, main

pytestmark = pytest.mark.fast


def test_final_checkpoint_is_the_default_with_an_opt_out(tmp_path, capsys):
    """`train --help` offers --no-final-checkpoint; the flag and a config file's key turn it off. (The final
    checkpoint of a run and `sample --from` on it: test_distributed.py::test_two_processes_match_one.)"""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--no-final-checkpoint" in capsys.readouterr().out
    (tmp_path / "c.toml").write_text("final_checkpoint = false\n")
    assert config_from_argv(["train"]).checkpoint.final_checkpoint is True
    assert config_from_argv(["train", "--no-final-checkpoint"]).checkpoint.final_checkpoint is False
    assert config_from_argv(["train", "--config", str(tmp_path / "c.toml")]).checkpoint.final_checkpoint is False


@pytest.mark.slow
def test_train_on_in_memory_tokens_without_a_tokenizer(tmp_path, capsys):
    """`train()` on a `TextDataset` of the caller's own token arrays with `tokenizer_path=""`: the run
    trains (nothing to copy: no tokenizer.json) and ends with its final checkpoint. Its validation
    split holds 3 batches, fewer than --eval-batches 5: said at the start, and evaluated on those 3.
    A second run in a folder holding a run's results says that it replaces them; an --export-hf that
    cannot receive the export is refused before anything is built."""
    from taco_jax.data import TextDataset
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.loop import prepare, train

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=4096).astype(np.int32)
    ds = TextDataset(train=tokens, val=tokens[:1024], vocab_size=300, eot_id=0, tokenizer_path="", val_plays=())
    out = tmp_path / "run"
    cfg = TrainConfig.from_flags(model="gpt2-tiny", batch_size=8, seq_len=32, steps=2, eval_every=100,
                                 eval_batches=5, out=str(out))
    summary = train(cfg, dataset=ds, progress=False)
    assert [r["step"] for r in metrics(out)] == [1, 2] and math.isfinite(summary["final_val_loss"])
    assert not (out / "tokenizer.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["2"]
    assert "warning: --eval-batches 5, but the validation split holds 3 batches of 8 x 32 tokens: each " \
           "evaluation uses those 3" in capsys.readouterr().err
    again = tmp_path / "again"
    again.mkdir()
    (again / "summary.json").write_text("{}")
    (again / "metrics.jsonl").write_text("")
    prepare(cfg.replace(out=str(again)), dataset=ds)
    assert f"out={str(again)!r} holds a previous run's summary.json, metrics.jsonl: this run replaces them " \
           "(give another --out to keep them)" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    third = str(tmp_path / "third")
    for export, match in ((third, r"export_hf=.* is the run's --out folder: the Hugging Face config.json would "
                                  r"replace the run's"),
                          (str(tmp_path / "file"), r"export_hf=.* is an existing file; .*\(set by --export-hf or "
                                                   r"\[checkpoint\] export_hf\)")):
        with pytest.raises(ValueError, match=match):
            prepare(cfg.replace(out=third, export_hf=export), dataset=ds)


def test_an_export_into_another_run_s_folder_is_refused_unless_told(tmp_path):
    """--export-hf outside the run's --out: a folder inside another run's folder, or one holding an HF
    checkpoint that is not this run's export (another run's, by its record, or one without a record),
    is refused before anything runs, naming the folder and --overwrite-export (nothing created); this
    run's own export (inside --out, or recorded with this --out: a resumed run) and any folder with
    --overwrite-export are accepted."""
    from taco_jax.models.hf import EXPORT_RECORD
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.loop import check_export_dir
    from taco_jax.util import jsonio

    first, other = tmp_path / "a", tmp_path / "c"
    first.mkdir()
    jsonio.write(first / "config.json", TrainConfig.from_flags(out=str(first)).to_dict())  # a run's folder

    def export(folder, run=None):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        if run is not None:
            (folder / EXPORT_RECORD).write_text(json.dumps({"step": 2, "run": str(run)}))

    export(first / "hf", first)
    export(tmp_path / "exports" / "a", first)
    export(tmp_path / "exports" / "plain")
    allow = (r"give a folder of this run \(e\.g\. --export-hf '\{out\}/hf': inside --out\) or --overwrite-export to "
             r"write there anyway \(set by --export-hf or \[checkpoint\] export_hf\)$")
    inside = rf"lies in '{first}', the folder of another run \(this run's --out is '{other}'\): the export would " \
             "write into it"
    for folder, why in ((first / "hf", inside), (first / "new", inside),
                        (tmp_path / "exports" / "a", rf"already holds the export of run '{first}' \(step 2\): this "
                                                     "run would replace it"),
                        (tmp_path / "exports" / "plain", "already holds a Hugging Face checkpoint: this run would "
                                                         "replace it")):
        cfg = TrainConfig.from_flags(out=str(other), export_hf=str(folder))
        with pytest.raises(ValueError, match=rf"^export_hf='{folder}' {why}; {allow}"):
            check_export_dir(cfg)
        assert folder.exists() == (folder.name != "new")  # nothing created
        check_export_dir(cfg.replace(overwrite_export=True))
    for out, folder in ((first, first / "hf"), (first, tmp_path / "exports" / "a"), (other, other / "hf")):
        check_export_dir(TrainConfig.from_flags(out=str(out), export_hf=str(folder), resume=True))


def _shadowing_folder(tmp_path) -> pathlib.Path:
    """A working directory holding a `taco_jax` package without `__version__` (as the folder that holds
    a clone named taco_jax does): it comes first on the path of `python -m` started there."""
    cwd = tmp_path / "cwd"
    (cwd / "taco_jax").mkdir(parents=True)
    (cwd / "taco_jax" / "__init__.py").write_text("")
    return cwd


@pytest.mark.procs
def test_launch_from_a_folder_holding_another_taco_jax(tmp_path):
    """The launcher (here `python -P`, as the console script: no working directory on its path) started
    in a folder holding another `taco_jax`: its processes import the launcher's package; the package's
    folder goes first on their PYTHONPATH unless it is there already. `python -m taco_jax` is the same
    command."""
    cwd = _shadowing_folder(tmp_path)
    r = subprocess.run([sys.executable, "-P", "-m", "taco_jax.cli", "launch", "--processes", "2", "--", "--version"],
                       cwd=cwd, env=env(tmp_path / "cache"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert sorted(line for line in r.stdout.splitlines() if "taco-jax" in line) == ["[0] taco-jax 0.1.0",
                                                                                     "[1] taco-jax 0.1.0"]
    assert launch_mod.child_env({})["PYTHONPATH"] == str(ROOT)
    assert launch_mod.child_env({"PYTHONPATH": f"{ROOT}/"})["PYTHONPATH"] == f"{ROOT}/"
    r = subprocess.run([sys.executable, "-m", "taco_jax", "--version"], cwd=ROOT, env=env(tmp_path / "cache"),
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "taco-jax 0.1.0"), r.stderr[-3000:]


def test_launch_reads_the_mesh_of_a_config_file(tmp_path):
    """The launcher resolves the command's mesh as `train` does (`--config` file, then the flags): a
    tensor axis spanning two nodes is refused from a config file as from --mesh; a mesh whose size the
    process count does not divide is refused naming both (not an XLA_FLAGS hint from the processes)."""
    toml = tmp_path / "run.toml"
    toml.write_text('mesh = "tensor=2,data=4"\n')
    with pytest.raises(ValueError, match=r"mesh tensor=2,data=4 puts a tensor group on processes of different nodes"):
        launch_mod.launch(4, ["train", "--config", str(toml)], config_of=config_from_argv,
                          link="intra=8gbit,inter=1gbit", nodes=2)
    with pytest.raises(ValueError, match=r"mesh data=2,tensor=4 has 8 devices, not divisible by --processes 3"):
        launch_mod.launch(3, ["train"], config_of=config_from_argv)
    with pytest.raises(ValueError, match=r"mesh data=1,tensor=2 has 2 devices, not divisible by --processes 4"):
        launch_mod.launch(4, ["train", "--config", str(toml), "--mesh", "data=1,tensor=2"],
                          config_of=config_from_argv)  # the flag wins


def test_gloo_connection_lines_are_dropped_even_when_interleaved():
    """Gloo's threads write their connection message unsynchronised: a line holding pieces of two, or
    the rest of one, is still recognised, whatever numbers its interleaving puts between the pieces;
    one whole message with a missing peer, or anything else, is kept."""
    msg = "is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    for line in (f"[Gloo] Rank 1 {msg}\n", f"[Gloo] Rank [Gloo] Rank 1 {msg}\n", f"0 {msg}\n",
                 f"[Gloo] Rank 0 {msg}[Gloo] Rank 1 {msg}\n",
                 "[Gloo] Rank 2 is connected to 7 peer ranks. [Gloo] Rank 1 is connected to [Gloo] Rank 3 is "
                 "connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n",
                 "7Expected number of connected peer ranks is : 7\n", " peer ranks. Expected number of connected "
                 "peer ranks is : 7\n",
                 "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
                 "is : 0 is connected to [Gloo] Rank 11 peer ranks. \n"):  # seen in CI: two messages interleaved
        assert launch_mod._gloo_connected_only(line), line
    for line in ("[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1\n",
                 f"[Gloo] Rank 1 {msg} step 3\n", "[taco-jax] step 1/3 loss 7.6\n", "\n"):
        assert not launch_mod._gloo_connected_only(line), line


def test_peer_stopped_during_evaluation_is_named_within_the_auto_limit(tmp_path, cache):
    """2 processes launched from a folder holding another `taco_jax`, their mesh from a `--config` file
    (data=1,tensor=2: one device each), `--step-timeout auto`. Process 1 stops itself (SIGSTOP) at the
    evaluation after step 2: process 0's watchdog, armed around each evaluation batch, ends the run
    with a `taco-jax: error` line naming process 1 within the auto limit + 10 s. Gloo's connection
    lines are left out of the launcher's output."""
    cwd = _shadowing_folder(tmp_path)
    (cwd / "run.toml").write_text('mesh = "data=1,tensor=2"\nstep_timeout = "auto"\nsteps = 3\n')
    log = tmp_path / "log"
    cmd = [sys.executable, "-P", "-m", "taco_jax.cli", "launch", "--processes", "2", "--", "train", *TINY,
           "--config", "run.toml", "--eval-every", "1", "--eval-batches", "2", "--no-progress", "--out", "run"]
    p = subprocess.Popen(cmd, cwd=cwd, env=env(cache, TACO_JAX_TEST_STALL="1:eval@2:stop"), stdout=open(log, "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_stop = wait_for(lambda: "process 1 stops itself (SIGSTOP)" in log.read_text(), p, timeout=400,
                          what="process 1 stopping itself", log=log)
        assert p.wait(timeout=200) == 1, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: the launcher and its processes
    elapsed = time.monotonic() - t_stop
    text = log.read_text()
    err = next(line for line in text.splitlines() if "taco-jax: error" in line)
    assert err.startswith("[0] taco-jax: error: evaluation after step 2 (batch 1 of 2) did not finish within "
                          "--step-timeout auto ("), err
    assert re.search(r"stopped answering: process 1 \(no heartbeat", err), err
    limit = float(re.search(r"--step-timeout auto \(([\d.]+) s\)", err)[1])
    assert elapsed <= limit + 10, (elapsed, err)
    assert [r["step"] for r in metrics(cwd / "run")] == [1]  # step 2's record follows its evaluation
    assert "[0] [taco-jax] gpt2-tiny on mesh data=1,tensor=2" in text
    assert "[Gloo]" not in text and "Fatal Python error" not in text
    print(f"SIGSTOP at evaluation -> launcher exit: {elapsed:.1f} s (auto limit {limit} s)")


def test_watchdog_guard_limits():
    """`StepWatchdog.guard`: the step limit; the first work of a kind (it compiles, or opens files) and
    work before any step get the first step's; file work adds its bytes at `IO_FLOOR_BYTES_PER_S`."""
    from taco_jax.train.distributed import IO_FLOOR_BYTES_PER_S, StepWatchdog

    w = StepWatchdog(2.0)  # first step: 10 × 2 s
    try:
        with w.guard("export to x", 0, kind="export"):
            assert (w._limit, w._what) == (20.0, "export to x")  # before any step
        w.start(1)
        w.done()
        for first in (True, False):
            with w.guard("evaluation after step 1 (batch 1 of 2)", 1, kind="eval"):
                assert w._limit == (20.0 if first else 2.0) and w._step == 1
            assert w._step is None  # disarmed after it
        with w.guard("checkpoint of step 1", 1, kind="checkpoint", nbytes=IO_FLOOR_BYTES_PER_S):
            assert w._limit == 21.0
        with w.guard("checkpoint of step 1 (completing)", 1, kind="checkpoint", nbytes=IO_FLOOR_BYTES_PER_S):
            assert w._limit == 3.0
    finally:
        w.close()


def test_make_train_twice_replaces_its_own_compare_outputs(tmp_path):
    """`make train` a second time removes the previous run's compare outputs (one printed line) and
    keeps other files; the `compare` it runs gets the same --out. (`install` is taken as done; the
    venv's `taco-jax` is a script recording what it saw.)"""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "taco-jax"
    script.write_text('#!/bin/sh\necho "$@" > "$SEEN"; ls -A "$3" >> "$SEEN"; mkdir -p "$3/none/checkpoints"\n')
    script.chmod(0o755)
    out = tmp_path / "cmp"
    seen = tmp_path / "seen.txt"

    def make_train():
        return subprocess.run(["make", "--no-print-directory", "-o", "install", "train", f"VENV={venv}",
                               f"OUT={out}", "ARGS=--steps 3"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "SEEN": str(seen)}, timeout=60)

    first = make_train()
    assert first.returncode == 0, first.stderr
    assert "replacing" not in first.stdout
    for name in ("taco/checkpoints", "summary.json", "loss.png", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x") if "." in name else (out / name).mkdir()
    second = make_train()
    assert second.returncode == 0, second.stderr
    assert second.stdout.count(f"make train: replacing the previous run in {out}") == 1
    args, *listing = seen.read_text().splitlines()
    assert args == f"compare --out {out} --steps 3"
    assert listing == ["notes.txt"]  # what compare found: the earlier outputs gone, the other file kept


def test_cpu_shares_split_the_launchers_cpus():
    """`launch --pin-cpus`: contiguous shares, the first ones one CPU larger; more processes than
    CPUs wrap around (they share); nothing to split is refused."""
    assert launch_mod.cpu_shares(2, [0, 1]) == [{0}, {1}]
    assert launch_mod.cpu_shares(2, [4, 0, 2, 1, 3]) == [{0, 1, 2}, {3, 4}]
    assert launch_mod.cpu_shares(3, [0, 1, 2, 3]) == [{0, 1}, {2}, {3}]
    assert launch_mod.cpu_shares(4, [0, 1]) == [{0}, {1}, {0}, {1}]
    assert launch_mod.cpu_shares(1, [0, 1]) == [{0, 1}]
    with pytest.raises(ValueError, match=r"processes >= 1 and CPUs \(got 0"):
        launch_mod.cpu_shares(0, [0, 1])
    with pytest.raises(ValueError, match=r"\(got 2, \[\]\)"):
        launch_mod.cpu_shares(2, [])


def test_pinned_processes_start_on_their_share():
    """Each process starts with its share as its CPU affinity (set before exec, so the namespace
    wrapper and python inherit it); without shares, every CPU the launcher has."""
    import io

    def cpus(text):  # "0-2,5" -> {0, 1, 2, 5}
        return {c for part in text.split(",") for a, _, b in [part.partition("-")]
                for c in range(int(a), int(b or a) + 1)}

    report = ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"]  # the cli command follows as sh's $0.., unread
    for shares in (launch_mod.cpu_shares(2), None):
        out = io.StringIO()
        status = launch_mod._run(2, ["--version"], dict(os.environ), "127.0.0.1:1", lambda i: report, 5.0, out,
                                 shares=shares)
        assert status == 0, out.getvalue()
        got = {int(m[1]): cpus(m[2]) for m in re.finditer(r"\[(\d)\] Cpus_allowed_list:\s*(\S+)", out.getvalue())}
        assert got == {i: (shares[i] if shares else os.sched_getaffinity(0)) for i in range(2)}, out.getvalue()


def test_a_pinned_run_reports_and_records_its_cpus(tmp_path, cache):
    """`launch --pin-cpus -- train`: the launcher prints each process's share; process 0's summary.json
    records the CPUs it ran on (its share), an unpinned run all of the launcher's."""
    shares = launch_mod.cpu_shares(2)
    for pin in (True, False):
        out = tmp_path / f"pin{pin}"
        r = run(cli("launch", "--processes", "2", *(["--pin-cpus"] if pin else []), "--", "train", *TINY,
                    "--steps", "1", "--mesh", "data=1,tensor=2", "--out", out), cache)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["process_cpus"] == sorted(shares[0] if pin else os.sched_getaffinity(0))
        assert ("[launch] CPUs: process 0 on " in r.stdout) == pin, r.stdout[-2000:]
    assert launch_mod._cpu_list({0, 1, 2, 5}) == "CPUs 0-2,5" and launch_mod._cpu_list({3}) == "CPU 3"


def test_an_exported_device_count_gives_way_to_the_run_s_flags(tmp_path, cache):
    """Issue 52, 7: an exported XLA_FLAGS device count no longer beats the explicit flags. `plan
    --devices 2` under a count of 1 (refused before: "give --devices 2") and `launch --processes 2 --
    train --mesh data=1,tensor=2` under a count of 8 (each process got 8 devices and was refused with
    advice for one process) run, each saying in one line that the count was replaced; the launcher's
    processes then find their own count and say nothing. The other XLA_FLAGS entries are kept
    (`with_device_count`). (The launch flags are `test_a_pinned_run_reports_and_records_its_cpus`'s.)"""
    from _procs import TEST_XLA_FLAGS

    count = "--xla_force_host_platform_device_count"
    r = run(cli("plan", "--model", "gpt2-tiny", "--mesh", "data=2", "--devices", "2", "--batch-size", "8",
                "--seq-len", "32", "--out", tmp_path / "plan"), cache,
            XLA_FLAGS=f"{TEST_XLA_FLAGS} {count}=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"[taco-jax] warning: $XLA_FLAGS sets {count}=1; replaced by 2, as --devices 2 asks (the other "
            "XLA_FLAGS entries are kept)") in r.stderr.splitlines(), r.stderr[-3000:]
    out = tmp_path / "run"
    r = run(cli("train", *TINY, "--steps", "1", "--mesh", "data=1,tensor=2", "--out", out, processes=2), cache,
            XLA_FLAGS=f"{TEST_XLA_FLAGS} {count}=8")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stderr.splitlines() == [f"[launch] warning: $XLA_FLAGS sets {count}=8; each process gets 1 instead, as "
                                     "--mesh data=1,tensor=2 over --processes 2 asks (the other XLA_FLAGS entries are "
                                     "kept)"], r.stderr
    assert "$XLA_FLAGS" not in r.stdout and metrics(out)[-1]["step"] == 1
    from taco_jax.train.distributed import with_device_count

    assert with_device_count(f"--a=1 {count}=8 --b", 2) == (f"--a=1 {count}=2 --b", "8")
    assert with_device_count(f"{count}=4 --b {count}=8", 2) == (f"{count}=2 --b", "8")  # XLA takes the last
    assert with_device_count(f"--b {count}=2", 2) == (f"--b {count}=2", None)
    assert with_device_count("", 2) == (f"{count}=2", None)


@pytest.mark.parametrize("command", [["predict"], ["plan", "--no-compile"], ["sample", "--from", "r", "--prompt", "a"],
                                     ["prepare-data", "corpus", "--out", "data/x"], ["calibrate", "--captures", "c"]])
def test_launch_refuses_a_command_it_does_not_run_before_any_process_starts(command, capsys):
    """Issue 52, 8: `launch -- predict|plan|sample|prepare-data|calibrate` started processes that died on the
    `--coordinator` the launcher gives them. Refused (exit 2) naming the command and the commands launch
    runs, before any process starts (this test is `fast`: a child process would fail it)."""
    assert main(["launch", "--processes", "2", "--", *command]) == 2
    assert capsys.readouterr().err == (f"taco-jax: error: launch runs train and compare (the commands that join a "
                                       f"multi-process run), not {command[0]}: run `taco-jax {command[0]} ...` "
                                       "without launch (one process)\n")


def test_sigterm_during_compilation_stops_a_one_process_run_in_one_line(tmp_path, cache):
    """Issue 52, 13: SIGTERM to a one-process `train` while it compiles (here: its own empty compilation
    cache, so compiling takes seconds; the signal comes once the first program is in it, i.e. the
    parameter initializer compiled and the train step's compilation ahead) ended it within a second
    and without a word. It still ends at once (nothing is trained, so nothing to save), now with one
    line saying where it was and what is kept, exit status 143 (128 + SIGTERM) and no crash of XLA's
    cut-short compilation at the exit. A resumed run's line names its checkpoint (`hooks.kept`)."""
    from taco_jax.train import hooks

    cold, out, log = tmp_path / "cold-cache", tmp_path / "run", tmp_path / "log"
    cold.mkdir()
    p = start(cli("train", *TINY, "--steps", "2", "--no-progress", "--out", out), cold, log)
    try:
        wait_for(lambda: any(cold.iterdir()), p, timeout=300, what="the first compiled program", log=log)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        status = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    lines = log.read_text().splitlines()
    assert status == 143, lines[-20:]
    assert lines[-1] == "taco-jax: stopped by SIGTERM during compilation, before step 1: nothing trained, no " \
                        "checkpoint saved", lines[-20:]
    assert elapsed < 15 and not (out / "metrics.jsonl").exists(), elapsed
    print(f"SIGTERM during compilation -> exit in {elapsed:.2f} s")
    for step in (2, 4):  # a resumed run's: the newest complete checkpoint (a save in flight is not one)
        (out / "checkpoints" / str(step)).mkdir(parents=True)
    (out / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
    stop = hooks.StopBeforeSteps(out)
    stop.phase = "the restore of its checkpoint"
    with pytest.raises(hooks.Stopped) as e:
        stop._on_sigterm(signal.SIGTERM, None)
    assert str(e.value) == ("stopped by SIGTERM during the restore of its checkpoint, before step 5: nothing new "
                            f"saved; the latest checkpoint is {out / 'checkpoints' / '4'} (continue with --resume)")
    stop.phase = None  # the steps began: the Preemption hook's handler decides
    stop._on_sigterm(signal.SIGTERM, None)
