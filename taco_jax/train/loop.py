"""The training loop (nanoGPT-style, reads top to bottom): prepare -> compile and account -> loop -> summarize.

Everything beside the step itself (watchdog, capture, monitor, evaluation, metrics log, progress,
preemption, checkpoints, profile, TensorBoard) is a per-step hook (`train/hooks.py`)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.collectives.hlo import collective_bytes
from taco_jax.collectives.policy import SITES, CommPolicy
from taco_jax.data import TokenStream, check_data, check_resumed_data, data_label, eval_batches, training_data
from taco_jax.models import count_params
from taco_jax.models.hf import EXPORT_RECORD, read_config, read_record, save_hf
from taco_jax.parallel.mesh import DATA, MESH_AXES, STAGE
from taco_jax.parallel.pipeline import schedule_stats
from taco_jax.train import capture, hooks, tensorboard
from taco_jax.train import distributed as dist
from taco_jax.train.checkpoint import Checkpoints, saved_steps
from taco_jax.train.comm_flags import AXIS_SITES
from taco_jax.train.config import OUT_DIR, TrainConfig, flag_values
from taco_jax.train.monitor import Monitor
from taco_jax.train.plots import plot_losses, plot_monitor
from taco_jax.train.profile import ProfileSteps, profile_dir
from taco_jax.train.step import Trainer, compiled_memory, lr_schedule, make_trainer
from taco_jax.util import jsonio
from taco_jax.util.console import rel, say


def train(cfg: TrainConfig, *, dataset=None, progress: bool = True, devices=None) -> dict:
    """Trains `cfg.model.name` on Shakespeare or `cfg.data.path`; writes `config.json`, `metrics.jsonl`,
    `summary.json` and `loss.png` to `cfg.checkpoint.out` (strict JSON, `util/jsonio.py`).

    Returns the summary: final losses, tokens/s, the policy that ran (backends resolved) and the compiled step's
    wire bytes per step by mesh axis (`collectives.hlo.collective_bytes`). `progress`: a progress bar on a terminal,
    else a line every `cfg.logging.log_every` steps. `devices`: the mesh's devices (default all). `dataset`: e.g. a
    `TextDataset` of the caller's own token arrays (`tokenizer_path=""`: no tokenizer.json in the run folder).
    Multi-process: every process runs this and builds only its rows of the batches; process 0 writes the files. A
    run that ends normally leaves a checkpoint at its last step (unless `final_checkpoint` is off); SIGTERM ends it
    at the next step boundary with a checkpoint and a summary holding "preempted_at_step" (`train/hooks.py`,
    `train/checkpoint.py`).
    Raises: ValueError for a configuration that cannot run or an output folder that cannot be written (before
    anything is compiled); CheckpointError naming what differs; FloatingPointError for a non-finite loss or gradient
    norm (naming the step; unless `cfg.training.allow_nonfinite`) or, with a codec `nonfinite="error"`, a message
    holding NaN/Inf (naming the site); `hooks.Stopped` (its text the line to print) when a one-process run gets
    SIGTERM before its first step."""
    with hooks.StopBeforeSteps(cfg.checkpoint.out) as stop:  # SIGTERM before the first step: stopped at once
        return _train(cfg, dataset, progress, devices, stop)


def _train(cfg: TrainConfig, dataset, progress: bool, devices, stop: hooks.StopBeforeSteps) -> dict:
    run = prepare(cfg, dataset, devices)  # 1. everything checked before anything is compiled
    stop.phase = "compilation"
    state = initial_state(run)  # same initial parameters for every --comm (same seed)
    if (done := finished_summary(run)) is not None:  # --resume of a run that reached cfg.training.steps
        return done
    acct = compile_step(run, state)  # 2. compile once; wire bytes and memory from the compiled program
    stop.phase = "the restore of its checkpoint" if run.resuming else "start-up"
    resume(run, acct, state)  # from the latest checkpoint with --resume; the first batch
    lrs = np.asarray(lr_schedule(cfg)(np.arange(cfg.training.steps)))  # the learning rate of step k: lrs[k - 1]
    with make_hooks(run, acct, state, progress) as run_hooks:  # 3. the loop
        stop.phase = None  # SIGTERM from here: the Preemption hook's (a checkpoint at the next step boundary)
        t_start = time.perf_counter()
        for step in range(state.start + 1, cfg.training.steps + 1):
            extra = run_hooks.before_step(state, step)  # capture, monitor (this step's batch)
            t = time.perf_counter()
            state.params, state.opt_state, m = acct.train_step(state.params, state.opt_state, state.inputs,
                                                               state.targets)
            loss = float(m["loss"])  # blocks: the step time below is real
            dt = time.perf_counter() - t
            rec = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(lrs[step - 1]),
                   "step_s": dt, "tokens_per_s": run.tokens_per_step / dt, **extra}
            run_hooks.on_step(state, step, rec)  # evaluate, log, checks, progress, checkpoint
            if state.preempted:
                break
            if step < cfg.training.steps:
                state.inputs, state.targets = run.batches.next(run.batch_sharding)
        ends = run_hooks.end(state)  # the final checkpoint complete
        wall = time.perf_counter() - t_start
        if cfg.checkpoint.export_hf:  # also on SIGTERM (the weights of the step it stopped at)
            write_export(run, state, run_hooks.guard)
    return summarize(run, acct, state, wall, ends)  # 4.


def write_export(run: Run, state: hooks.RunState, guard) -> None:
    """The HF export of the run's weights (`save_hf`; every process calls it) to `cfg.checkpoint.export_dir`,
    recording the step and the run (`models.hf.EXPORT_RECORD`). `guard`: `StepWatchdog.guard`."""
    cfg = run.cfg
    folder = cfg.checkpoint.export_dir
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    last = state.history[-1]["step"] if state.history else 0
    record = {"step": last, "steps": cfg.training.steps, "preempted": bool(state.preempted),
              "run": str(run.out.resolve())}
    with guard(f"export to {folder}", last, kind="export", nbytes=nbytes):
        save_hf(folder, cfg.model_config, state.params,
                stacked_key=run.trainer.staged.layer_key if run.trainer.staged else None,  # a layer at a time
                base_config=read_config(cfg.model.init_from) if cfg.model.init_from else None,
                source=cfg.model.init_from or None, tokenizer=run.dataset.tokenizer_path or None,
                eos_token_id=run.dataset.eot_id, record=record)
    why = f", the step SIGTERM stopped the run at (of steps={cfg.training.steps})" if state.preempted else ""
    say(f"[taco-jax] HF export of step {last}{why} written to {rel(folder, run.out)} "
        f"({rel(pathlib.Path(folder) / EXPORT_RECORD, run.out)} records the step)")


@dataclasses.dataclass
class Run:
    """A prepared run: its config, output folder, trainer, data and checkpoints (`prepare`)."""

    cfg: TrainConfig
    out: pathlib.Path
    writer: bool  # this process writes the run's files (process 0)
    trainer: Trainer
    dataset: object
    batches: TokenStream
    batch_sharding: NamedSharding
    ckpt: Checkpoints
    resuming: bool  # --resume with a checkpoint present: from the newest intact one

    @property
    def vocab(self) -> tuple[int, int]:
        """(vocabulary, padded rows) of this run: a checkpoint saved with other padding is re-padded."""
        return self.cfg.model_config.vocab_size, self.cfg.model_config.padded_vocab_size

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.data.batch_size * self.cfg.data.seq_len


@dataclasses.dataclass
class Accounting:
    """The compiled train step and what was read off it before the first step (`compile_step`)."""

    train_step: object  # the compiled step: (params, opt_state, inputs, targets) -> (params, opt_state, metrics)
    compile_s: float
    wire: dict  # `collective_bytes` of the compiled HLO
    issued: dict  # the same of the uncompiled HLO (before the backend's dtype rewrites)
    memory: dict | None  # `compiled_memory`


def prepare(cfg: TrainConfig, dataset=None, devices=None) -> Run:
    """The output folder, mesh, model, optimizer, data and checkpoint folder of a run, each checked
    (raises ValueError / CheckpointError as `train`)."""
    out = check_out_dir(cfg.checkpoint.out)
    check_resumable(cfg)  # before anything is printed or built
    check_export_dir(cfg)
    if not cfg.checkpoint.resume and dist.is_writer() and (old := previous_outputs(out)):
        say(f"[taco-jax] out={str(out)!r} holds a previous run's {', '.join(old)}: this run replaces them "
            "(give another --out to keep them)")
    if cfg.logging.capture and jax.process_count() > 1:
        raise ValueError(f"capture={cfg.logging.capture} records on one process; run it without --num-processes")
    if cfg.logging.tensorboard:
        tensorboard.check_available()
    trainer = make_trainer(cfg, devices)
    source = f" from {cfg.model.init_from}" if cfg.model.init_from else ""
    policy = describe_policy(trainer.policy, cfg.parallelism.axes)
    say(f"[taco-jax] {cfg.model.name}{source} on mesh {cfg.parallelism.mesh}: {policy}"
        + (f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""))
    if note := cfg.vocab_note():  # a published preset's own vocabulary, or --data's
        say(f"[taco-jax] {note}")
    ds = dataset or training_data(cfg.data.path, cfg.bpe_vocab_size)  # --data DIR (memory-mapped) or Shakespeare
    vocab = cfg.model_config.vocab_size
    check_data(ds, vocab if cfg.data.path else min(cfg.model.vocab_size, vocab), cfg.model.init_from,
               batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len)  # vocabulary, tokenizer, split sizes
    ckpt = Checkpoints(out / "checkpoints", keep=cfg.checkpoint.keep_checkpoints)
    saved = ckpt.steps()
    if cfg.checkpoint.resume and not saved:
        say(f"[taco-jax] --resume: no checkpoint in {rel(ckpt.directory, out)}; starting from step 0")
    if cfg.checkpoint.resume and saved and (note := check_resumed_data(ds, out, cfg.data.path, recorded_data(out))):
        say(f"[taco-jax] {note}")  # the run's tokenizer and data against the data given now
    batch_sharding = NamedSharding(trainer.mesh, P(*(a for a in (DATA,) if a in trainer.mesh.axis_names)))
    batches = TokenStream(ds.train, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.training.seed)  # training batches
    resuming = bool(cfg.checkpoint.resume and saved)
    return Run(cfg, out, dist.is_writer(), trainer, ds, batches, batch_sharding, ckpt, resuming)


def initial_state(run: Run) -> hooks.RunState:
    """The run's initial parameters and optimizer state (`Trainer.init`); with a checkpoint to
    resume, checked against it first (CheckpointError naming what differs)."""
    params, opt_state = run.trainer.init()
    if run.resuming:  # CheckpointError naming what differs, before compiling (checkpoint metas only)
        run.ckpt.resume(run.cfg.to_dict(), params, opt_state, vocab=run.vocab,
                        fallback=run.cfg.checkpoint.resume_fallback, arrays=False)
    return hooks.RunState(params, opt_state, None, None)


def finished_summary(run: Run) -> dict | None:
    """With `--resume` of a finished run (newest checkpoint at `cfg.training.steps` or later, and a
    `summary.json`): that summary, unchanged. None otherwise (the run resumes as usual)."""
    latest = run.ckpt.steps()[-1] if run.resuming else 0
    summary = run.out / "summary.json"
    if not run.resuming or latest < run.cfg.training.steps or not summary.exists():
        return None
    run.ckpt.close()
    say(f"[taco-jax] --resume: {rel(run.ckpt.directory / str(latest), run.out)} is at step {latest} of "
        f"steps={run.cfg.training.steps}; the run is finished, nothing to do ({rel(summary, run.out)} left as it "
        "is; a larger --steps continues it)")
    return json.loads(summary.read_text())


def recorded_data(out: pathlib.Path) -> str | None:
    """The data folder a run in `out` recorded in its config.json ("" = Shakespeare), or None when it
    records none (no or unreadable config.json)."""
    try:
        return flag_values(json.loads((out / "config.json").read_text())).get("data", "")
    except (OSError, ValueError):
        return None


def compile_step(run: Run, state: hooks.RunState) -> Accounting:
    """Compiles the train step once, from the initial arrays (a resumed run runs the same program),
    and reads the collectives' wire bytes and the memory off the compiled program."""
    cfg, trainer = run.cfg, run.trainer
    t0 = time.perf_counter()
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), np.int32, sharding=run.batch_sharding)
    lowered = trainer.train_step.lower(state.params, state.opt_state, batch, batch)
    train_step = lowered.compile()
    compile_s = time.perf_counter() - t0
    # before the backend's dtype rewrites (XLA:CPU promotes a bf16 all-reduce to f32)
    issued = collective_bytes(lowered.as_text(dialect="hlo"), trainer.mesh)
    return Accounting(train_step, compile_s, collective_bytes(train_step.as_text(), trainer.mesh), issued,
                      compiled_memory(train_step))  # memory per device; temp = activations (what --remat lowers)


