"""Data-driven reshaping: choose each site's codec from captured messages (`taco-jax calibrate`).

TACO (arXiv 2604.24088) chooses how a `[tokens, hidden]` message is cut into groups from the
data's statistics; its criterion is not public (TACO_SPEC.md §2). Ours, stated exactly:

  Data: the messages of `taco-jax train --capture N` (every tensor rank, data rank 0). Captured
  steps are split alternately: steps 1st, 3rd, 5th, ... calibrate; 2nd, 4th, ... are held out
  (with a single captured step, its messages alternate instead).
  Candidates: `candidates()`, every kind marked for calibration with every parameter it takes. Per-site objective:
  maximise SQNR_s(c) = 10·log10(Σ‖x‖² / Σ‖x − decode(encode(x))‖²) over the site's messages, subject to
  wire_bytes_per_element(c, n) ≤ budget (default 1.0625 B/elt, the spec's TACO setting: 0.53× bf16). Ties (within
  0.01 dB, or the same infinite SQNR) go to fewer bytes. A message holding NaN/±Inf is left out of both splits and
  reported ("excluded"). Policy objective (to compare policies): the mean over sites of the held-out SQNR (dB).

The report compares the calibrated policy on the held-out messages with every fixed choice (one
candidate on every site), including the best one picked with hindsight."""

from __future__ import annotations

import functools
import itertools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import CodecConfig, cosine, max_rel_error, roundtrip, sqnr_db
from taco_jax.codec.config import GROUP_AXES, GROUP_SIZES
from taco_jax.codec.kinds import FP8_FMTS, registered
from taco_jax.collectives.policy import POLICY_FORMAT, TENSOR_SITES, CommPolicy
from taco_jax.train.capture import Message, load_captures
from taco_jax.util import jsonio

#: Default wire-byte budget per element: TACO's own setting (E4M3, G = 128, two FP32 scales: 1 + 8/128).
DEFAULT_BUDGET = CodecConfig().wire_bytes_per_element()
#: SQNR differences within this many dB are ties, broken by fewer wire bytes.
TIE_DB = 0.01


def candidates() -> list[CodecConfig]:
    """The search space from the kinds with `calibrate` set (`taco_jax.codec.kinds`, registration
    order): per-message-scale kinds in each FP8 format, then per G and group axis each grouped kind
    with every format, Hadamard and scale layout it takes (132 codecs for the built-in kinds)."""
    kinds = [k for k in registered() if k.calibrate]
    out = [CodecConfig(**v) for k in kinds if not k.grouped for v in _variants(k)]
    for g, axis in itertools.product(GROUP_SIZES, GROUP_AXES):
        out += [CodecConfig(**v, group_size=g, group_axis=axis) for k in kinds
                if k.grouped and g in k.group_sizes for v in _variants(k)]
    return out


def _variants(kind) -> list[dict]:
    """Codec fields of `kind` (without G and group axis): every FP8 format × Hadamard × scale layout it takes."""
    fmts = FP8_FMTS if kind.fp8 else (None,)
    hads = (False, True) if kind.hadamard == "optional" else (False,)
    return [{"kind": kind.name, **({"fmt": f} if f else {}), **({"hadamard": True} if h else {}),
             **({"scale_layout": lay} if lay != "dual" else {})}
            for f, h, lay in itertools.product(fmts, hads, kind.scale_layouts)]


def split_messages(msgs: list[Message], max_per_split: int | None = 16) -> dict[str, dict[str, list[Message]]]:
    """{"calib"|"heldout": {site: messages}}: alternate captured steps (see the module docstring),
    then at most `max_per_split` messages per site, evenly spaced over (step, role, rank)."""
    steps = sorted({m.step for m in msgs})
    out = {"calib": {}, "heldout": {}}
    for site in sorted({m.site for m in msgs}):
        ms = sorted((m for m in msgs if m.site == site), key=lambda m: (m.step, m.role, m.rank))
        if len(steps) >= 2:
            cal = [m for m in ms if steps.index(m.step) % 2 == 0]
            held = [m for m in ms if steps.index(m.step) % 2 == 1]
        else:
            cal, held = ms[0::2], ms[1::2]
        for name, part in (("calib", cal), ("heldout", held)):
            if max_per_split and len(part) > max_per_split:
                idx = np.linspace(0, len(part) - 1, max_per_split).round().astype(int)
                part = [part[i] for i in idx]
            out[name][site] = part
    return out


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip(x: jax.Array, cfg: CodecConfig) -> jax.Array:
    """x [M, *msg] -> decode(encode(x)) per message, float32."""
    return roundtrip(x, cfg, batch_dims=1).astype(jnp.float32)


