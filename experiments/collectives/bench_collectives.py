"""Compressed collectives against the exact `lax` ones, in the manner of nccl-tests (JSON + PNG).

Run from the repository root (the workers import this checkout's `taco_jax`):

    .venv/bin/python -m experiments.collectives.bench_collectives --out runs/bench_collectives             # everything
    .venv/bin/python -m experiments.collectives.bench_collectives --out runs/bc --quick                    # 64 KB, 1 MB
    .venv/bin/python -m experiments.collectives.bench_collectives --out runs/bc --transports gloo --ranks 2 \\
        --codecs none,taco --backends ffi --sizes 64K,256K,1M,4M,16M,64M --dtypes float32,bfloat16
    .venv/bin/python -m experiments.collectives.bench_collectives --out runs/bc --collectives psum \\
        --variants 'two_shot,one_shot,k4:algorithm=two_shot:chunks=4'        # a new psum option

What is measured: every collective of `taco_jax.collectives.compressed` (psum as each of
`--variants`, all_gather, psum_scatter, ppermute) × codec (`--codecs`, names of
`taco_jax.codec.presets.NAMED`; "none" is the exact collective and always runs: the `lax` one, except
psum_scatter under gloo, which taco_jax runs as all-to-all + sum, transport "gloo") × codec
backend (`--backends`; only kind "taco" has backends, the other kinds run the jnp reference and
get backend "reference") × dtype × message size (`--sizes`, bytes per rank) × transport:

  sim   one process, P simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=P):
        a "collective" is an in-process copy between device buffers.
  gloo  P processes × 1 CPU device on 127.0.0.1, `jax.distributed` with gloo (TCP) collectives
        (`taco_jax.train.distributed.initialize`): a real transport.

P is `--ranks` (a list: "2,4" runs both). The script starts its own worker processes (one for
sim, P for gloo; each `python -m experiments.collectives.bench_collectives --worker ...`) and merges their
results; it never starts a JAX backend itself.

Each case is one jitted `jax.shard_map` over a 1-D mesh of the P devices (axis "x"); rank r holds a
message of `size_bytes` (a vector of size_bytes / itemsize elements, standard normal, different
on every rank):
  psum          all-reduce, result on every rank (its size: size_bytes).
  all_gather    tiled along axis 0: result P × size_bytes per rank.
  psum_scatter  reduce-scatter, tiled along axis 0: result size_bytes / P per rank.
  ppermute      ring shift r -> r+1 mod P (for P = 2 a swap).
Timing: the exact collective (codec "none") and every compressed one of the same (collective,
variant, dtype, size) are compiled, run `--warmup` times, then timed in `--runs` interleaved
rounds (each round times every function once, the order rotated per round), so load from other
processes hits exact and compressed alike; speedup_vs_exact = exact median / compressed median
of those rounds. A round's time is wall time of the call to the ready result; with several
processes, the largest of the processes' times for that round (a collective ends when its last
rank does). The input is not donated; each call allocates its output. With `--donate` every
function donates its input (`donate_argnums=0`, a fresh copy made outside the timed region per
call), so a result of the input's shape (psum, ppermute) may reuse the input's buffer, as inside a
training step, instead of page-faulting in a fresh one (≥ 32 MB buffers are mapped anew by glibc).

Output `OUT/bench_collectives.json` (strict JSON, `taco_jax.util.jsonio`), schema
"taco_jax.bench_collectives/1" — stable; other tools (the α–β cost model) read it:

  {"schema": "taco_jax.bench_collectives/1",
   "env": {...: jax / jaxlib versions, python, cpu count, load averages before and after,
           git commit, command line, UTC time, each worker's device list; "note"},
   "config": {the options},
   "rows": [row, ...],
   "summary": {"break_even": [...]}}

One row per (transport, ranks, collective, algorithm, codec, backend, dtype, size):
  collective        "psum" | "all_gather" | "psum_scatter" | "ppermute"
  algorithm         psum: the variant's name ("two_shot", "one_shot", or a --variants name);
                    the other collectives: "default" or a --variants name
  codec             preset name ("none" = exact `lax` collective)
  backend           codec backend that ran ("lax" for codec none; "reference" for non-taco kinds)
  dtype             "float32" | "bfloat16" (message dtype)
  transport         "sim" | "gloo"
  processes, devices  processes and devices (= P ranks) of the run
  size_bytes        message bytes per rank (the input of each rank)
  time_s_median, time_s_min   seconds per call over the timed rounds
  algbw_gbps        algorithm bandwidth, 1e9 bytes/s: S / time with S = size_bytes, except
                    all_gather: S = P × size_bytes (the gathered result, as nccl-tests counts it)
  busbw_gbps        algbw × 2(P-1)/P (psum), × (P-1)/P (all_gather, psum_scatter), × 1 (ppermute)
                    (nccl-tests' definitions; the same formula for exact and compressed rows, so
                    busbw measures the *uncompressed* bytes moved per second)
  wire_bytes        bytes sent per rank per call, read from the compiled HLO
                    (`taco_jax.collectives.hlo.collective_bytes`, summed over ops)
  rel_err           ||y - y_exact||_2 / ||y_exact||_2 over every rank's output of the first call,
                    float64 on the host;
                    y_exact from a direct `lax` call (so codec "none" must give 0.0, up to
                    summation order for psum_scatter, whose reference is `lax.psum` sliced:
                    XLA:CPU's gloo reduce-scatter intermittently returns wrong values,
                    jax-ml/jax#40830; under gloo the exact psum_scatter row is
                    `compressed.psum_scatter` with codec none, i.e. all-to-all + local sum,
                    transport "gloo", `CodecConfig.transport`)
  speedup_vs_exact  exact time_s_median / this row's time_s_median, same rounds (1.0 for "none")
Extra row keys (also stable): exact_time_s_median, exact_time_s_min, exact_wire_bytes,
speedup_vs_exact_min (exact time_s_min / time_s_min: the least load-disturbed ratio on a shared
machine), rel_err_last (rel_err of the last timed call's output: a deterministic collective gives
rel_err_last == rel_err; a difference flags a race), runs, times_s (every round's time),
variant_kwargs (keyword arguments passed to the compressed function).

summary.break_even: per (transport, processes, collective, algorithm, codec, backend, dtype), the
smallest measured size from which the compressed collective beats the exact one at every larger
measured size (speedup_vs_exact > 1), or null; with the speedup at the largest size.

`--variants`: comma-separated `[COLLECTIVE/]NAME[:KEY=VALUE[:KEY=VALUE...]]`; no COLLECTIVE/ means
psum. VALUE is read as JSON if it parses (4, true, "x"), else as a string. For psum a variant
without KEY "algorithm" gets algorithm=NAME, so "two_shot" alone is algorithm="two_shot". Each
collective runs the variants given for it, or its default ("two_shot", "one_shot" for psum;
"default" with no keyword arguments for the others). Keyword arguments the function does not
accept are refused (ValueError) before anything runs, so new options of `compressed.py`
(chunking, a transform-domain two-shot) are benchmarked by naming them.

`OUT/bench_collectives.md`: the rows as a Markdown table (exact beside each codec).

PNG `OUT/bench_collectives.png`: per transport and rank count, bus bandwidth and speedup vs
size for each collective (× algorithm): exact in black, compressed in colour, float32 solid,
bfloat16 dashed.

Caveat: on a shared machine the absolute times carry the other processes' load (recorded in
env.loadavg_*); the ratios within a run are what the interleaving makes comparable.

Note (CPU): XLA:CPU widens bf16 collectives to f32, so the exact bf16 rows move 4 bytes per element
(`exact_wire_bytes`) and their wire ratio is against f32; on a GPU the exact bf16 wire is 2 bytes
per element and the ratio would be ≈ 2× larger (0.53 instead of 0.27 for taco E4M3 G = 128).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments.common import ROOT, child_env, module_command, run_record
from taco_jax.util import jsonio

SCHEMA = "taco_jax.bench_collectives/1"
COLLECTIVES = ("psum", "all_gather", "psum_scatter", "ppermute")
TRANSPORTS = ("sim", "gloo")
DTYPES = ("float32", "bfloat16")
ROW_KEYS = ("collective", "algorithm", "codec", "backend", "dtype", "transport", "processes", "devices",
            "size_bytes", "time_s_median", "time_s_min", "algbw_gbps", "busbw_gbps", "wire_bytes", "rel_err",
            "speedup_vs_exact")
DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "64K,1M"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


# -----------------------------------------------------------------------------------------------
# options


def parse_size(text: str) -> int:
    """'64K' / '1M' / '256MB' / '4096' -> bytes (binary units). Raises ValueError naming the text."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].upper() not in _UNITS:
        raise ValueError(f"size {text!r} must be a number with an optional unit K, M or G (e.g. 64K, 16M)")
    n = int(m[1]) * _UNITS[m[2].upper()]
    if n <= 0:
        raise ValueError(f"size {text!r} must be > 0")
    return n


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_variants(text: str | None) -> dict[str, list[tuple[str, dict]]]:
    """`--variants` -> {collective: [(name, kwargs), ...]} for every collective (module docstring).

    Raises ValueError for an unknown collective, a malformed item, a duplicate name or a keyword the
    collective's function does not accept.
    """
    from taco_jax.collectives import compressed

    out: dict[str, list[tuple[str, dict]]] = {c: [] for c in COLLECTIVES}
    for item in _csv(text or ""):
        coll, _, spec = item.rpartition("/")
        coll = coll or "psum"
        if coll not in COLLECTIVES:
            raise ValueError(f"--variants item {item!r}: collective {coll!r} is not one of {COLLECTIVES}")
        name, *pairs = spec.split(":")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            raise ValueError(f"--variants item {item!r}: name {name!r} must be letters, digits, _ . + -")
        kwargs = {}
        for pair in pairs:
            key, eq, val = pair.partition("=")
            if not eq or not key.isidentifier():
                raise ValueError(f"--variants item {item!r}: {pair!r} must be KEY=VALUE")
            try:
                kwargs[key] = json.loads(val)
            except json.JSONDecodeError:
                kwargs[key] = val
        if coll == "psum":
            kwargs.setdefault("algorithm", name)
        params = inspect.signature(getattr(compressed, coll)).parameters
        bad = [k for k in kwargs if k not in params or k in ("x", "axis_name", "codec", "perm")]
        if bad:
            allowed = [k for k in params if k not in ("x", "axis_name", "codec", "perm")]
            raise ValueError(f"--variants item {item!r}: compressed.{coll} has no option {bad} (options: {allowed})")
        if any(n == name for n, _ in out[coll]):
            raise ValueError(f"--variants: {coll} variant {name!r} given twice")
        out[coll].append((name, kwargs))
    defaults = {"psum": [("two_shot", {"algorithm": "two_shot"}), ("one_shot", {"algorithm": "one_shot"})]}
    for c in COLLECTIVES:
        out[c] = out[c] or defaults.get(c, [("default", {})])
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder for bench_collectives.json and .png")
    p.add_argument("--transports", default="sim,gloo", help="comma-separated: sim, gloo (default both)")
    p.add_argument("--ranks", default="2", help="comma-separated rank counts P (gloo: processes; sim: devices)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--variants", default=None, help="[COLLECTIVE/]NAME[:KEY=VALUE...], comma-separated (docstring)")
    p.add_argument("--codecs", default="none,taco,fp8_group,int8", help="names of taco_jax.codec.presets.NAMED")
    p.add_argument("--backends", default="reference,ffi", help="backends of the taco kind (reference, ffi, auto)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", default=None, help=f"bytes per rank, e.g. 64K,1M,16M (default {DEFAULT_SIZES})")
    p.add_argument("--runs", type=int, default=None, help="timed rounds per case, >= 5 (default 10; --quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per function first (default 2; quick 1)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 rounds, 1 warm-up call")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--donate", action="store_true",
                   help="donate each call's input (a fresh copy per call, untimed): results of the input's shape "
                        "may reuse its buffer, as in a training step (docstring)")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="workers' allocator, as `taco-jax launch --malloc` (keep: GLIBC_TUNABLES="
                        "taco_jax.launch.MALLOC_KEEP unless set; default: glibc's own)")
    p.add_argument("--timeout", type=float, default=7200.0,
                   help="seconds per transport run; then its workers are stopped and the cases measured so far "
                   "kept (env.workers[].complete is false)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: worker config file
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if not args.out:
        p.error("--out is required")
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.runs = args.runs if args.runs is not None else (5 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    return args


def build_config(args) -> dict:
    """Checked options -> the plain config every worker gets. Raises ValueError naming a bad value."""
    from taco_jax.codec.config import BACKENDS
    from taco_jax.codec.presets import NAMED

    transports = _csv(args.transports)
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"--transports: {t!r} is not one of {TRANSPORTS}")
    try:
        ranks = [int(r) for r in _csv(args.ranks)]
    except ValueError:
        raise ValueError(f"--ranks={args.ranks!r} must be comma-separated integers") from None
    if not ranks or any(r < 2 for r in ranks):
        raise ValueError(f"--ranks={args.ranks!r}: every rank count must be >= 2")
    colls = _csv(args.collectives)
    for c in colls:
        if c not in COLLECTIVES:
            raise ValueError(f"--collectives: {c!r} is not one of {COLLECTIVES}")
    codecs = _csv(args.codecs)
    for c in codecs:
        if c not in NAMED:
            raise ValueError(f"--codecs: {c!r} is not one of {tuple(NAMED)}")
    codecs = ["none"] + [c for c in codecs if c != "none"]
    backends = _csv(args.backends)
    for b in backends:
        if b not in BACKENDS or b == "pallas":
            raise ValueError(f"--backends: {b!r} must be one of reference, ffi, triton, auto")
    dtypes = _csv(args.dtypes)
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: {d!r} is not one of {DTYPES}")
    sizes = sorted({parse_size(s) for s in _csv(args.sizes)})
    if args.runs < 5:
        raise ValueError(f"--runs={args.runs} must be >= 5")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    variants = parse_variants(args.variants)
    return dict(transports=transports, ranks=ranks, collectives=colls, codecs=codecs, backends=backends,
                dtypes=dtypes, sizes=sizes, runs=args.runs, warmup=args.warmup, donate=args.donate, malloc=args.malloc,
                variants={c: [[n, kw] for n, kw in variants[c]] for c in colls})


# -----------------------------------------------------------------------------------------------
# worker: runs every case of one transport (one process of it)


def _log(msg: str) -> None:
    print(f"[bench_collectives {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _elements(size_bytes: int, itemsize: int, p: int) -> int:
    """Elements per rank: size_bytes / itemsize, which must divide by P (psum_scatter's blocks)."""
    n = size_bytes // itemsize
    if n * itemsize != size_bytes or n % p:
        raise ValueError(f"size {size_bytes} B is not a multiple of {itemsize} B × {p} ranks")
    return n


def _case_functions(coll, kwargs, codecs, p):
    """(exact lax function, {label: compressed function}) of per-rank bodies for shard_map."""
    from jax import lax

    from taco_jax.collectives import compressed

    perm = tuple((r, (r + 1) % p) for r in range(p))
    if coll == "psum":
        ref = lambda x: lax.psum(x, "x")  # noqa: E731
        mk = lambda c: lambda x: compressed.psum(x, "x", codec=c, **kwargs)  # noqa: E731
    elif coll == "all_gather":
        ref = lambda x: lax.all_gather(x, "x", axis=0, tiled=True)  # noqa: E731
        mk = lambda c: lambda x: compressed.all_gather(x, "x", codec=c, **{"tiled": True, **kwargs})  # noqa: E731
    elif coll == "psum_scatter":
        # the reference is psum + this rank's block, not lax.psum_scatter: XLA:CPU's gloo
        # reduce-scatter intermittently returns wrong values (jax-ml/jax#40830)
        def ref(x):
            n = x.shape[0] // p
            return lax.dynamic_slice_in_dim(lax.psum(x, "x"), lax.axis_index("x") * n, n)
        mk = lambda c: lambda x: compressed.psum_scatter(x, "x", codec=c, **{"tiled": True, **kwargs})  # noqa: E731
    else:
        ref = lambda x: lax.ppermute(x, "x", perm)  # noqa: E731
        mk = lambda c: lambda x: compressed.ppermute(x, "x", perm, codec=c, **kwargs)  # noqa: E731
    return ref, {label: mk(c) for label, c in codecs.items()}


def _host_sq(y, ref) -> tuple[float, float]:
    """(Σ (y - ref)², Σ ref²) over this process's shards, float64."""
    num = den = 0.0
    ys = {s.device: s.data for s in y.addressable_shards}
    for s in ref.addressable_shards:
        r = np.asarray(s.data, np.float64)
        d = np.asarray(ys[s.device], np.float64) - r
        num += float(np.dot(d.ravel(), d.ravel()))
        den += float(np.dot(r.ravel(), r.ravel()))
    return num, den


def worker(cfg_path: str, process_id: int) -> None:
    cfg = json.loads(pathlib.Path(cfg_path).read_text())
    transport, p = cfg["transport"], cfg["ranks"]
    if transport == "gloo":
        from taco_jax.train import distributed as dist  # noqa: PLC0415  (gloo selected before the backend starts)
        dist.initialize(dist.DistConfig(cfg["coordinator"], p, process_id))
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax import kernels
    from taco_jax.codec.presets import NAMED
    from taco_jax.collectives.hlo import collective_bytes

    devices = jax.devices()
    if len(devices) != p:
        raise RuntimeError(f"{transport}: expected {p} devices, got {len(devices)}: {devices}")
    mesh = Mesh(np.asarray(devices), ("x",))
    spec = NamedSharding(mesh, P("x"))
    say = _log if process_id == 0 else (lambda _m: None)

    codecs = {}  # label (codec, backend) -> CodecConfig
    for name in cfg["codecs"]:
        if name == "none":
            continue
        base = NAMED[name]
        for b in (cfg["backends"] if base.kind == "taco" else ["reference"]):
            c = kernels.resolve_codec(dataclasses.replace(base, backend=b), n_devices=p)
            codecs.setdefault((name, c.backend), c)
    from taco_jax.codec.config import NONE
    from taco_jax.codec.dispatch import resolve_transport

    cases = []
    t_start = time.monotonic()
    env = dict(process_id=process_id, process_count=jax.process_count(), devices=[str(d) for d in devices],
               jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
               backend_platform=jax.default_backend(), glibc_tunables=os.environ.get("GLIBC_TUNABLES"),
               exact_transport=resolve_transport())  # what the exact collectives' "auto" transport is here

    def save(complete: bool) -> None:
        """This process's results so far (rewritten after every case: a run stopped by --timeout keeps
        what it measured). Internal file; Python's json reads its own NaN tokens."""
        doc = dict(env=dict(env, seconds=time.monotonic() - t_start, complete=complete), cases=cases)
        path = pathlib.Path(cfg["result_dir"]) / f"process{process_id}.json"
        path.with_suffix(".tmp").write_text(json.dumps(doc))
        path.with_suffix(".tmp").replace(path)
    donate = bool(cfg.get("donate", False))
    copy = jax.jit(jnp.copy)
    for dtype in cfg["dtypes"]:
        dt = jnp.dtype(dtype)
        for size in cfg["sizes"]:
            n = _elements(size, dt.itemsize, p)
            make = jax.jit(lambda k, n=n, dt=dt: jax.random.normal(k, (p * n,), dt), out_shardings=spec)
            x = jax.block_until_ready(make(jax.random.key(size)))
            # --donate: each call gets (and consumes) a fresh copy of x, made before its timer starts
            inp = (lambda x=x: jax.block_until_ready(copy(x))) if donate else (lambda x=x: x)
            for coll in cfg["collectives"]:
                ref_fn, lax_compiled, y_ref = None, None, None
                for vname, kwargs in cfg["variants"][coll]:
                    ref_body, bodies = _case_functions(coll, kwargs, {("none", "lax"): NONE, **codecs}, p)
                    if y_ref is None:
                        ref_fn = jax.jit(jax.shard_map(ref_body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
                        lax_compiled = ref_fn.lower(x).compile()
                        y_ref = jax.block_until_ready(lax_compiled(x))
                    compiled = {}
                    for label, body in bodies.items():
                        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                                    donate_argnums=0 if donate else ())
                        compiled[label] = f.lower(x).compile()
                    wire, sq = {}, {}
                    for label, c in compiled.items():
                        wire[label] = sum(collective_bytes(c.as_text(), mesh)["by_axis"].values())
                        y = jax.block_until_ready(c(inp()))
                        sq[label] = _host_sq(y, y_ref)
                        del y
                    labels = list(compiled)
                    for _ in range(cfg["warmup"]):
                        for label in labels:
                            jax.block_until_ready(compiled[label](inp()))
                    times, sq_last = {label: [] for label in labels}, {}
                    for r in range(cfg["runs"]):
                        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                            xi = inp()
                            t0 = time.perf_counter()
                            y = jax.block_until_ready(compiled[label](xi))
                            times[label].append(time.perf_counter() - t0)
                            if r == cfg["runs"] - 1:  # the last timed output: same result as the first?
                                sq_last[label] = _host_sq(y, y_ref)
                            del y
                    for label in labels:
                        cases.append(dict(collective=coll, algorithm=vname, variant_kwargs=kwargs, codec=label[0],
                                          backend=label[1], dtype=dtype, size_bytes=size, wire_bytes=wire[label],
                                          sq_err=sq[label][0], sq_ref=sq[label][1], sq_err_last=sq_last[label][0],
                                          times_s=times[label]))
                    ex = np.median(times[("none", "lax")])
                    say(f"{transport} P={p} {dtype} {size:>10d} B {coll}/{vname}: exact {ex * 1e3:.3f} ms; " +
                        ", ".join(f"{c}/{b} {np.median(times[(c, b)]) * 1e3:.3f} ms" for c, b in labels[1:]))
                    save(False)
                    del compiled
                del y_ref, lax_compiled
            del x
    save(True)


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001 — informational only
        return None


# -----------------------------------------------------------------------------------------------
# driver: starts the workers, merges, summarizes, writes


def _worker_env(devices_per_process: int, malloc: str = "keep") -> dict:
    from taco_jax.launch import malloc_env

    env = malloc_env({k: v for k, v in os.environ.items()
                      if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}, malloc)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return child_env(env)


def run_transport(cfg: dict, transport: str, p: int, timeout: float) -> list[dict]:
    """Runs one transport with P ranks in fresh worker processes; returns each process's result.
    Raises RuntimeError (with the failing worker's output) when a worker fails or times out."""
    from taco_jax.launch import _die_with_parent, free_port

    nproc = p if transport == "gloo" else 1
    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as tmp:
        wcfg = dict(cfg, transport=transport, ranks=p, result_dir=tmp, coordinator=f"127.0.0.1:{free_port()}")
        cfg_path = pathlib.Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(wcfg))
        env = _worker_env(1 if transport == "gloo" else p, cfg.get("malloc", "keep"))
        procs, logs = [], []
        for i in range(nproc):
            log = open(pathlib.Path(tmp) / f"log{i}.txt", "w+")  # noqa: SIM115 — closed below
            cmd = module_command(__spec__.name, "--worker", str(cfg_path), "--process-id", str(i))
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=None if i == 0 else log, start_new_session=True,
                                          preexec_fn=_die_with_parent))
            logs.append(log)
        deadline, failed = time.monotonic() + timeout, None
        try:
            while any(pr.poll() is None for pr in procs):
                bad = [i for i, pr in enumerate(procs) if pr.returncode not in (None, 0)]
                if bad or time.monotonic() > deadline:
                    failed = bad[0] if bad else -1
                    break
                time.sleep(0.1)
            if failed is None:
                failed = next((i for i, pr in enumerate(procs) if pr.returncode != 0), None)
        finally:
            for pr in procs:
                if pr.poll() is None:
                    os.killpg(pr.pid, signal.SIGKILL)
                    pr.wait()
        files = [pathlib.Path(tmp) / f"process{i}.json" for i in range(nproc)]
        if failed == -1 and all(f.exists() for f in files):  # --timeout: keep the cases measured so far
            _log(f"{transport} with {p} ranks: --timeout {timeout:g} s passed; keeping the cases measured so far")
            failed = None
        if failed is not None:
            tails = []
            for i, log in enumerate(logs):
                log.seek(0)
                tails.append(f"--- worker {i} (status {procs[i].returncode}) ---\n{log.read()[-3000:]}")
            what = "timed out" if failed == -1 else f"worker {failed} failed"
            raise RuntimeError(f"{transport} with {p} ranks: {what}\n" + "\n".join(tails))
        for log in logs:
            log.close()
        return [json.loads(f.read_text()) for f in files]


