"""Deterministic per-step fidelity: the compressed step's gradient against the exact one at fixed parameters.

No seed or chaos enters: at parameters taken from an exact run (steps in `--checkpoints`, kept in
memory; step 0 = the initialisation) and on one fixed training batch per checkpoint, the loss and
gradient with a codec on one tensor-parallel site (or on all of them) is compared with the exact
step's (`--comm none`, same mesh, same sequence-parallel setting):

  cosine    ⟨g, ĝ⟩ / (‖g‖ ‖ĝ‖)
  rel_err   ‖ĝ − g‖ / ‖g‖
  sqnr_db   10 log10(‖g‖² / ‖ĝ − g‖²)      (∞ when ĝ = g)

per parameter group (embeddings, attention qkv / out, MLP in / out, norms, LM head; each summed
over layers; "layerK" = all of block K; "all" = the whole gradient), float64 sums on the host,
plus the relative difference of the compressed forward's loss. Sites: `ar_fwd` and `ar_bwd`
(Megatron "g" forward and "f" backward all-reduces, without sequence parallelism), `all_gather`
and `reduce_scatter` (with `--sequence-parallel`), and "all" (every site, each setting).

    python -m experiments.fidelity.grad_fidelity --out runs/grad_fidelity --models gpt2-tiny qwen3-tiny

Writes `<out>/grad_fidelity.json` (strict JSON) and `<out>/grad_fidelity.md`. The best codec of the
family for `experiments/fidelity/fidelity_runs.py` is chosen from it by `best_codec` (rule in its docstring).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time

from experiments.common import cpu_devices, run_record

if "jax" not in sys.modules:
    cpu_devices(8)

import numpy as np  # noqa: E402

from experiments.fidelity.fidelity_runs import SeedRunner, base_config  # noqa: E402

#: (regex on the parameter path, group), first match wins; GPT-2 and Qwen names.
GROUP_RULES = (
    (r"wte|wpe|embed_tokens", "embed"),
    (r"lm_head", "lm_head"),
    (r"norm|ln_", "norms"),
    (r"qkv|q_proj|k_proj|v_proj", "attn_qkv"),
    (r"attn'\]\['proj|o_proj", "attn_out"),
    (r"mlp'\]\['fc|gate_proj|up_proj", "mlp_in"),
    (r"mlp'\]\['proj|down_proj", "mlp_out"),
)
#: Site configurations: name -> (sites compressed, sequence parallelism).
SITE_SETS = {
    "ar_fwd": (("ar_fwd",), False),
    "ar_bwd": (("ar_bwd",), False),
    "all (no SP)": (("ar_fwd", "ar_bwd"), False),
    "all_gather": (("all_gather",), True),
    "reduce_scatter": (("reduce_scatter",), True),
    "all (SP)": (("ar_fwd", "ar_bwd", "all_gather", "reduce_scatter"), True),
}
#: Name of the rounding-floor row (`measure(floor=True)`).
FLOOR = "exact_f32_compute"
#: The 8-bit-ish budget for "best codec of the family": TACO's wire bytes per element.
BYTES_BUDGET = 1.0625


def param_group(path: str) -> str:
    """Group of a parameter from its key path, e.g. "['h'][0]['attn']['qkv']['kernel']" -> "attn_qkv"."""
    for pattern, group in GROUP_RULES:
        if re.search(pattern, path):
            return group
    return "other"


def _layer(path: str) -> str | None:
    m = re.match(r"\['(?:h|layers)'\]\[(\d+)\]", path)
    return f"layer{m.group(1)}" if m else None


def grad_compare(ref, test) -> dict:
    """Per-group cosine, relative error and SQNR (dB) of gradient pytree `test` against `ref`.

    Args: two pytrees of the same structure (arrays of any float dtype; compared in float64).
    Returns: {group: {"cosine", "rel_err", "sqnr_db", "numel"}} with groups from `param_group`,
      "layerK" per transformer block and "all". An exact match gives cosine 1, rel_err 0, sqnr_db ∞;
      a zero reference gives NaN cosine / rel_err (NaN in any leaf propagates).
    Raises: ValueError when the structures or shapes differ.
    """
    import jax

    lr, tr = jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves_with_path(test)
    if [p for p, _ in lr] != [p for p, _ in tr]:
        raise ValueError("ref and test gradients have different structures")
    acc = {}
    for (path, a), (_, b) in zip(lr, tr, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"{jax.tree_util.keystr(path)}: shapes {a.shape} vs {b.shape}")
        key = jax.tree_util.keystr(path)
        s = np.array([np.vdot(a, b), np.vdot(a, a), np.vdot(b, b), np.sum((b - a) ** 2), a.size])
        for g in ("all", param_group(key), _layer(key)):
            if g:
                acc[g] = acc.get(g, 0) + s
    out = {}
    for g, (dot, na, nb, ne, n) in acc.items():
        out[g] = {"cosine": float(dot / math.sqrt(na * nb)) if na * nb > 0 else float("nan"),
                  "rel_err": float(math.sqrt(ne / na)) if na > 0 else float("nan"),
                  "sqnr_db": float(10 * math.log10(na / ne)) if ne > 0 else (math.inf if na > 0 else float("nan")),
                  "numel": int(n)}
    return out


def codecs(backend: str = "ffi") -> dict:
    """Every codec kind at its defaults (G = 128, E4M3, hidden axis) plus the named variants."""
    from taco_jax.codec import CodecConfig, codec_kinds
    from taco_jax.codec.presets import NAMED

    out = {k: CodecConfig(kind=k) for k in codec_kinds() if k != "none"}
    out.update({n: c for n, c in NAMED.items() if n not in out and n != "none"})
    return {n: dataclasses.replace(c, backend=backend) for n, c in out.items()}


def value_and_grad_fn(model_cfg, mesh, policy, sequence_parallel: bool):
    import jax

    from taco_jax.train.step import make_steps

    return jax.jit(make_steps(model_cfg, mesh, policy, sequence_parallel=sequence_parallel).value_and_grad)


def measure(cfg, ds, devices, checkpoints, codec_map: dict, site_sets: dict, *, seed: int = 0, log=print,
            done=(), sink=None, floor: bool = False) -> list:
    """Rows {checkpoint, sites, codec, loss_rel_diff, groups: grad_compare(...)} for one model config.

    `cfg`: the exact run's TrainConfig (its steps >= max(checkpoints); the whole run is trained, so
    the learning-rate schedule is the run's); parameters at `checkpoints` come from training it with
    `seed`; the batch of checkpoint c is the first batch of the stream with seed 10_000 + c (fixed,
    not a training batch). `done`: (sites, codec) pairs to skip; `sink(row)` is called per new row.
    `floor`: also a row `FLOOR` (exact communication, float32 instead of the run's compute dtype):
    how far plain rounding moves the gradient, the scale against which the codecs' errors read."""
    import jax
    from jax.sharding import NamedSharding

    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.data import TokenStream

    if max(checkpoints) > cfg.training.steps:
        raise ValueError(f"checkpoints={checkpoints} go beyond the run's steps={cfg.training.steps}")
    runner = SeedRunner(cfg, ds, devices)
    kept = runner.run(seed, keep_at=set(checkpoints))["params"]
    mesh, model_cfg = runner.trainer.mesh, cfg.model_config
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), runner.trainer.specs)
    params = {c: jax.device_put(kept[c], shard) for c in checkpoints}
    data = cfg.data
    batches = {c: TokenStream(ds.train, data.batch_size, data.seq_len, seed=10_000 + c).next(runner.batch_sharding)
               for c in checkpoints}
    rows, refs = [], {}
    for sp in sorted({sp for _, sp in site_sets.values()} | ({False} if floor else set())):
        f = value_and_grad_fn(model_cfg, mesh, CommPolicy(), sp)
        refs[sp] = {c: jax.tree.map(np.asarray, f(params[c], *batches[c])) for c in checkpoints}
    if floor and ("all (no SP)", FLOOR) not in done:  # rounding floor: exact comm, float32 instead of bf16 compute
        f = value_and_grad_fn(dataclasses.replace(model_cfg, dtype="float32"), mesh, CommPolicy(), False)
        for c in checkpoints:
            loss, grads = f(params[c], *batches[c])
            ref_loss, ref_grads = refs[False][c]
            rows.append({"model": cfg.model.name, "checkpoint": c, "sites": "all (no SP)", "codec": FLOOR,
                         "config": "none, float32 compute", "bytes_per_elt": 4.0, "loss": float(loss),
                         "exact_loss": float(ref_loss), "loss_rel_diff": float((loss - ref_loss) / ref_loss),
                         "groups": grad_compare(ref_grads, jax.tree.map(np.asarray, grads))})
            if sink:
                sink(rows[-1])
    for name, (sites, sp) in site_sets.items():
        for cname, codec in codec_map.items():
            if (name, cname) in done:
                continue
            t0 = time.perf_counter()
            f = value_and_grad_fn(model_cfg, mesh, CommPolicy(**dict.fromkeys(sites, codec)), sp)
            for c in checkpoints:
                loss, grads = f(params[c], *batches[c])
                ref_loss, ref_grads = refs[sp][c]
                rows.append({"model": cfg.model.name, "checkpoint": c, "sites": name, "codec": cname,
                             "config": codec.name,
                             "bytes_per_elt": codec.wire_bytes_per_element(), "loss": float(loss),
                             "exact_loss": float(ref_loss),
                             "loss_rel_diff": float((loss - ref_loss) / ref_loss),
                             "groups": grad_compare(ref_grads, jax.tree.map(np.asarray, grads))})
                if sink:
                    sink(rows[-1])
            log(f"[grad_fidelity] {cfg.model.name} {name} {cname}: all-group SQNR "
                + ", ".join(f"{r['groups']['all']['sqnr_db']:.1f}" for r in rows[-len(checkpoints):])
                + f" dB ({time.perf_counter() - t0:.0f} s)")
    return rows


