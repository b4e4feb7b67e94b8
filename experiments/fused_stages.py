"""Where the fused two-shot all-reduce spends its codec time, and what the SP collectives compile to.

1. Stage times of the "ffi" wire codec (`CodecConfig.wire`, C++ FFI on CPU), one process, for an
   M MB float32 message per rank split over P = 2 ranks: `encode_packed` (split rows for the
   all-to-all), `reduce_packed` (decode both received halves, FP32 sum, re-encode), `decode_packed`
   of the gathered rows, and, for scale, a jitted `x * 2` of the same message (a fresh output
   buffer). Median of --reps calls. Run with TACO_FFI_THREADS=1 to see one core's share, as each of
   2 processes on 2 cores gets.
2. `--hlo`: transposes in the compiled 2-device sequence-parallel train step (gpt2-narrow, float32,
   batch 64 x 32), exact vs taco with the fused wire path on and off.

    TACO_FFI_THREADS=1 python experiments/fused_stages.py --mb 16 64 --hlo
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _median_ms(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def stage_times(mb: float, reps: int) -> dict:
    """Milliseconds per stage of the fused two-shot psum (P = 2) of an `mb` MB float32 message."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from taco_jax.codec import TACO
    from taco_jax.kernels import ffi_codec

    cfg = dataclasses.replace(TACO, backend="ffi")
    n = int(mb * 2**20) // 4
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, n // 2), np.float32))
    enc = jax.jit(lambda v: ffi_codec.encode_packed(v, cfg, split=True))
    parts = enc(x)
    red = jax.jit(lambda a, b: ffi_codec.reduce_packed([a, b], cfg, n // 2))
    mine = red(*parts)
    dec = jax.jit(lambda g: ffi_codec.decode_packed(g, cfg, n // 2))
    return {"encode_ms": _median_ms(enc, x, reps=reps), "reduce_ms": _median_ms(red, *parts, reps=reps),
            "decode_ms": _median_ms(dec, jnp.stack([mine, mine]), reps=reps),
            "x_times_2_ms": _median_ms(jax.jit(lambda v: v * 2), x, reps=reps)}


def sp_transposes() -> dict:
    """Transpose ops in the compiled SP train step: exact, taco fused, taco unfused."""
    import jax

    from taco_jax.collectives import TENSOR_SITES
    from taco_jax.train.config import TrainConfig
    from taco_jax.train.step import make_trainer

    out = {}
    for label, comm, fused in (("exact", "none", True), ("taco_fused", "taco", True), ("taco_unfused", "taco", False)):
        generic = () if fused or comm == "none" else tuple(f"{s}:wire=generic" for s in TENSOR_SITES)
        cfg = TrainConfig.from_flags(comm=comm, mesh="data=1,tensor=2", model="gpt2-narrow", batch_size=64,
                                     seq_len=32, dtype="float32", vocab_size=512, sequence_parallel=True,
                                     site=generic)
        tr = make_trainer(cfg, jax.devices()[:2])
        params, opt = tr.init()
        batch = jax.ShapeDtypeStruct((64, 32), "int32", sharding=None)
        text = tr.train_step.lower(params, opt, batch, batch).compile().as_text()
        out[label] = len(re.findall(r"=\s*\S+\s+transpose\(", text))  # instructions, not metadata
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, nargs="+", default=[16.0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--hlo", action="store_true", help="also count transposes in the compiled SP train step")
    args = p.parse_args(argv)
    res = {"threads": os.environ.get("TACO_FFI_THREADS", "default"),
           "stages": {mb: stage_times(mb, args.reps) for mb in args.mb}}
    if args.hlo:
        res["sp_transposes"] = sp_transposes()
    for mb, st in res["stages"].items():
        print(f"{mb:g} MB: " + "  ".join(f"{k} {v:.2f}" for k, v in st.items()))
    if args.hlo:
        print("SP train step transposes:", res["sp_transposes"])
    return res


if __name__ == "__main__":
    main()
