"""Where compression pays: exact vs TACO end to end on emulated links, and the cost model against it.

Runs `experiments/e2e/bench_e2e.py` for each configuration of `CONFIGS` (models, TP 2/4, SP on/off,
bf16/f32, a link sweep, chunked all-reduce, the collective matmul, a two-tier DP×TP cluster) into
`<out>/<name>/`, skipping a configuration whose `bench_e2e.json` exists (`--force` reruns it), then:

1. **Cost model of an emulated step** (α–β, three fitted constants): for a variant v on a link of
   measured payload rate R (bytes/s; per tier for two tiers),
       t(v, R) = t_local(v) + n_msg(v) · α + κ(m) · Σ_axis B_axis(v) / R_axis,  κ(m) = κ0 + κ1 · m
   t_local(v) = v's step in one process (compute, plus the codec for TACO: codec time =
   t_local(taco) − t_local(exact)), n_msg and B = the compiled step's collectives per step and
   wire bytes per device (summary.json, HLO), m = B / n_msg (mean message, MB). α (seconds per
   collective) and κ (how much longer a step's bidirectional, bursty transfer takes than its bytes at
   the rate a one-way bulk transfer measured; it grows with the message) are fitted by least squares
   of the relative error over the exact rows of the link sweep (`FIT_CONFIGS`) on shaped links only;
   every other row (TACO, other configurations) is a prediction. Loopback (`none`) uses the shipped
   gloo calibration's α and bandwidth (taco_jax/perf/calibration_cpu_gloo.json). Beside it, the
   **loopback model**: the same form with t_loop(v), v's multi-process step on loopback (the same
   processes on the same cores, no namespaces, no shaping; every configuration runs it), in place of
   t_local(v), fitted on the same rows: n·α is what a shaped link adds beyond κ·B/R (per collective
   only if the fitted rows differ in n), while the cost of the processes sharing the cores stays in
   t_loop. Also the bandwidth bound: the byte bound
   with f_bw = κ·B/R / t (the exact step's byte-proportional share) in place of f (which also holds
   the per-collective costs that no byte reduction removes).
2. **Predictions for GPU clusters** with the same kind of model (`taco_jax.perf.model.step_time`,
   declared hardware: FLOP rate × MFU, link bandwidth, the measured H200 codec): the paper's GPT/Qwen
   settings with the TP link set to NVLink 4 (H100/H200), H800 NVLink, PCIe Gen5 x16, InfiniBand
   NDR; for each, the emulated rate at which gpt2-narrow (bf16, SP, TP=2) here has the same exact-step
   communication fraction (the same FLOPs per byte of TP traffic, relative to each machine's rates).
3. Writes `<out>/study.json`, `<out>/study.md` (the tables, each with its command) and
   `<out>/speedup_vs_link.png` (measured, byte bound, model).

  python -m experiments.e2e.e2e_study --out runs/e2e_study              # everything (> 70 min on 2 cores)
  python -m experiments.e2e.e2e_study --out runs/e2e_study --only gpt2_tp2_sp_bf16
  python -m experiments.e2e.e2e_study --out runs/e2e_study --analyze    # tables and plot only

Needs root (network namespaces; docs/distributed.md "Emulated links"). Run on a quiet machine:
timings of a loaded machine are not results. The load guard (experiments/e2e/load_guard.py) checks the
machine before the study and during every configuration: busier than allowed before the start, the
study does not start; during a configuration, its result goes to `bench_e2e.loaded.json` (never read
here) and the study stops with exit status 3, keeping the configurations finished before it.
`--allow-loaded` runs on and labels loaded configurations in study.json, study.md and the terminal;
`--wait-quiet SECONDS` waits out a busy machine instead and runs a round it was busy during again
(experiments/e2e/load_guard.py); `--calibrate-probe` times the guard's probe on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import shlex
import sys

import numpy as np

from experiments.common import ROOT, run_record
from experiments.e2e import bench_e2e, load_guard
from taco_jax.util import jsonio

MAIN_LINKS = ["50mbit", "250mbit", "500mbit", "1gbit", "2gbit", "4gbit", "none"]
CHUNKS = [f"taco_c{k}=--comm taco --chunks {k}" for k in (2, 4, 8)]
CM = "--tp-overlap collective-matmul"


def _cfg(model="gpt2-narrow", processes=2, mesh="data=1,tensor=2", dtype="bfloat16", sp=True, links=("250mbit",),
         variants=bench_e2e.DEFAULT_VARIANTS, local=True, launch="", rounds=2):
    args = ["--model", model, "--processes", str(processes), "--mesh", mesh, "--dtype", dtype,
            "--rounds", str(rounds), "--links", *links]
    args += (["--sequence-parallel"] if sp else []) + ([] if local else ["--no-local"])
    args += [f"--launch-args={launch}"] if launch else []
    return args + [a for v in variants for a in ("--variant", v)]


#: name -> bench_e2e arguments (batch 256 × 32 tokens, 8 steps, median of the last 6, 2 rounds). Every
#: configuration also runs on loopback (`none`): the cost model's anchor.
CONFIGS = {
    "gpt2_tp2_sp_bf16": _cfg(links=MAIN_LINKS),
    "gpt2_tp2_sp_f32": _cfg(dtype="float32", links=MAIN_LINKS),
    "gpt2_tp2_bf16_chunks": _cfg(sp=False, links=("250mbit", "none"), variants=(*bench_e2e.DEFAULT_VARIANTS, *CHUNKS)),
    "gpt2_tp2_sp_bf16_overlap": _cfg(links=("250mbit", "none"),
                                     variants=(*bench_e2e.DEFAULT_VARIANTS, f"exact_cm=--comm none {CM}",
                                               f"taco_cm=--comm taco {CM}"), local=False),
    "qwen3_tp2_sp_bf16": _cfg(model="qwen3-narrow", links=("250mbit", "1gbit", "none")),
    "qwen3_tp4_sp_bf16": _cfg(model="qwen3-narrow", processes=4, mesh="data=1,tensor=4",
                              links=("250mbit", "1gbit", "none")),
    "gpt2_dp2_tp2_two_tier": _cfg(processes=4, mesh="data=2,tensor=2", links=("intra=1gbit,inter=100mbit", "none"),
                                  launch="--nodes 2",
                                  variants=("exact=--comm none", "taco=--comm taco --dp-comm taco")),
}


def pinned(args: list[str]) -> list[str]:
    """A configuration's bench_e2e arguments with `taco-jax launch --pin-cpus` added to its launch flags
    (each process on its own share of the CPUs; `taco_jax.launch.cpu_shares`)."""
    if any(a.startswith("--launch-args=") for a in args):
        return [f"{a} --pin-cpus" if a.startswith("--launch-args=") and "--pin-cpus" not in a.split() else a
                for a in args]
    return [*args, "--launch-args=--pin-cpus"]


#: The configurations whose exact rows on shaped links fit the emulated link's (α, κ0, κ1).
FIT_CONFIGS = ("gpt2_tp2_sp_bf16", "gpt2_tp2_sp_f32")
CALIBRATION = ROOT / "taco_jax/perf/calibration_cpu_gloo.json"


def _rates(row: dict) -> dict:
    """Bytes/s per mesh axis of a row's shaped link (measured payload rate, per tier)."""
    m = row["measured_bit_per_s"]
    if "link" in m:
        return {"tensor": m["link"] / 8, "data": m["link"] / 8}
    return {"tensor": m["intra"] / 8, "data": m["inter"] / 8}


