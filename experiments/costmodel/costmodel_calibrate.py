"""Fits the cost model's gloo-loopback link and codec speeds to real-transport rows, writes the
calibration file `min_bytes="auto"` reads on CPU, and prints predicted vs measured times.

    python -m experiments.costmodel.costmodel_measure --out runs/costmodel/measure.json  # or bench_collectives' JSON
    python -m experiments.costmodel.costmodel_calibrate runs/costmodel/measure.json \
        --write taco_jax/perf/calibration_cpu_gloo.json

`--stat time_s_min` fits and compares the fastest round instead of the median (steadier on a
loaded machine; codec rows then use encode_s_min / decode_s_min when present).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys

from taco_jax import perf
from taco_jax.codec import TACO
from taco_jax.collectives.policy import CommPolicy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", nargs="+", help="bench JSON files (rows with the bench_collectives/1 keys)")
    p.add_argument("--write", default="", help="calibration JSON to write")
    p.add_argument("--stat", default="time_s_median", choices=("time_s_median", "time_s_min"))
    p.add_argument("--dtypes", default="float32", help="message dtypes of the rows compared (float32,bfloat16)")
    p.add_argument("--codec-from", default="auto", choices=("auto", "sim", "codec"),
                   help="codec speed from sim psum rows (the collective's local work) or isolated codec rows")
    a = p.parse_args(argv)
    rows = [r for f in a.rows for r in perf.load_rows(f)]
    if a.stat == "time_s_min":
        rows = [{**r, "time_s_median": r.get("time_s_min", r.get("time_s_median")),
                 "encode_s": r.get("encode_s_min", r.get("encode_s")),
                 "decode_s": r.get("decode_s_min", r.get("decode_s"))} for r in rows]
    cmd = "python -m experiments.costmodel.costmodel_calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    cal = perf.fit_calibration(rows, codec_from=a.codec_from, command=cmd,
                         machine=f"{platform.node()} {platform.machine()} ({a.stat})")
    print(f"link: alpha = {cal.link.alpha_s * 1e6:.1f} us, beta = {cal.link.beta_s_per_byte * 1e9:.3f} ns/B "
          f"({cal.link.bandwidth_GBps:.3f} GB/s)")
    for b, s in cal.codec.items():
        print(f"codec {b}: encode {s.encode_GBps:.3f} GB/s, decode {s.decode_GBps:.3f} GB/s, "
              f"overhead {s.overhead_s * 1e6:.1f} us")
    tables = [("model: alpha-beta link + linear codec", cal, "model")]
    if perf.sim_times(rows):
        link = perf.fit_link(rows, subtract_sim=True)
        tables.append((f"decomposed: sim-measured local work + transfer on alpha = {link.alpha_s * 1e6:.1f} us, "
                       f"beta = {link.beta_s_per_byte * 1e9:.3f} ns/B (fit on exact gloo - sim)",
                       dataclasses.replace(cal, link=link), "sim"))
    for title, c, local in tables:
        print(f"-- {title}")
        print(f"{'collective':12s} {'backend':9s} {'dtype':8s} {'MB/rank':>7s} {'measured ms':>12s} "
              f"{'predicted ms':>13s} {'error':>7s}")
        worst, within = 0.0, 0
        checks = perf.validate(c, rows, local=local, dtypes=tuple(a.dtypes.split(",")))
        for v in checks:
            worst = max(worst, abs(v["error"]))
            within += abs(v["error"]) <= 0.25
            print(f"{v['collective']:12s} {v['backend']:9s} {v['dtype']:8s} {v['size_bytes'] / 2**20:7.2f} "
                  f"{v['measured_s'] * 1e3:12.2f} {v['predicted_s'] * 1e3:13.2f} {v['error']:+7.0%}")
        print(f"largest |error|: {worst:.0%}; within 25%: {within} of {len(checks)}")
    for b in cal.codec:
        pol = CommPolicy.taco(dataclasses.replace(TACO, backend=b))
        n = perf.site_break_even(pol, cal.link, cal.codec, cal.processes, sequence_parallel=False)
        print(f"break-even (min_bytes auto) {b}: {'never' if n >= perf.NEVER else f'{n / 2**20:.2f} MB'}")
    if a.write:
        print("wrote", cal.to_json(a.write))


if __name__ == "__main__":
    main()
