"""One JSON report of the GPU path, for a lent GPU (run by experiments/gpu/gpu_check.sh; <= 6 min on an H200).

Sections (each runs even if an earlier one failed; a failure is recorded as {"error": ...} and named
in "errors"; a section left out by --sections is {"skipped": ...}, not an error):
  conformance  every available codec backend (not `auto`) against `reference` under the rule of
               `taco_jax.kernels` (`taco_jax.kernels.conformance.check_backend`, as in the tests):
               E4M3 / E5M2, G 32/128/512;
  throughput   encode / decode / decode-sum GB/s per backend x {bf16, f32} x --sizes MB (4,16,64,256)
               beside an XLA device copy of the same bytes (back-to-back calls, two inputs rotated,
               median of 3 passes); also $OUT/gpu_speeds.json, the speeds `auto` ranks GPU
               backends by (--update-speeds writes them into the hardware table's [h200.codec]);
  collectives  compressed (taco) vs exact all-reduce and all-gather of bf16 and f32 messages over
               the visible devices (skipped, with the reason, on one device), time and relative error;
  training     a short compressed training run (gpt2-tiny, synthetic learnable tokens): losses, s/step.

    python -m experiments.gpu.gpu_check --out runs/gpu_check            # on the GPU
    python -m experiments.gpu.gpu_check --out runs/gpu_dry --dry-run    # CPU: tiny sizes, checks the format

`validate(report)` checks the format (raises ValueError naming the bad field); --dry-run runs it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

from experiments.common import cpu_devices, run_record

if "--dry-run" in sys.argv:
    cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SCHEMA = "taco_jax.gpu_check/1"
SECTIONS = ("conformance", "throughput", "collectives", "training")


def _timed(fn, x, rounds: int) -> float:
    """Best wall time of `fn(x)` (blocked) over `rounds` calls after one warm-up, in seconds."""
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t)
    return best


def environment() -> dict:
    dev = jax.devices()[0]
    env = dict(jax=jax.__version__, python=platform.python_version(), platform=dev.platform,
               device_kind=dev.device_kind, n_devices=len(jax.devices()))
    try:
        import triton  # noqa: PLC0415

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from taco_jax import kernels  # noqa: PLC0415

    env["backends"] = list(kernels.available_backends())
    return env


def backends_here() -> list[str]:
    from taco_jax import kernels  # noqa: PLC0415

    return [b for b in kernels.available_backends() if b != "auto"]


def conformance(dry: bool) -> list[dict]:
    from taco_jax.kernels.conformance import check_backend  # noqa: PLC0415  (the rule of taco_jax.kernels)

    rows = []
    for name in backends_here():
        if name == "reference":
            continue
        cases = [("e4m3", 32), ("e5m2", 128)] if dry else [(f, g) for f in ("e4m3", "e5m2") for g in (32, 128, 512)]
        for fmt, g in cases:
            row = dict(backend=name, fmt=fmt, group_size=g)
            try:
                check_backend(name, g, fmt)
                row.update(ok=True, detail="")
            except Exception as e:  # noqa: BLE001  (recorded, the report goes on)
                row.update(ok=False, detail=f"{type(e).__name__}: {e}"[:1000])
            rows.append(row)
    return rows


def _per_call(fn, args_list, reps: int) -> float:
    """Seconds per call of `fn` over `reps` back-to-back calls (inputs rotated, so a message below
    the L2 size is not served from the cache), after a warm-up; median of 3 such passes."""
    jax.block_until_ready(fn(*args_list[0]))
    passes = []
    for _ in range(3):
        t = time.perf_counter()
        outs = [fn(*args_list[i % len(args_list)]) for i in range(reps)]
        jax.block_until_ready(outs)
        passes.append((time.perf_counter() - t) / reps)
    return float(np.median(passes))


DTYPES = ("bfloat16", "float32")
SIZES_MB = (4, 16, 64, 256)
P_SUM = 4  # decode-sum: ranks' messages summed


def throughput(dry: bool, sizes_mb=SIZES_MB, dtypes=DTYPES) -> list[dict]:
    """GB/s of every backend x dtype x size x op through the codec's dispatcher (`encode`, `decode`,
    `decode_sum`: the path training takes, converts included where a backend does not take the
    dtype natively), beside an XLA device copy (`jnp.copy`: read + write) of the same bytes.
    encode: bytes of the input message per second; decode: bytes of the output message;
    decode-sum: P_SUM ranks' encoded messages of that size decoded and summed into one output
    message, bytes of the output per second (the copy: of the output's bytes)."""
    from taco_jax.codec import dispatch  # noqa: PLC0415
    from taco_jax.codec.config import CodecConfig  # noqa: PLC0415

    names = [b for b in backends_here() if not (b == "pallas" and jax.default_backend() == "cpu")]
    rows = []
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        item = np.dtype(jnp.dtype(dtype)).itemsize
        for mb in (0.0625,) if dry else sizes_mb:
            n = max(1, int(mb * 2**20) // (item * 4096)) * 4096
            xs = [jnp.asarray(rng.standard_normal((n // 4096, 4096), dtype=np.float32), dtype) for _ in range(2)]
            nbytes = n * item
            reps = 2 if dry else (20 if mb <= 16 else 8)
            t_copy = _per_call(jax.jit(jnp.copy), [(x,) for x in xs], reps)
            for name in names:
                cfg = CodecConfig(backend=name, wire="generic")
                f_enc = jax.jit(lambda t, cfg=cfg: dispatch.encode(t, cfg))
                f_dec = jax.jit(lambda e, cfg=cfg: dispatch.decode(e, cfg))
                f_sum = jax.jit(lambda e, cfg=cfg: dispatch.decode_sum(e, cfg))
                encs = [jax.block_until_ready(f_enc(x)) for x in xs]
                sums = [jax.block_until_ready(jax.jit(lambda t, cfg=cfg: dispatch.encode(
                    jnp.stack([t * (r + 1) for r in range(P_SUM)]), cfg, batch_dims=1))(x)) for x in xs]
                for op, fn, args in (("encode", f_enc, [(x,) for x in xs]), ("decode", f_dec, [(e,) for e in encs]),
                                     ("decode_sum", f_sum, [(e,) for e in sums])):
                    t = _per_call(fn, args, reps)
                    rows.append(dict(backend=name, dtype=dtype, op=op, size_mb=nbytes / 2**20, gbps=nbytes / t / 1e9,
                                     memcpy_gbps=nbytes / t_copy / 1e9, ratio_vs_memcpy=t_copy / t,
                                     ranks=P_SUM if op == "decode_sum" else 1))
                del encs, sums
    return rows


def speed_table(rows: list[dict], env: dict) -> dict:
    """The speed table `taco_jax.kernels` ranks by (`gpu_speed_table`'s format) from throughput
    rows: per backend, float32 encode / decode GB/s at the largest size measured."""
    best = {}
    for r in rows:
        if r["dtype"] == "float32" and r["op"] in ("encode", "decode"):
            cur = best.setdefault(r["backend"], {})
            if r["size_mb"] >= cur.get(f"{r['op']}_mb", 0):
                cur[f"{r['op']}_mb"] = r["size_mb"]
                g = r["gbps"]  # one decimal; 3 significant digits below 0.1 GB/s (a slow CPU): never 0
                cur[f"{r['op']}_GBps"] = round(g, 1) if g >= 0.1 else float(f"{g:.3g}")
    src = f"measured by experiments/gpu/gpu_check.py on {env['device_kind']} (jax {env['jax']}), float32, E4M3, G=128"
    return {"source": src, "backends": {
        b: {"encode_GBps": v["encode_GBps"], "decode_GBps": v["decode_GBps"], "measured": True,
            "source": f"{src}, {v['encode_mb']:.0f} MB"} for b, v in best.items() if "encode_GBps" in v}}


def collectives(dry: bool) -> dict:
    from jax.sharding import Mesh  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from taco_jax import collectives as col  # noqa: PLC0415
    from taco_jax import kernels  # noqa: PLC0415
    from taco_jax.codec.config import CodecConfig  # noqa: PLC0415

    n = len(jax.devices())
    if n < 2:
        return dict(n_devices=n, skipped=f"needs >= 2 visible devices, {n} visible", rows=[])
    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    codec = CodecConfig(backend=kernels.resolve("auto"))
    ops = {
        "all_reduce": (lambda x: jax.lax.psum(x, "x"), lambda x: col.psum(x, "x", codec=codec)),
        "all_gather": (lambda x: jax.lax.all_gather(x, "x", tiled=True),
                       lambda x: col.all_gather(x, "x", codec=codec, tiled=True)),
    }
    rows = []
    for dtype in DTYPES:
        item = np.dtype(jnp.dtype(dtype)).itemsize
        for mb in (0.0625,) if dry else (16, 64, 256):
            cols = 4096
            rows_per_dev = max(16, int(mb * 2**20) // (item * cols) // 16 * 16)
            x = jnp.asarray(np.random.default_rng(0).standard_normal((n * rows_per_dev, cols), dtype=np.float32), dtype)
            for op, (exact, taco) in ops.items():
                out = P() if op == "all_reduce" else P("x")  # all-gather: every device's gathered copy
                fe, ft = (jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=out)) for f in (exact, taco))
                ye, yt = (np.asarray(f(x)).astype(np.float32) for f in (fe, ft))
                rel = float(np.linalg.norm(yt - ye) / np.linalg.norm(ye))
                te, tt = _timed(fe, x, 1 if dry else 10), _timed(ft, x, 1 if dry else 10)
                rows.append(dict(op=op, dtype=dtype, size_mb=rows_per_dev * cols * item / 2**20, exact_ms=te * 1e3,
                                 taco_ms=tt * 1e3, speedup=te / tt, rel_err=rel))
    return dict(n_devices=n, backend=codec.backend, rows=rows)


def training(dry: bool, n_steps: int = 30) -> dict:
    from taco_jax import kernels  # noqa: PLC0415
    from taco_jax.train.config import TrainConfig  # noqa: PLC0415
    from taco_jax.train.step import make_trainer, shard_batch  # noqa: PLC0415

    devices = jax.devices()[:2] if dry else jax.devices()  # dry run: a small, quick mesh
    n = len(devices)
    tp = next(t for t in (4, 2, 1) if n % t == 0)  # gpt2-tiny's 4 heads split over <= 4 devices
    mesh = f"data={n // tp},tensor={tp}" if tp > 1 else f"data={n}"  # tensor=1: no TP message to compress
    backend = kernels.resolve("auto")
    steps, v, b, t = (2, 512, 8, 32) if dry else (max(3, n_steps), 2048, 16, 128)
    cfg = TrainConfig.from_flags(model="gpt2-tiny", comm="taco", backend=backend, mesh=mesh, vocab_size=v, batch_size=b,
                      seq_len=t, steps=steps, warmup_steps=1, dp_comm="taco" if n == 1 else "none")
    tr = make_trainer(cfg, devices=devices)
    params, opt = tr.init()
    tokens = (np.arange(b * (t + 1)) * 7 % v).reshape(b, t + 1).astype(np.int32)  # learnable sequence
    inputs, targets = shard_batch(tr, tokens[:, :-1], tokens[:, 1:])
    warm = 2 if steps > 2 else 1  # steps before timing: compilation (the 2nd call may compile again)
    losses, t0 = [], None
    for i in range(steps):
        params, opt, m = tr.train_step(params, opt, inputs, targets)
        losses.append(float(m["loss"]))
        if i == warm - 1:
            t0 = time.perf_counter()
    s_per_step = (time.perf_counter() - t0) / max(1, steps - warm)
    note = "" if tp > 1 else "1 device: no tensor-parallel message; dp_comm=taco on a 1-device data axis"
    return dict(mesh=mesh, backend=backend, dp_comm=cfg.communication.policy.dp_grads.name, steps=steps, losses=losses,
                s_per_step=s_per_step,
                tokens_per_s=b * t / s_per_step, loss_fell=losses[-1] < losses[0], note=note)


# --------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------

_ROW_FIELDS = {
    "conformance": {"backend": str, "fmt": str, "group_size": int, "ok": bool, "detail": str},
    "throughput": {"backend": str, "dtype": str, "op": str, "size_mb": float, "gbps": float, "memcpy_gbps": float,
                   "ratio_vs_memcpy": float, "ranks": int},
    "collectives": {"op": str, "dtype": str, "size_mb": float, "exact_ms": float, "taco_ms": float, "speedup": float,
                    "rel_err": float},
}


def _check_rows(name: str, rows) -> None:
    if not isinstance(rows, list):
        raise ValueError(f"{name} must be a list of rows, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        for key, typ in _ROW_FIELDS[name].items():
            val = row.get(key) if isinstance(row, dict) else None
            ok = isinstance(val, (int, float)) and not isinstance(val, bool) if typ is float else isinstance(val, typ)
            if not ok:
                raise ValueError(f"{name}[{i}].{key} must be {typ.__name__}, got {val!r}")
            if typ is float and not np.isfinite(val) and key != "rel_err":
                raise ValueError(f"{name}[{i}].{key} must be finite, got {val!r}")


def validate(report: dict) -> None:
    """Checks the report's format. Raises ValueError naming the first bad field."""
    if report.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}, got {report.get('schema')!r}")
    for key in ("run", "environment", "errors", "seconds", *SECTIONS):
        if key not in report:
            raise ValueError(f"report lacks {key!r}")
    if not isinstance(report["errors"], list):
        raise ValueError(f"errors must be a list, got {report['errors']!r}")
    for name in SECTIONS:
        sec = report[name]
        if isinstance(sec, dict) and set(sec) == {"skipped"}:
            continue
        if isinstance(sec, dict) and "error" in sec:
            if name not in report["errors"]:
                raise ValueError(f"{name} failed but is not listed in errors")
            continue
        if name in ("conformance", "throughput"):
            _check_rows(name, sec)
        elif name == "collectives":
            if not isinstance(sec, dict) or not isinstance(sec.get("n_devices"), int):
                raise ValueError(f"collectives.n_devices must be int, got {sec!r}")
            _check_rows(name, sec.get("rows"))
            if not sec["rows"] and not sec.get("skipped"):
                raise ValueError("collectives has no rows and no 'skipped' reason")
        else:
            losses = sec.get("losses") if isinstance(sec, dict) else None
            if not isinstance(losses, list) or len(losses) != sec.get("steps") or not all(
                    isinstance(v, float) for v in losses):
                raise ValueError(f"training.losses must be {sec.get('steps')} floats, got {losses!r}")
            if not (isinstance(sec.get("s_per_step"), float) and sec["s_per_step"] > 0):
                raise ValueError(f"training.s_per_step must be a positive float, got {sec.get('s_per_step')!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny sizes; validates the report's format")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--sizes", default=",".join(map(str, SIZES_MB)), help="throughput: message sizes in MB")
    p.add_argument("--update-speeds", action="store_true",
                   help="write the measured speeds into taco_jax/perf/hardware.toml's [h200.codec] (GPU only; "
                        "$OUT/gpu_speeds.json is always written)")
    p.add_argument("--train-steps", type=int, default=30, help="training: steps (2 in a dry run)")
    args = p.parse_args(argv)
    wanted = args.sections.split(",")
    if bad := [s for s in wanted if s not in SECTIONS]:
        raise ValueError(f"--sections {bad} not in {SECTIONS}")
    t_all = time.perf_counter()
    report = dict(schema=SCHEMA, run=run_record(__spec__.name, argv), dry_run=args.dry_run, environment=environment(),
                  errors=[])
    sizes = tuple(float(v) for v in args.sizes.split(","))
    fns = (conformance, lambda dry: throughput(dry, sizes), collectives, lambda dry: training(dry, args.train_steps))
    for name, fn in zip(SECTIONS, fns):
        if name not in wanted:
            report[name] = {"skipped": "not run (--sections)"}
            continue
        t = time.perf_counter()
        try:
            report[name] = fn(args.dry_run)
        except Exception as e:  # noqa: BLE001  (recorded; the other sections still run)
            traceback.print_exc()
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            report["errors"].append(name)
        print(f"gpu_check: {name} {time.perf_counter() - t:.1f} s", flush=True)
    report["seconds"] = time.perf_counter() - t_all
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    validate(report)
    if isinstance(report["throughput"], list) and report["throughput"]:
        table = json.dumps(speed_table(report["throughput"], report["environment"]), indent=1) + "\n"
        (out / "gpu_speeds.json").write_text(table)
        if args.update_speeds:
            if args.dry_run or report["environment"]["platform"] == "cpu":
                raise ValueError("--update-speeds needs a GPU run (not --dry-run / CPU)")
            from taco_jax.perf import hardware  # noqa: PLC0415

            hardware.update_codec_speeds(json.loads(table))
    failed = [r for r in report["conformance"] if isinstance(r, dict) and not r.get("ok")] \
        if isinstance(report["conformance"], list) else []
    print(f"gpu_check: wrote {out / 'gpu_check.json'}; errors={report['errors']}; non-conforming={len(failed)}")
    return 1 if report["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