def best_codec(rows: list, budget: float = BYTES_BUDGET, sites: str = "all (no SP)") -> str:
    """The best codec of the family by the deterministic measure.

    Among codecs with wire bytes/element <= `budget` (TACO's 1.0625: the 8-bit-ish codecs)
    and != 'taco', the highest mean over models and checkpoints of the whole-gradient SQNR (dB)
    with every site of `sites` compressed. Raises ValueError when no row qualifies."""
    scores = {}
    for r in rows:
        if r["sites"] == sites and r["bytes_per_elt"] <= budget and r["codec"] != "taco":
            scores.setdefault(r["codec"], []).append(r["groups"]["all"]["sqnr_db"])
    if not scores:
        raise ValueError(f"no codec within {budget} B/elt measured on sites={sites!r}")
    return max(scores, key=lambda k: float(np.mean(scores[k])))


def _floats(obj):
    """A strict-JSON record read back: the strings "NaN" / "Infinity" / "-Infinity" become floats."""
    if isinstance(obj, dict):
        return {k: _floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_floats(v) for v in obj]
    return float(obj) if obj in ("NaN", "Infinity", "-Infinity") else obj


def _fmt(v, spec):
    return "∞" if v == math.inf else "—" if math.isnan(v) else format(v, spec)


def markdown(rows: list, groups=("all", "embed", "attn_qkv", "attn_out", "mlp_in", "mlp_out", "norms")) -> str:
    """Tables per model: SQNR (dB) of the whole gradient per site × codec (mean over checkpoints),
    then, for the all-sites rows, SQNR / cosine / rel. error per group and the loss difference."""
    md = []
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        cks = sorted({r["checkpoint"] for r in rs})
        names = list(dict.fromkeys(r["codec"] for r in rs))
        site_names = list(dict.fromkeys(r["sites"] for r in rs))

        def mean(sel, f):  # NaN (shown "—") for a combination not measured
            return float(np.mean([f(r) for r in sel])) if sel else float("nan")

        def cell(s, n, rs=rs):  # "mean (per checkpoint)"
            sel = sorted((r for r in rs if r["sites"] == s and r["codec"] == n), key=lambda r: r["checkpoint"])
            if not sel:
                return "—"
            per = "/".join(_fmt(r["groups"]["all"]["sqnr_db"], ".1f") for r in sel)
            return f"{_fmt(mean(sel, lambda r: r['groups']['all']['sqnr_db']), '.1f')} ({per})"

        md += [f"**{model}: whole-gradient SQNR (dB): mean over checkpoints (at steps {'/'.join(map(str, cks))})**",
               "", "| sites | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for s in site_names:
            md.append(f"| {s} | " + " | ".join(cell(s, n) for n in names) + " |")
        md += ["", f"**{model}: all sites (no SP), per parameter group, mean over checkpoints**", "",
               "| codec | B/elt | loss rel. diff | " + " | ".join(f"SQNR {g}" for g in groups)
               + " | cosine all | rel. err all |", "|---|---|---|" + "---|" * len(groups) + "---|---|"]
        for n in names:
            sel = [r for r in rs if r["sites"] == "all (no SP)" and r["codec"] == n]
            if not sel:
                continue
            md.append(f"| {n} | {sel[0]['bytes_per_elt']:.4f} | {mean(sel, lambda r: r['loss_rel_diff']):+.2e} | "
                      + " | ".join(_fmt(mean(sel, lambda r, g=g: r["groups"][g]["sqnr_db"]), ".1f") for g in groups)
                      + f" | {mean(sel, lambda r: r['groups']['all']['cosine']):.6f}"
                      + f" | {mean(sel, lambda r: r['groups']['all']['rel_err']):.4f} |")
        md.append("")
    return "\n".join(md)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/grad_fidelity")
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "qwen3-tiny"])
    p.add_argument("--checkpoints", type=int, nargs="+", default=[0, 50, 100],
                   help="steps of the exact run whose parameters are measured (0: initialisation)")
    p.add_argument("--codecs", nargs="+", default=None, help="names (default: every kind + named variants)")
    p.add_argument("--sites", nargs="+", default=list(SITE_SETS), choices=list(SITE_SETS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="the exact run's schedule length (lr decay)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mesh", default="data=1,tensor=2")
    p.add_argument("--backend", default="ffi")
    p.add_argument("--floor", action="store_true", help=f"add the rounding floor row {FLOOR!r} (float32 compute)")
    args = p.parse_args(argv)
    run = run_record(__spec__.name, argv)
    args.eval_batches = 1
    import jax

    from taco_jax.data import load_shakespeare
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.util import jsonio

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()[:math.prod(parse_mesh(args.mesh).values())]
    ds = load_shakespeare(2048)
    cmap = codecs(args.backend)
    if args.codecs:
        cmap = {n: cmap[n] for n in args.codecs}
    cpu0, t0 = time.process_time(), time.perf_counter()
    rows_path = out / "rows.jsonl"  # resumable: (model, sites, codec) already there are not remeasured
    rows = [_floats(json.loads(line)) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    rows = [r for r in rows if r["checkpoint"] in args.checkpoints]

    def sink(row):
        with open(rows_path, "a") as f:
            f.write(jsonio.dumps(row) + "\n")

    for model in args.models:
        cfg = base_config(args, model)
        cfg = cfg.replace(steps=max(args.steps, max(args.checkpoints)))
        done = {(r["sites"], r["codec"]) for r in rows if r["model"] == model}
        todo = {s: SITE_SETS[s] for s in args.sites}
        if all((s, c) in done for s in todo for c in cmap) and (not args.floor or ("all (no SP)", FLOOR) in done):
            continue
        rows += measure(cfg, ds, devices, args.checkpoints, cmap, todo, done=done, sink=sink, floor=args.floor,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    rows = [r for r in rows if r["model"] in args.models and (r["codec"] in cmap or r["codec"] == FLOOR)]
    best = best_codec(rows) if any(r["sites"] == "all (no SP)" for r in rows) else None
    meta = {**{k: getattr(args, k) for k in ("models", "checkpoints", "batch_size", "seq_len", "steps", "lr", "dtype",
                                             "mesh", "backend")},
            "command": run["command"],
            "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - t0, "cpu_count": os.cpu_count(),
            "best_codec": best, "best_rule": " ".join(best_codec.__doc__.split("\n\n")[1].split()[:-6])}
    jsonio.write(out / "grad_fidelity.json", {"run": run, "meta": meta, "rows": rows})
    md = markdown(rows) + (f"\nBest codec of the family (rule: {meta['best_rule']}): **{best}**\n" if best else "")
    (out / "grad_fidelity.md").write_text(md)
    print(md)
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