def resume(run: Run, acct: Accounting, state: hooks.RunState) -> None:
    """With a checkpoint to resume: its arrays, data position and metrics records into `state`
    (placed as the compiled step returns them). Then `config.json` written and the first batch drawn."""
    out = run.out
    if run.resuming:
        state.start, state.params, state.opt_state, meta, notes, warnings = run.ckpt.resume(
            run.cfg.to_dict(), state.params, state.opt_state, shardings=acct.train_step.output_shardings[:2],
            vocab=run.vocab, fallback=run.cfg.checkpoint.resume_fallback)
        state.resume_notes = notes
        for w in warnings:  # corrupt newer checkpoints skipped (renamed aside, not deleted)
            say(f"[taco-jax] warning: {w}")
        run.batches.restore(meta["data"])
        if (out / "metrics.jsonl").exists():
            state.history = [r for r in jsonio.read_metrics(out / "metrics.jsonl") if r["step"] <= state.start]
        state.val_loss = next((r["val_loss"] for r in reversed(state.history) if "val_loss" in r), None)
        say(f"[taco-jax] resumed from {rel(run.ckpt.directory / str(state.start), out)} (step {state.start})"
            + "".join(f"; {n}" for n in notes))
    if run.writer:
        jsonio.write(out / "config.json", run.cfg.to_dict())
        if run.dataset.tokenizer_path:  # none for a library caller's own token arrays
            shutil.copyfile(run.dataset.tokenizer_path, out / "tokenizer.json")  # the run's tokenizer (`sample`)
    state.inputs, state.targets = run.batches.next(run.batch_sharding)


