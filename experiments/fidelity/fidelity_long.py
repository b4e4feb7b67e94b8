"""Fidelity at length: TACO vs exact over thousands of steps on a real corpus, paired seeds, with the
loss gap and the per-site SQNR tracked over training.

For each model (a GPT-2 and a Qwen3 preset) and each seed s the exact run (`--comm none`) and the
TACO run (`taco_jax.codec.presets.NAMED["taco"]` on every tensor-parallel site) train with the same
seed: the same initial parameters and the same data order, evaluated on the same validation
windows. Mesh data=1 × tensor=2 with sequence parallelism (all-gather / reduce-scatter sites), bf16
compute. Each run is one `taco_jax.train.loop.train` call (the trainer of `taco-jax train`) in
`<out>/runs/<model>/<variant>/seed<s>/` with its own config.json, metrics.jsonl (per step: loss,
grad_norm; val_loss every `--eval-every` steps; the online monitor's per-site SQNR every
`--monitor-every` steps on the TACO runs, `train/monitor.py`) and Orbax checkpoints every
`--checkpoint-every` steps.

Resumable: every run starts with `--resume` (from its newest checkpoint, the data stream's position
included, so the continued run's losses are bit for bit those of an uninterrupted one); a run whose
summary.json says it finished is skipped (its checkpoints are removed unless `--keep-checkpoints`).
Runs go seed by seed (exact then TACO for each model), so a stopped study leaves whole pairs. A
SIGTERM ends the current run at a step boundary with a checkpoint and stops the study; run the same
command again to continue. `<out>/study.json` holds the study's run settings; another setting in
the same `--out` is refused (naming it), more `--seeds` add runs.

Report (`--analyze`: from the saved runs only, nothing trained; complete pairs only):
  - the paired loss gap Δ_s = 100·(L_taco,s − L_exact,s)/L_exact,s (% of the exact loss) with its
    95 % t-interval over seeds (`fidelity_runs.paired_ci`) at the `--milestones` and at the end:
    validation (the val loss at that step: milestones must be multiples of `--eval-every`) and
    training (each run's mean loss over the `--train-window` steps ending there; paired runs see
    the same batches);
  - per site, the monitor's SQNR (energy-weighted over the site's calls, `sqnr_db`) over training:
    the mean over seeds at the first and the last monitored step, the least-squares slope over all
    seeds' points (dB per 1,000 steps) and the drift it implies over the monitored span; a drift
    below −`DRIFT_DB` dB is flagged;
  - the gradient-norm ratio ‖g_taco‖/‖g_exact‖ per step, as 100·(mean ratio − 1) over the window
    and over the whole run, with its interval over seeds;
  - the tokens seen per run (steps × batch × sequence length) and in epochs of the training split.
  Plots: `gap.png` (the gap's mean and 95 % band against steps, train and validation per model) and
  `sqnr.png` (SQNR per site against steps, mean over seeds and the seeds' range).

    python -m experiments.fidelity.prepare_corpus --out runs/corpus/cpython-stdlib
    python -m experiments.fidelity.fidelity_long --corpus runs/corpus/cpython-stdlib --out runs/fidelity_long
    python -m experiments.fidelity.fidelity_long --out runs/fidelity_long --analyze        # tables and plots again
    python -m experiments.fidelity.fidelity_long --corpus runs/corpus/cpython-stdlib --probe gpt2-tiny qwen3-tiny

`--probe MODEL...`: times a few train steps of each model at this study's settings (both variants,
the monitor and one validation batch), and the study's estimated hours; nothing is written.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import shutil
import sys
import time

from experiments.common import cpu_devices, run_record

if "jax" not in sys.modules:  # simulated CPU devices for the mesh
    cpu_devices(8)

import numpy as np  # noqa: E402

from experiments.fidelity.fidelity_runs import paired_ci, variant_policy  # noqa: E402

#: The compared variants: exact and TACO on every tensor-parallel site.
VARIANTS = ("none", "taco")
#: Steps at which the gap is reported (those up to --steps; the end is always reported).
MILESTONES = (250, 500, 1000, 2000)
#: A site whose fitted SQNR falls by more than this many dB over the monitored span is flagged.
DRIFT_DB = 1.0
#: study.json fields a continued study must share with the runs already there.
RUN_SETTINGS = ("models", "steps", "batch_size", "seq_len", "lr", "dtype", "mesh", "eval_every", "eval_batches",
                "monitor_every", "checkpoint_every", "backend", "corpus_output_sha256")
#: Per-step fields that hold timings (differ between two runs of the same numbers).
TIMING_KEYS = ("step_s", "tokens_per_s", "monitor_s")


# -----------------------------------------------------------------------------
# the runs


def run_dir(out, model: str, variant: str, seed: int) -> pathlib.Path:
    return pathlib.Path(out) / "runs" / model / variant / f"seed{seed}"


def run_config(study: dict, model: str, variant: str, seed: int, out):
    """The `TrainConfig` of one run of `study` (the study.json dict)."""
    from taco_jax.train.config import TrainConfig

    return TrainConfig.from_flags(
        model=model, mesh=study["mesh"], sequence_parallel=True, steps=study["steps"], batch_size=study["batch_size"],
        seq_len=study["seq_len"], lr=study["lr"], dtype=study["dtype"], seed=seed, eval_every=study["eval_every"],
        eval_batches=study["eval_batches"], data=study["corpus"], monitor_every=study["monitor_every"],
        monitor_warn_sqnr=-math.inf, checkpoint_every=study["checkpoint_every"], keep_checkpoints=1, resume=True,
        log_every=study["log_every"], out=str(run_dir(out, model, variant, seed)),
        policy=variant_policy(variant, study["backend"]))


def run_complete(path, steps: int) -> bool:
    """Whether the run folder `path` holds a finished run of `steps` steps (summary.json without
    "preempted_at_step", metrics.jsonl up to that step)."""
    from taco_jax.util import jsonio

    path = pathlib.Path(path)
    if not (path / "summary.json").is_file() or not (path / "metrics.jsonl").is_file():
        return False
    import json

    s = json.loads((path / "summary.json").read_text())
    recs = jsonio.read_metrics(path / "metrics.jsonl")
    return s.get("steps") == steps and "preempted_at_step" not in s and bool(recs) and recs[-1]["step"] == steps


def planned_runs(study: dict):
    """(model, variant, seed) in run order: seed by seed, each model's exact run then its TACO run."""
    return [(m, v, s) for s in range(study["seeds"]) for m in study["models"] for v in VARIANTS]