def evaluate(cfg: CodecConfig, msgs: list[Message]) -> dict:
    """SQNR (dB), max relative error (‖e‖∞/‖x‖∞, worst message), cosine (`taco_jax.codec.metrics`,
    float64) and wire B/elt of `cfg` on `msgs` (decoded in one jitted call per message shape).

    Raises: ValueError naming the site and step of a message holding NaN/±Inf."""
    for m in msgs:
        if not np.isfinite(m.x).all():
            raise ValueError(f"message {m.site} step {m.step} ({m.role}, rank {m.rank}) holds NaN/Inf")
    xs = [m.x for m in msgs]
    ys = list(xs)
    if cfg.kind != "none":
        by_shape: dict[tuple, list[int]] = {}
        for i, x in enumerate(xs):
            by_shape.setdefault(x.shape, []).append(i)
        for idx in by_shape.values():
            decoded = np.asarray(_roundtrip(jnp.asarray(np.stack([xs[i] for i in idx])), cfg))
            for i, y in zip(idx, decoded):
                ys[i] = y
    return {"sqnr_db": sqnr_db(xs, ys), "max_rel_err": max_rel_error(xs, ys), "cosine": cosine(xs, ys),
            "bytes_per_elt": cfg.wire_bytes_per_element(jnp.float32, n=xs[0].size), "messages": len(msgs)}


def _better(sqnr: float, nbytes: float, best_sqnr: float | None, best_bytes: float | None) -> bool:
    """Objective order: higher SQNR; a tie (within TIE_DB, or the same infinity) -> fewer bytes."""
    if best_sqnr is None:
        return True
    tie = sqnr == best_sqnr or (math.isfinite(sqnr) and math.isfinite(best_sqnr) and abs(sqnr - best_sqnr) <= TIE_DB)
    return nbytes < best_bytes if tie else sqnr > best_sqnr


def _best(items, sqnr, nbytes):
    """The best of `items` in the objective order (`_better`); sqnr / nbytes: item -> value."""
    best = None
    for it in items:
        if best is None or _better(sqnr(it), nbytes(it), sqnr(best), nbytes(best)):
            best = it
    return best


def nonfinite_messages(msgs: list[Message]) -> list[dict]:
    """Where the messages holding NaN/±Inf are: [{"site", "step", "role", "what", "rank"}]."""
    return [{"site": m.site, "step": m.step, "role": m.role, "what": m.what, "rank": m.rank}
            for m in msgs if not np.isfinite(m.x).all()]


def _fmt_db(v: float) -> str:
    return "∞" if v == math.inf else f"{v:.2f}"