def _transfer_s(row: dict, loopback) -> float:
    """Σ_axis wire bytes per device / the axis's measured rate (shaped link), or · β (loopback)."""
    if not row["measured_bit_per_s"]:
        return sum(row["wire_bytes_per_step"].values()) * loopback[1]
    rates = _rates(row)
    return sum(b / rates.get(axis, rates["tensor"]) for axis, b in row["wire_bytes_per_step"].items())


def _mean_message_mb(row: dict) -> float:
    """Mean wire bytes per collective per device, MB (1e6 bytes)."""
    return sum(row["wire_bytes_per_step"].values()) / max(row["tensor_messages_per_step"], 1) / 1e6


def _efficiency(row: dict, link: tuple[float, float, float]) -> float:
    """κ = κ0 + κ1 · mean message MB: a step's transfer time over its bytes at the measured rate."""
    return link[1] + link[2] * _mean_message_mb(row)


def _comm_s(row: dict, link: tuple[float, float, float], loopback: tuple[float, float]) -> tuple[float, float]:
    """(per-message part n·α, byte part κ·B/R) of a row's step: shaped links with the fitted `link` =
    (α, κ0, κ1), loopback with the gloo calibration `loopback` = (α, β)."""
    if not row["measured_bit_per_s"]:
        return row["tensor_messages_per_step"] * loopback[0], _transfer_s(row, loopback)
    return row["tensor_messages_per_step"] * link[0], _efficiency(row, link) * _transfer_s(row, loopback)


