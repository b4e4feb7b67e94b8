"""The training loop (nanoGPT-style, reads top to bottom) and the none-vs-taco comparison.

Run from the shell:
    taco-jax train --comm taco --out runs/taco          # one run
    taco-jax compare --out runs/compare                 # same seed/data, --comm none then taco
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from taco_jax.codec import raise_if_nonfinite
from taco_jax.collectives.hlo import collective_bytes
from taco_jax.collectives.policy import SITES, CommPolicy
from taco_jax.data import TokenStream, check_data, eval_batches, training_data
from taco_jax.models import count_params
from taco_jax.models.hf import read_config, save_hf
from taco_jax.parallel.mesh import DATA, MESH_AXES, STAGE
from taco_jax.parallel.pipeline import schedule_stats
from taco_jax.train import capture, jsonio
from taco_jax.train import distributed as dist
from taco_jax.train.checkpoint import Checkpoints
from taco_jax.train.config import AXIS_SITES, TrainConfig, policy_label
from taco_jax.train.monitor import Monitor
from taco_jax.train.step import compiled_memory, make_trainer


def check_out_dir(out) -> pathlib.Path:
    """Creates the output folder `out` and checks that a file can be written there.

    Raises: ValueError naming `out` when it is an existing file, cannot be created, or is not
    writable (permissions, read-only or full disk).
    """
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


def describe_policy(policy: CommPolicy) -> str:
    """One line per mesh axis: its sites' codecs (taco with its backend), for the start of a run."""
    def codec(c):
        return f"{c.name}[{c.backend}]" if c.kind == "taco" else c.name

    parts = []
    for axis, sites in AXIS_SITES.items():
        names = {s: codec(getattr(policy, s)) for s in sites}
        parts.append(f"{axis}: " + (names[sites[0]] if len(set(names.values())) == 1 else
                                     ", ".join(f"{s}={n}" for s, n in names.items())))
    return "; ".join(parts) + f" (all-reduce {policy.all_reduce_algorithm}, min_bytes {policy.min_bytes})"


#: Element types of compressed wire buffers in compiled HLO (codes travel as 1-byte integers).
_CODE_DTYPES = ("u8", "s8")


def compressed_axes(policy: CommPolicy, detail: list[dict] | None = None) -> list[str]:
    """Mesh axes on which at least one site compresses, in mesh order. With `detail` (the compiled
    step's `collective_bytes(...)["detail"]`), only axes that really move compressed codes (a 1-byte
    integer collective on that axis): a site whose messages all fall under `min_bytes` stays exact."""
    axes = [a for a in MESH_AXES if any(getattr(policy, s).kind != "none" for s in AXIS_SITES[a])]
    if detail is None:
        return axes
    moved = {r["axis"] for r in detail if any(d in _CODE_DTYPES for d in r["dtype"].split("+"))}
    return [a for a in axes if a in moved]