def make_hooks(run: Run, acct: Accounting, state: hooks.RunState, progress: bool) -> hooks.Hooks:
    """The run's hooks, outermost first (`train/hooks.py`: `on_step` runs them innermost first)."""
    cfg, trainer = run.cfg, run.trainer
    metrics = run.out / "metrics.jsonl"
    monitor = Monitor.start(cfg, trainer) if cfg.logging.monitor_every else None  # train --monitor-every N
    if monitor and not monitor.sites:
        say("[taco-jax] --monitor-every: no tensor site is compressed (or no tensor axis); nothing to monitor")
    val = [dist.global_arrays(run.batch_sharding, x, y) for x, y in
           eval_batches(run.dataset.val, cfg.data.batch_size, cfg.data.seq_len, max_batches=cfg.logging.eval_batches)
           ] if cfg.logging.eval_batches else []  # --eval-batches 0: no evaluation (no eval step is compiled)
    if len(val) < cfg.logging.eval_batches:
        say(f"[taco-jax] warning: --eval-batches {cfg.logging.eval_batches}, but the validation split holds "
            f"{len(val)} batches of {cfg.data.batch_size} x {cfg.data.seq_len} tokens: each evaluation uses those "
            f"{len(val)}")
    watchdog = dist.StepWatchdog(cfg.communication.step_timeout, wire_bytes=sum(acct.wire["by_axis"].values()),
                                 link=dist.emulated_link(cfg.communication.emulated_link))

    def evaluate(params, step):
        losses = []
        for k, (vx, vy) in enumerate(val):  # each batch's collectives under the watchdog, as a step's
            with watchdog.guard(f"evaluation after step {step} (batch {k + 1} of {len(val)})", step, kind="eval",
                                stall=f"eval@{step}" if k == 0 else ""):
                losses.append(float(trainer.eval_step(params, vx, vy)))
        return float(np.mean(losses))

    checked = any(getattr(trainer.policy, s).nonfinite == "error" for s in SITES)  # codec nonfinite="error"
    steps = cfg.training.steps
    return hooks.Hooks([
        hooks.Checkpoint(run.ckpt, run.batches, cfg.checkpoint.checkpoint_every, steps, cfg.to_dict(), run.out,
                         final=cfg.checkpoint.final_checkpoint, guard=watchdog.guard),
        hooks.Preemption(),
        hooks.Progress(cfg.communication.label, state.start, steps, cfg.logging.log_every, progress and run.writer),
        tensorboard.TensorBoard(run.out / "tensorboard", acct.wire["by_axis"], start=state.start)
        if cfg.logging.tensorboard and run.writer else None,
        hooks.MonitorCheck(monitor, rel(metrics, run.out)) if monitor else None,
        hooks.MetricsLog(metrics, run.out, state.history, run.writer, cfg.training.allow_nonfinite),
        hooks.Evaluate(evaluate, cfg.logging.eval_every, steps, cfg.training.allow_nonfinite) if val else None,
        hooks.CodecErrors() if checked else None,
        hooks.Capture(capture.Recorder.start(cfg, run.out, trainer)) if cfg.logging.capture else None,
        hooks.MonitorMeasure(monitor) if monitor else None,
        ProfileSteps(*cfg.profile_range(), profile_dir(cfg)) if cfg.logging.profile_steps else None,
        hooks.Watchdog(watchdog),
    ], guard=watchdog.guard)


