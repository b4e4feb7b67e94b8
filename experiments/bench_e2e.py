"""End-to-end exact vs TACO on emulated links: tokens/s of real multi-process training runs, paired.

For each link rate (`--links`, e.g. "250mbit,1gbit,none"; "none" = loopback, no namespaces), runs
`taco-jax launch --processes P [--link RATE] -- train ...` with `--comm none` (exact) and with
`--comm taco`, in `--rounds` alternating rounds (exact first in even rounds, TACO first in odd ones,
so drifting machine load hits both alike). Per run: the median step time over the steps after
`--warmup` (metrics.jsonl `step_s`). Per link: median tokens/s of each, and the median and spread
(min, max) over rounds of the per-round speedup exact s/step / TACO s/step.

Also, once: the exact step without transport (`taco-jax train --comm none`, the same mesh in one
process: in-process collectives are memory copies). Its step time t_local against the exact
step over a link, t_exact, gives the communication fraction f = 1 - t_local / t_exact, and with the
wire-byte ratio r = TACO / exact tensor-axis wire bytes per step (summary.json, compiled HLO) the
byte bound 1 / ((1 - f) + f · r): the speedup if TACO only cut bytes (overlap may exceed it).
On a CPU host with few cores the one-process step can be slower than the multi-process one (the
processes compute in parallel, the one process's devices share its threads): then f is clipped at
0 (`comm_fraction_raw` keeps the value) and the bound says nothing; use a machine with a core per
device, or read f from the link sweep (the exact step's growth as the rate falls).

Writes `<out>/bench_e2e.json` and `<out>/bench_e2e.md` (one table row per link, with the command).
Needs root (network namespaces) for links other than "none"; see docs/distributed.md.

  python -m experiments.bench_e2e --links 250mbit,1gbit,none --rounds 3 --steps 12 --out runs/bench_e2e
  make bench-e2e ARGS="--links 500mbit --rounds 1"

Timings on a shared or loaded machine are not results: rerun on a quiet one before quoting them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

from taco_jax.train import jsonio


def _train_args(a) -> list[str]:
    args = ["--model", a.model, "--mesh", a.mesh, "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--dtype", a.dtype, "--steps", str(a.steps), "--eval-every", str(10 * a.steps), "--eval-batches", "1",
            "--no-progress"]
    return args + (["--sequence-parallel"] if a.sequence_parallel else [])


def _run(cmd: list[str], out: pathlib.Path, timeout: float, warmup: int) -> dict:
    """Runs one training command; returns its median step time (after `warmup` steps) and summary."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"`{shlex.join(cmd)}` exited with status {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    steps = [json.loads(line)["step_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(steps) <= warmup:
        raise RuntimeError(f"{out}: {len(steps)} steps, need more than --warmup {warmup}")
    summary = json.loads((out / "summary.json").read_text())
    return {"step_s": statistics.median(steps[warmup:]), "steps_s": steps, "wall_s": time.perf_counter() - t0,
            "wire_bytes_per_step": summary["wire_bytes_per_step"], "emulated_link": summary.get("emulated_link")}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "taco_jax.cli", *args]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--links", default="250mbit,1gbit,none", help="comma-separated link rates; none = loopback")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--mesh", default="data=1,tensor=2")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its median")
    p.add_argument("--rounds", type=int, default=3, help="alternating exact/TACO rounds per link")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run, then it fails")
    p.add_argument("--out", default="runs/bench_e2e")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.steps <= a.warmup or a.processes < 2:
        p.error(f"need --rounds >= 1 (got {a.rounds}), --steps > --warmup (got {a.steps}, {a.warmup}) and "
                f"--processes >= 2 (got {a.processes})")
    links = [x.strip() for x in a.links.split(",") if x.strip()]
    if not links:
        p.error(f"--links {a.links!r} names no link")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train = _train_args(a)

    local_dir = out / "local_exact"
    local = _run(_cli("train", *train, "--comm", "none", "--out", str(local_dir)), local_dir, a.timeout, a.warmup)
    rows = []
    for link in links:
        runs = {"none": [], "taco": []}
        for rnd in range(a.rounds):
            for comm in (("none", "taco") if rnd % 2 == 0 else ("taco", "none")):
                d = out / f"{link}_{comm}_r{rnd}"
                launch = ["launch", "--processes", str(a.processes)] + ([] if link == "none" else ["--link", link])
                runs[comm].append(_run(_cli(*launch, "--", "train", *train, "--comm", comm, "--out", str(d)), d,
                                       a.timeout, a.warmup))
                print(f"[bench_e2e] {link} round {rnd} {comm}: {runs[comm][-1]['step_s']:.4f} s/step", flush=True)
        exact_s = statistics.median(r["step_s"] for r in runs["none"])
        taco_s = statistics.median(r["step_s"] for r in runs["taco"])
        ratios = [e["step_s"] / t["step_s"] for e, t in zip(runs["none"], runs["taco"])]
        tensor = {c: runs[c][0]["wire_bytes_per_step"].get("tensor", 0) for c in runs}
        r_bytes = tensor["taco"] / tensor["none"] if tensor["none"] else float("nan")
        f_raw = 1.0 - local["step_s"] / exact_s  # < 0: the one-process step was slower (e.g. 2 cores, 1 process)
        f = min(max(f_raw, 0.0), 1.0)
        measured = runs["none"][0]["emulated_link"]
        rows.append({
            "link": link,
            "measured_bit_per_s": None if not measured else
            {k: v["measured_bit_per_s"] for k, v in measured["tiers"].items()},
            "tokens_per_step": a.batch_size * a.seq_len,
            "exact_s_per_step": exact_s, "taco_s_per_step": taco_s,
            "exact_tokens_per_s": a.batch_size * a.seq_len / exact_s,
            "taco_tokens_per_s": a.batch_size * a.seq_len / taco_s,
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "local_exact_s_per_step": local["step_s"], "comm_fraction": f, "comm_fraction_raw": f_raw,
            "byte_ratio": r_bytes, "byte_bound": 1.0 / ((1.0 - f) + f * r_bytes),
            "tensor_wire_bytes_per_step": tensor,
            "runs": {c: [{k: v for k, v in r.items() if k != "emulated_link"} for r in rs] for c, rs in runs.items()},
        })
    result = {"format": "taco_jax.bench_e2e/1", "command": shlex.join(["python", "-m", "experiments.bench_e2e",
                                                                        *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(a), "rows": rows,
              "note": "timings of a shared/loaded machine are not results; rerun on a quiet one"}
    jsonio.write(out / "bench_e2e.json", result)
    lines = [f"`{result['command']}`", "",
             "| link | measured Mbit/s | exact s/step | TACO s/step | speedup (median [min, max]) | f | r | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = "-" if not r["measured_bit_per_s"] else \
            ", ".join(f"{k} {v / 1e6:.0f}" for k, v in r["measured_bit_per_s"].items())
        lines.append(f"| {r['link']} | {m} | {r['exact_s_per_step']:.4f} | {r['taco_s_per_step']:.4f} | "
                     f"{r['speedup_median']:.2f}× [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | "
                     f"{r['comm_fraction']:.2f} | {r['byte_ratio']:.3f} | {r['byte_bound']:.2f}× |")
    (out / "bench_e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