def train(cfg: TrainConfig, *, dataset=None, progress: bool = True, devices=None) -> dict:
    """Trains `cfg.model` on Shakespeare; writes `config.json`, `metrics.jsonl`, `summary.json` and
    `loss.png` to `cfg.out` (strict JSON: non-finite numbers as strings, `train/jsonio.py`).

    Returns the summary: final train/validation loss, tokens/s, the policy that ran (backends
    resolved), and the compiled train step's wire bytes per step by mesh axis
    (`collectives.hlo.collective_bytes`).
    `progress`: a progress bar on a terminal; with stderr not a terminal, a line every `cfg.log_every` steps.
    `devices`: the mesh's devices (default all; `jax.devices()[:1]` for a one-device reference).
    Multi-process (`jax.distributed` initialized): every process runs this; each builds only its
    rows of the batches, process 0 writes the files. Checkpoints (`cfg.checkpoint_every`, SIGTERM,
    `cfg.resume`): `train/checkpoint.py`; a SIGTERM ends the run at the next step boundary with a
    checkpoint and a summary holding "preempted_at_step". `cfg.step_timeout`: `distributed.StepWatchdog`.
    Raises: ValueError for a configuration that cannot run, an output folder that cannot be
    written (before anything is compiled) or a checkpoint that cannot be resumed (CheckpointError,
    naming what differs); FloatingPointError when the loss or gradient norm of a
    step is not finite (naming the step; unless `cfg.allow_nonfinite`) or, with a codec
    `nonfinite="error"`, when a message held NaN/Inf (naming the site).
    """
    # 1. output folder, mesh, model, optimizer (all checked before anything is compiled)
    out = check_out_dir(cfg.out)
    writer = dist.is_writer()  # process 0 writes the run's files
    if cfg.capture and jax.process_count() > 1:
        raise ValueError(f"capture={cfg.capture} records on one process; run it without --num-processes")
    trainer = make_trainer(cfg, devices)
    policy = trainer.policy  # backends resolved ("auto" -> what runs here)
    if writer:
        source = f" from {cfg.init_from}" if cfg.init_from else ""
        print(f"[taco-jax] {cfg.model}{source} on mesh {cfg.mesh}: {describe_policy(policy)}"
              + (f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""), file=sys.stderr, flush=True)
    ds = dataset or training_data(cfg.data, cfg.vocab_size)  # --data DIR (memory-mapped) or Shakespeare
    check_data(ds, cfg.model_config.vocab_size if cfg.data else min(cfg.vocab_size, cfg.model_config.vocab_size),
               cfg.init_from)  # vocabulary and tokenizer fit the model
    ckpt = Checkpoints(out / "checkpoints", keep=cfg.keep_checkpoints)
    saved = ckpt.steps()
    if saved and not cfg.resume:
        raise ValueError(f"{ckpt.directory} holds checkpoints (latest step {saved[-1]}); give --resume to continue "
                         "that run, or another --out")
    params, opt_state = trainer.init()  # identical initial parameters for every --comm (same seed)
    batch_sharding = NamedSharding(trainer.mesh, P(*(a for a in (DATA,) if a in trainer.mesh.axis_names)))
    batches = TokenStream(ds.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)  # = batch_iterator's stream
    resuming = bool(cfg.resume and saved)  # from the newest intact checkpoint
    if cfg.resume and not saved and writer:
        print(f"[taco-jax] --resume: no checkpoint in {ckpt.directory}; starting from step 0", file=sys.stderr,
              flush=True)
    vocab = (cfg.model_config.vocab_size, cfg.model_config.padded_vocab_size)  # padding may differ: re-padded
    if resuming:  # CheckpointError naming what differs, before compiling (checkpoint metas only)
        ckpt.resume(cfg.to_dict(), params, opt_state, vocab=vocab, fallback=cfg.resume_fallback, arrays=False)

    # 2. compile once (from the initial arrays: a resumed run runs the same program) and read the
    #    collectives' wire bytes off the optimized HLO
    recorder = capture.Recorder.start(cfg, out, trainer) if cfg.capture else None  # train --capture N
    monitor = Monitor.start(cfg, trainer) if cfg.monitor_every else None  # train --monitor-every N
    if monitor and not monitor.sites and writer:
        print("[taco-jax] --monitor-every: no tensor site is compressed (or no tensor axis); nothing to monitor",
              file=sys.stderr, flush=True)
    checked = any(getattr(policy, s).nonfinite == "error" for s in SITES)  # codec nonfinite="error"
    t0 = time.perf_counter()
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), np.int32, sharding=batch_sharding)
    lowered = trainer.train_step.lower(params, opt_state, batch, batch)
    train_step = lowered.compile()
    compile_s = time.perf_counter() - t0
    wire = collective_bytes(train_step.as_text(), trainer.mesh)
    # as the program issues them, before the backend's dtype rewrites (XLA:CPU has no bf16 all-reduce
    # and promotes it to f32; GPUs send bf16)
    issued = collective_bytes(lowered.as_text(dialect="hlo"), trainer.mesh)
    memory = compiled_memory(train_step)  # per device; temp = activations etc. (what --remat lowers)

    start, history = 0, []
    if resuming:  # placed as the compiled step returns them (its steady-state layout)
        start, params, opt_state, meta, notes, warnings = ckpt.resume(
            cfg.to_dict(), params, opt_state, shardings=train_step.output_shardings[:2], vocab=vocab,
            fallback=cfg.resume_fallback)
        for w in warnings if writer else ():  # corrupt newer checkpoints skipped (renamed aside, not deleted)
            print(f"[taco-jax] warning: {w}", file=sys.stderr, flush=True)
        batches.restore(meta["data"])
        history = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= start] \
            if (out / "metrics.jsonl").exists() else []
        if writer:
            print(f"[taco-jax] resumed from {ckpt.directory / str(start)} (step {start})"
                  + "".join(f"; {n}" for n in notes), file=sys.stderr, flush=True)
    if writer:
        jsonio.write(out / "config.json", cfg.to_dict())
        shutil.copyfile(ds.tokenizer_path, out / "tokenizer.json")  # the run's tokenizer (taco-jax sample)
    val = [dist.global_arrays(batch_sharding, x, y) for x, y in
           eval_batches(ds.val, cfg.batch_size, cfg.seq_len, max_batches=cfg.eval_batches)]
    stop = _Preemption()
    x, y = batches.next(batch_sharding)

    def evaluate(p):
        return float(np.mean([float(trainer.eval_step(p, vx, vy)) for vx, vy in val]))

    # 3. the loop: step, log, evaluate every `eval_every` steps and at the end
    tokens_per_step = cfg.batch_size * cfg.seq_len
    val_loss = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
    watchdog = dist.StepWatchdog(cfg.step_timeout, wire_bytes=sum(wire["by_axis"].values()))
    preempted = None
    t_start = time.perf_counter()
    bar = tqdm(range(start + 1, cfg.steps + 1), desc=f"train[{cfg.comm}]", dynamic_ncols=True, initial=start,
               total=cfg.steps, disable=None if progress and writer else True)  # None: no bar off a terminal
    log_lines = progress and writer and cfg.log_every and not sys.stderr.isatty()  # logs: a line every log_every
    with _metrics_log(out / "metrics.jsonl", history, writer) as log, _closing(watchdog, stop, ckpt):
        for step in bar:
            fidelity = None
            if monitor and monitor.due(step):  # this step's messages: compressed vs exact (train step untouched)
                t = time.perf_counter()
                fidelity = monitor.measure(step, params, x, y)
                monitor_s = time.perf_counter() - t
            t = time.perf_counter()
            if recorder:  # on capture steps: this step's TP messages -> <out>/captures/stepNNNNN.npz
                recorder.capture(step, params, x, y)
            watchdog.start(step)
            params, opt_state, m = train_step(params, opt_state, x, y)
            loss = float(m["loss"])  # blocks: the step time below is real
            watchdog.done()
            dt = time.perf_counter() - t
            if recorder:
                recorder.finish_step(step, loss)
            if checked:
                raise_if_nonfinite()  # FloatingPointError naming the site(s) that saw NaN/Inf this step
            rec = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "step_s": dt,
                   "tokens_per_s": tokens_per_step / dt}
            if fidelity is not None:
                rec.update(monitor=fidelity, monitor_s=monitor_s)
            finite = math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
            if finite or cfg.allow_nonfinite:
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    val_loss = rec["val_loss"] = evaluate(params)
            log.write(jsonio.dumps(rec) + "\n")
            log.flush()
            history.append(rec)
            if not finite and not cfg.allow_nonfinite:
                bad = ", ".join(f"{k}={rec[k]}" for k in ("loss", "grad_norm") if not math.isfinite(rec[k]))
                raise FloatingPointError(
                    f"step {step}: {bad} is not finite (loss={loss:.6g}); the run stopped (metrics up to step "
                    f"{step} in {out / 'metrics.jsonl'}; --allow-nonfinite keeps training)")
            if fidelity is not None:  # warnings; MonitorError under --monitor-min-sqnr
                monitor.check(step, fidelity, f" (metrics up to step {step} in {out / 'metrics.jsonl'})")
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_loss:.3f}" if val_loss else "-")
            if log_lines and (step % cfg.log_every == 0 or step == cfg.steps):
                print(f"[train {cfg.comm}] step {step}/{cfg.steps} loss {loss:.4f} val "
                      f"{f'{val_loss:.4f}' if val_loss is not None else '-'} {rec['tokens_per_s']:.0f} tokens/s",
                      file=sys.stderr, flush=True)
            if stop.reached(step):  # SIGTERM (preemption): checkpoint now, then stop
                preempted = step
            if preempted or step == cfg.steps and cfg.checkpoint_every or \
                    cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                ckpt.save(step, params, opt_state, {"data": batches.state(), "config": cfg.to_dict()},
                          wait=bool(preempted))
            if preempted:
                if writer:
                    print(f"[taco-jax] SIGTERM: checkpoint {ckpt.directory / str(step)} written; the run stopped "
                          f"at step {step} (continue with --resume)", file=sys.stderr, flush=True)
                break
            if step < cfg.steps:
                x, y = batches.next(batch_sharding)
        ckpt.wait()  # the last save complete (raises its error)
    wall = time.perf_counter() - t_start
    captured = recorder.close() if recorder else None
    if cfg.export_hf:  # model layout, vocabulary padding dropped (models/hf.py)
        save_hf(cfg.export_hf, cfg.model_config, trainer.staged.unstack_layers(params) if trainer.staged else params,
                base_config=read_config(cfg.init_from) if cfg.init_from else None,  # multi-process: gathered
                source=cfg.init_from or None, tokenizer=ds.tokenizer_path)

    backends = sorted({getattr(policy, s).backend for s in SITES if getattr(policy, s).kind == "taco"})
    summary = {
        "comm": cfg.comm,
        "backend": backends[0] if len(backends) == 1 else (backends or None),  # of the taco codecs, resolved
        "compressed_axes": compressed_axes(policy, wire["detail"]),
        "policy": policy.to_dict(),
        "model": cfg.model,
        "n_params": count_params(cfg.model_config),  # without vocabulary padding (published counts)
        "init_from": cfg.init_from or None,
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "final_train_loss": float(np.mean([r["loss"] for r in history[-10:]])),
        "final_val_loss": val_loss,
        "tokens_per_s": tokens_per_step * (len(history) and history[-1]["step"] - start) / wall,
        "train_wall_s": wall,
        "compile_s": compile_s,
        "dtype": cfg.dtype,  # compute dtype (TP messages); parameters and optimizer state are float32
        "remat": cfg.remat,
        "compiled_memory_bytes": memory,  # per device, of the compiled train step (None: not reported)
        "wire_bytes_per_step": wire["by_axis"],
        "wire_detail": wire["detail"],
        "wire_bytes_per_step_issued": issued["by_axis"],  # uncompiled HLO: bf16 all-reduces counted as bf16
        "wire_bytes_per_step_issued_as_f32": as_f32(issued["detail"]),  # the same, every bf16 message at 4 bytes
        "devices": f"{len(jax.devices())}x {jax.devices()[0].platform}",
        "processes": jax.process_count(),
    }
    if cfg.step_timeout == "auto":
        summary["step_timeout_auto"] = watchdog.describe()  # the limit at the end of the run
    if link := dist.emulated_link():  # `taco-jax launch --link`: requested and measured rates
        summary["emulated_link"] = link
    if start:
        summary["resumed_from_step"] = start
    if preempted:
        summary["preempted_at_step"] = preempted
    stages = cfg.mesh_axes.get(STAGE, 1)
    if stages > 1 or cfg.microbatches > 1:  # pipeline: schedule and its bubble (parallel/pipeline.py)
        summary["pipeline"] = {"schedule": cfg.schedule, "stages": stages, "microbatches": cfg.microbatches,
                               **schedule_stats(cfg.schedule, stages, cfg.microbatches)}
    if captured:
        summary["captures"] = captured
    if monitor and monitor.sites:
        summary["monitor"] = monitor_summary(history, start)
    if not writer:
        return summary
    jsonio.write(out / "summary.json", summary)
    plot_losses(out / "loss.png", {cfg.comm: out / "metrics.jsonl"}, title=f"{cfg.model} on Shakespeare, mesh "
                f"{cfg.mesh}; compressed axes: {', '.join(summary['compressed_axes']) or 'none'}")
    if any("monitor" in r for r in history):
        plot_monitor(out / "monitor.png", out / "metrics.jsonl", title=f"{cfg.model}, mesh {cfg.mesh}, {cfg.comm}: "
                     "SQNR of the compressed TP collectives")
    return summary