def check_study(out, study: dict) -> dict:
    """Writes `<out>/study.json`, or checks it against `study` when there: raises ValueError naming
    each run setting (`RUN_SETTINGS`) that differs from the runs already in `out`. Returns the study
    as written (the larger of the two seed counts)."""
    from taco_jax.util import jsonio

    path = pathlib.Path(out) / "study.json"
    if path.is_file():
        import json

        before = json.loads(path.read_text())
        diff = [f"{k}: {before.get(k)!r} there, {study[k]!r} now" for k in RUN_SETTINGS if before.get(k) != study[k]]
        if diff:
            raise ValueError(f"{path} was made with other run settings ({'; '.join(diff)}); continue with the same "
                             "settings or give another --out")
        study = {**study, "seeds": max(before["seeds"], study["seeds"])}
    path.parent.mkdir(parents=True, exist_ok=True)
    jsonio.write(path, study)
    return study


def run_study(study: dict, out, *, keep_checkpoints: bool = False) -> list[tuple]:
    """Trains every planned run of `study` that is not complete (module docstring); returns the runs
    trained. Raises SystemExit (status 3) when a SIGTERM stopped a run (its checkpoint written)."""
    import jax

    from taco_jax.data import load_prepared
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.train.loop import train
    from taco_jax.util.console import say

    ds = load_prepared(study["corpus"])
    devices = jax.devices()[:math.prod(parse_mesh(study["mesh"]).values())]
    trained = []
    for model, variant, seed in planned_runs(study):
        path = run_dir(out, model, variant, seed)
        if run_complete(path, study["steps"]):
            say(f"[fidelity_long] {model} {variant} seed {seed}: complete, skipped")
            continue
        say(f"[fidelity_long] {model} {variant} seed {seed}: training in {path}")
        summary = train(run_config(study, model, variant, seed, out), dataset=ds, devices=devices)
        if "preempted_at_step" in summary:
            say(f"[fidelity_long] stopped at step {summary['preempted_at_step']} of {path}; run the same command "
                "again to continue")
            raise SystemExit(3)
        if not keep_checkpoints:
            shutil.rmtree(path / "checkpoints", ignore_errors=True)
        trained.append((model, variant, seed))
    return trained


