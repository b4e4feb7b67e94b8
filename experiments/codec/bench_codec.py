"""Encode/decode throughput of each codec backend beside a memcpy of the same bytes (JSON + plot).

Run (CPU; build the FFI library first with `make -C custom_calls`):

    .venv/bin/python -m experiments.codec.bench_codec --out runs/bench_codec            # 1 MB .. 256 MB
    .venv/bin/python -m experiments.codec.bench_codec --out runs/bench_codec --quick    # 1 and 16 MB
    .venv/bin/python -m experiments.codec.bench_codec --out runs/x --sizes 4,64 --backends ffi
    .venv/bin/python -m experiments.codec.bench_codec --out runs/x --sizes 16,64 --backends ffi --dtype bfloat16

Throughput is the message's bytes (encode: its input, decode: its output) per second, the
message in `--dtype` (float32 by default; bfloat16 as training sends it), and each case is
compared with a memcpy of that many bytes measured in the same run. A backend that reads and
writes the dtype natively (`codec.backends.get_native`) is called with it as
it is; the others get the casts `codec.dispatch` adds (to float32 before encode, clip and back after
decode), inside the timed program. Cases are timed in interleaved rounds and the best round is kept, so load from other
processes hits every case alike. Regimes, each against its own memcpy:

  steady  outputs reuse donated buffers (`donate_argnums`, `keep_unused=True`), as in a
          training step whose buffers are recycled; memcpy = the faster of numpy `copyto` into
          a preallocated array and an XLA in-place copy (`dynamic_update_slice` into a donated
          buffer). The acceptance ratio (>= 0.5x) is read here.
  fresh   a plain jitted call that allocates its outputs; on CPU the OS zero-fills fresh pages,
          which dominates large decodes; memcpy = jitted `jnp.copy` (also fresh).
  program K = min(8, 8 MB / size) different messages per jitted call (8 at 1 MB, 2 at 4 MB;
          only where K >= 2, i.e. sizes up to 4 MB),
          donated outputs, time per message: the codec as it runs inside a compiled training
          step, where no Python -> jit dispatch (20-40 us per call on the 2-core CPU) separates
          one collective's codec call from the next; memcpy = numpy `copyto` of K different
          buffers back to back, or K in-place XLA copies in one call, the faster.
  hot     the steady cases, each timed call right after the same call, so its inputs and
          outputs are as cache-resident as they get (a 1 MB message fits a core's L2).

Where a message is matters at 1 MB: a memcpy of an L2-resident 1 MB runs 2-3x faster than one
from L3 or memory, while the encoder is compute-bound. In steady and fresh the cache state is
whatever the round's other cases leave behind, so the 1 MB steady memcpy runs faster when fewer
backends share the round (`--backends ffi` alone leaves more of the message in L2); program and
hot are timed in passes of their own so that they do not change it.

`call_floor_us` in the JSON is each case's time on an 8-group message: the fixed cost of one
call (jit dispatch, XLA runtime, thread-pool hand-off), which weighs on the 1 MB ratios; in the
program regime, the cost per message of a call holding 8 of them.

On GPU the same script compares with device copies (and reports the HBM peak, if known).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_record
from taco_jax import kernels
from taco_jax.codec.backends import get_backend, get_native
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.dispatch import clip_to_dtype
from taco_jax.perf.hardware import shipped

MB = 1 << 20
DEFAULT_SIZES = (1, 4, 16, 64, 256)
#: HBM peak GB/s by device name, for the GPU report: the hardware table's `[KEY.target]` memory bandwidth.
HBM_PEAK_GBS = {k.upper(): s.target["memory_bandwidth_GBps"] for k, s in shipped().items() if s.target}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder for bench_codec.json and bench_codec.png")
    p.add_argument("--sizes", default=None, help="comma-separated MB of message (default 1,4,16,64,256)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="message dtype")
    p.add_argument("--backends", default=None, help="comma-separated (default: reference,ffi + pallas at 1 MB)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--fmt", default="e4m3", choices=("e4m3", "e5m2"))
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per case (best kept)")
    p.add_argument("--quick", action="store_true", help="sizes 1,16 MB and 3 rounds")
    p.add_argument("--pallas-max-mb", type=float, default=1.0, help="largest size run with pallas (slow on CPU)")
    return p.parse_args(argv)


def _block(tree):
    jax.block_until_ready(tree)
    return tree


class Case:
    """A timed closure; `step()` runs it once (state, e.g. donated buffers, carried inside)."""

    def __init__(self, name: str, kind: str, regime: str, backend: str, fn, per_call: int = 1):
        self.name, self.kind, self.regime, self.backend, self.fn = name, kind, regime, backend, fn
        self.per_call = per_call  # messages per fn() call: times are per message
        self.times: list[float] = []

    def step(self):
        t0 = time.perf_counter()
        self.fn()
        self.times.append((time.perf_counter() - t0) / self.per_call)


def program_count(nbytes: int) -> int:
    """Messages per call in the program regime (1: no program regime at this size)."""
    return max(1, min(8, (8 * MB) // nbytes))


def make_cases(x: jax.Array, cfg: CodecConfig, backends: list[str]) -> list[Case]:
    cases: list[Case] = []
    k = program_count(x.size * x.dtype.itemsize)
    xs = [x] + [x * (1.0 + 0.01 * i) for i in range(1, k)] if k > 1 else []  # K different messages

    # memcpy baselines (same bytes as the message)
    xh = np.asarray(x)
    dst = np.empty_like(xh)
    cases.append(Case("numpy copyto", "memcpy", "steady", "memcpy", lambda: np.copyto(dst, xh)))
    copy_fresh = jax.jit(jnp.copy)
    cases.append(Case("xla copy (fresh)", "memcpy", "fresh", "memcpy", lambda: _block(copy_fresh(x))))
    copy_into = jax.jit(lambda src, d: jax.lax.dynamic_update_slice(d, src, (0, 0)), donate_argnums=1)
    box = {"d": jnp.zeros_like(x)}

    def xla_inplace():
        box["d"] = _block(copy_into(x, box["d"]))

    cases.append(Case("xla copy (in place)", "memcpy", "steady", "memcpy", xla_inplace))

    if xs:
        srcs = [np.asarray(t) for t in xs]
        dsts = [np.empty_like(t) for t in srcs]

        def numpy_program():
            for d, t in zip(dsts, srcs, strict=True):
                np.copyto(d, t)

        cases.append(Case("numpy copyto", "memcpy", "program", "memcpy", numpy_program, per_call=k))
        copies_into = jax.jit(
            lambda srcs_, ds: [jax.lax.dynamic_update_slice(d, t, (0, 0)) for t, d in zip(srcs_, ds, strict=True)],
            donate_argnums=1,
        )
        boxes = {"d": [jnp.zeros_like(t) for t in xs]}

        def xla_program():
            boxes["d"] = _block(copies_into(xs, boxes["d"]))

        cases.append(Case("xla copy (in place)", "memcpy", "program", "memcpy", xla_program, per_call=k))

    for name in backends:
        cases += backend_cases(name, x, cfg)
        if xs:
            cases += program_cases(name, xs, cfg)
    return cases


def _as_dispatched(name: str, dtype):
    """Backend `name`'s (encode, decode) for messages of `dtype`, with the casts `codec.dispatch`
    adds for a dtype the backend does not read and write natively."""
    enc, dec = get_backend(name)
    if jnp.dtype(dtype).name in get_native(name).dtypes:
        return enc, lambda c, s, a: dec(c, s, a, dtype=dtype)
    return (lambda t, cfg, **kw: enc(t.astype(jnp.float32), cfg, **kw),
            lambda c, s, a: clip_to_dtype(dec(c, s, a), dtype).astype(dtype))


def backend_cases(name: str, x: jax.Array, cfg: CodecConfig) -> list[Case]:
    """Encode and decode of backend `name`, fresh and steady (donated outputs)."""
    g = x.shape[1]
    enc, dec = _as_dispatched(name, x.dtype)
    enc_fresh = jax.jit(lambda t: enc(t, cfg, last_count=g))
    dec_fresh = jax.jit(dec)
    codes, s, a = _block(enc_fresh(x))
    enc_steady = jax.jit(lambda t, c, s_, a_: enc(t, cfg, last_count=g), donate_argnums=(1, 2, 3), keep_unused=True)
    dec_steady = jax.jit(lambda c, s_, a_, o: dec(c, s_, a_), donate_argnums=3, keep_unused=True)
    st = {"enc": list(_block(enc_fresh(x))), "out": jnp.zeros_like(x)}

    def enc_step():
        st["enc"] = list(_block(enc_steady(x, *st["enc"])))

    def dec_step():
        st["out"] = _block(dec_steady(codes, s, a, st["out"]))

    return [
        Case(f"{name} encode", "encode", "fresh", name, lambda: _block(enc_fresh(x))),
        Case(f"{name} decode", "decode", "fresh", name, lambda: _block(dec_fresh(codes, s, a))),
        Case(f"{name} encode", "encode", "steady", name, enc_step),
        Case(f"{name} decode", "decode", "steady", name, dec_step),
    ]


def program_cases(name: str, xs: list[jax.Array], cfg: CodecConfig) -> list[Case]:
    """Encode and decode of len(xs) messages in one jitted call (donated outputs)."""
    g, k = xs[0].shape[1], len(xs)
    enc, dec = _as_dispatched(name, xs[0].dtype)
    enc_all = jax.jit(lambda ts: [enc(t, cfg, last_count=g) for t in ts])
    encs = _block(enc_all(xs))
    enc_program = jax.jit(lambda ts, outs: enc_all(ts), donate_argnums=1, keep_unused=True)
    dec_program = jax.jit(lambda es, outs: [dec(*e) for e in es], donate_argnums=1, keep_unused=True)
    st = {"enc": _block(enc_all(xs)), "out": [jnp.zeros_like(t) for t in xs]}

    def enc_step():
        st["enc"] = _block(enc_program(xs, st["enc"]))

    def dec_step():
        st["out"] = _block(dec_program(encs, st["out"]))

    return [
        Case(f"{name} encode", "encode", "program", name, enc_step, per_call=k),
        Case(f"{name} decode", "decode", "program", name, dec_step, per_call=k),
    ]


def bench_size(mb: float, cfg: CodecConfig, backends: list[str], rounds: int, dtype=jnp.float32) -> dict:
    g = cfg.group_size
    itemsize = jnp.dtype(dtype).itemsize
    n = max(1, int(mb * MB) // (itemsize * g))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, g), dtype=np.float32)).astype(dtype)
    nbytes = n * g * itemsize
    cases = make_cases(x, cfg, backends)
    cases += [Case(c.name, c.kind, "hot", c.backend, c.fn, c.per_call) for c in cases if c.regime == "steady"]
    for c in cases:  # warm up: compile, first-touch the donated buffers
        c.fn()
        c.fn()
    # One interleaved pass per group of regimes (the program regime's K messages and the hot
    # regime's warm-up calls would change the cache state the others see).
    for group in ({"steady", "fresh"}, {"program"}, {"hot"}):
        timed = [c for c in cases if c.regime in group]
        for _ in range(rounds):
            for c in timed:
                if c.regime == "hot":
                    c.fn()  # the same call just before: inputs and outputs cache-resident
                c.step()
    rows = []
    for c in cases:
        best = min(c.times)
        rows.append(
            dict(
                case=c.name,
                kind=c.kind,
                regime=c.regime,
                backend=c.backend,
                per_call=c.per_call,
                best_s=best,
                median_s=float(np.median(c.times)),
                gbps=nbytes / best / 1e9,
            )
        )
    memcpy = {
        regime: max(r["gbps"] for r in rows if r["kind"] == "memcpy" and r["regime"] == regime)
        for regime in sorted({r["regime"] for r in rows})
    }
    numpy_copy = {q["regime"]: q["gbps"] for q in rows if q["case"] == "numpy copyto"}
    for r in rows:
        r["ratio_vs_memcpy"] = r["gbps"] / memcpy[r["regime"]]
        r["ratio_vs_numpy_copy"] = r["gbps"] / numpy_copy["steady" if r["regime"] == "fresh" else r["regime"]]
    return dict(size_mb=nbytes / MB, n_groups=n, bytes=nbytes, memcpy_gbps=memcpy, rows=rows)


def environment() -> dict:
    dev = jax.devices()[0]
    env = dict(
        jax=jax.__version__,
        platform=jax.default_backend(),
        device=str(dev.device_kind),
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        load_avg=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )
    try:
        from taco_jax.kernels import ffi_codec  # noqa: PLC0415

        levels = ffi_codec.cpu_kernel_levels()  # the CPU kernel that `impl=auto` runs here
        env["ffi_cpu_kernel"] = {1: "scalar", 2: "avx2", 3: "avx512"}[max(levels)] if levels else "not built"
    except Exception as e:  # noqa: BLE001  (report only)
        env["ffi_cpu_kernel"] = repr(e)
    for k, v in HBM_PEAK_GBS.items():
        if k in env["device"]:
            env["hbm_peak_gbps"] = v
    return env


def plot(result: dict, path: Path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    sizes = [s["size_mb"] for s in result["sizes"]]
    for ax, kind in zip(axes, ("encode", "decode"), strict=True):
        names = sorted({(r["backend"], r["regime"]) for s in result["sizes"] for r in s["rows"] if r["kind"] == kind})
        for backend, regime in names:
            pts = [
                (s["size_mb"], r["gbps"])
                for s in result["sizes"]
                for r in s["rows"]
                if r["kind"] == kind and r["backend"] == backend and r["regime"] == regime
            ]
            xs, ys = zip(*pts, strict=True)
            style = {"steady": "o-", "program": "^-", "hot": "v--", "fresh": "s:"}[regime]
            ax.plot(xs, ys, style, label=f"{backend} ({regime})")
        for regime, style in (("steady", "k--"), ("program", "k-."), ("hot", "k-"), ("fresh", "k:")):
            pts = [(s["size_mb"], s["memcpy_gbps"][regime]) for s in result["sizes"] if regime in s["memcpy_gbps"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"memcpy ({regime})")
        ax.plot(
            sizes,
            [0.5 * s["memcpy_gbps"]["steady"] for s in result["sizes"]],
            color="gray",
            lw=0.8,
            label="0.5x memcpy (steady)",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"message size (MB of {result['config']['dtype']})")
        ax.set_title(f"TACO {kind}, G={result['config']['group_size']} {result['config']['fmt']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"GB/s of {result['config']['dtype']} message")
    axes[1].legend(fontsize=7, loc="lower right")
    env = result["environment"]
    fig.suptitle(f"{env['device']} ({env['platform']}), jax {env['jax']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = (
        [float(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([1.0, 16.0] if args.quick else list(map(float, DEFAULT_SIZES)))
    )
    rounds = args.rounds or (3 if args.quick else 7)
    cfg = CodecConfig(fmt=args.fmt, group_size=args.group_size)
    avail = kernels.available_backends()
    if args.backends:
        wanted = args.backends.split(",")
        for b in wanted:
            kernels.resolve(b)  # clear error for an unavailable backend
    else:
        wanted = [b for b in ("reference", "ffi", "triton", "pallas") if b in avail]
    result = dict(run=run_record(__spec__.name, argv),
                  config=dict(fmt=args.fmt, group_size=args.group_size, rounds=rounds, dtype=args.dtype),
                  environment=environment(), sizes=[])
    # Per-call floor: the same cases on an 8-group (4 KiB) message, where the time is almost all
    # dispatch (Python -> jit -> XLA runtime -> handler). It bounds the ratio of small messages.
    itemsize = jnp.dtype(args.dtype).itemsize
    floor = bench_size(8 * itemsize * args.group_size / MB, cfg, [b for b in wanted if b != "pallas"], rounds,
                       args.dtype)
    result["call_floor_us"] = {
        r["case"] if r["regime"] in r["case"] else f"{r['case']} ({r['regime']})": r["best_s"] * 1e6
        for r in floor["rows"]
    }
    print("per-call floor (8 groups): " + ", ".join(f"{k} {v:.0f} us" for k, v in result["call_floor_us"].items()))
    for mb in sizes:
        backends = [b for b in wanted if b != "pallas" or mb <= args.pallas_max_mb or jax.default_backend() == "gpu"]
        t0 = time.perf_counter()
        res = bench_size(mb, cfg, backends, rounds, args.dtype)
        result["sizes"].append(res)
        print(
            f"\n== {res['size_mb']:g} MB {args.dtype} ({res['n_groups']} groups of {cfg.group_size}), "
            "memcpy "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in res["memcpy_gbps"].items())
            + f" [{time.perf_counter() - t0:.0f} s]"
        )
        for r in res["rows"]:
            print(f"  {r['case']:<22} {r['regime']:<7} {r['gbps']:8.2f} GB/s   {r['ratio_vs_memcpy']:5.2f}x memcpy")
        (out / "bench_codec.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "bench_codec.png")
    print(f"\nwrote {out / 'bench_codec.json'} and {out / 'bench_codec.png'}")
    return result


if __name__ == "__main__":
    main()
