"""Minimal real-transport measurement for calibrating `taco_jax.perf` (stand-in until
experiments/collectives/bench_collectives.py's JSON exists): 2 processes x 1 CPU device, jax.distributed + gloo
over 127.0.0.1; per size the exact `lax.psum` and the two-shot compressed psum (TACO, per backend),
median (and min) of `--reps` interleaved rounds after a warm-up; and, per backend, the local encode / decode time of a
whole message (both processes run it at once, as in a collective). Then the same psums in one
process on a simulated 2-device mesh (transport "sim": in-process copies), whose compressed - exact
difference is the local work of the compressed collective (codec, sums, splits).

Run (from the repository root; writes rows in the `taco_jax.bench_collectives/1` shape, subset of keys):

    python -m experiments.costmodel.costmodel_measure --out runs/costmodel/measure.json --sizes-mb 0.25,1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import child_env, module_command, run_record

SIM = 99  # --pid of the one-process child on a simulated 2-device mesh (transport "sim")


def _child(args) -> None:
    import jax

    sim = args.pid == SIM
    if not sim:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.pid)
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax.codec import TACO, decode, encode
    from taco_jax.collectives import compressed

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = []

    def once(fn, x):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        return time.perf_counter() - t

    for mb in args.sizes_mb:
        n = int(mb * (1 << 20)) // 4
        local = np.random.default_rng(0 if sim else args.pid).standard_normal(n, dtype=np.float32)
        if sim:  # one process, 2 simulated devices: rank r's message is row r
            both = np.concatenate([local, np.random.default_rng(1).standard_normal(n, dtype=np.float32)])
            x = jax.device_put(both, NamedSharding(mesh, P("x")))
        else:
            x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local, (2 * n,))
        y = jnp.asarray(local)
        cases = {}  # name -> (fn, input); timed in interleaved rounds (load hits every case alike)
        for backend in ["exact", *args.backends]:
            if backend == "reference" and mb > args.reference_max_mb:
                continue
            codec = None if backend == "exact" else dataclasses.replace(TACO, backend=backend)
            body = (lambda v: jax.lax.psum(v, "x")) if codec is None else \
                (lambda v, c=codec: compressed.psum(v, "x", codec=c))
            cases[("psum", backend)] = (jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())), x)
            if codec is not None and not sim:  # local codec time of the whole message
                enc = jax.jit(lambda v, c=codec: encode(v, c))
                cases[("encode", backend)] = (enc, y)
                cases[("decode", backend)] = (jax.jit(lambda e, c=codec: decode(e, c, jnp.float32)), enc(y))
        times = {k: [] for k in cases}
        for fn, v in cases.values():
            once(fn, v)  # compile + warm-up
        for _ in range(args.reps):
            for k, (fn, v) in cases.items():
                times[k].append(once(fn, v))
        for (what, backend), ts in times.items():
            if what == "psum":
                rows.append(dict(collective="psum", algorithm="two_shot",
                                 codec="none" if backend == "exact" else "taco",
                                 backend="none" if backend == "exact" else backend, dtype="float32",
                                 transport="sim" if sim else "gloo",
                                 processes=2, devices=2, size_bytes=4 * n, time_s_median=float(np.median(ts)),
                                 time_s_min=float(np.min(ts))))
            elif what == "encode":
                td = times[("decode", backend)]
                rows.append(dict(collective="codec", backend=backend, codec="taco", dtype="float32", size_bytes=4 * n,
                                 encode_s=float(np.median(ts)), decode_s=float(np.median(td)),
                                 encode_s_min=float(np.min(ts)), decode_s_min=float(np.min(td))))
    if sim:  # appends to the gloo run's file
        d = json.loads(Path(args.out).read_text())
        d["rows"] += rows
        Path(args.out).write_text(json.dumps(d, indent=1))
        return
    if args.pid == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"schema": "taco_jax.bench_collectives/1", "source":
                                              "experiments.costmodel.costmodel_measure", "rows": rows}, indent=1))
    jax.distributed.shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes-mb", default="0.25,1,4,16,64")
    p.add_argument("--backends", default="ffi,reference")
    p.add_argument("--reps", type=int, default=7, help="interleaved timing rounds (median and min kept)")
    p.add_argument("--reference-max-mb", type=float, default=16.0, help="largest size timed with the reference backend")
    p.add_argument("--malloc", choices=("keep", "default"), default="default",
                   help="the children's allocator, as `taco-jax launch --malloc` (default: glibc's own, as "
                        "the shipped calibration was measured; docs/cost_model.md)")
    p.add_argument("--port", type=int, default=12977)
    p.add_argument("--pid", type=int, default=-1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes_mb = [float(s) for s in a.sizes_mb.split(",")]
    a.backends = [b for b in a.backends.split(",") if b]
    if a.pid >= 0:
        return _child(a)
    from taco_jax.launch import malloc_env

    env = malloc_env(child_env({**os.environ, "JAX_PLATFORMS": "cpu"}), a.malloc)
    env.pop("XLA_FLAGS", None)
    from taco_jax.launch import run_local

    run = run_record(__spec__.name, argv)
    cmd = module_command(__spec__.name, *(argv or sys.argv[1:]))
    try:  # one child failing (or 1800 s passing) stops the other
        run_local([[*cmd, "--pid", str(i)] for i in range(2)],
                  env=env, timeout_s=1800)
    except RuntimeError as e:
        raise SystemExit(f"gloo children: {e}") from None
    sim_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    if subprocess.run([*cmd, "--pid", str(SIM)], env=sim_env).returncode:
        raise SystemExit("the simulated-mesh child failed")
    Path(a.out).write_text(json.dumps({"run": run, **json.loads(Path(a.out).read_text())}, indent=1))
    print(Path(a.out).read_text()[:2000])


if __name__ == "__main__":
    main()