# -----------------------------------------------------------------------------
# analysis


def load_pairs(out, study: dict) -> dict:
    """{model: {seed: {variant: metrics records}}} of the complete pairs in `out` (timing fields kept)."""
    from taco_jax.util import jsonio

    pairs = {}
    for model in study["models"]:
        for seed in range(study["seeds"]):
            paths = {v: run_dir(out, model, v, seed) for v in VARIANTS}
            if all(run_complete(p, study["steps"]) for p in paths.values()):
                pairs.setdefault(model, {})[seed] = {v: jsonio.read_metrics(p / "metrics.jsonl")
                                                     for v, p in paths.items()}
    return pairs


def _per_step(recs: list[dict], key: str, steps: int) -> np.ndarray:
    """float64 [steps] of `key` by step (NaN where a step has no such entry)."""
    out = np.full(steps, np.nan)
    for r in recs:
        if key in r:
            out[r["step"] - 1] = float(r[key])
    return out


def _window_mean(x: np.ndarray, window: int) -> np.ndarray:
    """[n]: mean of x over the `window` entries ending at each index (fewer at the start)."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, x.size + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def _ci(deltas) -> dict:
    d = np.asarray(deltas, dtype=np.float64)
    return paired_ci(d) if d.size > 1 else {"n": int(d.size), "mean": float(d.mean()) if d.size else float("nan")}


def gap_series(seeds: dict, steps: int, window: int) -> dict:
    """Per-seed paired series [n_seeds, steps] (% of exact): "train" (window means of the loss), "val"
    (NaN where not evaluated), "grad_norm_ratio" (100·(window mean of the ratio − 1))."""
    out = {"train": [], "val": [], "grad_norm_ratio": []}
    for runs in seeds.values():
        ex, tc = runs["none"], runs["taco"]
        le, lt = _window_mean(_per_step(ex, "loss", steps), window), _window_mean(_per_step(tc, "loss", steps), window)
        out["train"].append(100 * (lt - le) / le)
        ve, vt = _per_step(ex, "val_loss", steps), _per_step(tc, "val_loss", steps)
        out["val"].append(100 * (vt - ve) / ve)
        ratio = _per_step(tc, "grad_norm", steps) / _per_step(ex, "grad_norm", steps)
        out["grad_norm_ratio"].append(100 * (_window_mean(ratio, window) - 1))
    return {k: np.array(v) for k, v in out.items()}


def sqnr_trend(seeds: dict) -> dict:
    """Per site of the TACO runs' monitor records: steps, mean over seeds per monitored step, the
    first / last of those means, the least-squares slope over all seeds' finite points (dB per 1,000
    steps), the drift it implies over the monitored span and whether it is below −DRIFT_DB."""
    from scipy import stats

    points: dict[str, dict[int, list[float]]] = {}
    for runs in seeds.values():
        for r in runs["taco"]:
            for site, v in r.get("monitor", {}).items():
                points.setdefault(site, {}).setdefault(r["step"], []).append(float(v["sqnr_db"]))
    out = {}
    for site, by_step in points.items():
        steps = sorted(by_step)
        mean = [float(np.mean(by_step[k])) for k in steps]
        xs = np.array([k for k in steps for _ in by_step[k]], dtype=np.float64)
        ys = np.array([v for k in steps for v in by_step[k]])
        ok = np.isfinite(ys)
        fit = stats.linregress(xs[ok], ys[ok]) if np.unique(xs[ok]).size > 1 else None
        slope = float(fit.slope) * 1000 if fit else float("nan")
        drift = slope * (steps[-1] - steps[0]) / 1000 if fit else float("nan")
        out[site] = {"steps": steps, "mean_sqnr_db": mean,
                     "min_sqnr_db": [float(np.min(by_step[k])) for k in steps],
                     "max_sqnr_db": [float(np.max(by_step[k])) for k in steps],
                     "first_step": steps[0], "first_sqnr_db": mean[0], "last_step": steps[-1], "last_sqnr_db": mean[-1],
                     "slope_db_per_1k_steps": slope,
                     "slope_stderr_db_per_1k_steps": float(fit.stderr) * 1000 if fit else float("nan"),
                     "drift_db": drift, "drifts_down": bool(drift < -DRIFT_DB)}
    return out


def analyze(out, study: dict, milestones=MILESTONES, window: int = 50) -> dict:
    """The report of the complete pairs in `out` (module docstring); nothing is trained.
    Returns {"study", "models": {model: {...}}}. Raises ValueError naming a milestone that is not a
    multiple of the study's eval_every."""
    steps = study["steps"]
    at = sorted({m for m in milestones if m <= steps} | {steps})
    bad = [m for m in at if m % study["eval_every"] and m != steps]
    if bad:
        raise ValueError(f"milestones {bad} are not multiples of eval_every={study['eval_every']}: the validation "
                         "loss is not recorded there")
    pairs = load_pairs(out, study)
    tokens_per_run = steps * study["batch_size"] * study["seq_len"]
    models = {}
    for model, seeds in pairs.items():
        series = gap_series(seeds, steps, window)
        gaps = {split: {k: _ci(series[split][:, k - 1]) for k in at} for split in ("train", "val", "grad_norm_ratio")}
        models[model] = {
            "seeds": sorted(seeds), "milestones": at, **gaps,
            "interval_at_last_vs_first": {split: _width_change(gaps[split], at) for split in ("train", "val")},
            "sqnr": sqnr_trend(seeds),
            "grad_norm_ratio_run_mean_pct": _ci([100 * (np.mean(_per_step(r["taco"], "grad_norm", steps)
                                                                / _per_step(r["none"], "grad_norm", steps)) - 1)
                                                 for r in seeds.values()]),
            "tokens_per_run": tokens_per_run, "runs": 2 * len(seeds), "tokens_total": 2 * len(seeds) * tokens_per_run,
            "epochs_per_run": tokens_per_run / study["corpus_train_tokens"],
            "train_wall_s": float(sum(r["step_s"] + r.get("monitor_s", 0.0) for s in seeds.values()
                                      for recs in s.values() for r in recs)),
            "curves": {k: {"steps": [i + 1 for i in _curve_steps(v)], "ci": [_ci(v[:, i]) for i in _curve_steps(v)]}
                       for k, v in series.items()},
        }
    return {"study": study, "window": window, "planned_pairs": study["seeds"] * len(study["models"]),
            "complete_pairs": sum(len(s) for s in pairs.values()), "models": models}


