"""Does XLA:CPU run a ring step's ppermute while a partial matmul runs? A `jax.profiler` trace of one
SP layer pair (ColumnParallel -> GELU -> RowParallel, tensor = 4 simulated CPU devices), read per
device from the thunk events of the perfetto trace.

    python -m experiments.collectives.tp_overlap_trace --overlap collective-matmul --comm taco --sizes 4 512 512 2048

Prints, over 3 traced calls: the collective thunks' time, how much of it a matmul thunk (`ynn_fusion`)
of the same device ran concurrently, the (collective, matmul) pairs seen concurrent, and how many
threads each device's execution used. On a loaded machine the durations mean little (the
collective thunks include waiting at the rendezvous for the other simulated devices); the
concurrency is what this shows. `--hlo FILE` also writes the compiled HLO (metadata stripped).

`--from-trace DIR` reads a trace already taken instead, e.g. one process of a training run on an
emulated link (`taco-jax launch --link 250mbit -- train ... --profile-steps 4:5`), and `--other`
names what counts as concurrent work (thunk name prefixes: `ffi_call` = the codec, `fusion`,
`all-to-all` = the other collectives, ...):

    python -m experiments.collectives.tp_overlap_trace --from-trace runs/c2/profile/process0 --other ffi_call fusion all
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from experiments.common import cpu_devices

if "jax" not in sys.modules:
    cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.collectives.tp_overlap_fidelity import column_parallel, row_parallel, sp_context  # noqa: E402
from taco_jax.collectives import CommPolicy  # noqa: E402

COLLECTIVES = ("ppermute", "all_gather", "all-gather", "all-to-all", "all_to_all", "reduce_scatter",
               "reduce-scatter", "all_reduce", "all-reduce")


def concurrency(trace_dir: str, other: tuple[str, ...] = ("ynn_fusion",)) -> dict:
    """Per (run, device) thunk intervals of the perfetto trace under `trace_dir` -> summary dict: the
    collective thunks' time and how much of it ran concurrently with another thunk whose name starts
    with one of `other` (default: the matmuls, `ynn_fusion`; a collective prefix counts the other
    collectives) on the same device."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if "hlo_op" in e.get("args", {})]
    runs = collections.defaultdict(list)
    for e in events:
        key = (e["args"]["run_id"], e["args"]["device_ordinal"])
        runs[key].append((e["ts"], e["ts"] + e["dur"], e["name"], e["tid"]))
    coll_us = overlap_us = 0.0
    pairs, threads = collections.Counter(), []
    for thunks in runs.values():
        colls = [t for t in thunks if t[2].startswith(COLLECTIVES)]
        if not colls:
            continue
        threads.append(len({t[3] for t in thunks}))
        for c in colls:
            dots = [t for t in thunks if t is not c and t[2].startswith(other)]  # may hold other collectives
            coll_us += c[1] - c[0]
            spans = sorted((max(c[0], d[0]), min(c[1], d[1])) for d in dots if min(c[1], d[1]) > max(c[0], d[0]))
            end = -1e30
            for a, b in spans:  # union of the concurrent spans
                a = max(a, end)
                if b > a:
                    overlap_us, end = overlap_us + b - a, b
            pairs.update((c[2], d[2]) for d in dots if min(c[1], d[1]) > max(c[0], d[0]))
    return {"executions": len(threads), "collective_ms": coll_us / 1e3, "concurrent_with_other_ms": overlap_us / 1e3,
            "threads_per_execution": threads, "pairs": pairs.most_common(12)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--overlap", default="collective-matmul", choices=("none", "collective-matmul"))
    ap.add_argument("--comm", default="taco", choices=("none", "taco"))
    ap.add_argument("--sizes", type=int, nargs=4, default=(4, 512, 512, 2048), metavar=("B", "T", "D", "F"))
    ap.add_argument("--hlo", default="")
    ap.add_argument("--from-trace", default="", metavar="DIR",
                    help="only read an existing trace (e.g. a `train --profile-steps` folder), print its concurrency")
    ap.add_argument("--other", nargs="+", default=["ynn_fusion"],
                    help="thunk name prefixes counted as concurrent work (default: the matmuls, ynn_fusion)")
    args = ap.parse_args(argv)
    if args.from_trace:
        print(json.dumps({"trace": args.from_trace, "other": args.other,
                          **concurrency(args.from_trace, tuple(args.other))}))
        return 0
    b, t, d, f = args.sizes
    p = 4
    mesh = Mesh(np.asarray(jax.devices()[:p]), ("tensor",))
    policy = CommPolicy.none() if args.comm == "none" else CommPolicy.taco().resolve_backends(n_devices=p)
    ctx = sp_context(policy, args.overlap)
    seq = P(None, "tensor")
    col, row = column_parallel(ctx), row_parallel(ctx)
    fn = jax.jit(jax.shard_map(lambda x, wc, wr: row(jax.nn.gelu(col(x, wc)), wr), mesh=mesh,
                               in_specs=(seq, seq, P("tensor")), out_specs=seq))
    x, wc, wr = jnp.ones((b, t, d)), jnp.ones((d, f)) / d, jnp.ones((f, d)) / f
    if args.hlo:
        text = fn.lower(x, wc, wr).compile().as_text()
        with open(args.hlo, "w") as fh:
            fh.write(re.sub(r", metadata=\{[^}]*\}", "", text))
    fn(x, wc, wr).block_until_ready()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(3):
                fn(x, wc, wr).block_until_ready()
        print(json.dumps({"overlap": args.overlap, "comm": args.comm, "sizes": args.sizes,
                          **concurrency(tmp, tuple(args.other))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