def summarize(run: Run, acct: Accounting, state: hooks.RunState, wall: float, ends: dict) -> dict:
    """The run's summary (returned by `train`; process 0 writes it to `summary.json` and the plots).
    `ends`: the hooks' entries (captures, monitor)."""
    cfg, policy, history, start = run.cfg, run.trainer.policy, state.history, state.start
    backends = sorted({getattr(policy, s).backend for s in SITES if getattr(policy, s).kind == "taco"})
    summary = {
        "comm": cfg.communication.label,
        "backend": backends[0] if len(backends) == 1 else (backends or None),  # of the taco codecs, resolved
        "compressed_axes": compressed_axes(policy, acct.wire["detail"]),
        "policy": policy.to_dict(),
        "model": cfg.model.name,
        "n_params": count_params(cfg.model_config),  # without vocabulary padding (published counts)
        "init_from": cfg.to_dict()["model"]["init_from"] or None,  # absolute, as config.json records it
        "mesh": cfg.parallelism.mesh,
        "steps": cfg.training.steps,
        "final_train_loss": float(np.mean([r["loss"] for r in history[-10:]])),
        "final_train_loss_steps": len(history[-10:]),  # the steps it averages (fewer than 10 in a short run)
        # the latest evaluation's; None with --eval-batches 0 (also when resuming a run that evaluated)
        "final_val_loss": state.val_loss if cfg.logging.eval_batches else None,
        "tokens_per_s": run.tokens_per_step * (len(history) and history[-1]["step"] - start) / wall,
        # steady state: the median training step after this run's first (no evaluation, checkpoint or warmup)
        "step_tokens_per_s": run.tokens_per_step / float(np.median([r["step_s"] for r in history[1:]]))
        if len(history) > 1 else None,
        "train_wall_s": wall,
        "compile_s": acct.compile_s,
        "dtype": cfg.model.dtype,  # compute dtype (TP messages); parameters and optimizer state are float32
        "remat": cfg.model.remat,
        "compiled_memory_bytes": acct.memory,  # per device, of the compiled train step (None: not reported)
        "wire_bytes_per_step": acct.wire["by_axis"],
        "wire_detail": acct.wire["detail"],
        "wire_bytes_per_step_issued": acct.issued["by_axis"],  # uncompiled HLO: bf16 all-reduces counted as bf16
        "wire_bytes_per_step_issued_as_f32": as_f32(acct.issued["detail"]),  # every bf16 message at 4 bytes
        "devices": f"{len(jax.devices())}x {jax.devices()[0].platform}",
        "processes": jax.process_count(),
        # the CPUs process 0 may run on (`launch --pin-cpus`: its share); None where the OS does not say
        "process_cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    if "step_timeout_auto" in ends:  # --step-timeout auto: the watchdog's limit at the end of the run
        summary["step_timeout_auto"] = ends.pop("step_timeout_auto")
    if link := dist.emulated_link(cfg.communication.emulated_link):  # `launch --link`: requested and measured rates
        summary["emulated_link"] = link.as_dict()
    if start:
        summary["resumed_from_step"] = start
        if state.resume_notes:  # config.json is this run's config: what the steps up to `start` ran with differs
            summary["resumed_with_changes"] = state.resume_notes
    if state.preempted:
        summary["preempted_at_step"] = state.preempted
    par = cfg.parallelism
    stages = par.axes.get(STAGE, 1)
    if par.pipelined:  # pipeline: schedule and its bubble (parallel/pipeline.py)
        summary["pipeline"] = {"schedule": par.schedule, "stages": stages, "microbatches": par.microbatches,
                               **schedule_stats(par.schedule, stages, par.microbatches)}
    summary.update(ends)
    if run.writer:
        write_outputs(run, summary, history)
    return summary


def write_outputs(run: Run, summary: dict, history: list[dict]) -> None:
    """`summary.json`, `loss.png` and (with monitor records) `monitor.png` in the run folder."""
    cfg, out = run.cfg, run.out
    model, mesh, comm = cfg.model.name, cfg.parallelism.mesh, cfg.communication.label
    jsonio.write(out / "summary.json", summary)
    plot_losses(out / "loss.png", {comm: out / "metrics.jsonl"}, title=f"{model} on {data_label(cfg.data.path)}, "
                f"mesh {mesh}; compressed axes: {', '.join(summary['compressed_axes']) or 'none'}")
    if any("monitor" in r for r in history):
        plot_monitor(out / "monitor.png", out / "metrics.jsonl", title=f"{model}, mesh {mesh}, {comm}: "
                     "SQNR of the compressed TP collectives")


def check_resumable(cfg: TrainConfig) -> None:
    """Raises ValueError when `<out>/checkpoints` holds checkpoints and `--resume` is not given (a run
    never overwrites another's checkpoints)."""
    if cfg.checkpoint.resume:
        return
    ckpt = pathlib.Path(cfg.checkpoint.out) / "checkpoints"
    if saved := saved_steps(ckpt):
        raise ValueError(f"{ckpt} holds checkpoints (latest step {saved[-1]}); give --resume to continue "
                         "that run, or another --out")


#: A run's result files in its folder (`train`'s and `compare`'s): a new run there replaces them.
RESULT_FILES = ("summary.json", "metrics.jsonl", "loss.png")


def previous_outputs(out) -> list[str]:
    """The result files of an earlier run in folder `out` (`RESULT_FILES`), e.g. ["summary.json"]."""
    return [f for f in RESULT_FILES if (pathlib.Path(out) / f).exists()]


def check_export_dir(cfg: TrainConfig) -> None:
    """Raises ValueError, before anything runs, when `--export-hf` cannot receive the export: an existing file, the
    run's own `--out`, or a folder that cannot be created and written (`check_out_dir`, which creates it); unless
    `--overwrite-export`, also a folder inside another run's folder (`run_folder`) or holding an HF checkpoint that
    is not this run's export (its `EXPORT_RECORD` names another `--out`)."""
    export = cfg.checkpoint.export_dir
    if not export:
        return
    where = "(set by --export-hf or [checkpoint] export_hf)"
    path, out = pathlib.Path(export).resolve(), pathlib.Path(cfg.checkpoint.out).resolve()
    if path == out:
        raise ValueError(f"export_hf={export!r} is the run's --out folder: the Hugging Face config.json would "
                         f"replace the run's; give another folder, e.g. {OUT_DIR}/hf {where}")
    if not cfg.checkpoint.overwrite_export and not path.is_relative_to(out):
        allow = (f"give a folder of this run (e.g. --export-hf '{OUT_DIR}/hf': inside --out) or --overwrite-export "
                 f"to write there anyway {where}")
        owner = next((d for d in (path, *path.parents) if run_folder(d)), None)
        if owner is not None:
            raise ValueError(f"export_hf={export!r} lies in {str(owner)!r}, the folder of another run (this run's "
                             f"--out is {str(out)!r}): the export would write into it; {allow}")
        record = read_record(path)
        held = (path / "config.json").is_file() or any(path.glob("*.safetensors"))
        if held and (record or {}).get("run") != str(out):
            whose = (f"the export of run {record['run']!r} (step {record.get('step')})" if record and "run" in record
                     else "a Hugging Face checkpoint")
            raise ValueError(f"export_hf={export!r} already holds {whose}: this run would replace it; {allow}")
    try:
        check_out_dir(export)
    except ValueError as e:
        raise ValueError(f"{str(e).replace('out=', 'export_hf=', 1)} {where}") from None


def run_folder(folder: pathlib.Path) -> bool:
    """Whether `folder` is a training run's (`train --out`): it holds a run's config.json (not an HF
    one), `checkpoints/` or a result file (`RESULT_FILES`)."""
    if (folder / "checkpoints").is_dir() or previous_outputs(folder):
        return True
    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(conf, dict) and "architectures" not in conf and ("checkpoint" in conf or "out" in conf)


def check_out_dir(out) -> pathlib.Path:
    """Creates the output folder `out` and checks that a file can be written there.
    Raises: ValueError naming `out` when it is a file, cannot be created or is not writable."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is an existing file; give a folder for the run's outputs")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"out={str(out)!r} is not a writable folder: {e.strerror or e}") from e
    return out


def describe_policy(policy: CommPolicy, axes: dict[str, int] | None = None) -> str:
    """One line per mesh axis: its sites' codecs (taco with its backend), for the start of a run. With `axes` (mesh
    axis sizes), a compressing axis that is absent or of size 1 says that it sends nothing."""
    def codec(c):
        return f"{c.name}[{c.backend}]" if c.kind == "taco" else c.name

    parts = []
    for axis, sites in AXIS_SITES.items():
        names = {s: codec(getattr(policy, s)) for s in sites}
        idle = (axes is not None and axes.get(axis, 1) <= 1
                and any(getattr(policy, s).kind != "none" for s in sites))
        parts.append(f"{axis}: " + (names[sites[0]] if len(set(names.values())) == 1 else
                                     ", ".join(f"{s}={n}" for s, n in names.items()))
                     + (f" (no {axis} axis in the mesh: nothing sent, nothing compressed)" if idle else ""))
    return "; ".join(parts) + f" (all-reduce {policy.all_reduce_algorithm}, min_bytes {policy.min_bytes})"


#: Element types of compressed wire buffers in compiled HLO (codes travel as 1-byte integers).
_CODE_DTYPES = ("u8", "s8")


def compressed_axes(policy: CommPolicy, detail: list[dict] | None = None) -> list[str]:
    """Mesh axes on which at least one site compresses, in mesh order; with `detail`
    (`collective_bytes(...)["detail"]`), only axes whose compiled step moves 1-byte codes."""
    axes = [a for a in MESH_AXES if any(getattr(policy, s).kind != "none" for s in AXIS_SITES[a])]
    if detail is None:
        return axes
    moved = {r["axis"] for r in detail if any(d in _CODE_DTYPES for d in r["dtype"].split("+"))}
    return [a for a in axes if a in moved]


def as_f32(detail: list[dict]) -> dict[str, int]:
    """Wire bytes by axis from `collective_bytes(...)["detail"]` with every bf16 / f16 message counted at
    4 bytes per element (what the same run would send computing in FP32). u16 rows are bf16 / f16
    messages bit-cast for the wire (exact collectives under gloo, `CodecConfig.transport`)."""
    out = collections.Counter()
    for row in detail:
        out[row["axis"]] += row["bytes"] * (2 if row["dtype"] in ("bf16", "f16", "u16") else 1)
    return dict(out)
