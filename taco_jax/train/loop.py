"""The training loop (nanoGPT-style, reads top to bottom) and the none-vs-taco comparison.

Run from the shell:
    taco-jax train --comm taco --out runs/taco          # one run
    taco-jax compare --out runs/compare                 # same seed/data, --comm none then taco
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from taco_jax.codec import raise_if_nonfinite
from taco_jax.collectives.hlo import collective_bytes
from taco_jax.collectives.policy import SITES
from taco_jax.data import batch_iterator, eval_batches, load_shakespeare
from taco_jax.models import count_params
from taco_jax.models.hf import read_config, save_hf
from taco_jax.parallel.pipeline import schedule_stats
from taco_jax.train import capture
from taco_jax.train.config import TrainConfig
from taco_jax.train.step import make_trainer, shard_batch


def train(cfg: TrainConfig, *, dataset=None, progress: bool = True, devices=None) -> dict:
    """Trains `cfg.model` on Shakespeare; writes `config.json`, `metrics.jsonl`, `summary.json` to `cfg.out`.

    Returns the summary: final train/validation loss, tokens/s, and the compiled train step's
    wire bytes per step by mesh axis (`collectives.hlo.collective_bytes`).
    `devices`: the mesh's devices (default all; `jax.devices()[:1]` for a one-device reference).
    Raises: ValueError for a configuration that cannot run (before anything is compiled).
    """
    # 1. mesh, model, optimizer (checks the mesh and backend before anything is written)
    trainer = make_trainer(cfg, devices)
    out = pathlib.Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    ds = dataset or load_shakespeare(cfg.vocab_size)
    if ds.vocab_size > min(cfg.vocab_size, cfg.model_config.vocab_size):
        raise ValueError(f"tokenizer vocab {ds.vocab_size} exceeds the model's vocab_size="
                         f"{min(cfg.vocab_size, cfg.model_config.vocab_size)}")
    params, opt_state = trainer.init()  # identical initial parameters for every --comm (same seed)
    batches = batch_iterator(ds.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    val = [shard_batch(trainer, x, y) for x, y in
           eval_batches(ds.val, cfg.batch_size, cfg.seq_len, max_batches=cfg.eval_batches)]

    # 2. compile once and read the collectives' wire bytes off the optimized HLO
    x, y = shard_batch(trainer, *next(batches))
    recorder = capture.Recorder.start(cfg, out, trainer) if cfg.capture else None  # train --capture N
    checked = any(getattr(cfg.policy, s).nonfinite == "error" for s in SITES)  # codec nonfinite="error"
    t0 = time.perf_counter()
    train_step = trainer.train_step.lower(params, opt_state, x, y).compile()
    compile_s = time.perf_counter() - t0
    wire = collective_bytes(train_step.as_text(), trainer.mesh)

    def evaluate(p):
        return float(np.mean([float(trainer.eval_step(p, vx, vy)) for vx, vy in val]))

    # 3. the loop: step, log, evaluate every `eval_every` steps and at the end
    tokens_per_step = cfg.batch_size * cfg.seq_len
    history, val_loss = [], None
    t_start = time.perf_counter()
    bar = tqdm(range(1, cfg.steps + 1), desc=f"train[{cfg.comm}]", dynamic_ncols=True,
               disable=None if progress else True)  # None: no bar when stderr is not a terminal (logs)
    with open(out / "metrics.jsonl", "w") as log:
        for step in bar:
            t = time.perf_counter()
            if recorder:  # on capture steps: this step's TP messages -> <out>/captures/stepNNNNN.npz
                recorder.capture(step, params, x, y)
            params, opt_state, m = train_step(params, opt_state, x, y)
            loss = float(m["loss"])  # blocks: the step time below is real
            dt = time.perf_counter() - t
            if recorder:
                recorder.finish_step(step, loss)
            if checked:
                raise_if_nonfinite()  # FloatingPointError naming the site(s) that saw NaN/Inf this step
            rec = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "step_s": dt,
                   "tokens_per_s": tokens_per_step / dt}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                val_loss = rec["val_loss"] = evaluate(params)
            log.write(json.dumps(rec) + "\n")
            history.append(rec)
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_loss:.3f}" if val_loss else "-")
            if step < cfg.steps:
                x, y = shard_batch(trainer, *next(batches))
    wall = time.perf_counter() - t_start
    captured = recorder.close() if recorder else None
    if cfg.export_hf:  # model layout, vocabulary padding dropped (models/hf.py)
        save_hf(cfg.export_hf, cfg.model_config, trainer.staged.unstack_layers(params) if trainer.staged else params,
                base_config=read_config(cfg.init_from) if cfg.init_from else None)

    summary = {
        "comm": cfg.comm,
        "backend": cfg.backend,
        "model": cfg.model if not cfg.init_from else f"init_from={cfg.init_from}",
        "n_params": count_params(cfg.model_config),  # without vocabulary padding (published counts)
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "final_train_loss": float(np.mean([r["loss"] for r in history[-10:]])),
        "final_val_loss": val_loss,
        "tokens_per_s": tokens_per_step * cfg.steps / wall,
        "train_wall_s": wall,
        "compile_s": compile_s,
        "wire_bytes_per_step": wire["by_axis"],
        "wire_detail": wire["detail"],
        "devices": f"{len(jax.devices())}x {jax.devices()[0].platform}",
    }
    stages = cfg.mesh_axes.get("stage", 1)
    if stages > 1 or cfg.microbatches > 1:  # pipeline: schedule and its bubble (parallel/pipeline.py)
        summary["pipeline"] = {"schedule": cfg.schedule, "stages": stages, "microbatches": cfg.microbatches,
                               **schedule_stats(cfg.schedule, stages, cfg.microbatches)}
    if captured:
        summary["captures"] = captured
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def compare(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Trains the same model twice (same seed and data order): `--comm none`, then `--comm taco`.

    The "none" run is exact on every axis; the "taco" run keeps `--dp-comm` / `--pp-comm`.

    Writes `<out>/none/`, `<out>/taco/` (each a `train` output), `<out>/loss.png` and
    `<out>/summary.json` with both final validation losses and their relative difference.
    """
    out = pathlib.Path(cfg.out)
    ds = load_shakespeare(cfg.vocab_size)
    exact = dict(comm="none", dp_comm="none", pp_comm="none")  # baseline: every axis exact
    runs = {c: train(dataclasses.replace(cfg, **(exact if c == "none" else dict(comm=c)), out=str(out / c)),
                     dataset=ds, progress=progress)
            for c in ("none", "taco")}
    base, taco = runs["none"]["final_val_loss"], runs["taco"]["final_val_loss"]
    tensor = {c: r["wire_bytes_per_step"].get("tensor", 0) for c, r in runs.items()}
    summary = {
        "val_loss_none": base,
        "val_loss_taco": taco,
        "val_loss_rel_diff": (taco - base) / base,
        "within_1pct": abs(taco - base) / base <= 0.01,
        "tensor_wire_bytes_per_step": tensor,
        "tensor_wire_ratio_taco_over_none": tensor["taco"] / tensor["none"] if tensor["none"] else None,
        "wire_bytes_per_step": {c: r["wire_bytes_per_step"] for c, r in runs.items()},
        "tokens_per_s": {c: r["tokens_per_s"] for c, r in runs.items()},
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("comm", "out")},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_losses(out, list(runs))
    return summary


def plot_losses(out: pathlib.Path, comms: list[str]) -> pathlib.Path:
    """Train (thin) and validation (markers) loss of each run in `out/<comm>/metrics.jsonl` -> loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in comms:
        recs = [json.loads(line) for line in open(out / c / "metrics.jsonl")]
        line, = ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, alpha=0.7, label=f"{c} train")
        ev = [r for r in recs if "val_loss" in r]
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color=line.get_color(), label=f"{c} val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="GPT on Shakespeare: exact vs TACO TP comm")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
