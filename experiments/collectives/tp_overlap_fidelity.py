"""Fidelity of `--tp-overlap collective-matmul` with TACO: the ring's requantization against the
non-overlapped (two-shot) sequence-parallel collectives, both against exact.

    python -m experiments.collectives.tp_overlap_fidelity --out runs/tp_overlap_fidelity

1. One SP layer pair on standard-normal inputs (x [B, T, D], weights N(0, 1/fan-in)), tensor = P
   simulated CPU devices, float32 and bfloat16; SQNR (dB, float64 on the host) against the exact
   non-overlapped layer of:
     gather fwd   ColumnParallel output x -> all-gather -> @ W_col      (ring: a block re-encoded per hop)
     gather bwd   its input gradient: reduce-scatter of dY @ W_col^T     (ring: accumulator requantized per hop)
     scatter fwd  RowParallel output h @ W_row -> reduce-scatter         (ring: accumulator requantized per hop)
     scatter bwd  its input gradient: all-gather of dY, @ W_row^T        (ring: a block re-encoded per hop)
   for the non-overlapped TACO layer ("two_shot") and the overlapped one ("ring").
2. gpt2-tiny, data=2 × tensor=4, --sequence-parallel, at initialisation on one random batch: the
   loss's relative difference and the whole gradient's SQNR against the exact step, both variants.

Writes `<out>/tp_overlap_fidelity.json` (strict JSON) and `.md`; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments.common import cpu_devices, run_record

if "jax" not in sys.modules:
    cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from taco_jax.codec.metrics import sqnr_db  # noqa: E402
from taco_jax.collectives import CommPolicy  # noqa: E402
from taco_jax.parallel.context import ParallelContext  # noqa: E402

VARIANTS = {"two_shot": "none", "ring": "collective-matmul"}


def sp_context(policy, overlap: str) -> ParallelContext:
    """The sequence-parallel `ParallelContext` of mesh axis "tensor" with `policy` (a `CommPolicy`) and
    `--tp-overlap` mode `overlap` ("none": two-shot collectives, "collective-matmul": the ring)."""
    return ParallelContext("tensor", policy, True, tp_overlap=overlap)


def column_parallel(ctx: ParallelContext):
    """ColumnParallel under `ctx`, per device inside a shard_map: f(x [B, T/P, D], w [D, F/P]) ->
    [B, T, F/P] (all-gather of x along T, then the matmul; the ring overlaps the two)."""
    def f(x, w):
        h = ctx.enter(x)
        mm = (lambda b: jnp.tensordot(b, w, axes=1))
        return h.apply(mm) if ctx.overlapped else mm(h)
    return f


def row_parallel(ctx: ParallelContext):
    """RowParallel under `ctx`, per device inside a shard_map: f(h [B, T, F/P], w [F/P, D]) ->
    [B, T/P, D] (the matmul, then reduce-scatter along T; the ring overlaps the two)."""
    return lambda h, w: ctx.exit_matmul(lambda b: jnp.tensordot(b, w, axes=1), h)


def layer_sqnr(p: int, dtype: str, b: int, t: int, d: int, f: int) -> dict:
    """{variant: {site: SQNR dB}} for one tensor size `p` and compute dtype."""
    mesh = Mesh(np.asarray(jax.devices()[:p]), ("tensor",))
    ks = jax.random.split(jax.random.key(p), 6)
    dt = jnp.dtype(dtype)
    x = jax.random.normal(ks[0], (b, t, d)).astype(dt)
    wc = (jax.random.normal(ks[1], (d, f)) / np.sqrt(d)).astype(dt)
    h = jax.random.normal(ks[2], (b, t, f)).astype(dt)
    wr = (jax.random.normal(ks[3], (f, d)) / np.sqrt(f)).astype(dt)
    ct_col = jax.random.normal(ks[4], (b, t, f)).astype(dt)
    ct_row = jax.random.normal(ks[5], (b, t, d)).astype(dt)
    seq, col_out = P(None, "tensor"), P(None, None, "tensor")

    def run(policy, overlap):
        ctx = sp_context(policy, overlap)
        col = jax.shard_map(column_parallel(ctx), mesh=mesh, in_specs=(seq, seq), out_specs=col_out)
        row = jax.shard_map(row_parallel(ctx), mesh=mesh, in_specs=(col_out, P("tensor")), out_specs=seq)
        y_col, vjp_col = jax.vjp(lambda x_: col(x_, wc), x)
        y_row, vjp_row = jax.vjp(lambda h_: row(h_, wr), h)
        return {"gather fwd": y_col, "gather bwd": vjp_col(ct_col)[0],
                "scatter fwd": y_row, "scatter bwd": vjp_row(ct_row)[0]}

    exact = run(CommPolicy.none(), "none")
    taco = CommPolicy.taco().resolve_backends(n_devices=p)
    return {name: {site: sqnr_db(np.asarray(exact[site], np.float64), np.asarray(v, np.float64))
                   for site, v in run(taco, overlap).items()} for name, overlap in VARIANTS.items()}


def model_fidelity(model: str = "gpt2-tiny") -> dict:
    """{variant: {"loss_rel_diff", "grad_sqnr_db"}}: `model` on data=2 × tensor=4 with SP, at init."""
    from flax import nnx

    from taco_jax.models import get_config, make_model
    from taco_jax.train.step import make_steps

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))
    cfg = get_config(model, vocab_size=512, dtype="float32")
    params = nnx.to_pure_dict(nnx.split(make_model(cfg, rngs=nnx.Rngs(0), tensor_size=4), nnx.Param)[1])
    ids = jax.random.randint(jax.random.key(1), (8, 65), 0, cfg.vocab_size)
    batch = (ids[:, :-1], ids[:, 1:])

    def step(policy, overlap):
        vg = make_steps(cfg, mesh, policy.resolve_backends(n_devices=8), sequence_parallel=True,
                        tp_overlap=overlap).value_and_grad
        loss, grads = jax.jit(vg)(params, *batch)
        return float(loss), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]

    loss0, g0 = step(CommPolicy.none(), "none")
    out = {}
    for name, overlap in VARIANTS.items():
        loss, g = step(CommPolicy.taco(), overlap)
        out[name] = {"loss_rel_diff": abs(loss - loss0) / abs(loss0), "grad_sqnr_db": sqnr_db(g0, g)}
    return out


def markdown(res: dict) -> str:
    sites = ("gather fwd", "gather bwd", "scatter fwd", "scatter bwd")
    lines = ["| P | dtype | variant | " + " | ".join(sites) + " |", "|---|---|---|" + "---|" * len(sites)]
    for row in res["layers"]:
        for name in VARIANTS:
            vals = " | ".join(f"{row[name][s]:.1f}" for s in sites)
            lines.append(f"| {row['p']} | {row['dtype']} | {name} | {vals} |")
    lines += ["", f"| {res['model']} (data=2, tensor=4, SP, init) | loss rel. diff | gradient SQNR (dB) |",
              "|---|---|---|"]
    for name, v in res["model_fidelity"].items():
        lines.append(f"| {name} | {v['loss_rel_diff']:.2e} | {v['grad_sqnr_db']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/tp_overlap_fidelity")
    ap.add_argument("--sizes", type=int, nargs=4, default=(4, 256, 256, 1024), metavar=("B", "T", "D", "F"))
    ap.add_argument("--tensor", type=int, nargs="+", default=(2, 4, 8))
    ap.add_argument("--model", default="gpt2-tiny")
    args = ap.parse_args(argv)
    res = {"run": run_record(__spec__.name, argv), "sizes": dict(zip("BTDF", args.sizes)), "model": args.model,
           "layers": []}
    for p in args.tensor:
        for dtype in ("float32", "bfloat16"):
            res["layers"].append({"p": p, "dtype": dtype, **layer_sqnr(p, dtype, *args.sizes)})
    res["model_fidelity"] = model_fidelity(args.model)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_overlap_fidelity.json").write_text(json.dumps(res, indent=2, allow_nan=False) + "\n")
    (out / "tp_overlap_fidelity.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
