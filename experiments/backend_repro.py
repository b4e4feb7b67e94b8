"""Does training with a codec backend reproduce the `reference` backend's losses?

Runs the default `taco-jax train` config (`--comm taco`, 300 steps) for each backend and seed, then
applies the training-level rule of `taco_jax.kernels`:

  1. early steps: per-step training loss within 1e-4 relative of the reference run with the same
     seed, for the first `--early` steps (before reordered float sums compound);
  2. end of run: the backend's mean final validation loss over the seeds lies within two standard
     errors of the difference of the two means (seed-to-seed spread of both backends), i.e. the
     backend is indistinguishable from the reference at this run-to-run noise.

    python experiments/backend_repro.py --out runs/ffi_repro --seeds 0 1 2 3          # run + report
    python experiments/backend_repro.py --out runs/ffi_repro --seeds 0 1 2 3 --no-run # report only

Each run lands in `<out>/taco_<backend>_seed<k>/` (skipped if its summary.json exists); one run
takes about 3 to 4 min on 2 CPU cores, so four seeds of two backends take about 25 to 30 min.
Writes `<out>/report.json` and prints a table. Exit status 1 if the rule fails. Flags not listed
below are passed to `taco-jax train`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_dir(out: Path, backend: str, seed: int) -> Path:
    return out / f"taco_{backend}_seed{seed}"


def ensure_run(out: Path, backend: str, seed: int, extra: list[str]):
    d = run_dir(out, backend, seed)
    if (d / "summary.json").exists():
        return
    args = ["train", "--comm", "taco", "--backend", backend, "--seed", str(seed), "--no-progress", "--out", str(d),
            *extra]
    print("+ taco-jax", " ".join(args), flush=True)
    # this interpreter's taco_jax, as experiments/fidelity.py does (no venv on PATH needed)
    subprocess.run([sys.executable, "-m", "taco_jax.cli", *args], check=True, stdout=subprocess.DEVNULL)


def load(out: Path, backend: str, seed: int) -> tuple[np.ndarray, float]:
    d = run_dir(out, backend, seed)
    losses = np.array([json.loads(line)["loss"] for line in open(d / "metrics.jsonl")])
    return losses, json.loads((d / "summary.json").read_text())["final_val_loss"]


def report(out: Path, backend: str, seeds: list[int], early: int) -> dict:
    rows, ok_early = [], True
    for s in seeds:
        ref_loss, ref_val = load(out, "reference", s)
        loss, val = load(out, backend, s)
        rel = np.abs(loss - ref_loss) / np.abs(ref_loss)
        first_over = int(np.argmax(rel > 1e-4)) + 1 if (rel > 1e-4).any() else None
        ok = bool(rel[:early].max() <= 1e-4)
        ok_early &= ok
        rows.append(dict(seed=s, ref_val=ref_val, val=val, diff=val - ref_val, early_max_rel=float(rel[:early].max()),
                         first_step_over_1e4=first_over, early_ok=ok))
    ref_vals, vals = np.array([r["ref_val"] for r in rows]), np.array([r["val"] for r in rows])
    n = len(seeds)
    se = math.sqrt(ref_vals.var(ddof=1) / n + vals.var(ddof=1) / n) if n > 1 else float("nan")
    mean_diff = float(vals.mean() - ref_vals.mean())
    ok_end = bool(abs(mean_diff) <= 2 * se)
    return dict(backend=backend, seeds=seeds, early_steps=early, rows=rows, ref_mean=float(ref_vals.mean()),
                mean=float(vals.mean()), mean_diff=mean_diff, se_of_diff=se, ref_seed_std=float(ref_vals.std(ddof=1)),
                early_ok=ok_early, end_ok=ok_end, ok=ok_early and ok_end)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder holding the runs (created)")
    p.add_argument("--backend", default="ffi", help="backend compared with reference (default: ffi)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                   help="training seeds, at least 2: the end-of-run check needs their spread (default: 0 1 2 3)")
    p.add_argument("--early", type=int, default=10, help="steps checked against 1e-4 relative (default: 10)")
    p.add_argument("--no-run", action="store_true", help="only report on existing runs")
    args, extra = p.parse_known_args(argv)  # anything else goes to `taco-jax train`
    if len(set(args.seeds)) < 2:
        p.error(f"--seeds {' '.join(map(str, args.seeds))}: need 2 or more distinct seeds (the rule uses their spread)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_run:
        for s in args.seeds:
            for b in ("reference", args.backend):
                ensure_run(out, b, s, extra)
    r = report(out, args.backend, args.seeds, args.early)
    (out / "report.json").write_text(json.dumps(r, indent=1))
    head = ("seed", "reference", args.backend, "diff", "max rel (early)", "1st step > 1e-4")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (4, 10, 10, 8, 16, 16), strict=True)))
    for row in r["rows"]:
        print(f"{row['seed']:>4} {row['ref_val']:10.4f} {row['val']:10.4f} {row['diff']:+8.4f} "
              f"{row['early_max_rel']:16.1e} {str(row['first_step_over_1e4']):>16}")
    print(f"mean: reference {r['ref_mean']:.4f}, {args.backend} {r['mean']:.4f}, diff {r['mean_diff']:+.4f} "
          f"(2 SE = {2 * r['se_of_diff']:.4f}); reference seed std {r['ref_seed_std']:.4f}")
    print(f"early steps within 1e-4: {r['early_ok']}; mean final val within 2 SE: {r['end_ok']} -> "
          f"{'PASS' if r['ok'] else 'FAIL'}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