def calibrate(captures, out, *, budget: float = DEFAULT_BUDGET, max_messages: int = 16,
              cands: list[CodecConfig] | None = None, progress: bool = True) -> dict:
    """Chooses a codec per captured tensor site; writes the policy file `out` and `<out>.report.json`/`.md`.

    `captures`: the `<run>/captures` folder of `taco-jax train --capture N` (or the run folder); `out`: policy JSON
    path (for `taco-jax train --policy FILE`); `budget`: largest wire bytes per element a chosen codec may use;
    `max_messages`: messages per site in each split (0: all); `cands`: the candidate codecs (default `candidates()`).
    Returns: the report dict (also written next to `out`).
    Raises: ValueError for a folder without captures, a budget no candidate meets, or max_messages < 0."""
    captures = pathlib.Path(captures)
    if not (captures / "meta.json").exists() and (captures / "captures" / "meta.json").exists():
        captures = captures / "captures"
    if not budget > 0:
        raise ValueError(f"budget={budget!r} must be > 0 bytes per element")
    if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 0:
        raise ValueError(f"max_messages={max_messages!r} must be an integer >= 0 (messages per site in each split; "
                         "0: all)")
    meta, msgs = load_captures(captures)
    msgs = [m for m in msgs if m.site in TENSOR_SITES]
    excluded = nonfinite_messages(msgs)
    if excluded:  # reported, then left out (their SQNR is -inf or NaN for every candidate)
        where = sorted({(e["site"], e["step"]) for e in excluded})
        print(f"[calibrate] excluded {len(excluded)} message(s) holding NaN/Inf at (site, step) {where}",
              file=sys.stderr, flush=True)
        msgs = [m for m in msgs if np.isfinite(m.x).all()]
    if not msgs:
        raise ValueError(f"captures={str(captures)!r}: no finite tensor-site message to calibrate on")
    split = split_messages(msgs, max_messages)
    sites = sorted(split["calib"])
    cands = list(cands or candidates())
    if CodecConfig() not in cands:
        cands.append(CodecConfig())  # the TACO default is always reported
    for s in sites:  # a budget no candidate meets, refused before evaluating any (bytes need no roundtrip)
        n = split["calib"][s][0].x.size if split["calib"][s] else None
        if n and not any(c.wire_bytes_per_element(jnp.float32, n=n) <= budget + 1e-12 for c in cands):
            raise ValueError(f"budget={budget} bytes/element: no candidate codec fits site {s!r}")
    # 1. every candidate on every site and split
    table = []
    for i, c in enumerate(cands):
        row = {"codec": c.name, "config": c.to_dict()}
        for part in ("calib", "heldout"):
            row[part] = {s: evaluate(c, split[part][s]) for s in sites if split[part][s]}
        table.append(row)
        if progress and ((i + 1) % 20 == 0 or i + 1 == len(cands)):
            print(f"[calibrate] {i + 1}/{len(cands)} candidates evaluated", file=sys.stderr, flush=True)
    # 2. per site: the best feasible candidate on the calibration split
    choice = {}
    for s in sites:
        feasible = [row for row in table if s in row["calib"] and row["calib"][s]["bytes_per_elt"] <= budget + 1e-12]
        if not feasible:
            raise ValueError(f"budget={budget} bytes/element: no candidate codec fits site {s!r}")
        choice[s] = _best(feasible, lambda row, s=s: row["calib"][s]["sqnr_db"],
                          lambda row, s=s: row["calib"][s]["bytes_per_elt"])
    # 3. compare on held-out: calibrated vs every fixed feasible choice (same codec on every site)
    held_sites = [s for s in sites if split["heldout"].get(s)]

    def score(rows_by_site):
        return float(np.mean([rows_by_site[s]["heldout"][s]["sqnr_db"] for s in held_sites]))

    calibrated = score(choice)
    fixed = []
    for row in table:
        feasible = all(row["heldout"][s]["bytes_per_elt"] <= budget + 1e-12 for s in held_sites)
        calib_score = float(np.mean([row["calib"][s]["sqnr_db"] for s in sites]))
        fixed.append({"codec": row["codec"], "feasible": feasible, "calib_mean_sqnr_db": calib_score,
                      "heldout_mean_sqnr_db": score({s: row for s in sites}),
                      "heldout": {s: row["heldout"][s]["sqnr_db"] for s in held_sites},
                      "bytes_per_elt": {s: row["heldout"][s]["bytes_per_elt"] for s in held_sites}})
    feas = [f for f in fixed if f["feasible"]]
    most_bytes = lambda f: max(f["bytes_per_elt"].values(), default=0.0)  # noqa: E731
    best_hind = _best(feas, lambda f: f["heldout_mean_sqnr_db"], most_bytes)
    best_cal = _best(feas, lambda f: f["calib_mean_sqnr_db"], most_bytes)
    taco = next(f for f in fixed if f["codec"] == CodecConfig().name)
    objective = (f"per site: maximise SQNR (dB, energy-weighted over the site's calibration messages) subject to "
                 f"wire bytes/element <= {budget}; ties within {TIE_DB} dB -> fewer bytes. "
                 "Policy score: mean over sites of held-out SQNR (dB).")
    per_site = {s: {"choice": choice[s]["codec"], "config": choice[s]["config"],
                    "calib": choice[s]["calib"][s], "heldout": choice[s]["heldout"].get(s)} for s in sites}
    report = {
        "captures": str(captures), "meta": {k: v for k, v in meta.items() if k not in ("roles", "files", "keys")},
        "objective": objective, "budget_bytes_per_element": budget, "candidates": len(cands),
        "messages": {p: {s: len(v) for s, v in split[p].items()} for p in split},
        "excluded": excluded,
        "sites": per_site,
        "heldout_mean_sqnr_db": {"calibrated": calibrated, "best_fixed_hindsight": best_hind["heldout_mean_sqnr_db"],
                                 "best_fixed_by_calibration": best_cal["heldout_mean_sqnr_db"],
                                 "taco_default": taco["heldout_mean_sqnr_db"]},
        "best_fixed_hindsight": best_hind["codec"], "best_fixed_by_calibration": best_cal["codec"],
        "calibrated_at_least_best_fixed": calibrated >= best_hind["heldout_mean_sqnr_db"] - 1e-9,
        "fixed": sorted(fixed, key=lambda f: -f["heldout_mean_sqnr_db"]),
        "table": table,
    }
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    policy_sites = {s: per_site[s]["config"] for s in sites}
    calib_meta = {s: {"choice": per_site[s]["choice"], "calib_sqnr_db": per_site[s]["calib"]["sqnr_db"],
                      "heldout_sqnr_db": (per_site[s]["heldout"] or {}).get("sqnr_db"),
                      "bytes_per_elt": per_site[s]["calib"]["bytes_per_elt"]} for s in sites}
    # the run's flags (--algorithm, --min-bytes) decide the rest; `CommPolicy.from_dict` validates it
    doc = {"format": POLICY_FORMAT, "sites": policy_sites, "objective": objective,
           "budget_bytes_per_element": budget, "captures": str(captures), "calibration": calib_meta}
    CommPolicy.from_dict(doc)
    jsonio.write(out, doc)
    jsonio.write(out.with_suffix(".report.json"), report, indent=1)
    out.with_suffix(".report.md").write_text(report_markdown(report) + "\n")
    return report


