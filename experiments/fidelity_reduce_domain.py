"""Fidelity of the two-shot all-reduce's reduction domain on captured tensor-parallel messages.

For every all-reduce message of `taco-jax train --capture N` (sites ar_fwd / ar_bwd, [P, *msg]
per file entry, one slice per tensor rank), runs the real `taco_jax.collectives.psum` on a
simulated P-device mesh with reduce_domain "signal" (decode, sum, re-encode) and "hadamard" (sum
in the transform domain, requantize) and compares each with the exact sum (float64).

  python experiments/fidelity_reduce_domain.py --captures RUN/captures [--backend ffi] [--fmt e4m3]
Prints energy-weighted SQNR (dB) over all messages and per site, and the per-message differences.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--captures", required=True)
    ap.add_argument("--backend", default="ffi")
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.captures, "step*.npz")))
    if not files:
        sys.exit(f"no step*.npz in {args.captures}")
    import numpy as np

    p = int(np.load(files[0])[next(iter(np.load(files[0]).keys()))].shape[0])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={p}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax import collectives as C
    from taco_jax import kernels
    from taco_jax.codec import TACO, sqnr_db

    codec = kernels.resolve_codec(dataclasses.replace(TACO, backend=args.backend, fmt=args.fmt,
                                                      group_size=args.group_size))
    mesh = jax.make_mesh((p,), ("t",), devices=jax.devices()[:p])
    fns = {d: jax.jit(jax.shard_map(lambda v, d=d: C.psum(v[0], "t", codec=codec, reduce_domain=d)[None],
                                    mesh=mesh, in_specs=P("t"), out_specs=P("t")))
           for d in ("signal", "hadamard")}
    exact, got = [], {d: [] for d in fns}
    sites, rows = [], []
    for f in files:
        z = np.load(f)
        for name in sorted(z.keys()):
            if not name.startswith(("ar_fwd", "ar_bwd")):
                continue
            x = z[name].astype(np.float32)
            want = x.astype(np.float64).sum(0)
            xs = jax.device_put(x, NamedSharding(mesh, P("t")))
            exact.append(want)
            sites.append(name.split("__")[0])
            r = {"file": os.path.basename(f), "message": name}
            for d, fn in fns.items():
                out = np.asarray(fn(xs))[0].astype(np.float64)
                got[d].append(out)
                r[d] = sqnr_db(want, out)
            rows.append(r)
    res = {"captures": args.captures, "messages": len(exact), "P": p, "codec": codec.to_dict(),
           "sqnr_db": {d: sqnr_db(exact, got[d]) for d in got}}
    for site in sorted(set(sites)):
        idx = [i for i, s in enumerate(sites) if s == site]
        res[f"sqnr_db_{site}"] = {d: sqnr_db([exact[i] for i in idx], [got[d][i] for i in idx]) for d in got}
    diff = np.array([r["hadamard"] - r["signal"] for r in rows])
    res["per_message_hadamard_minus_signal_db"] = {"min": float(diff.min()), "median": float(np.median(diff)),
                                                   "max": float(diff.max()), "hadamard_better_or_equal":
                                                   int((diff >= 0).sum()), "n": int(diff.size)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**res, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
