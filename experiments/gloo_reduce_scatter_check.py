"""How often XLA:CPU's gloo reduce-scatter returns wrong values (jax-ml/jax#40830), against the
all-to-all + sum that taco_jax uses instead (transport "gloo", `CodecConfig.transport`) and the
all-reduce, on real processes: 2 processes x 1 CPU device, `jax.distributed` + gloo on 127.0.0.1.

  python experiments/gloo_reduce_scatter_check.py --mb 64 --calls 8 --pairs 6 [--json OUT]

Each of `--pairs` fresh process pairs builds a float32 message of `--mb` MB per rank (rank r: numpy
standard normal, seed r), runs 3 exact all-gathers first (as in a benchmark run), then `--calls`
calls of each of: `lax.psum_scatter` ("lax_reduce_scatter"), `compressed.psum_scatter` with codec
none ("a2a_reduce_scatter", the workaround) and `lax.psum` ("all_reduce"), and compares every
result with the float64 sum computed on the host. A call is wrong when its relative L2 error
exceeds 1e-5 (float32 summation error is ~3e-8). Prints and writes the count of wrong calls per
(variant, rank) and the largest relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

VARIANTS = ("lax_reduce_scatter", "a2a_reduce_scatter", "all_reduce")
WRONG = 1e-5


def child(args) -> None:
    from taco_jax.train import distributed

    distributed.initialize(distributed.DistConfig(args.coordinator, 2, args.process_id))
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax.codec import NONE
    from taco_jax.collectives import compressed as cc

    pid = jax.process_index()
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())
    n = int(args.mb * 2**20) // 4
    parts = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(2)]
    total = parts[0].astype(np.float64) + parts[1]
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), parts[pid], (2 * n,))

    def sm(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    fns = {"lax_reduce_scatter": sm(lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True)),
           "a2a_reduce_scatter": sm(lambda v: cc.psum_scatter(v, "x", codec=NONE, scatter_dimension=0)),
           "all_reduce": sm(lambda v: lax.psum(v, "x"))}
    truth = {"lax_reduce_scatter": total[pid * n // 2:(pid + 1) * n // 2], "all_reduce": total}
    truth["a2a_reduce_scatter"] = truth["lax_reduce_scatter"]
    ag = sm(lambda v: lax.all_gather(v, "x", axis=0, tiled=True))
    for _ in range(3):
        jax.block_until_ready(ag(x))
    out = {}
    for name in VARIANTS:
        f = fns[name].lower(x).compile()
        errs = []
        for _ in range(args.calls):
            y = np.asarray(jax.block_until_ready(f(x)).addressable_shards[0].data).astype(np.float64)
            errs.append(float(np.linalg.norm(y - truth[name]) / np.linalg.norm(truth[name])))
        out[name] = errs
    with open(args.result, "w") as fh:
        json.dump({"process": pid, "errors": out}, fh)
    jax.distributed.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--mb", type=float, default=64.0, help="message MB per rank (float32)")
    p.add_argument("--calls", type=int, default=8, help="calls of each variant per process pair")
    p.add_argument("--pairs", type=int, default=6, help="fresh process pairs")
    p.add_argument("--json", default="", help="write the summary here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per process pair")
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_id >= 0:
        child(args)
        return {}
    if args.calls < 1 or args.pairs < 1:
        p.error(f"--calls {args.calls} and --pairs {args.pairs} must be >= 1")
    if int(args.mb * 2**20) // 4 < 2 or int(args.mb * 2**20) // 4 % 2:
        p.error(f"--mb {args.mb}: the message must hold an even, positive number of float32 values")
    import tempfile

    from taco_jax.launch import free_port, run_local

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the a2a variant must be the workaround whatever the caller's environment says
    env.update(TACO_GLOO_REDUCE_SCATTER="all_to_all", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])))
    wrong = {v: [0, 0] for v in VARIANTS}
    worst = dict.fromkeys(VARIANTS, 0.0)
    with tempfile.TemporaryDirectory(prefix="gloo_rs_") as tmp:
        for pair in range(args.pairs):
            coord = f"127.0.0.1:{free_port()}"
            res = [os.path.join(tmp, f"p{pair}_{i}.json") for i in range(2)]
            try:
                run_local([[sys.executable, __file__, "--mb", str(args.mb), "--calls", str(args.calls),
                            "--coordinator", coord, "--process-id", str(i), "--result", res[i]] for i in range(2)],
                          env=env, timeout_s=args.timeout)
            except RuntimeError as e:
                raise SystemExit(f"pair {pair}: {e}") from None
            for i in range(2):
                with open(res[i]) as fh:
                    errs = json.load(fh)["errors"]
                for name in VARIANTS:
                    wrong[name][i] += sum(e > WRONG for e in errs[name])
                    worst[name] = max(worst[name], *errs[name])
    summary = {"command": " ".join(sys.argv), "mb_per_rank": args.mb, "calls_per_rank": args.calls * args.pairs,
               "pairs": args.pairs, "wrong_calls_by_rank": wrong, "max_rel_err": worst, "threshold": WRONG}
    for name in VARIANTS:
        print(f"{name:20s} wrong calls: rank 0 {wrong[name][0]:3d}, rank 1 {wrong[name][1]:3d} "
              f"of {args.calls * args.pairs} each; largest relative error {worst[name]:.2g}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary


if __name__ == "__main__":
    main()
