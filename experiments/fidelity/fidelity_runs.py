"""Paired multi-seed fidelity runs: mean paired Δ final validation loss (compressed vs exact) with a 95 % CI.

For each model and each seed the exact run (`--comm none`) and each compressed variant train
with the same seed, i.e. the same initial parameters and the same data order, and are evaluated
on the same validation windows. Per seed the relative paired difference

    Δ_s = (L_variant,s − L_exact,s) / L_exact,s     (final validation loss, nats/token)

is taken; the report gives mean(Δ) with a two-sided 95 % t-interval over the seeds
(`paired_ci`, scipy.stats.t), the exact runs' own seed-to-seed spread (std of L_exact,s), and
the validation set's sampling noise: the standard error of the mean validation loss over the
validation batches (each batch's mean loss one sample) and the same for the per-batch paired
difference, i.e. how much Δ_s would move for another validation set of the same size.

One process per invocation: each variant's train step is compiled once and reused for every seed
(the seed only changes the initial parameters and the data stream, not the program).

    python -m experiments.fidelity.fidelity_runs --out runs/fidelity_runs --models gpt2-tiny qwen3-tiny \
        --variants none taco int8 --seeds 8 --steps 100
    python -m experiments.fidelity.fidelity_runs --quick --out /tmp/fr     # format check, seconds

Writes `<out>/runs.jsonl` (one line per finished (model, variant, seed): resumable; a line
already there is not rerun), `<out>/report.json` (strict JSON), `<out>/report.md` and
`<out>/paired_delta.png`. Variants: `none` (exact) and the codecs of `taco_jax.codec.presets.NAMED`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time

from experiments.common import cpu_devices, run_record

if "jax" not in sys.modules:  # simulated CPU devices for the mesh (a few idle extra ones cost nothing)
    cpu_devices(8)

import numpy as np  # noqa: E402

#: Two-sided confidence of the reported intervals.
CONFIDENCE = 0.95


def paired_ci(deltas, confidence: float = CONFIDENCE) -> dict:
    """Mean of paired differences with a two-sided Student-t confidence interval.

    Args:
      deltas: 1-D sequence of n >= 2 finite paired differences (any unit; e.g. % of exact loss).
      confidence: two-sided level in (0, 1).
    Returns: dict n, mean, std (sample, ddof=1), sem = std/√n, t (the t quantile, n−1 degrees of
      freedom), half_width = t·sem, lo, hi.
    Raises: ValueError for fewer than 2 values, a non-finite value or confidence outside (0, 1).
    Source: the paired t-interval (e.g. scipy.stats.ttest_rel(...).confidence_interval()).
    """
    from scipy import stats

    d = np.asarray(deltas, dtype=np.float64).ravel()
    if d.size < 2:
        raise ValueError(f"deltas has {d.size} value(s); a t-interval needs at least 2")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"deltas={d.tolist()} holds a non-finite value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie in (0, 1)")
    n, mean, std = d.size, float(d.mean()), float(d.std(ddof=1))
    sem = std / math.sqrt(n)
    t = float(stats.t.ppf(0.5 + confidence / 2, n - 1))
    return {"n": n, "mean": mean, "std": std, "sem": sem, "t": t, "half_width": t * sem,
            "lo": mean - t * sem, "hi": mean + t * sem}


def variant_policy(name: str, backend: str):
    """`CommPolicy` of a variant: every tensor-axis site with `NAMED[name]` (backend set), or exact."""
    from taco_jax.codec.presets import NAMED
    from taco_jax.collectives.policy import TENSOR_SITES, CommPolicy

    if name not in NAMED:
        raise ValueError(f"variant={name!r} is not one of {sorted(NAMED)}")
    codec = NAMED[name]
    if codec.kind != "none":
        codec = dataclasses.replace(codec, backend=backend)
    return CommPolicy(**dict.fromkeys(TENSOR_SITES, codec))


class SeedRunner:
    """One variant's train step compiled once; `run(seed)` trains from that seed's initial
    parameters and data order and returns the validation losses per batch at the end.

    `keep_at`: steps after which a host copy of the parameters is kept (`run(...)["params"]`;
    step 0 = the initial parameters), for `experiments/fidelity/grad_fidelity.py`.
    """

    def __init__(self, cfg, ds, devices):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from taco_jax.data import eval_batches
        from taco_jax.parallel.mesh import DATA
        from taco_jax.train import distributed as dist
        from taco_jax.train.step import make_trainer

        self.cfg, self.ds = cfg, ds
        self.trainer = make_trainer(cfg, devices)
        mesh = self.trainer.mesh
        self.batch_sharding = NamedSharding(mesh, P(*(a for a in (DATA,) if a in mesh.axis_names)))
        self.val = [dist.global_arrays(self.batch_sharding, x, y) for x, y in
                    eval_batches(ds.val, cfg.data.batch_size, cfg.data.seq_len, max_batches=cfg.logging.eval_batches)]
        t0 = time.perf_counter()
        params, opt_state = self.trainer.init()
        batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), np.int32, sharding=self.batch_sharding)
        self.train_step = self.trainer.train_step.lower(params, opt_state, batch, batch).compile()
        self.eval_step = self.trainer.eval_step
        self.compile_s = time.perf_counter() - t0

    def init(self, seed: int):
        t = dataclasses.replace(self.trainer, cfg=self.cfg.replace(seed=seed))
        return t.init()

    def evaluate(self, params) -> np.ndarray:
        """Mean loss of each validation batch (float64 [n_batches])."""
        return np.array([float(self.eval_step(params, x, y)) for x, y in self.val])

    def run(self, seed: int, keep_at=()) -> dict:
        import jax

        from taco_jax.data import TokenStream

        t0 = time.perf_counter()
        params, opt_state = self.init(seed)
        batches = TokenStream(self.ds.train, self.cfg.data.batch_size, self.cfg.data.seq_len, seed=seed)
        host = functools.partial(np.array, copy=True)  # a copy: the next step donates the buffers
        kept = {0: jax.tree.map(host, params)} if 0 in keep_at else {}
        loss = float("nan")
        for step in range(1, self.cfg.training.steps + 1):
            x, y = batches.next(self.batch_sharding)
            params, opt_state, m = self.train_step(params, opt_state, x, y)
            loss = float(m["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(f"seed {seed}: loss {loss} at step {step} ({self.cfg.communication.label})")
            if step in keep_at:
                kept[step] = jax.tree.map(host, params)
        val = self.evaluate(params)
        return {"seed": seed, "final_val_loss": float(val.mean()), "final_train_loss": loss,
                "val_batch_losses": val.tolist(), "wall_s": time.perf_counter() - t0, "params": kept}


def base_config(args, model: str):
    from taco_jax.train.config import TrainConfig

    return TrainConfig.from_flags(model=model, mesh=args.mesh, steps=args.steps, batch_size=args.batch_size,
                                  seq_len=args.seq_len, eval_batches=args.eval_batches, lr=args.lr, dtype=args.dtype,
                                  out=str(pathlib.Path(args.out) / "unused"))


def _read_done(path: pathlib.Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r["variant"], r["seed"])] = r
    return done


def summarize(records: list[dict], variants: list[str], models: list[str]) -> dict:
    """Per model: the exact runs' spread and validation noise, and per compressed variant the paired
    Δ (% of exact) with its CI and the per-seed validation noise of Δ."""
    out = {}
    for model in models:
        by = {(r["variant"], r["seed"]): r for r in records if r["model"] == model}
        exact = {s: r for (v, s), r in by.items() if v == "none"}
        seeds = sorted(exact)
        if not seeds:
            continue
        ex = np.array([exact[s]["final_val_loss"] for s in seeds])
        nb = len(exact[seeds[0]]["val_batch_losses"])
        se_val = [np.std(exact[s]["val_batch_losses"], ddof=1) / math.sqrt(nb) if nb > 1 else float("nan")
                  for s in seeds]
        m = {"seeds": seeds, "exact": {
            "final_val_loss": ex.tolist(), "mean": float(ex.mean()),
            "seed_std": float(ex.std(ddof=1)) if len(ex) > 1 else float("nan"),
            "seed_std_pct": float(100 * ex.std(ddof=1) / ex.mean()) if len(ex) > 1 else float("nan"),
            "val_batches": nb, "val_tokens": int(nb * records[0]["tokens_per_batch"]),
            "val_sem_mean": float(np.mean(se_val)),
            "val_sem_pct": float(100 * np.mean(se_val) / ex.mean())}, "variants": {}}
        for v in variants:
            if v == "none":
                continue
            ss = [s for s in seeds if (v, s) in by]
            if not ss:
                continue
            d = np.array([100 * (by[(v, s)]["final_val_loss"] - exact[s]["final_val_loss"])
                          / exact[s]["final_val_loss"] for s in ss])
            # validation noise of Δ: SE over validation batches of the per-batch relative difference
            se_d = []
            for s in ss:
                a, b = np.array(exact[s]["val_batch_losses"]), np.array(by[(v, s)]["val_batch_losses"])
                se_d.append(100 * np.std((b - a) / a, ddof=1) / math.sqrt(len(a)) if len(a) > 1 else float("nan"))
            ci = paired_ci(d) if len(d) > 1 else {"n": len(d), "mean": float(d.mean())}
            m["variants"][v] = {"delta_pct": d.tolist(), "ci95": ci, "val_sem_of_delta_pct": float(np.mean(se_d)),
                                "final_val_loss": [by[(v, s)]["final_val_loss"] for s in ss],
                                "config": by[(v, ss[0])]["codec"]}
        out[model] = m
    return out


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"Paired runs: {meta['steps']} steps, batch {meta['batch_size']} × {meta['seq_len']}, mesh "
             f"{meta['mesh']}, lr {meta['lr']}, dtype {meta['dtype']}, backend {meta['backend']}; "
             f"95 % t-interval over seeds.", "",
             "| model | variant | n seeds | mean paired Δ val loss | 95 % CI half-width | CI | exact mean (seed std) "
             "| val noise of Δ (SE) | val noise of loss (SE) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, m in summary.items():
        e = m["exact"]
        for v, r in m["variants"].items():
            ci = r["ci95"]
            hw = ci.get("half_width", float("nan"))
            lines.append(f"| {model} | {v} | {ci['n']} | {ci['mean']:+.3f} % | ±{hw:.3f} % | "
                         f"[{ci.get('lo', float('nan')):+.3f}, {ci.get('hi', float('nan')):+.3f}] % | "
                         f"{e['mean']:.4f} ({e['seed_std']:.4f} = {e['seed_std_pct']:.2f} %) | "
                         f"{r['val_sem_of_delta_pct']:.4f} % | {e['val_sem_pct']:.3f} % |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary)
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        vs = list(summary[model]["variants"])
        for i, v in enumerate(vs):
            r = summary[model]["variants"][v]
            d = np.array(r["delta_pct"])
            ax.scatter(np.full(d.size, i) + np.linspace(-0.15, 0.15, d.size), d, s=12, alpha=0.6)
            ci = r["ci95"]
            if "half_width" in ci:
                ax.errorbar(i + 0.3, ci["mean"], yerr=ci["half_width"], fmt="ks", capsize=4, ms=5)
        ax.axhline(0, color="k", lw=0.7)
        ax.set_xticks(range(len(vs)), vs)
        ax.set(title=f"{model}: paired Δ vs exact", ylabel="Δ final val loss (%)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/fidelity_runs")
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "qwen3-tiny"])
    p.add_argument("--variants", nargs="+", default=["none", "taco", "int8"],
                   help="'none' (exact, always run) and names of taco_jax.codec.presets.NAMED")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=1000, help="validation batches (default: all windows)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mesh", default="data=1,tensor=2")
    p.add_argument("--backend", default="ffi", help="taco group math backend (ffi: the C++ CPU codec)")
    p.add_argument("--quick", action="store_true", help="format check: 2 seeds, 3 steps, tiny batches")
    args = p.parse_args(argv)
    run = run_record(__spec__.name, argv)
    if args.quick:
        args.seeds, args.steps, args.batch_size, args.seq_len, args.eval_batches = 2, 3, 2, 32, 2
    if args.eval_batches < 1:  # the study measures validation losses
        p.error(f"--eval-batches {args.eval_batches}: the study compares validation losses; give 1 or more")
    variants = ["none"] + [v for v in args.variants if v != "none"]
    import jax

    from taco_jax.data import load_shakespeare
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.util import jsonio

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_dev = math.prod(parse_mesh(args.mesh).values())
    devices = jax.devices()[:n_dev]
    runs_path = out / "runs.jsonl"
    done = _read_done(runs_path)
    ds = load_shakespeare(2048)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    compile_s = 0.0
    for v in variants:  # variant-major: an interrupted invocation leaves whole variants for every model
        for model in args.models:
            todo = [s for s in range(args.seeds) if (model, v, s) not in done]
            if not todo:
                continue
            cfg = base_config(args, model).replace(policy=variant_policy(v, args.backend))
            runner = SeedRunner(cfg, ds, devices)
            compile_s += runner.compile_s
            for s in todo:
                r = runner.run(s)
                r.pop("params")
                rec = {"model": model, "variant": v, "codec": cfg.communication.label, **r,
                       "tokens_per_batch": args.batch_size * args.seq_len}
                done[(model, v, s)] = rec
                with open(runs_path, "a") as f:
                    f.write(jsonio.dumps(rec) + "\n")
                print(f"[fidelity_runs] {model} {v} seed {s}: val {r['final_val_loss']:.4f} "
                      f"({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    records = [r for (m, v, s), r in done.items() if m in args.models and v in variants and s < args.seeds]
    summary = summarize(records, variants, args.models)
    meta = {k: getattr(args, k) for k in ("models", "variants", "seeds", "steps", "batch_size", "seq_len",
                                          "eval_batches", "lr", "dtype", "mesh", "backend")}
    meta.update(command=run["command"],
                this_invocation_cpu_s=time.process_time() - cpu0, this_invocation_wall_s=time.perf_counter() - t0,
                this_invocation_compile_s=compile_s, cpu_count=os.cpu_count(),
                run_wall_s_total=float(sum(r["wall_s"] for r in records)))
    report = {"run": run, "meta": meta, "summary": summary}
    jsonio.write(out / "report.json", report)
    (out / "report.md").write_text(markdown(summary, meta))
    plot(summary, out / "paired_delta.png")
    print((out / "report.md").read_text())
    return report


if __name__ == "__main__":
    main()
