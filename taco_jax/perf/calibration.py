"""Fitting the cost model to measurements, and the `min_bytes="auto"` break-even threshold.

Rows are dicts in the shape of `experiments/collectives/bench_collectives.py`'s JSON (schema
"taco_jax.bench_collectives/1": collective, algorithm, codec, backend, dtype, transport, processes,
size_bytes (per-rank message), time_s_median, ...) or of `experiments/costmodel/costmodel_measure.py`'s (the
same keys, plus rows with collective "codec" holding encode_s / decode_s of a whole message).

Calibration file (`CALIBRATION_FORMAT`, e.g. `calibration_cpu_gloo.json` beside this module): the
fitted link and codec speeds, the rows' source and the command that produced it."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from taco_jax.codec import CodecConfig
from taco_jax.collectives.policy import TENSOR_SITES, CommPolicy
from taco_jax.perf import hardware as declared
from taco_jax.perf import model
from taco_jax.perf.model import CodecSpeed, Link

CALIBRATION_FORMAT = "taco_jax.perf.calibration/1"
#: The calibration shipped for CPU (2 processes, gloo over 127.0.0.1 on this repository's machine).
CPU_CALIBRATION = pathlib.Path(__file__).with_name("calibration_cpu_gloo.json")
_OP_OF = {"psum": "all_reduce", "all_reduce": "all_reduce", "all_gather": "all_gather",
          "psum_scatter": "reduce_scatter", "reduce_scatter": "reduce_scatter", "ppermute": "send", "send": "send"}


def _num(row: dict, key: str) -> float:
    v = row.get(key)
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"row {row.get('collective')!r} size {row.get('size_bytes')!r}: {key}={v!r} "
                         f"must be a finite number >= 0")
    return float(v)


def _sim_key(r: dict) -> tuple:
    codec = r.get("codec", "none")
    return (_OP_OF.get(r.get("collective")), codec, "none" if codec == "none" else r.get("backend"),
            r.get("dtype", "float32"), int(r.get("devices", r.get("processes", 2))), int(r["size_bytes"]))


def sim_times(rows) -> dict:
    """{(op, codec, backend, dtype, ranks, size_bytes): time_s_median} of the simulated-mesh rows
    (transport "sim"; exact rows under codec "none", backend "none")."""
    return {_sim_key(r): _num(r, "time_s_median") for r in rows if r.get("transport") == "sim"
            and _OP_OF.get(r.get("collective")) and r.get("algorithm", "two_shot") in ("two_shot", "default")}


def fit_link(rows, *, name: str = "gloo-loopback", source: str = "", subtract_sim: bool = False,
             dtype: str = "float32") -> Link:
    """α (s) and β (s/byte) from exact all-reduce timings by least squares on t = 2(p-1)·α + 2(p-1)/p·n·β (n =
    size_bytes, p = processes; gloo rows with codec "none", collective psum / all_reduce; time_s_median), residuals
    relative to t. `subtract_sim`: t minus the same exact collective's time on the simulated mesh, so that α–β describe
    the transport alone (sizes without a sim row left out). Only rows of message `dtype` (gloo reduces bfloat16 far
    slower than float32 on CPU).

    Raises: ValueError when fewer than two distinct sizes are given, for a bad row value, or when
      the fit gives a negative β (the rows do not grow with size). A negative α is clipped to 0.
    """
    sim = sim_times(rows) if subtract_sim else {}
    pts = []
    for r in rows:
        if r.get("codec", "none") != "none" or _OP_OF.get(r.get("collective")) != "all_reduce" or \
                r.get("transport", "gloo") != "gloo" or r.get("dtype", "float32") != dtype:
            continue
        p, n, t = int(r.get("processes", 2)), _num(r, "size_bytes"), _num(r, "time_s_median")
        if subtract_sim:
            local = sim.get(_sim_key({**r, "devices": p}))
            if local is None or t <= local:
                continue
            t -= local
        pts.append((p, n, t))
    if len({n for _, n, _ in pts}) < 2:
        raise ValueError(f"fit_link needs exact all-reduce rows at >= 2 sizes; got {len(pts)} rows")
    a = np.array([[2.0 * (p - 1), 2.0 * (p - 1) / p * n] for p, n, _ in pts])
    t = np.array([t for _, _, t in pts])
    w = 1.0 / np.maximum(t, 1e-12)  # relative residuals: every size counts alike
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if beta <= 0:
        raise ValueError(f"fitted beta={beta!r} s/byte is not positive: the exact timings do not grow with size")
    what = "exact rows minus their sim time" if subtract_sim else "exact rows"
    return Link(name, max(float(alpha), 0.0), float(beta), source or f"least squares on {len(pts)} {what}")


def fit_codec(rows, backend: str, *, source: str = "") -> CodecSpeed:
    """Codec speed of `backend` from rows with collective "codec" (size_bytes, encode_s, decode_s):
    least squares (relative residuals) of t = overhead + n / throughput for encode and decode (one shared overhead, the
    mean of the two intercepts, clipped at 0).

    Raises: ValueError when fewer than two sizes of that backend are given or a slope is not positive."""
    pts = [(_num(r, "size_bytes"), _num(r, "encode_s"), _num(r, "decode_s")) for r in rows
           if r.get("collective") == "codec" and r.get("backend") == backend]
    if len({n for n, _, _ in pts}) < 2:
        raise ValueError(f"fit_codec needs codec rows of backend={backend!r} at >= 2 sizes; got {len(pts)}")
    n = np.array([p[0] for p in pts])
    a = np.stack([np.ones_like(n), n], 1)
    out = []
    for col in (1, 2):
        t = np.array([p[col] for p in pts])
        w = 1.0 / np.maximum(t, 1e-12)  # relative residuals, as fit_link
        (c0, c1), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
        if c1 <= 0:
            raise ValueError(f"backend={backend!r}: fitted {'encode' if col == 1 else 'decode'} time does not grow "
                             f"with size (slope {c1!r} s/byte)")
        out.append((c0, c1))
    overhead = max(0.0, (out[0][0] + out[1][0]) / 2)
    return CodecSpeed(1e-9 / out[0][1], 1e-9 / out[1][1], overhead, source or f"least squares on {len(pts)} rows")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A fitted link and codec speeds per backend, with provenance (`CALIBRATION_FORMAT`)."""

    link: Link
    codec: dict
    processes: int = 2
    command: str = ""
    machine: str = ""

    def to_json(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        d = {"format": CALIBRATION_FORMAT, "command": self.command, "machine": self.machine,
             "processes": self.processes, "link": dataclasses.asdict(self.link),
             "codec": {k: dataclasses.asdict(v) for k, v in self.codec.items()}}
        path.write_text(json.dumps(d, indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def from_json(cls, path) -> Calibration:
        """Reads a calibration file. Raises ValueError naming the file for a wrong format or field."""
        path = pathlib.Path(path)
        try:
            d = json.loads(path.read_text())
            if d.get("format") != CALIBRATION_FORMAT:
                raise ValueError(f"format={d.get('format')!r}, expected {CALIBRATION_FORMAT!r}")
            return cls(Link(**d["link"]), {k: CodecSpeed(**v) for k, v in d["codec"].items()},
                       int(d.get("processes", 2)), d.get("command", ""), d.get("machine", ""))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"calibration file {str(path)!r}: {e}") from e


def fit_codec_sim(rows, backend: str, *, codec: str = "taco", source: str = "") -> CodecSpeed:
    """Codec speed of `backend` from simulated-mesh psum rows (transport "sim": in-process copies),
    where compressed minus exact time is the local work of the two-shot all-reduce (encode,
    decode, the FP32 sum, splits): least squares (relative to the compressed time) of
    Δ = 4·overhead + (n(1+1/p) + 2n) / throughput, one throughput for encode and decode.

    Raises: ValueError when fewer than two sizes have both an exact and a compressed row, or the
      fitted slope is not positive.
    """
    def key(r):
        return int(r.get("processes", 1)), int(r.get("devices", 2)), r.get("dtype", "float32"), r["size_bytes"]

    sim = [r for r in rows if r.get("transport") == "sim" and _OP_OF.get(r.get("collective")) == "all_reduce"
           and r.get("algorithm", "two_shot") == "two_shot"]
    exact = {key(r): _num(r, "time_s_median") for r in sim if r.get("codec", "none") == "none"}
    pts = [(key(r)[1], _num(r, "size_bytes"), _num(r, "time_s_median") - exact[key(r)], _num(r, "time_s_median"))
           for r in sim if r.get("codec") == codec and r.get("backend") == backend and key(r) in exact]
    if len({n for _, n, _, _ in pts}) < 2:
        raise ValueError(f"fit_codec_sim needs sim psum rows (exact and {codec}/{backend}) at >= 2 sizes; "
                         f"got {len(pts)}")
    a = np.array([[4.0, n * (1 + 1 / p) + 2 * n] for p, n, _, _ in pts])
    d = np.array([dt for _, _, dt, _ in pts])
    w = 1.0 / np.array([t for _, _, _, t in pts])
    (c0, c1), *_ = np.linalg.lstsq(a * w[:, None], d * w, rcond=None)
    if c1 <= 0:
        raise ValueError(f"backend={backend!r}: the sim compressed - exact time does not grow with size "
                         f"(slope {c1!r} s/byte)")
    tp = 1e-9 / c1
    return CodecSpeed(tp, tp, max(0.0, float(c0)), source or f"sim psum compressed - exact, {len(pts)} sizes")


def fit_calibration(rows, *, codec_from: str = "auto", command: str = "", machine: str = "") -> Calibration:
    """`Calibration` of the rows: `fit_link` on the exact gloo all-reduces; per backend, the codec
    speed from `codec_from`: "sim" (`fit_codec_sim`, the local work of the collective), "codec"
    (`fit_codec`, encode / decode timed alone) or "auto" (sim where such rows exist, else codec).
    Raises: ValueError from the fits, or for an unknown `codec_from`."""
    if codec_from not in ("auto", "sim", "codec"):
        raise ValueError(f"codec_from={codec_from!r} must be 'auto', 'sim' or 'codec'")
    gloo = [r for r in rows if r.get("transport", "gloo") == "gloo" and r.get("collective") != "codec"]
    sim_backends = {r.get("backend") for r in rows if r.get("transport") == "sim" and r.get("codec") == "taco"}
    codec_backends = {r["backend"] for r in rows if r.get("collective") == "codec"}
    speeds = {}
    for b in sorted(sim_backends | codec_backends):
        use_sim = codec_from == "sim" or (codec_from == "auto" and b in sim_backends)
        if use_sim:
            speeds[b] = fit_codec_sim(rows, b)
        elif b in codec_backends:
            speeds[b] = fit_codec(rows, b)
    procs = {int(r.get("processes", 2)) for r in gloo}
    return Calibration(fit_link(gloo), speeds, max(procs or {2}), command, machine)


def validate(cal: Calibration, rows, *, codec: CodecConfig | None = None, local: str = "model",
             dtypes=("float32",)) -> list[dict]:
    """Predicted vs measured time of every gloo collective row of `rows` (psum two-shot, all_gather, psum_scatter,
    ppermute; exact, and taco with a backend `cal` knows; message dtype in `dtypes`): [{collective, backend, dtype,
    size_bytes (per rank, as the row), measured_s, predicted_s, error (predicted/measured - 1)}]. A row's size_bytes
    is the per-rank message (bench_collectives/1), so an all-gather's model size is processes × size_bytes.

    local: "model": `model.collective_time` (α–β plus the linear codec model); "sim": the same collective's measured
      time on the simulated mesh (its local work: codec, sums, buffers) plus the α–β transfer of its wire bytes (use
      with `fit_link(subtract_sim=True)`); rows without a sim counterpart are left out.
    Raises: ValueError for an unknown `local`."""
    if local not in ("model", "sim"):
        raise ValueError(f"local={local!r} must be 'model' or 'sim'")
    codec = codec or CodecConfig()
    sim = sim_times(rows)
    out = []
    for r in rows:
        op = _OP_OF.get(r.get("collective"))
        dtype = r.get("dtype", "float32")
        if op is None or r.get("transport", "gloo") != "gloo" or dtype not in dtypes or \
                r.get("algorithm", "two_shot") not in ("two_shot", "default"):
            continue
        backend = r.get("backend", "none")
        compressed = r.get("codec", "none") != "none"
        if compressed and (r.get("codec") != "taco" or (local == "model" and backend not in cal.codec)):
            continue
        c = dataclasses.replace(codec, backend=backend) if compressed else model.NONE
        p = int(r.get("processes", 2))
        item = 2 if dtype == "bfloat16" else 4
        n = r["size_bytes"] * (p if op == "all_gather" else 1)  # the model's all-gather size is the gathered one
        if local == "sim":
            t_local = sim.get(_sim_key({**r, "devices": p}))
            if t_local is None:
                continue
            pred = t_local + model.comm_time(op, n, p, cal.link, model.wire_ratio(c, item))
        else:
            pred = model.collective_time(op, n, p, cal.link, c, cal.codec.get(backend), itemsize=item)
        meas = float(r["time_s_median"])
        out.append({"collective": r["collective"], "backend": backend if compressed else "exact", "dtype": dtype,
                    "size_bytes": r["size_bytes"], "measured_s": meas, "predicted_s": pred,
                    "error": pred / meas - 1})
    return out


def load_rows(path) -> list[dict]:
    """The rows of a bench JSON file ({"rows": [...]} or a bare list). Raises ValueError naming the file."""
    path = pathlib.Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"bench file {str(path)!r}: {e}") from e
    rows = d.get("rows") if isinstance(d, dict) else d
    if not isinstance(rows, list):
        raise ValueError(f"bench file {str(path)!r}: expected a list of rows or {{'rows': [...]}}")
    return rows


# min_bytes = "auto"
def site_break_even(policy: CommPolicy, link: Link, speeds: dict, p: int, *, itemsize: int = 4,
                    sequence_parallel: bool | None = None) -> int:
    """Smallest message (bytes, as `CommPolicy.codec_for` measures it) from which every compressed
    tensor site of `policy` that runs pays on `link` over `p` ranks: the largest of the sites'
    `model.break_even_bytes` (ar_fwd / ar_bwd: all-reduce; all_gather: all-gather, threshold on the
    local shard, i.e. the gathered size / p; reduce_scatter: reduce-scatter). `sequence_parallel`
    True: only all_gather / reduce_scatter run; False: only ar_fwd / ar_bwd; None: all four. Returns `model.NEVER`
    if one never pays; 0 if no site compresses. `speeds`: {backend: CodecSpeed} ("default" as the fallback).
    Raises: ValueError when a compressed site's backend has no speed in `speeds`."""
    ops = {"ar_fwd": "all_reduce", "ar_bwd": "all_reduce", "all_gather": "all_gather",
           "reduce_scatter": "reduce_scatter"}
    running = {None: TENSOR_SITES, True: ("all_gather", "reduce_scatter"), False: ("ar_fwd", "ar_bwd")}
    out = 0
    for site in running[sequence_parallel]:
        c = getattr(policy, site)
        if c.kind == "none":
            continue
        speed = speeds.get(c.backend, speeds.get("default"))
        if speed is None:
            raise ValueError(f"site {site}: no codec speed for backend={c.backend!r} (known: {sorted(speeds)})")
        n = model.break_even_bytes(ops[site], p, link, c, speed, itemsize=itemsize)
        if site == "all_gather" and n < model.NEVER:
            n = -(-n // p)
        out = max(out, n)
    return out


def auto_threshold(policy: CommPolicy, hw: model.Hardware, tensor_size: int, *, itemsize: int = 4,
                   sequence_parallel: bool | None = None) -> int:
    """The `--min-bytes auto` threshold (bytes) of `policy` on GPU hardware `hw`: `site_break_even` over
    max(tensor_size, 2) ranks on the link the tensor axis crosses (`model.links`: intra-node while
    `tensor_size` ranks fit in a node, else inter-node) with `hw`'s codec speeds. The one resolver of
    a GPU run (`resolve_min_bytes`) and of `taco-jax plan` / `predict` (`train.plan.resolve_policy`).
    Raises: ValueError when a compressed site's backend has no speed on `hw`."""
    link = hw.intra if tensor_size <= hw.gpus_per_node else hw.inter
    return site_break_even(policy, link, hw.codec, max(int(tensor_size), 2), itemsize=itemsize,
                           sequence_parallel=sequence_parallel)


def resolve_min_bytes(policy: CommPolicy, platform: str, *, tensor_size: int = 2, itemsize: int = 4,
                      sequence_parallel: bool | None = None, calibration=None,
                      link_bytes_per_s: float | None = None, hardware: model.Hardware | None = None) -> CommPolicy:
    """`policy` with min_bytes "auto" replaced by the predicted break-even size (others: unchanged).

    CPU: the shipped gloo calibration (`CPU_CALIBRATION`, or `calibration`, a `Calibration` or path), also for a
    one-process run on the simulated mesh, so that the numerics do not depend on the process count. GPU
    ("cuda"/"gpu"/"rocm"): `auto_threshold` on `hardware` (default `hardware.DEFAULT_GPU`), as `taco-jax plan` resolves
    it. `tensor_size`: ranks on the tensor axis (< 2 -> 2). `link_bytes_per_s` (CPU): the link rate measured by
    `taco-jax launch --link`; per byte the slower of it and the calibration's β. `sequence_parallel`: which tensor
    sites run (`site_break_even`). The one threshold applies to every site. Call once the policy's backends are
    concrete (`CommPolicy.resolve_backends`).
    Raises: ValueError for an unknown platform or a backend without a speed."""
    if policy.min_bytes != "auto":
        return policy
    if platform in ("cuda", "gpu", "rocm"):
        hw = hardware or declared.shipped()[declared.DEFAULT_GPU].hardware
        return dataclasses.replace(policy, min_bytes=auto_threshold(policy, hw, tensor_size, itemsize=itemsize,
                                                                    sequence_parallel=sequence_parallel))
    if platform != "cpu":
        raise ValueError(f"platform={platform!r}: min_bytes='auto' knows 'cpu' and 'cuda'")
    cal = calibration if isinstance(calibration, Calibration) else Calibration.from_json(
        calibration or CPU_CALIBRATION)
    link, speeds = cal.link, cal.codec
    if link_bytes_per_s:
        link = Link(f"emulated {link_bytes_per_s * 8 / 1e6:.0f} Mbit/s", link.alpha_s,
                    max(link.beta_s_per_byte, 1.0 / link_bytes_per_s), "measured by taco-jax launch --link")
    return dataclasses.replace(policy, min_bytes=site_break_even(policy, link, speeds, max(int(tensor_size), 2),
                                                                 itemsize=itemsize,
                                                                 sequence_parallel=sequence_parallel))
