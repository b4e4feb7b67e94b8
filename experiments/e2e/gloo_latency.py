"""What one gloo collective costs between two processes of an emulated cluster beyond its bytes:
a 2-process `jax.distributed` run (gloo, one CPU device each) timing psum (all-reduce) and ppermute
(a swap: one message each way) of one f32 message, on shaped links or loopback (JSON + table).
`--shaping` replaces the emulator's qdiscs by a variant of experiments/e2e/link_latency.py.

Run as root from the repository root (the cluster's namespaces are always removed again):

    python -m experiments.e2e.gloo_latency --link 1gbit --out runs/gloo_latency
    python -m experiments.e2e.gloo_latency --link none --out runs/gloo_latency_lo     # 127.0.0.1

The launcher (its link test) and each worker run SCHED_FIFO (`--rt-prio`, 0: off; set before JAX
starts, so its threads inherit it). Each worker warms each function up, then times `--reps` calls
per (collective, size): `--gap` s idle, then the call to the ready result. The two processes' times
of a call are paired by index; a call's time is the larger of the two. Ideal: the message's bytes
over the link's measured payload rate once (a 2-rank psum and a ppermute each move SIZE bytes each
way; gloo's ring all-reduce for 2 ranks: a reduce-scatter and an all-gather of SIZE / 2 each).
Fit: t = α + SIZE / R_eff over the sizes' medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

from experiments.common import run_record
from taco_jax import emulate
from taco_jax.util.procs import child_env


def worker(args) -> None:
    if args.rt_prio:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_prio))
    from taco_jax.train import distributed

    distributed.initialize(distributed.DistConfig(args.coordinator, 2, args.process_id))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    out = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        n = size // 4
        fns = {"psum": jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                             out_specs=P("x"))),
               "ppermute": jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]), mesh=mesh,
                                                 in_specs=P("x"), out_specs=P("x")))}
        local = np.full((n,), 1.0 + args.process_id, np.float32)
        x = jax.make_array_from_single_device_arrays(
            (2 * n,), NamedSharding(mesh, P("x")), [jax.device_put(local, jax.local_devices()[0])])
        for name, f in fns.items():
            for _ in range(3):
                f(x).block_until_ready()
            ts = []
            for _ in range(args.reps):
                time.sleep(args.gap)
                t0 = time.perf_counter()
                f(x).block_until_ready()
                ts.append(time.perf_counter() - t0)
            out[f"{name}:{size}"] = ts
    del jnp
    pathlib.Path(args.out, f"w{args.process_id}.json").write_text(json.dumps(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="RATE, or none (127.0.0.1, no namespaces)")
    p.add_argument("--sizes", default="4096,65536,262144,1048576,4194304")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--gap", type=float, default=0.005)
    p.add_argument("--rt-prio", type=int, default=50)
    p.add_argument("--shaping", default="base",
                   help="a variant of experiments.e2e.link_latency (default: the emulator's)")
    p.add_argument("--out", default="runs/gloo_latency")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rt_prio:  # the link test's threads too (a starved receiver reads a low rate)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt_prio))
    env = child_env({**os.environ, "JAX_PLATFORMS": "cpu"})
    run = run_record(__spec__.name, argv)
    load0 = os.getloadavg()
    bulk = None
    cl = emulate.Cluster(2, emulate.LinkSpec.parse(args.link)) if args.link != "none" else None
    try:
        if cl is not None:
            from experiments.e2e.link_latency import apply_variant

            apply_variant(cl, args.shaping, cl.spec.inter)
            bulk = emulate.measure(cl.names[0], cl.names[1], cl.addrs[1], cl.spec.inter, seconds=0.3)
            host = cl.addrs[0]
        else:
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for i in range(2):
            cmd = [sys.executable, "-m", __spec__.name, "--worker", "--process-id", str(i),
                   "--coordinator", f"{host}:{port}", "--sizes", args.sizes, "--reps", str(args.reps),
                   "--gap", str(args.gap), "--rt-prio", str(args.rt_prio), "--out", str(out)]
            procs.append(subprocess.Popen((cl.exec_prefix(i) if cl else []) + cmd, env=env))
        for pr in procs:
            if pr.wait(timeout=900):
                raise SystemExit(f"worker failed: {pr.returncode}")
    finally:
        if cl is not None:
            cl.close()
    w = [json.loads((out / f"w{i}.json").read_text()) for i in range(2)]
    rate = bulk or float("nan")
    rows = []
    for key in w[0]:
        name, size = key.split(":")
        ts = [max(a, b) for a, b in zip(w[0][key], w[1][key])]
        srt = sorted(ts)
        ideal = int(size) * 8 / rate if bulk else float("nan")
        rows.append({"collective": name, "size": int(size), "n": len(ts), "median_ms": statistics.median(ts) * 1e3,
                     "p10_ms": srt[len(srt) // 10] * 1e3, "p90_ms": srt[9 * len(srt) // 10] * 1e3,
                     "ideal_ms": ideal * 1e3})
    fits = {}
    for name in ("psum", "ppermute"):
        pts = [(r["size"], r["median_ms"]) for r in rows if r["collective"] == name]
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fits[name] = {"alpha_ms": my - slope * mx, "r_eff_mbit": 8 / slope / 1e3}
    doc = {"schema": "taco_jax.gloo_latency/1", "run": run, "link": args.link, "shaping": args.shaping,
           "bulk_bit_per_s": bulk,
           "load_before": load0, "load_after": os.getloadavg(), "uname": " ".join(os.uname()),
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gap_s": args.gap, "rows": rows, "fits": fits}
    (out / "gloo_latency.json").write_text(json.dumps(doc, indent=1))
    md = [f"link {args.link}, shaping {args.shaping} (bulk {bulk / 1e6 if bulk else float('nan'):.0f} Mbit/s); "
          f"load {load0[0]:.1f} -> "
          f"{doc['load_after'][0]:.1f}; gap {args.gap * 1e3:g} ms", "",
          "| collective | size | n | median ms | p10 | p90 | ideal ms |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['collective']} | {r['size'] >> 10} KB | {r['n']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | "
           f"{r['p90_ms']:.2f} | {r['ideal_ms']:.2f} |" for r in rows]
    md += ["", *(f"fit {k}: α = {v['alpha_ms']:.2f} ms, R_eff = {v['r_eff_mbit']:.0f} Mbit/s" for k, v in fits.items())]
    (out / "gloo_latency.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