def _bus_factor(coll: str, p: int) -> float:
    return {"psum": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "psum_scatter": (p - 1) / p}.get(coll, 1.0)


def _rel(num: float, den: float) -> float:
    return float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else float("inf"))


def merge(results: list[dict], transport: str, p: int) -> list[dict]:
    """Per-process case results -> rows (module docstring). A round's time is the slowest process's."""
    key = lambda c: (c["collective"], c["algorithm"], c["codec"], c["backend"], c["dtype"], c["size_bytes"])  # noqa: E731
    per = [{key(c): c for c in r["cases"]} for r in results]
    rows, base = [], {}
    for c in results[0]["cases"]:
        k = key(c)
        if not all(k in d for d in per):  # a run stopped by --timeout: a case not every process finished
            continue
        parts = [d[k] for d in per]
        times = np.max(np.asarray([q["times_s"] for q in parts], np.float64), axis=0)
        den = sum(float(q["sq_ref"]) for q in parts)
        rel, rel_last = (_rel(sum(float(q[k]) for q in parts), den) for k in ("sq_err", "sq_err_last"))
        med, mn = float(np.median(times)), float(np.min(times))
        coll, size = c["collective"], c["size_bytes"]
        moved = size * (p if coll == "all_gather" else 1)
        algbw = moved / med / 1e9
        row = dict(collective=coll, algorithm=c["algorithm"], codec=c["codec"], backend=c["backend"],
                   dtype=c["dtype"], transport=transport, processes=len(results), devices=p, size_bytes=size,
                   time_s_median=med, time_s_min=mn, algbw_gbps=algbw, busbw_gbps=algbw * _bus_factor(coll, p),
                   wire_bytes=int(c["wire_bytes"]), rel_err=rel, rel_err_last=rel_last,
                   speedup_vs_exact=None, speedup_vs_exact_min=None,
                   exact_time_s_median=None, exact_time_s_min=None, exact_wire_bytes=None,
                   runs=len(times), times_s=times.tolist(),
                   variant_kwargs=c["variant_kwargs"])
        if c["codec"] == "none":
            base[k[:2] + k[4:]] = row
        rows.append(row)
    for row in rows:
        ex = base[(row["collective"], row["algorithm"], row["dtype"], row["size_bytes"])]
        row["exact_time_s_median"], row["exact_wire_bytes"] = ex["time_s_median"], ex["wire_bytes"]
        row["exact_time_s_min"] = ex["time_s_min"]
        row["speedup_vs_exact"] = ex["time_s_median"] / row["time_s_median"]
        row["speedup_vs_exact_min"] = ex["time_s_min"] / row["time_s_min"]
    return rows