def report_markdown(report: dict) -> str:
    """The calibrated choice per site and the top fixed choices, as markdown tables."""
    sites = list(report["sites"])
    lines = [f"Objective: {report['objective']}", "",
             "| site | calibrated choice | B/elt | calib SQNR (dB) | held-out SQNR (dB) |", "|---|---|---|---|---|"]
    for s, r in report["sites"].items():
        held = r["heldout"]["sqnr_db"] if r["heldout"] else math.nan
        lines.append(f"| {s} | `{r['choice']}` | {r['calib']['bytes_per_elt']:.4f} | {_fmt_db(r['calib']['sqnr_db'])} "
                     f"| {_fmt_db(held)} |")
    h = report["heldout_mean_sqnr_db"]
    lines += ["", "| policy (held-out) | mean SQNR over sites (dB) |", "|---|---|",
              f"| calibrated (per site) | {h['calibrated']:.2f} |",
              f"| best fixed, chosen with hindsight on held-out: `{report['best_fixed_hindsight']}` | "
              f"{h['best_fixed_hindsight']:.2f} |",
              f"| best fixed, chosen on calibration: `{report['best_fixed_by_calibration']}` | "
              f"{h['best_fixed_by_calibration']:.2f} |",
              f"| TACO default (`{CodecConfig().name}`) | {h['taco_default']:.2f} |", "",
              "Fixed choices within the budget, best 15 by held-out mean SQNR:", "",
              "| fixed codec | " + " | ".join(f"{s} (dB)" for s in sites) + " | mean (dB) | B/elt |",
              "|---|" + "---|" * (len(sites) + 2)]
    for f in [f for f in report["fixed"] if f["feasible"]][:15]:
        bpe = max(f["bytes_per_elt"].values())
        lines.append(f"| `{f['codec']}` | " + " | ".join(_fmt_db(f["heldout"][s]) for s in sites)
                     + f" | {f['heldout_mean_sqnr_db']:.2f} | {bpe:.4f} |")
    return "\n".join(lines)


def main_args(captures: str, out: str, budget: float, max_messages: int, kinds: list[str] | None = None) -> dict:
    """CLI entry (`taco-jax calibrate`): runs `calibrate` (candidates of `kinds` only, if given); a short summary."""
    cands = None
    if kinds:
        cands = [c for c in candidates() if c.kind in kinds]
        if not cands:
            raise ValueError(f"kinds={kinds!r}: no candidate codec; choose among "
                             f"{sorted({c.kind for c in candidates()})}")
    rep = calibrate(captures, out, budget=budget, max_messages=max_messages, cands=cands)
    return {"policy": str(out), "report": str(pathlib.Path(out).with_suffix(".report.md")),
            "choice": {s: r["choice"] for s, r in rep["sites"].items()},
            "heldout_mean_sqnr_db": rep["heldout_mean_sqnr_db"],
            "best_fixed_hindsight": rep["best_fixed_hindsight"],
            "calibrated_at_least_best_fixed": rep["calibrated_at_least_best_fixed"]}

