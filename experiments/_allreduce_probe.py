"""Private timing probe of the two-shot all-reduce over a real transport (2 processes x 1 CPU device,
jax.distributed + gloo on 127.0.0.1). The full benchmark is experiments/bench_collectives.py; this
one only times a few variants and sub-programs, median of --reps.

  python experiments/_allreduce_probe.py --mb 16 64 --dtype float32 --variants exact two_shot hd
Variant grammar: exact | two_shot | one_shot | hd (transform-domain) | sig (signal domain) | gx / gc (exact /
compressed all-gather of the whole message, first P-th of the result kept), with optional ":k=K"
(chunks) and ":ref" (reference backend), plus sub-programs: enc, dec, a2a, ag (wire sizes of the
taco two-shot; a2a32 / ag32: the same bytes moved as uint32) to see where the time goes. The
processes inherit the environment (e.g. GLIBC_TUNABLES=taco_jax.launch.MALLOC_KEEP, TACO_FFI_THREADS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: sub-programs: fixed input, output discarded (never donated)
SUB = ("enc", "dec", "a2a", "ag", "a2a32", "ag32", "gx", "gc")


def child(args):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coord, 2, args.pid)
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax import kernels
    from taco_jax.codec import TACO, decode, encode
    from taco_jax.collectives import compressed as cc

    mesh = jax.make_mesh((2,), ("t",), devices=jax.devices())
    dtype = jnp.dtype(args.dtype)
    for mb in args.mb:
        n = int(mb * 2**20) // dtype.itemsize
        rng = np.random.default_rng(jax.process_index())
        local = rng.standard_normal((1, n), np.float32).astype(dtype)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("t")), local, (2, n))
        fs, xs = {}, {}
        for var in args.variants:
            name, *opts = var.split(":")
            kw = dict(o.split("=") for o in opts if "=" in o)
            backend = "reference" if "ref" in opts else "ffi"
            codec = kernels.resolve_codec(dataclasses.replace(TACO, backend=backend))
            pkw = {}
            if "k" in kw:
                pkw["chunks"] = int(kw["k"])

            def body(v, name=name, codec=codec, pkw=pkw, opts=opts):
                v = v.reshape(-1)
                if name == "exact":
                    if "chunks" in pkw and "ord" in opts:  # the same, each psum ordered after the previous one
                        outs, prev = [], None
                        for c in jnp.split(v, pkw["chunks"]):
                            if prev is not None:
                                c, _ = lax.optimization_barrier((c, prev))
                            prev = lax.psum(c, "t")
                            outs.append(prev)
                        return jnp.concatenate(outs)[None]
                    if "chunks" in pkw:  # K independent exact psums over contiguous pieces
                        return jnp.concatenate([lax.psum(c, "t") for c in jnp.split(v, pkw["chunks"])])[None]
                    return lax.psum(v, "t")[None]
                if name in ("two_shot", "one_shot"):
                    return cc.psum(v, "t", codec=codec, algorithm=name, **pkw)[None]
                if name in ("hd", "sig"):
                    rd = "hadamard" if name == "hd" else "signal"
                    return cc.psum(v, "t", codec=codec, algorithm="two_shot", reduce_domain=rd, **pkw)[None]
                if name == "enc":
                    e = encode(v.reshape(2, -1), codec, batch_dims=1)
                    return (e.codes.astype(jnp.float32)[:, :1, 0] + e.scale[:, :1]).reshape(1, -1)
                if name == "dec":
                    e = encode(v[:128 * 2].reshape(2, -1), codec, batch_dims=1)
                    big = jax.tree.map(lambda t: jnp.tile(t, (1, v.size // 256) + (1,) * (t.ndim - 2)), e)
                    big = dataclasses.replace(big, shape=(v.size // 2,))
                    return decode(big, codec, jnp.float32)[:, :1].reshape(1, -1)
                if name == "gx":  # exact all-gather of the whole message
                    return lax.all_gather(v, "t", axis=0).reshape(1, -1)[:, : v.size]
                if name == "gc":  # compressed all-gather of the whole message
                    return cc.all_gather(v, "t", codec=codec, axis=0).reshape(1, -1)[:, : v.size]
                if name in ("a2a", "ag", "a2a32", "ag32"):  # "...32": the same bytes moved as uint32
                    wire = v.size + 8 * (v.size // 128)  # codes + s + a bytes of the whole message
                    b = lax.bitcast_convert_type(v[: wire // 4].reshape(-1, 1), jnp.uint8).reshape(2, -1)
                    if name.endswith("32"):
                        b, name = lax.bitcast_convert_type(v[: wire // 4], jnp.uint32).reshape(2, -1), name[:-2]
                    if name == "a2a":
                        return lax.all_to_all(b, "t", 0, 0).astype(jnp.float32)[:, :1].reshape(1, -1)
                    return lax.all_gather(b[0], "t", axis=0).astype(jnp.float32)[:, :1].reshape(1, -1)
                raise ValueError(name)

            # --donate: the output reuses the input's buffer (fed back as the next input), so no
            # fresh output buffer is page-faulted in per call (~150 ms per 64 MB on this VM)
            fs[var] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("t"), out_specs=P("t"), check_vma=False),
                              donate_argnums=0 if args.donate and name not in SUB else ())
            xs[var] = x.copy()
            if "unpacked" in opts:  # every wire codec now moves one packed row per message
                raise SystemExit("the 'unpacked' variant is gone: the wire codecs (taco_jax.codec.wire) always pack")
            sub = name in SUB
            y = fs[var](xs[var]).block_until_ready()
            xs[var] = xs[var] if sub else y
        ts = {v: [] for v in fs}
        for _ in range(args.reps):  # round robin: every variant sees the same background load
            for var, f in fs.items():
                t0 = time.perf_counter()
                y = f(xs[var]).block_until_ready()
                xs[var] = y if y.shape == xs[var].shape else xs[var]
                ts[var].append(time.perf_counter() - t0)
        for var, tv in ts.items():
            tv.sort()
            med = tv[len(tv) // 2] * 1e3
            if jax.process_index() == 0:
                print(f"{mb:6g} MB {args.dtype:8s} {var:22s} median {med:8.2f} ms  min {tv[0]*1e3:8.2f}  "
                      f"max {tv[-1]*1e3:8.2f}  (n={len(tv)})", flush=True)
    jax.distributed.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, nargs="+", default=[16.0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variants", nargs="+", default=["exact", "two_shot"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--donate", action="store_true", help="donate the input buffer (see child())")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds; then both processes are killed")
    ap.add_argument("--pid", type=int, default=-1)
    ap.add_argument("--coord", default="")
    args = ap.parse_args()
    if args.pid >= 0:
        return child(args)
    from taco_jax.launch import free_port, run_local

    coord = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    try:  # one child failing (or the deadline) stops the other
        run_local([[sys.executable, __file__, *sys.argv[1:], "--pid", str(i), "--coord", coord] for i in range(2)],
                  env=env, timeout_s=args.timeout)
    except RuntimeError as e:
        sys.exit(f"_allreduce_probe: {e}")


if __name__ == "__main__":
    main()