def break_even(rows: list[dict]) -> list[dict]:
    """Smallest size from which a compressed collective beats the exact one at every larger size."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["codec"] != "none":
            k = (r["transport"], r["processes"], r["devices"], r["collective"], r["algorithm"], r["codec"],
                 r["backend"], r["dtype"])
            groups.setdefault(k, []).append(r)
    out = []
    for k, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["size_bytes"])
        be = None
        for r in reversed(rs):
            if r["speedup_vs_exact"] > 1.0:
                be = r["size_bytes"]
            else:
                break
        out.append(dict(zip(("transport", "processes", "devices", "collective", "algorithm", "codec", "backend",
                             "dtype"), k, strict=True),
                        break_even_bytes=be, speedup_at_largest=rs[-1]["speedup_vs_exact"],
                        largest_bytes=rs[-1]["size_bytes"], max_speedup=max(r["speedup_vs_exact"] for r in rs)))
    return out


def markdown(rows: list[dict]) -> str:
    """A README table: per transport, P, dtype, collective × algorithm and size, the exact time and
    each compressed codec's time, speedup (medians; min-based in brackets), wire-byte ratio, rel_err."""
    lines = []
    comp = sorted({(r["codec"], r["backend"]) for r in rows if r["codec"] != "none"})
    exact = [r for r in rows if r["codec"] == "none"]
    index = {(r["transport"], r["devices"], r["collective"], r["algorithm"], r["dtype"], r["size_bytes"],
              r["codec"], r["backend"]): r for r in rows}
    head = "| transport | P | dtype | collective | size/rank | exact ms |" + "".join(
        f" {c}/{b} ms | speedup (min) | wire × | rel_err |" for c, b in comp)
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for e in exact:
        cells = [e["transport"], str(e["devices"]), e["dtype"], f"{e['collective']}/{e['algorithm']}",
                 _human(e["size_bytes"]), f"{e['time_s_median'] * 1e3:.2f}"]
        for c, b in comp:
            r = index.get((*[e[k] for k in ("transport", "devices", "collective", "algorithm", "dtype",
                                            "size_bytes")], c, b))
            cells += ["–"] * 4 if r is None else [
                f"{r['time_s_median'] * 1e3:.2f}", f"{r['speedup_vs_exact']:.2f} ({r['speedup_vs_exact_min']:.2f})",
                f"{r['wire_bytes'] / e['wire_bytes']:.3f}", f"{r['rel_err']:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _human(n: int) -> str:
    for unit, f in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """busbw and speedup vs size, one column per collective × algorithm, two rows per transport × P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["transport"], r["devices"], r["processes"]) for r in rows})
    cols = sorted({(r["collective"], r["algorithm"]) for r in rows},
                  key=lambda c: (COLLECTIVES.index(c[0]), c[1]))
    labels = sorted({(r["codec"], r["backend"]) for r in rows if r["codec"] != "none"})
    colours = dict(zip(labels, plt.cm.tab10.colors, strict=False))
    fig, axes = plt.subplots(2 * len(runs), len(cols), figsize=(3.6 * len(cols), 5.2 * len(runs)), squeeze=False)
    for i, (tr, p, nproc) in enumerate(runs):
        for j, (coll, alg) in enumerate(cols):
            ab, asp = axes[2 * i, j], axes[2 * i + 1, j]
            for dtype, ls in (("float32", "-"), ("bfloat16", "--")):
                sel = [r for r in rows if (r["transport"], r["devices"], r["collective"], r["algorithm"], r["dtype"])
                       == (tr, p, coll, alg, dtype)]
                for lab in [("none", "lax"), *labels]:
                    rs = sorted((r for r in sel if (r["codec"], r["backend"]) == lab), key=lambda r: r["size_bytes"])
                    if not rs:
                        continue
                    xs = [r["size_bytes"] for r in rs]
                    c = "black" if lab[0] == "none" else colours[lab]
                    name = "exact" if lab[0] == "none" else f"{lab[0]}/{lab[1]}"
                    ab.plot(xs, [r["busbw_gbps"] for r in rs], ls, marker=".", color=c, label=f"{name} {dtype}")
                    if lab[0] != "none":
                        asp.plot(xs, [r["speedup_vs_exact"] for r in rs], ls, marker=".", color=c,
                                 label=f"{name} {dtype}")
            asp.axhline(1.0, color="black", lw=0.8)
            for ax in (ab, asp):
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3)
            ab.set_yscale("log")
            asp.set_yscale("log")
            ab.set_title(f"{coll}/{alg} — {tr}, P={p} ({nproc} proc)", fontsize=9)
            ab.set_ylabel("busbw (GB/s)")
            asp.set_ylabel("speedup vs exact")
            asp.set_xlabel("bytes per rank")
            if j == 0:
                ab.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.process_id)
        return {}
    cfg = build_config(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = run_record(__spec__.name, argv)
    load0 = os.getloadavg()
    t0 = time.time()
    rows, workers = [], []
    for transport in cfg["transports"]:
        for p in cfg["ranks"]:
            _log(f"{transport}, {p} ranks: sizes {[_human(s) for s in cfg['sizes']]}")
            res = run_transport(cfg, transport, p, args.timeout)
            workers.append(dict(transport=transport, ranks=p, **res[0]["env"]))
            rows.extend(merge(res, transport, p))
    env = dict(python=platform.python_version(), machine=platform.machine(), system=platform.platform(),
               cpu_count=os.cpu_count(), loadavg_before=list(load0), loadavg_after=list(os.getloadavg()),
               git_commit=run["commit"],
               command=module_command(__spec__.name, *(sys.argv[1:] if argv is None else argv)),
               utc_start=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), seconds=time.time() - t0,
               jax=workers[0]["jax"] if workers else None, jaxlib=workers[0]["jaxlib"] if workers else None,
               workers=workers,
               note="CPU timings on the machine as it was (see loadavg_*): other processes may share the cores")
    result = dict(schema=SCHEMA, run=run, env=env, config={k: v for k, v in cfg.items()}, rows=rows,
                  summary=dict(break_even=break_even(rows)))
    path = jsonio.write(out / "bench_collectives.json", result)
    _log(f"wrote {path}")
    if not args.no_plot and rows:
        plot(rows, out / "bench_collectives.png")
        _log(f"wrote {out / 'bench_collectives.png'}")
    (out / "bench_collectives.md").write_text(markdown(rows))
    _print_table(rows)
    return result


def _print_table(rows: list[dict]) -> None:
    print(f"{'transport':9} {'P':>2} {'collective':12} {'algorithm':9} {'codec':10} {'backend':9} {'dtype':8} "
          f"{'size':>6} {'time_ms':>9} {'busbw':>7} {'wire':>10} {'rel_err':>8} {'speedup':>7}")
    for r in rows:
        print(f"{r['transport']:9} {r['devices']:>2} {r['collective']:12} {r['algorithm']:9} {r['codec']:10} "
              f"{r['backend']:9} {r['dtype']:8} {_human(r['size_bytes']):>6} {r['time_s_median'] * 1e3:9.3f} "
              f"{r['busbw_gbps']:7.3f} {r['wire_bytes']:10d} {r['rel_err']:8.2e} {r['speedup_vs_exact']:7.2f}")


if __name__ == "__main__":
    main()
