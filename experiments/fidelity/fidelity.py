"""Fidelity of the codec family on real captured TP messages (site × codec table + plot) and the convergence ablation.

Exact commands behind docs/fidelity.md (2-core CPU, simulated data=2 × tensor=4 mesh):

    taco-jax train --comm none --capture 8 --out runs/fidelity/capture
    taco-jax train --comm none --sequence-parallel --capture 8 --out runs/fidelity/capture_sp
    taco-jax calibrate --captures runs/fidelity/capture/captures --out runs/fidelity/policy.json
    taco-jax calibrate --captures runs/fidelity/capture_sp/captures --out runs/fidelity/policy_sp.json
    taco-jax calibrate --captures runs/fidelity/capture/captures --out runs/fidelity/policy_fp8.json \
        --kinds fp8_tensor fp8_group taco
    python -m experiments.fidelity.fidelity table \
        --captures runs/fidelity/capture/captures runs/fidelity/capture_sp/captures \
        --policies runs/fidelity/policy.json runs/fidelity/policy_sp.json --out runs/fidelity/table
    python -m experiments.fidelity.fidelity ablation --policy runs/fidelity/policy.json \
        --policy-fp8 runs/fidelity/policy_fp8.json --out runs/fidelity/ablation \
        --variants none fp8_tensor fp8_group int8 taco taco_folded calibrated calibrated_fp8 tah

`table` evaluates every named codec (and the calibrated per-site choice) on the *held-out*
captured messages (the captured steps `taco-jax calibrate` did not see), per site and per role
(e.g. ar_fwd after attention vs after MLP), and plots held-out SQNR against wire bytes for all
132 candidates of the calibration. `ablation` trains the default GPT config once per codec
(`taco-jax train`, same seed and data order) and tabulates the final validation loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

from taco_jax.codec import CodecConfig
from taco_jax.codec.presets import NAMED
from taco_jax.collectives.policy import CommPolicy
from taco_jax.launch import child_env, cli_command
from taco_jax.train.calibrate import evaluate, split_messages
from taco_jax.train.capture import load_captures
from taco_jax.util import jsonio

#: Ablation variants: name -> `taco-jax train` flags (the paper's ablation table, plus the calibrated policy).
VARIANTS = {
    "none": ["--comm", "none"],
    "fp8_tensor": ["--comm", "taco", "--codec-kind", "fp8_tensor"],
    "fp8_group": ["--comm", "taco", "--codec-kind", "fp8_group"],
    "int8": ["--comm", "taco", "--codec-kind", "int8"],
    "taco": ["--comm", "taco"],
    "taco_folded": ["--comm", "taco", "--scale-layout", "folded"],
    "calibrated": ["--comm", "taco", "--policy", "{policy}"],
    "calibrated_fp8": ["--comm", "taco", "--policy", "{policy_fp8}"],  # calibrated among FP8 codecs only
    "tah": ["--comm", "taco", "--codec-kind", "tah"],
    "int4_had": ["--comm", "taco", "--codec-kind", "int4"],  # + Hadamard: set through a policy file below
}


def _role_class(site: str, role: str, what: str) -> str:
    """Direction and kind of a message: ("ar_fwd", "exit03", "h1.attn") -> "fwd: after attn".

    Forward messages leave a TP block (ctx.exit: all-reduce or reduce-scatter of partial sums) or
    enter one (ctx.enter with SP: all-gather of the sequence shard); backward ones are the
    cotangents of the other direction.
    """
    fwd = site == "ar_fwd" or (site == "all_gather") == role.startswith("enter")
    kind = re.sub(r"\d+$", "", re.sub(r"^h\d+\.", "", what))
    kind = {"attn": "after attn", "mlp": "after MLP", "embed": "after embedding", "attn_in": "into attn",
            "mlp_in": "into MLP", "lm_head_in": "into LM head"}.get(kind, kind)
    return f"{'fwd' if fwd else 'bwd'}: {kind}"


def _db(v):
    return "∞" if v == math.inf else f"{v:.2f}"


def table(captures: list[str], policies: list[str], out: str, max_messages: int = 24) -> dict:
    """Site/role × codec table on held-out captured messages; writes table.md, table.json, sqnr_vs_bytes.png."""
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, md = [], []
    for cap, pol_path in zip(captures, policies, strict=True):
        meta, msgs = load_captures(cap)
        held = split_messages(msgs, None)["heldout"]
        policy = CommPolicy.from_json(pol_path)
        for site, site_msgs in held.items():
            groups = {"all": site_msgs}
            for m in sorted(site_msgs, key=lambda m: _role_class(m.site, m.role, m.what)):
                groups.setdefault(_role_class(m.site, m.role, m.what), []).append(m)
            codecs = dict(NAMED)
            codecs["calibrated"] = getattr(policy, site)
            for role, ms in groups.items():
                if max_messages and len(ms) > max_messages:
                    ms = [ms[i] for i in np.linspace(0, len(ms) - 1, max_messages).round().astype(int)]
                for name, c in codecs.items():
                    r = evaluate(c, ms)
                    rows.append({"captures": cap, "site": site, "role": role, "codec": name, "config": c.name, **r})
                print(f"[table] {site}/{role}: {len(ms)} messages", file=sys.stderr, flush=True)
    (out_dir / "table.json").write_text(jsonio.dumps(rows, indent=1))
    names = list(NAMED) + ["calibrated"]
    for metric, label in (("sqnr_db", "SQNR (dB)"), ("max_rel_err", "max rel. error ‖e‖∞/‖x‖∞"),
                          ("cosine", "cosine similarity")):
        per_role = metric == "sqnr_db"  # the other metrics: one row per site
        md += [f"**{label}** (held-out messages{', per site and message kind' if per_role else ''})", "",
               "| site / messages | n | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        keys = list(dict.fromkeys((r["site"], r["role"]) for r in rows if per_role or r["role"] == "all"))
        for site, role in keys:
            sel = {r["codec"]: r for r in rows if r["site"] == site and r["role"] == role}
            fmt = {"sqnr_db": _db, "max_rel_err": lambda v: f"{v:.4f}", "cosine": lambda v: f"{v:.6f}"}[metric]
            md.append(f"| {site} / {role} | {sel['none']['messages']} | "
                      + " | ".join(fmt(sel[n][metric]) for n in names) + " |")
        md.append("")
    bpe = {n: c.wire_bytes_per_element() for n, c in NAMED.items()}
    md += ["**wire bytes / element** (large-message limit; exact per message in table.json): "
           + ", ".join(f"{n} {v:.4f}" for n, v in bpe.items()) + "; calibrated: per site, see the policy.", ""]
    (out_dir / "table.md").write_text("\n".join(md) + "\n")
    plot(policies, out_dir / "sqnr_vs_bytes.png")
    return {"rows": len(rows), "markdown": str(out_dir / "table.md")}


def plot(policies: list[str], path) -> None:
    """Held-out SQNR vs wire bytes/element of every calibration candidate, per site (from the calibrate reports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from taco_jax.codec import get_kind

    reports = [json.loads(pathlib.Path(p).with_suffix(".report.json").read_text()) for p in policies]
    panels = [(rep, s) for rep in reports for s in rep["sites"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (rep, site) in zip(axes[0], panels, strict=True):
        for row in rep["table"]:
            r = row["heldout"].get(site)
            if r is None:
                continue
            kind = row["config"]["kind"]  # drawn in its registry entry's colour (taco_jax.codec.kinds)
            ax.scatter(r["bytes_per_elt"], float(r["sqnr_db"]), s=10, color=get_kind(kind).color, alpha=0.6,
                       label=kind if kind not in ax.get_legend_handles_labels()[1] else None)
        choice = rep["sites"][site]
        ax.scatter(choice["heldout"]["bytes_per_elt"], float(choice["heldout"]["sqnr_db"]), marker="*", s=180,
                   color="black", label=f"calibrated: {choice['choice']}")
        ax.axvline(rep["budget_bytes_per_element"], ls="--", color="k", lw=0.7)
        ax.set(title=site, xlabel="wire bytes / element", ylabel="held-out SQNR (dB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ablation(policy: str, out: str, variants: list[str], steps: int | None, extra: list[str],
             policy_fp8: str | None = None) -> dict:
    """Trains once per variant with `taco-jax train` (skips variants already done); writes ablation.md/json."""
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in variants:
        run = out_dir / name
        flags = [f.format(policy=policy, policy_fp8=policy_fp8) for f in VARIANTS[name]]
        if name == "int4_had":
            p = out_dir / "int4_had_policy.json"
            CommPolicy.taco(CodecConfig(kind="int4", hadamard=True)).to_json(p)
            flags = ["--comm", "none", "--policy", str(p)]
        cmd = ["taco-jax", "train", *flags, "--out", str(run), "--no-progress", *extra]
        if steps:
            cmd += ["--steps", str(steps)]
        if not (run / "summary.json").exists():
            print("[ablation]", " ".join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cli_command(*cmd[1:]), check=True, env=child_env(os.environ))
        s = json.loads((run / "summary.json").read_text())
        results[name] = {"command": " ".join(cmd), "final_val_loss": s["final_val_loss"],
                         "final_train_loss": s["final_train_loss"], "steps": s["steps"],
                         "tensor_wire_bytes_per_step": s["wire_bytes_per_step"].get("tensor", 0),
                         "train_wall_s": s["train_wall_s"]}
    base = results.get("none")
    md = ["| codec | final val loss | Δ vs none | tensor-axis wire bytes / step / device | × none |",
          "|---|---|---|---|---|"]
    for name, r in results.items():
        d = (r["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"] if base else float("nan")
        ratio = r["tensor_wire_bytes_per_step"] / base["tensor_wire_bytes_per_step"] if base else float("nan")
        md.append(f"| {name} | {r['final_val_loss']:.4f} | {d:+.2%} | {r['tensor_wire_bytes_per_step']:,} "
                  f"| {ratio:.3f} |")
    (out_dir / "ablation.md").write_text("\n".join(md) + "\n")
    (out_dir / "ablation.json").write_text(jsonio.dumps(results, indent=2))
    _plot_losses(out_dir, list(results))
    return results


def _plot_losses(out_dir: pathlib.Path, names: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        recs = [json.loads(line) for line in open(out_dir / n / "metrics.jsonl")]
        ev = [r for r in recs if "val_loss" in r]
        ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", ms=3, label=n)
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="GPT on Shakespeare: TP codec ablation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "val_loss.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--captures", nargs="+", required=True)
    t.add_argument("--policies", nargs="+", required=True, help="one calibrated policy per captures folder")
    t.add_argument("--out", default="runs/fidelity/table")
    t.add_argument("--max-messages", type=int, default=24, help="held-out messages per site/role")
    a = sub.add_parser("ablation")
    a.add_argument("--policy", required=True, help="calibrated policy for the 'calibrated' variant")
    a.add_argument("--policy-fp8", default=None, help="policy calibrated among FP8 kinds (variant calibrated_fp8)")
    a.add_argument("--out", default="runs/fidelity/ablation")
    a.add_argument("--variants", nargs="+", default=["none", "fp8_tensor", "fp8_group", "int8", "taco", "taco_folded",
                                                     "calibrated"], choices=list(VARIANTS))
    a.add_argument("--steps", type=int, default=None, help="override the default 300 steps")
    a.add_argument("extra", nargs="*", help="more `taco-jax train` flags (after --)")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(jsonio.dumps(table(args.captures, args.policies, args.out, args.max_messages), indent=2))
    else:
        res = ablation(args.policy, args.out, args.variants, args.steps, args.extra, args.policy_fp8)
        print(jsonio.dumps({k: v["final_val_loss"] for k, v in res.items()}, indent=2))


if __name__ == "__main__":
    main()
