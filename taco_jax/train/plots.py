"""Plots of a run's metrics: the loss curves of one or more runs, and the fidelity monitor's SQNR."""

from __future__ import annotations

import math
import pathlib

from taco_jax.collectives.policy import SITES
from taco_jax.util.jsonio import read_metrics


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
    if ev:  # none with --eval-batches 0
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

    runs: {legend label: path of the run's metrics.jsonl}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, metrics in runs.items():
        recs = read_metrics(metrics)
        line, = ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, alpha=0.7,
                        label=f"{label}: train")
        ev = [r for r in recs if "val_loss" in r]
        if ev:  # none with --eval-batches 0
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