def _predict(row: dict, anchor_s: float, link: tuple[float, float, float], loopback: tuple[float, float]) -> float:
    """t_anchor + n_msg · α + κ · B / R (t_anchor: the row's loopback step, or its one-process step)."""
    return anchor_s + sum(_comm_s(row, link, loopback))


def _fit_link(rows: list[dict], anchor: str = "loopback_s_per_step") -> tuple[float, float, float]:
    """(α, κ0, κ1) minimising Σ ((t_pred − t)/t)² over shaped-link rows: linear least squares of
    t − t_anchor = n_msg · α + (κ0 + κ1 · m) · B/R (m: mean message MB), each row divided by its t;
    t_anchor is the row's `anchor` field (its multi-process loopback step, or its one-process step for
    the one-process model). With one message size among the rows κ1 = 0; a negative α or κ1 is refitted
    as 0."""
    n = np.array([r["tensor_messages_per_step"] for r in rows], float)
    tr = np.array([_transfer_s(r, None) for r in rows], float)
    m = np.array([_mean_message_mb(r) for r in rows], float)
    y = np.array([r["s_per_step"] - r[anchor] for r in rows], float)
    w = 1.0 / np.array([r["s_per_step"] for r in rows], float)
    cols = {"alpha": n, "k0": tr, "k1": tr * m}
    if np.ptp(m) <= 1e-3 * m.max():
        cols.pop("k1")
    while True:
        coef, *_ = np.linalg.lstsq(np.stack(list(cols.values()), 1) * w[:, None], y * w, rcond=None)
        got = dict(zip(cols, coef))
        bad = [k for k in ("alpha", "k1") if got.get(k, 0.0) < 0]
        if not bad:
            return float(got.get("alpha", 0.0)), float(got["k0"]), float(got.get("k1", 0.0))
        cols.pop(bad[0])


def _span(rows: list[dict], key: str) -> list[float] | None:
    v = [r[key] for r in rows if r.get(key) is not None]
    return [min(v), max(v)] if v else None


