"""Error bars of the cost model's predictions, from where it was checked against measurements.

Two sources:
- **emulated**: the end-to-end study on an emulated cluster (docs/emulated.md), shipped inside the
  package as `model_errors.json` beside this module (`errors_from_study` of the study; its "study"
  field names the repository file it was derived from; package code reads only the shipped copy):
  per configuration and shaped link, the measured TACO speedup over exact against the model's, and the model's
  step-time error for exact and TACO. Loopback rows (the transfer is CPU work on the same cores, which an α-β link
  does not describe) and chunked all-reduces (K > 1, which the model gets backwards; docs/emulated.md) are left out.
- **coccl**: the model's speedups for COCCL's published settings on 32 H800 (`perf.paper`: GPT-6.7B 1.10×, GPT-13B
  1.24×, Qwen2.5-7B 1.05×) with TACO on the TP, DP and PP axes: COCCL compresses with its own codecs per role, so this
  compares the model with the closest published end-to-end numbers, not with a measurement of this implementation.

A prediction's range: the point times (1 + e) for the smallest and largest relative error e =
measured / model - 1 of a source (`speedup_range`)."""

from __future__ import annotations

import json
import pathlib
import re

#: The shipped per-configuration errors on the emulated cluster (`errors_from_study`).
ERRORS_FILE = pathlib.Path(__file__).with_name("model_errors.json")
ERRORS_FORMAT = "taco_jax.perf.model_errors/1"


def errors_from_study(study: dict, source: str = "") -> dict:
    """The emulated-cluster errors of an e2e study (`experiments/e2e/e2e_study.py`'s study.json; `source`:
    where it lies, recorded as "study"): {"format", "study", "rows": [{"config", "link",
    "measured_speedup", "model_speedup", "speedup_error" (measured / model - 1), "exact_step_error",
    "taco_step_error" (model / measured - 1)}]}, one row per TACO variant "taco" (one chunk) on a shaped link.
    Raises ValueError when the study has no such row."""
    rows = study.get("rows", [])
    exact = {(r["config"], r["link"]): r for r in rows if r.get("variant") == "exact"}
    out = []
    for r in rows:
        if r.get("variant") != "taco" or r.get("link") == "none" or r.get("model_speedup") is None:
            continue
        e = exact.get((r["config"], r["link"]))
        out.append({"config": r["config"], "link": r["link"], "measured_speedup": round(r["speedup_median"], 4),
                    "model_speedup": round(r["model_speedup"], 4),
                    "speedup_error": round(r["speedup_median"] / r["model_speedup"] - 1, 4),
                    "exact_step_error": round(e["model_error"], 4) if e else None,
                    "taco_step_error": round(r["model_error"], 4)})
    if not out:
        raise ValueError("the study has no TACO row on a shaped link with a model prediction")
    return {"format": ERRORS_FORMAT, "study": source, "rows": out}


def emulated_errors() -> list[dict]:
    """The rows of the shipped `model_errors.json` (`errors_from_study`)."""
    data = json.loads(ERRORS_FILE.read_text())
    if data.get("format") != ERRORS_FORMAT:
        raise ValueError(f"{ERRORS_FILE}: format {data.get('format')!r} is not {ERRORS_FORMAT!r}")
    return data["rows"]


def coccl_errors() -> list[dict]:
    """The model against COCCL's published end-to-end speedups on 32 H800 (`perf.paper` settings whose
    reference is COCCL's): [{"setting", "published", "model_speedup" (TACO TP + DP + PP on the
    declared H800), "speedup_error" (published / model - 1)}]."""
    from taco_jax.perf import model, paper

    out = []
    pol = paper.policies()["taco_tp+dp+pp"]
    for label, cfg, lay, hw, ref in paper.settings():
        m = re.fullmatch(r"COCCL ([\d.]+)x", ref)
        if not m:
            continue
        s = model.speedup(cfg, lay, hw, pol)
        out.append({"setting": label, "published": float(m[1]), "model_speedup": round(s, 4),
                    "speedup_error": round(float(m[1]) / s - 1, 4)})
    return out


def summary() -> dict:
    """{"emulated": {...}, "coccl": {...}}: each source's smallest and largest speedup error, the
    number of points and what they are."""
    emu, coccl = emulated_errors(), coccl_errors()

    def span(rows, key="speedup_error"):
        v = [r[key] for r in rows if r.get(key) is not None]
        return [min(v), max(v)]

    steps = [r[k] for r in emu for k in ("exact_step_error", "taco_step_error") if r.get(k) is not None]
    return {
        "emulated": {"speedup_error": span(emu), "step_error": [min(steps), max(steps)], "points": len(emu),
                     "configs": sorted({r["config"] for r in emu}),
                     "what": "measured TACO speedup over exact on an emulated cluster (2-core CPU VM, shaped links "
                             "47 Mbit/s-3.8 Gbit/s; docs/emulated.md) against the model's, per configuration"},
        "coccl": {"speedup_error": span(coccl), "points": len(coccl), "settings": [r["setting"] for r in coccl],
                  "what": "COCCL's published end-to-end speedups on 32 H800 (its own codecs) against the model's "
                          "with TACO on TP + DP + PP"},
    }


def speedup_range(point: float, errors: dict | None = None) -> dict:
    """The range of a predicted speedup `point`: per source (`summary`), [point·(1 + e_min),
    point·(1 + e_max)], and "all": the union of the sources' ranges."""
    errors = errors or summary()
    out = {src: [point * (1 + e["speedup_error"][0]), point * (1 + e["speedup_error"][1])] for src, e in errors.items()}
    out["all"] = [min(v[0] for v in out.values()), max(v[1] for v in out.values())]
    return out


def step_range(step_s: float, errors: dict | None = None) -> list[float]:
    """Range of a predicted step time from the emulated cluster's step-time errors (model / measured
    - 1 in [a, b]: measured in [t / (1 + b), t / (1 + a)])."""
    a, b = (errors or summary())["emulated"]["step_error"]
    return [step_s / (1 + b), step_s / (1 + a)]