class _Preemption:
    """SIGTERM (preemption) -> stop at a step boundary. One process: a Python SIGTERM handler sets a
    flag. Several: JAX's preemption sync manager (its SIGTERM notifier, started by
    `jax.distributed.initialize`) makes `reached(step)` true at the same step on every process, so
    all of them save the same checkpoint."""

    def __init__(self):
        self.multi, self.flag, self.old = jax.process_count() > 1, False, None
        if not self.multi and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_):
        self.flag = True

    def reached(self, step: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.flag

    def restore(self) -> None:
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
            self.old = None


@contextlib.contextmanager
def _closing(watchdog, stop, ckpt):
    """Ends the run's helpers however the loop ends: the watchdog disarmed and its thread stopped,
    the SIGTERM handler restored, the checkpoint manager closed (a pending save is finished)."""
    try:
        yield
    finally:
        watchdog.close()
        stop.restore()
        ckpt.close()


@contextlib.contextmanager
def _metrics_log(path, kept: list[dict], writer: bool):
    """`metrics.jsonl` opened for the step records: rewritten with the `kept` records of a resumed
    run first; process 0 only (other processes get a sink)."""
    if not writer:
        yield open(os.devnull, "w")
        return
    with open(path, "w") as log:
        for rec in kept:
            log.write(jsonio.dumps(rec) + "\n")
        yield log


def as_f32(detail: list[dict]) -> dict[str, int]:
    """Wire bytes by axis from `collective_bytes(...)["detail"]` with every bf16 / f16 message counted at
    4 bytes per element (what the same run would send computing in FP32)."""
    out = collections.Counter()
    for row in detail:
        out[row["axis"]] += row["bytes"] * (2 if row["dtype"] in ("bf16", "f16") else 1)
    return dict(out)


def _ratio(runs: dict, key: str) -> float | None:
    """Compressed / exact tensor-axis wire bytes of `compare`'s two runs under summary key `key`."""
    exact = runs["none"][key].get("tensor", 0)
    return runs["taco"][key].get("tensor", 0) / exact if exact else None


def compare(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Trains the same model twice (same seed and data order): exact on every axis ("none"), then
    with `cfg.policy` ("taco": `--comm` and its codec flags, `--dp-comm`, `--pp-comm`, `--policy`, `--site`).

    Writes `<out>/none/`, `<out>/taco/` (each a `train` output), `<out>/loss.png` and
    `<out>/summary.json`: both final validation losses, their relative difference, and the wire
    bytes per step of each run by mesh axis with the compressed / exact ratio per axis.
    In a multi-process run (`taco-jax launch --processes N -- compare ...`) every process trains
    both runs on the distributed runtime and returns the summary; process 0 writes the files.
    Raises: as `train`; ValueError before any training when `<out>` cannot be written.
    """
    out = check_out_dir(cfg.out)
    ds = training_data(cfg.data, cfg.vocab_size)
    configs = {"none": dataclasses.replace(cfg, policy=CommPolicy.none(), out=str(out / "none")),
               "taco": dataclasses.replace(cfg, out=str(out / "taco"))}
    for c in configs.values():
        check_out_dir(c.out)
    runs = {c: train(run_cfg, dataset=ds, progress=progress) for c, run_cfg in configs.items()}
    base, taco = runs["none"]["final_val_loss"], runs["taco"]["final_val_loss"]
    wire = {c: r["wire_bytes_per_step"] for c, r in runs.items()}
    ratio = {a: wire["taco"].get(a, 0) / n for a, n in wire["none"].items() if n}
    axes = runs["taco"]["compressed_axes"]
    summary = {
        "model": cfg.model,
        "mesh": cfg.mesh,
        "val_loss_none": base,
        "val_loss_taco": taco,
        "val_loss_rel_diff": (taco - base) / base,
        "within_1pct": abs(taco - base) / base <= 0.01,
        "compressed_axes": axes,
        "policy_taco": runs["taco"]["policy"],
        "tensor_wire_bytes_per_step": {c: w.get("tensor", 0) for c, w in wire.items()},
        "tensor_wire_ratio_taco_over_none": ratio.get("tensor"),
        "wire_ratio_taco_over_none": ratio,  # per mesh axis: compressed / exact wire bytes per step
        "wire_bytes_per_step": wire,
        # wire ratio against the exact run's messages as issued (bf16 with --dtype bfloat16) and as if
        # they were FP32 (the uncompiled HLO; XLA:CPU's compiled exact all-reduces are f32 either way)
        "tensor_wire_ratio_vs_exact_issued": _ratio(runs, "wire_bytes_per_step_issued"),
        "tensor_wire_ratio_vs_exact_f32": _ratio(runs, "wire_bytes_per_step_issued_as_f32"),
        "dtype": cfg.dtype,
        "tokens_per_s": {c: r["tokens_per_s"] for c, r in runs.items()},
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("policy", "out")},
        "processes": runs["taco"]["processes"],
    }
    if not dist.is_writer():
        return summary
    jsonio.write(out / "summary.json", summary)
    codecs = ", ".join(f"{a}: {policy_label(configs['taco'].policy, AXIS_SITES[a])}" for a in axes)
    taco_label = f"compressed ({codecs})" if axes else "taco (nothing compressed)"
    plot_losses(out / "loss.png", {"exact (every axis)": out / "none" / "metrics.jsonl",
                                   taco_label: out / "taco" / "metrics.jsonl"},
                title=f"{cfg.model} on Shakespeare, mesh {cfg.mesh}: exact vs compressed")
    return summary


def read_metrics(path) -> list[dict]:
    """The records of a `metrics.jsonl`, non-finite numbers (written as strings) back as floats."""
    recs = [json.loads(line) for line in open(path)]
    return [{k: float(v) if k in ("loss", "val_loss", "grad_norm") else v for k, v in r.items()} for r in recs]


def monitor_summary(history: list[dict], start: int = 0) -> dict:
    """The monitor over a run (`summary.json` "monitor"): per site the mean and minimum over the
    monitored steps of `sqnr_db` and the minimum of `min_sqnr_db` (NaN if any step's was NaN), and
    the cost: mean `monitor_s` over the monitored steps but the first of this process (it compiles
    the monitor) and mean `step_s` over the steps after the first of this process (`start + 1`)."""
    mon = [r for r in history if "monitor" in r and r["step"] > start]
    sites = {}
    for site in SITES:
        vals = [(float(r["monitor"][site]["sqnr_db"]), float(r["monitor"][site]["min_sqnr_db"]))
                for r in mon if site in r["monitor"]]
        if vals:
            worst = [v[1] for v in vals]
            sites[site] = {"mean_sqnr_db": float(np.mean([v[0] for v in vals])), "min_sqnr_db": float(np.min(worst)),
                           "first_sqnr_db": vals[0][0], "last_sqnr_db": vals[-1][0]}
    later = [r for r in history if r["step"] > start + 1]
    timed = [r["monitor_s"] for r in mon[1:]]  # the first measurement compiles the monitor
    step_s = float(np.mean([r["step_s"] for r in later])) if later else None
    monitor_s = float(np.mean(timed)) if timed else None
    return {"steps": [r["step"] for r in mon], "sites": sites, "monitor_s_mean": monitor_s, "step_s_mean": step_s,
            "monitor_over_step": monitor_s / step_s if monitor_s and step_s else None}


def plot_monitor(path, metrics, title: str) -> pathlib.Path:
    """Fidelity monitor plot -> `path` (PNG): the training loss (top) and, below it on the same step
    axis, each monitored site's SQNR (dB; solid: energy-weighted over the site's calls, dashed: its
    worst call) from the "monitor" entries of `metrics` (a run's metrics.jsonl). Infinite or NaN
    values are left out of the plot (they stay in metrics.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(1, 1.2))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, label="train")
    ev = [r for r in recs if "val_loss" in r]
    ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="val")
    ax.set(ylabel="cross-entropy (nats/token)")
    ax.legend(fontsize=8)
    mon = [r for r in recs if "monitor" in r]
    for site in SITES:
        pts = [(r["step"], float(r["monitor"][site]["sqnr_db"]), float(r["monitor"][site]["min_sqnr_db"]))
               for r in mon if site in r["monitor"]]
        pts = [p for p in pts if math.isfinite(p[1]) and math.isfinite(p[2])]
        if pts:
            line, = bx.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"{site}")
            bx.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(), lw=0.8,
                    label=f"{site}: worst call")
    bx.set(xlabel="step", ylabel="SQNR (dB)")
    bx.legend(fontsize=7, ncol=2)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120, metadata={"Title": title})
    plt.close(fig)
    return path


def plot_losses(path, runs: dict, title: str) -> pathlib.Path:
    """Train (thin) and validation (markers) loss of each run -> `path` (PNG; `title` and the run
    labels also stored as its "Title" / "Description" text).

    runs: {legend label: path of the run's metrics.jsonl}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, metrics in runs.items():
        recs = read_metrics(metrics)
        line, = ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, alpha=0.7,
                        label=f"{label}: train")
        ev = [r for r in recs if "val_loss" in r]
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color=line.get_color(),
                label=f"{label}: val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120, metadata={"Title": title, "Description": "; ".join(runs)})  # PNG text chunks
    plt.close(fig)
    return path