def _load(path: pathlib.Path) -> dict:
    """A configuration's bench_e2e.json; ValueError naming the file if it is not one."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("no list of rows")
        return data
    except ValueError as e:
        raise ValueError(f"{path} is not a bench_e2e result ({e}); rerun that configuration (--only NAME --force)") \
            from None


def _machine(studies: dict) -> str:
    """The machine(s) the runs recorded (their load guard's), else the analysing host, said so."""
    seen = {json.dumps(s["load_guard"]["machine"], sort_keys=True) for s in studies.values()
            if (s.get("load_guard") or {}).get("machine")}
    if seen:
        return "; ".join(f"{m['node']}: {m['cpu']}, {m['cpus']} CPUs" for m in map(json.loads, sorted(seen)))
    return (f"not recorded by the runs (analysed on {platform.node()}: {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Linux {platform.release()})")


def analyze(out: pathlib.Path, run: dict | None = None) -> dict:
    """The study's tables from the configurations' results under `out`: writes out/study.json (with
    `run`, the run record, by default that of `--out OUT --analyze`), study.md and speedup_vs_link.png;
    returns study.json's content. Raises ValueError with fewer than 3 exact rows on shaped links of
    `FIT_CONFIGS` (the cost model's fit)."""
    cal = json.loads(CALIBRATION.read_text())["link"]
    loopback = (cal["alpha_s"], cal["beta_s_per_byte"])
    studies = {n: _load(out / n / "bench_e2e.json") for n in CONFIGS if (out / n / "bench_e2e.json").exists()}
    loaded = [n for n, s in studies.items() if s.get("loaded")]
    # every row with a one-process step gets the model; (α, κ0, κ1) from the link sweep's exact rows on
    # shaped links (FIT_CONFIGS); every other row is a prediction
    rows = [dict(r, config=n) for n, s in studies.items() for r in s["rows"]]
    modelled = [r for r in rows if r["local_s_per_step"] is not None]
    fit_rows = [r for r in modelled
                if r["variant"] == "exact" and r["measured_bit_per_s"] and r["config"] in FIT_CONFIGS]
    if len(fit_rows) < 3:
        raise ValueError(f"the cost model is fitted on the link sweep ({', '.join(FIT_CONFIGS)}): {len(fit_rows)} "
                         f"exact rows on shaped links under {out}, need >= 3; run `--only {' '.join(FIT_CONFIGS)}`")
    link = _fit_link(fit_rows, "local_s_per_step")
    for r in modelled:
        r["model_s_per_step"] = _predict(r, r["local_s_per_step"], link, loopback)
        r["model_error"] = r["model_s_per_step"] / r["s_per_step"] - 1.0
    # The loopback model: each configuration and variant's multi-process step on loopback (the same
    # processes on the same cores, no namespaces, no shaping) as the anchor in place of the one-process
    # step, fitted on the same rows; what a shaped link adds to the processes' own step.
    loops = {(r["config"], r["variant"]): r["s_per_step"] for r in rows if not r["measured_bit_per_s"]}
    shaped = [r for r in rows if r["measured_bit_per_s"]]
    for r in rows:
        r["loopback_s_per_step"] = loops.get((r["config"], r["variant"]))
    loop_fit = [r for r in fit_rows if r["loopback_s_per_step"] is not None]
    loop_link = _fit_link(loop_fit) if len(loop_fit) >= 3 else None
    fitted = {id(r) for r in fit_rows}
    for r in shaped:
        r["model_fitted"] = id(r) in fitted
        if loop_link is not None and r["loopback_s_per_step"] is not None:
            r["loop_model_s_per_step"] = _predict(r, r["loopback_s_per_step"], loop_link, loopback)
            r["loop_model_error"] = r["loop_model_s_per_step"] / r["s_per_step"] - 1.0
    for n in studies:  # model speedups against the config's exact variant, same link; the bandwidth bound
        base = {r["link"]: r for r in rows if r["config"] == n and r["variant"] == "exact"}
        for r in (r for r in rows if r["config"] == n):
            b = base[r["link"]]
            if "model_s_per_step" in r and "model_s_per_step" in b:
                r["model_speedup"] = b["model_s_per_step"] / r["model_s_per_step"]
                r["codec_s_per_step"] = r["local_s_per_step"] - b["local_s_per_step"]
                f_bw = min(_comm_s(b, link, loopback)[1] / b["s_per_step"], 1.0)  # the byte-proportional share
                r["bandwidth_fraction"] = f_bw
                r["bandwidth_bound"] = bench_e2e.byte_bound(f_bw, r["byte_ratio"])
    held = [r for r in shaped if not r["model_fitted"]]
    n_held = {k: sum(f"{k}_error" in r for r in held) for k in ("model", "loop_model")}
    gpu = gpu_predictions(rows, link)
    run = run or run_record(__spec__.name, ["--out", str(out), "--analyze"])
    result = {"format": "taco_jax.e2e_study/1", "run": run,
              "alpha_s": link[0], "kappa0": link[1], "kappa1_per_mb": link[2],
              "loopback_model": None if loop_link is None else
              {"alpha_s": loop_link[0], "kappa0": loop_link[1], "kappa1_per_mb": loop_link[2]},
              "model_error": {"fitted": _span(fit_rows, "model_error"), "held_out": _span(held, "model_error"),
                              "loopback_model_fitted": _span(loop_fit, "loop_model_error"),
                              "loopback_model_held_out": _span(held, "loop_model_error"), "held_out_rows": len(held),
                              "held_out_modelled": n_held["model"], "loopback_held_out_modelled": n_held["loop_model"]},
              "loopback_alpha_s": loopback[0], "loopback_bytes_per_s": 1.0 / loopback[1],
              "machine": _machine(studies), "fit_configs": sorted({r["config"] for r in fit_rows}),
              "commands": {n: s["command"] for n, s in studies.items()}, "rows": rows, "gpu_predictions": gpu,
              "loaded": loaded}
    jsonio.write(out / "study.json", result)
    (out / "study.md").write_text(markdown(result))
    plot(result, out / "speedup_vs_link.png")
    print(markdown(result))
    if loaded:
        print(f"[e2e_study] LOADED: {', '.join(loaded)} ran on a machine busier than the study allows "
              "(--allow-loaded): not results", file=sys.stderr, flush=True)
    return result


def _emulated_rate_for(f_target: float, row_exact: dict, link: tuple[float, float, float]) -> float:
    """Measured payload bit/s at which this row's exact step would spend f_target of its time in the
    byte-proportional transfer (κ·B/R / (t_local + n·α + κ·B/R) = f_target, solved for R): the
    emulated link with the GPU setting's share of TP transfer time (its per-collective part, which a
    GPU fabric barely has, counted as fixed)."""
    fixed = row_exact["local_s_per_step"] + row_exact["tensor_messages_per_step"] * link[0]
    t_bytes = f_target / (1.0 - f_target) * fixed
    return 8 * _efficiency(row_exact, link) * sum(row_exact["wire_bytes_per_step"].values()) / t_bytes


def gpu_predictions(rows: list[dict], link: tuple[float, float, float]) -> list[dict]:
    """Predicted speedups of TACO on the TP axis (and with DP/PP codecs) for the paper's settings, each
    with its TP link set to every declared GPU link; plus the emulated rate of the same comm fraction.
    Each speedup carries the model's error on this study's TACO rows (`range_*`: the point times 1 + e
    for the smallest and largest e = measured / model speedup − 1, `perf.uncertainty.errors_from_study`),
    and a setting on its own hardware with a published speedup of COCCL's gets `published_error` =
    published / model − 1 (TACO on TP + DP + PP, as COCCL compresses every axis)."""
    from taco_jax.perf import hardware, model, paper, uncertainty

    try:
        errs = [r["speedup_error"] for r in uncertainty.errors_from_study({"rows": rows})["rows"]]
        span = (min(errs), max(errs))
    except ValueError:  # no TACO row on a shaped link with a model prediction
        span = None

    tp_links = [("H100/H200 NVLink 4 (450 GB/s)", hardware.H200, hardware.NVLINK4),
                ("H800 NVLink (200 GB/s)", hardware.H800, hardware.NVLINK_H800),
                ("PCIe Gen5 x16 (64 GB/s)", hardware.H200, hardware.PCIE_GEN5),
                ("InfiniBand NDR (50 GB/s per GPU)", hardware.H200, hardware.IB_NDR)]
    ref = next((r for r in rows if r["config"] == "gpt2_tp2_sp_bf16" and r["variant"] == "exact"
                and r["local_s_per_step"] is not None and r["measured_bit_per_s"]), None)
    out = []
    pol = paper.policies()
    for label, cfg, lay, own_hw, published in paper.settings():
        if "FP32 wire" in label or "IB)" in label:
            continue
        coccl = re.fullmatch(r"COCCL ([\d.]+)x", published)
        for link_name, hw, tp_link in tp_links:
            hw2 = dataclasses.replace(hw, intra=tp_link, gpus_per_node=max(hw.gpus_per_node, lay.tp))
            base = model.step_time(cfg, lay, hw2)
            f_tp = (lay.n_micro + lay.pp - 1) * base["tp_s"] / base["step_s"]  # 1F1B slots × TP time per slot
            row = {"setting": label, "tp_link": link_name, "exact_step_s": base["step_s"],
                   "comm_fraction": base["comm_fraction"], "tp_comm_fraction": f_tp,
                   "taco_tp": model.speedup(cfg, lay, hw2, pol["taco_tp"]),
                   "taco_tp+dp+pp": model.speedup(cfg, lay, hw2, pol["taco_tp+dp+pp"]), "published": published}
            if span is not None:
                for k in ("taco_tp", "taco_tp+dp+pp"):
                    row[f"range_{k}"] = uncertainty.speedup_range(row[k], {"emulated": {"speedup_error": span}})[
                        "emulated"]
            if coccl and hw is own_hw and tp_link is own_hw.intra:
                row["published_error"] = float(coccl[1]) / row["taco_tp+dp+pp"] - 1.0
            if ref and 0 < f_tp < 1:
                row["emulated_bit_per_s"] = _emulated_rate_for(f_tp, ref, link)
            out.append(row)
    return out


def _rate_label(r: dict) -> str:
    """'link 239' (measured payload Mbit/s per tier), with '; 250 in frames' where the run recorded it."""
    m, w = r["measured_bit_per_s"], r.get("measured_wire_bit_per_s") or {}
    return "loopback" if not m else ", ".join(
        f"{k} {v / 1e6:,.0f}" + (f"; {w[k] / 1e6:,.0f} in frames" if k in w else "") for k, v in m.items())


def _pct_span(v: list[float] | None) -> str:
    return "-" if not v else f"{100 * v[0]:+.1f} … {100 * v[1]:+.1f} %"


def markdown(res: dict) -> str:
    loaded = res.get("loaded", [])
    L = [f"**LOADED machine: {', '.join(loaded)} ran busier than the study allows (--allow-loaded); "
         "not results.**", ""] if loaded else []
    lm = res.get("loopback_model")
    fitc = ", ".join(res.get("fit_configs") or FIT_CONFIGS)
    L += [f"Machine: {res['machine']}. Fitted on the exact rows of {fitc} on shaped links: "
          f"α = {1e3 * res['alpha_s']:.2f} ms per collective, κ = {res['kappa0']:.2f} + {res['kappa1_per_mb']:.2f} × "
          "mean message MB (a step's "
          "transfer time / its bytes at the measured rate). "
          f"Loopback rows: the shipped gloo calibration (α = {1e6 * res['loopback_alpha_s']:.0f} µs, "
          f"{res['loopback_bytes_per_s'] / 1e9:.2f} GB/s). f: 1 − one-process step / exact step; byte bound "
          "1 / ((1 − f) + f·r). f_bw: the exact step's byte-proportional share (model: κ·B/R / t); bandwidth bound: "
          "the same with f_bw (what cutting bytes alone can give: the per-collective part stays). "
          + ("" if lm is None else
             "In brackets: the loopback model (the variant's multi-process step on loopback in place of its "
             f"one-process step, fitted on the same rows: α = {1e3 * lm['alpha_s']:.2f} ms, κ = {lm['kappa0']:.2f} + "
             f"{lm['kappa1_per_mb']:.2f} × m)."), ""]
    by_cfg = {}
    for r in res["rows"]:
        by_cfg.setdefault(r["config"], []).append(r)
    for name, rows in by_cfg.items():
        tag = " (LOADED machine: not a result)" if name in loaded else ""
        L += [f"### {name}{tag}", "", f"`{res['commands'][name]}`", "",
              "| link (measured Mbit/s) | variant | s/step | tokens/s | speedup vs exact (median [min, max]) | f | r | "
              "byte bound | f_bw | bandwidth bound | model s/step (error) | model speedup |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ex = r["variant"] == "exact"
            bound = "-" if r["byte_bound"] is None or ex else f"{r['byte_bound']:.2f}×"
            sp = "-" if ex else f"{r['speedup_median']:.2f}× [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}]"
            f = "-" if r["local_s_per_step"] is None else f"{r['comm_fraction']:.2f}"
            fbw = "-" if "bandwidth_fraction" not in r else f"{r['bandwidth_fraction']:.2f}"
            bbw = "-" if "bandwidth_bound" not in r or ex else f"{r['bandwidth_bound']:.2f}×"
            mod = "-" if "model_s_per_step" not in r else \
                f"{r['model_s_per_step']:.3f} ({100 * r['model_error']:+.0f} %)"
            if "loop_model_error" in r:
                mod += f" [{100 * r['loop_model_error']:+.0f} %]"
            ms = "-" if "model_speedup" not in r or ex else f"{r['model_speedup']:.2f}×"
            L.append(f"| {r['link']} ({_rate_label(r)}) | {r['variant']} | {r['s_per_step']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {sp} | {f} | {r['byte_ratio']:.3f} | {bound} | {fbw} | {bbw} | "
                     f"{mod} | {ms} |")
        L.append("")
    held = [r for r in res["rows"] if r.get("model_fitted") is False]
    err = res["model_error"]
    if held:
        L += ["### The models on the shaped rows they were not fitted on", "",
              f"One-process model: fitted rows {_pct_span(err['fitted'])}, {err['held_out_modelled']} of the "
              f"{len(held)} others (those with a one-process step) {_pct_span(err['held_out'])}. Loopback model: "
              f"fitted rows {_pct_span(err['loopback_model_fitted'])}, {err['loopback_held_out_modelled']} others "
              f"(those with a loopback row) {_pct_span(err['loopback_model_held_out'])} (error: model / measured − 1; "
              "a configuration without either has '-').", "",
              "| configuration | link | variant | measured s/step | one-process s/step | model (error) | "
              "loopback s/step | loopback model (error) |", "|---|---|---|---|---|---|---|---|"]

        def _cell(r, k):
            return "-" if f"{k}_s_per_step" not in r else \
                f"{r[f'{k}_s_per_step']:.3f} ({100 * r[f'{k}_error']:+.1f} %)"
        for r in held:
            loc = "-" if r["local_s_per_step"] is None else f"{r['local_s_per_step']:.3f}"
            lp = "-" if r["loopback_s_per_step"] is None else f"{r['loopback_s_per_step']:.3f}"
            L.append(f"| {r['config']} | {r['link']} | {r['variant']} | {r['s_per_step']:.3f} | {loc} | "
                     f"{_cell(r, 'model')} | {lp} | {_cell(r, 'loop_model')} |")
        L.append("")
    L += ["### Predicted on GPU clusters (taco_jax.perf.model, declared hardware; not measured)", "",
          "Ranges: the point times 1 + e for the smallest and largest error e = measured / model speedup − 1 of "
          "this study's TACO rows on shaped links. Published error: published / model − 1 (TACO TP+DP+PP, on the "
          "setting's own hardware).", "",
          "| setting | TP link | exact step s | TP comm fraction | TACO TP [range] | TACO TP+DP+PP [range] | emulated "
          "rate of the same fraction (gpt2-narrow bf16 SP TP2) | published (error) |",
          "|---|---|---|---|---|---|---|---|"]

    def _rng(g, k):
        r = g.get(f"range_{k}")
        return f"{g[k]:.2f}×" + ("" if r is None else f" [{r[0]:.2f}, {r[1]:.2f}]")
    for g in res["gpu_predictions"]:
        em = "-" if "emulated_bit_per_s" not in g else f"{g['emulated_bit_per_s'] / 1e6:,.0f} Mbit/s"
        pub = g["published"] + ("" if "published_error" not in g else f" ({100 * g['published_error']:+.0f} %)")
        L.append(f"| {g['setting']} | {g['tp_link']} | {g['exact_step_s']:.2f} | {g['tp_comm_fraction']:.2f} | "
                 f"{_rng(g, 'taco_tp')} | {_rng(g, 'taco_tp+dp+pp')} | {em} | {pub} |")
    return "\n".join(L) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    loop_bits = 8 * res["loopback_bytes_per_s"]
    for name, color in (("gpt2_tp2_sp_bf16", "C0"), ("gpt2_tp2_sp_f32", "C1")):
        rows = sorted((r for r in res["rows"] if r["config"] == name and r["variant"] == "taco"),
                      key=lambda r: (r["measured_bit_per_s"] or {"link": loop_bits})["link"])
        if not rows:
            continue
        x = np.array([(r["measured_bit_per_s"] or {"link": loop_bits})["link"] / 1e6 for r in rows])
        y = np.array([r["speedup_median"] for r in rows])
        err = np.array([[r["speedup_median"] - r["speedup_min"] for r in rows],
                        [r["speedup_max"] - r["speedup_median"] for r in rows]])
        label = name.rsplit("_", 1)[1]
        ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, label=f"measured {label}")
        ax.plot(x, [r["byte_bound"] for r in rows], "--", color=color, label=f"byte bound {label}")
        if all("bandwidth_bound" in r for r in rows):
            ax.plot(x, [r["bandwidth_bound"] for r in rows], "-.", color=color, lw=0.8,
                    label=f"bandwidth bound {label}")
        mod = [(xi, r["model_speedup"]) for xi, r in zip(x, rows) if "model_speedup" in r]
        if mod:
            ax.plot(*zip(*mod), ":", color=color, marker="x", label=f"model {label}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"link rate, measured payload Mbit/s (rightmost: loopback, ~{loop_bits / 1e9:.0f} Gbit/s)")
    ax.set_ylabel("TACO speedup over exact (s/step ratio)")
    ax.set_title("gpt2-narrow, TP=2 + SP, 2 processes in network namespaces (emulated links)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", default="runs/e2e_study",
                   help="study folder: <out>/<configuration>/bench_e2e.json, study.json, study.md "
                        "(default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=sorted(CONFIGS), metavar="NAME",
                   help=f"run these configurations only ({', '.join(sorted(CONFIGS))})")
    p.add_argument("--force", action="store_true", help="rerun configurations that have results")
    p.add_argument("--analyze", action="store_true", help="only tables and plot from existing results")
    p.add_argument("--rounds", type=int, help="override every configuration's rounds")
    p.add_argument("--pin-cpus", action="store_true",
                   help="run each configuration's processes each on its own share of the CPUs (`taco-jax launch "
                        "--pin-cpus`), as each rank owns its GPU; the one-process steps are unchanged")
    load_guard.add_arguments(p)
    a = p.parse_args(argv)
    run = run_record(__spec__.name, argv)
    if a.calibrate_probe:
        return bench_e2e.main(["--calibrate-probe"])
    if a.rounds is not None and a.rounds < 1:
        p.error(f"--rounds {a.rounds} must be >= 1")
    out = pathlib.Path(a.out)
    if a.analyze and not any((out / n / "bench_e2e.json").exists() for n in CONFIGS):
        p.error(f"no results under {out} (no <configuration>/bench_e2e.json for a configuration of "
                f"{', '.join(CONFIGS)}); run without --analyze first")
    todo = [] if a.analyze else [n for n in a.only or CONFIGS if a.force or not (out / n / "bench_e2e.json").exists()]
    for name in [] if a.analyze else [n for n in a.only or CONFIGS if n not in todo]:
        print(f"[e2e_study] {name}: results exist, skipped (--force reruns)", flush=True)
    if todo:
        procs = max(int(CONFIGS[n][CONFIGS[n].index("--processes") + 1]) for n in todo)
        guard = load_guard.Guard(processes=procs, allow_loaded=a.allow_loaded, tag="[e2e_study]",
                                 wait_s=a.wait_quiet)
        guard.check("before the study", start=True)
        guard.refuse_start()
        for name in todo:
            args = CONFIGS[name] + (["--rounds", str(a.rounds)] if a.rounds is not None else [])
            args = pinned(args) if a.pin_cpus else args
            print(f"[e2e_study] {name}: python -m experiments.e2e.bench_e2e {shlex.join(args)}", flush=True)
            try:
                bench_e2e.main([*args, "--out", str(out / name)], guard=guard)
            except load_guard.Loaded:
                load_guard.refuse(f"[e2e_study] stopped: {name} ran on a busy machine and was not added to the study "
                                  f"in {out}; rerun on a quiet machine (finished configurations are kept and skipped)")
    try:
        return analyze(out, run)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