def _curve_steps(v: np.ndarray) -> list[int]:
    """Indices of the steps where every seed has a finite value (at most ~200 of them, evenly spaced)."""
    ok = np.flatnonzero(np.all(np.isfinite(v), axis=0))
    return ok[:: max(1, ok.size // 200)].tolist() if ok.size else []


def _width_change(gaps: dict, at: list[int]) -> str | None:
    first, last = gaps[at[0]], gaps[at[-1]]
    if "half_width" not in first or "half_width" not in last or len(at) < 2:
        return None
    return (f"{'narrower' if last['half_width'] < first['half_width'] else 'wider'} at step {at[-1]} "
            f"(±{last['half_width']:.3f} %) than at step {at[0]} (±{first['half_width']:.3f} %)")


def _fmt_ci(ci: dict, unit: str = " %") -> tuple[str, str]:
    if "half_width" not in ci:
        return f"{ci['mean']:+.3f}{unit}", "—"
    return f"{ci['mean']:+.3f}{unit}", f"[{ci['lo']:+.3f}, {ci['hi']:+.3f}]{unit} (±{ci['half_width']:.3f})"


def markdown(report: dict) -> str:
    st = report["study"]
    lines = [f"Long paired study: {st['steps']} steps, batch {st['batch_size']} × {st['seq_len']}, mesh {st['mesh']} "
             f"with sequence parallelism, {st['dtype']}, lr {st['lr']}, TACO backend {st['backend']}; corpus "
             f"{st['corpus_name']} ({st['corpus_train_tokens']:,} training tokens, output sha256 "
             f"{st['corpus_output_sha256'][:16]}…); {report['complete_pairs']} of {report['planned_pairs']} pairs "
             f"complete; 95 % t-interval over seeds; training gap = mean over the {report['window']} steps ending "
             "at the step.", "",
             "| model | split | step | n seeds | mean paired Δ loss | 95 % CI |", "|---|---|---|---|---|---|"]
    for model, m in report["models"].items():
        for split in ("train", "val"):
            for k in m["milestones"]:
                ci = m[split][k]
                lines.append(f"| {model} | {split} | {k} | {ci['n']} | {' | '.join(_fmt_ci(ci))} |")
    lines.append("")
    for model, m in report["models"].items():
        for split, text in m["interval_at_last_vs_first"].items():
            if text:
                lines.append(f"- {model}, {split}: the interval is {text}.")
    lines += ["", "| model | site | first step | first SQNR | last step | last SQNR | slope (dB / 1k steps) "
              "| drift over the span | flag |", "|---|---|---|---|---|---|---|---|---|"]
    for model, m in report["models"].items():
        for site, s in m["sqnr"].items():
            flag = f"drifts down > {DRIFT_DB:g} dB" if s["drifts_down"] else "—"
            lines.append(f"| {model} | {site} | {s['first_step']} | {s['first_sqnr_db']:.2f} dB | {s['last_step']} | "
                         f"{s['last_sqnr_db']:.2f} dB | {s['slope_db_per_1k_steps']:+.3f} ± "
                         f"{s['slope_stderr_db_per_1k_steps']:.3f} | {s['drift_db']:+.2f} dB | {flag} |")
    lines += ["", "| model | step | grad-norm ratio − 1 (window mean) | 95 % CI |", "|---|---|---|---|"]
    for model, m in report["models"].items():
        for k in m["milestones"]:
            lines.append(f"| {model} | {k} | {' | '.join(_fmt_ci(m['grad_norm_ratio'][k]))} |")
        lines.append(f"| {model} | whole run | {' | '.join(_fmt_ci(m['grad_norm_ratio_run_mean_pct']))} |")
    lines += ["", "| model | runs | tokens per run | epochs per run | tokens, all runs | train wall (all runs) |",
              "|---|---|---|---|---|---|"]
    for model, m in report["models"].items():
        lines.append(f"| {model} | {m['runs']} | {m['tokens_per_run']:,} | {m['epochs_per_run']:.3f} | "
                     f"{m['tokens_total']:,} | {m['train_wall_s'] / 3600:.2f} h |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out) -> list[pathlib.Path]:
    """`gap.png` (train and validation gap per model, mean and 95 % band) and `sqnr.png` (SQNR per site)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out)
    models = list(report["models"])
    if not models:
        return []
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        for ax, split in zip(row, ("train", "val"), strict=True):
            c = report["models"][model]["curves"][split]
            xs = np.array(c["steps"])
            mean = np.array([ci["mean"] for ci in c["ci"]])
            ax.plot(xs, mean, marker="o" if split == "val" else None, ms=3, label="mean Δ")
            if all("lo" in ci for ci in c["ci"]):
                ax.fill_between(xs, [ci["lo"] for ci in c["ci"]], [ci["hi"] for ci in c["ci"]], alpha=0.3,
                                label="95 % CI")
            ax.axhline(0, color="k", lw=0.7)
            _label(ax, f"{model}: {split} loss, TACO vs exact", "paired Δ loss (%)")
    gap = _save(fig, out / "gap.png")
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for site, s in report["models"][model]["sqnr"].items():
            (line,) = ax.plot(s["steps"], s["mean_sqnr_db"], marker=".", label=site)
            ax.fill_between(s["steps"], s["min_sqnr_db"], s["max_sqnr_db"], color=line.get_color(), alpha=0.2)
        _label(ax, f"{model}: SQNR per site (TACO runs)", "SQNR (dB)")
    return [gap, _save(fig, out / "sqnr.png")]


def _label(ax, title: str, ylabel: str) -> None:
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out, study: dict, milestones=MILESTONES, window: int = 50, run: dict | None = None) -> dict:
    """`analyze`, then `<out>/report.json` (strict JSON; under "run" the run record `run`, by default
    that of `--out OUT --analyze`), `report.md`, `gap.png` and `sqnr.png`."""
    from taco_jax.util import jsonio

    run = run or run_record(__spec__.name, ["--out", str(out), "--analyze"])
    report = {"run": run, **analyze(out, study, milestones, window)}
    out = pathlib.Path(out)
    jsonio.write(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    plot(report, out)
    return report


# -----------------------------------------------------------------------------
# timing probe


def non_embedding_params(model_config) -> int:
    """Parameters of the decoder layers (matmul weights, norms, biases): `param_sizes` × layers."""
    matmul, other, _ = model_config.param_sizes()
    return model_config.n_layers * (matmul + other)


def probe(study: dict, models, steps: int = 4) -> list[dict]:
    """Per model and variant: wall and CPU seconds per train step (median over `steps` steps after a
    warm-up step), the monitor's seconds per measurement and one validation batch's seconds, at the
    study's settings; and the study's estimated hours per model on this machine as it is now."""
    import jax

    from experiments.fidelity.fidelity_runs import SeedRunner
    from taco_jax.data import TokenStream, load_prepared
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.train.monitor import Monitor
    from taco_jax.util import jsonio
    from taco_jax.util.console import say

    ds = load_prepared(study["corpus"])
    devices = jax.devices()[:math.prod(parse_mesh(study["mesh"]).values())]
    rows = []
    for model in models:
        row = {"model": model}
        for variant in VARIANTS:
            cfg = run_config(study, model, variant, 0, "/tmp/unused").replace(eval_batches=1, resume=False)
            runner = SeedRunner(cfg, ds, devices)
            params, opt = runner.init(0)
            batches = TokenStream(ds.train, cfg.data.batch_size, cfg.data.seq_len, seed=0)
            walls, cpus = [], []
            for i in range(steps + 1):
                x, y = batches.next(runner.batch_sharding)
                t, c = time.perf_counter(), time.process_time()
                params, opt, m = runner.train_step(params, opt, x, y)
                float(m["loss"])
                if i:
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
            runner.evaluate(params)  # compiles the eval step
            t = time.perf_counter()
            runner.evaluate(params)
            row[variant] = {"step_s": float(np.median(walls)), "cpu_s": float(np.median(cpus)),
                            "eval_batch_s": time.perf_counter() - t, "compile_s": runner.compile_s}
            if variant == "taco":
                mon = Monitor(runner.trainer, 1, steps, -math.inf, -math.inf)
                mon.measure(1, params, x, y)  # compiles
                t = time.perf_counter()
                mon.measure(2, params, x, y)
                row[variant]["monitor_s"] = time.perf_counter() - t
        mc = cfg.model_config
        row["non_embedding_params"] = non_embedding_params(mc)
        row["params"] = mc.n_params()
        n, s = study["seeds"], study["steps"]
        evals = (s // study["eval_every"] + 1) * study["eval_batches"]
        for key in ("step_s", "cpu_s"):
            train_s = n * s * (row["none"][key] + row["taco"][key])
            extra = n * (2 * evals * row["none"]["eval_batch_s"]
                         + s // study["monitor_every"] * row["taco"]["monitor_s"])
            row[f"study_hours_{key}"] = (train_s + extra) / 3600
        rows.append(row)
        say(f"[fidelity_long] probe {model}: {jsonio.dumps(row)}")
    return rows


# -----------------------------------------------------------------------------
# command line


def study_settings(args) -> dict:
    """study.json of these arguments (the corpus's corpus.json / meta.json read for its identity)."""
    import json

    from taco_jax.data.prepared import read_meta

    corpus = pathlib.Path(args.corpus)
    meta = read_meta(corpus)  # ValueError naming a folder that is not prepared
    info = json.loads((corpus / "corpus.json").read_text()) if (corpus / "corpus.json").is_file() else {}
    bad = [m for m in args.milestones if m % args.eval_every]
    if bad:
        raise ValueError(f"milestones {bad} are not multiples of --eval-every {args.eval_every}")
    return {"models": list(args.models), "seeds": args.seeds, "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "lr": args.lr, "dtype": args.dtype, "mesh": args.mesh,
            "eval_every": args.eval_every, "eval_batches": args.eval_batches, "monitor_every": args.monitor_every,
            "checkpoint_every": args.checkpoint_every, "backend": args.backend, "log_every": args.log_every,
            "corpus": str(corpus.resolve()), "corpus_name": info.get("name", corpus.name),
            "corpus_output_sha256": info.get("output_sha256", meta["tokenizer"]["sha256"]),
            "corpus_license": info.get("license"), "corpus_train_tokens": meta["train_tokens"]}


def main(argv=None) -> dict | list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/fidelity_long")
    p.add_argument("--corpus", default="runs/corpus/cpython-stdlib", help="a prepared folder (prepare_corpus)")
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "qwen3-tiny"], help="model presets")
    p.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mesh", default="data=1,tensor=2")
    p.add_argument("--eval-every", type=int, default=125)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--monitor-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--backend", default="ffi", help="taco group math backend (ffi: the C++ CPU codec)")
    p.add_argument("--milestones", type=int, nargs="+", default=list(MILESTONES))
    p.add_argument("--train-window", type=int, default=50, help="steps averaged for the training-loss gap")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep a finished run's last checkpoint")
    p.add_argument("--analyze", action="store_true", help="tables and plots from the saved runs; train nothing")
    p.add_argument("--probe", nargs="+", metavar="MODEL", help="time a few steps of these models; write nothing")
    p.add_argument("--probe-steps", type=int, default=4)
    args = p.parse_args(argv)
    run = run_record(__spec__.name, argv)
    from taco_jax.util import jsonio

    out = pathlib.Path(args.out)
    if args.analyze:
        import json

        path = out / "study.json"
        if not path.is_file():
            raise SystemExit(f"--analyze: {path} does not exist (no study in --out {str(out)!r})")
        report = write_report(out, json.loads(path.read_text()), args.milestones, args.train_window, run)
        print((out / "report.md").read_text())
        return report
    study = study_settings(args)
    if args.probe:
        rows = probe(study, args.probe, args.probe_steps)
        print(jsonio.dumps(rows, indent=2))
        return rows
    study = check_study(out, study)
    run_study(study, out, keep_checkpoints=args.keep_checkpoints)
    report = write_report(out, study, args.milestones, args.train_window, run)
    print((out / "report.md").read_text())
    return report


if __name__ == "__main__":
    main()
