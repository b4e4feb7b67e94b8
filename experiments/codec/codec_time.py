"""The codec's time in a training step, read from a profile rather than from a difference of steps.

`bench_e2e` calls the codec time the one-process TACO step minus the exact one. On a shared 2-core VM
that difference moves by more than the codec costs (±12 ms on ~270 ms steps, docs/results.md). This
study traces the same one-process runs with `jax.profiler` and sums, per simulated device and step,
the durations of the executed ops whose op name carries the codec's named scopes (`taco_encode`,
`taco_decode`: the FFI calls and any convert or reshape XLA runs inside them). The step difference is
printed beside it.

    python -m experiments.codec.codec_time --out runs/codec_time                        # this checkout
    python -m experiments.codec.codec_time --out runs/codec_time --trees OLD .          # before / after

Each `--trees` entry is a checkout of taco_jax with its C++ library built (`make ffi` there; an old
commit: `git worktree add OLD COMMIT && make -C OLD/custom_calls PYTHON=$PWD/.venv/bin/python`); a tree
without `taco_jax/kernels/_lib/libtaco_codec_cpu.so` is refused (it would measure the jnp fallback). A
run imports that tree's `taco_jax` (this interpreter, the tree as its working directory) and wraps
`taco_jax.cli.main` in `jax.profiler.start_trace` / `stop_trace`, so a commit older than
`--profile-steps` is measured the same way. The trees and `--comm none` / `taco` alternate within each
of `--rounds` rounds, so load that drifts hits every variant alike. Default run: gpt2-narrow, batch
256 × 32, bf16, `data=1,tensor=2` with sequence parallelism (the run of the GPU-codec issue's codec-time
line; XLA's in-process collectives, where `bench_e2e`'s one-process step gives `--transport gloo`: the
codec's ops are the same), 12 steps, the first 4 left out. `--out` must not hold runs of an earlier call.

Prints per tree: codec ms per device and step, median [min, max] over rounds; the median FFI call by
collective; the TACO − exact step time per round (from metrics.jsonl); a line per run goes to stderr.
Writes `codec_time.json` to `--out`. Times are wall clock under the profiler (which adds to every op
alike), on whatever machine runs it: the load probe's time over its calibrated time
(experiments/e2e/load_guard.py) before and after is printed and recorded, with a warning above the
guard's `Limits.probe_slowdown`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

from experiments.common import ROOT, run_record

#: The one-process step of the GPU-codec issue (docs/results.md, "The codec's time in a training step").
TRAIN_ARGS = ["--model", "gpt2-narrow", "--mesh", "data=1,tensor=2", "--batch-size", "256", "--seq-len", "32",
              "--dtype", "bfloat16", "--sequence-parallel", "--checkpoint-every", "0", "--no-progress"]

_DRIVER = """
import sys, jax, taco_jax
from taco_jax.cli import main
print("[codec_time] taco_jax from", taco_jax.__file__, flush=True)
out, comm, steps = sys.argv[1], sys.argv[2], sys.argv[3]
jax.profiler.start_trace(out + "/trace")
rc = main(["train", *sys.argv[4:], "--steps", steps, "--comm", comm, "--out", out + "/run"])
jax.profiler.stop_trace()
sys.exit(rc)
"""

_COLLECTIVE = re.compile(r"(all-reduce|all_reduce|reduce_scatter|reduce-scatter|all_gather|all-gather|all-to-all|"
                         r"collective-permute|pmax|psum)")


def run_one(tree: pathlib.Path, comm: str, out: pathlib.Path, steps: int, devices: int, extra: list[str]) -> None:
    """One traced `taco-jax train` of the checkout `tree` into `out` (trace/, run/, log.txt).
    Raises RuntimeError with the log's tail if it fails."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(tree))
    with open(out / "log.txt", "w") as log:
        rc = subprocess.call([sys.executable, "-c", _DRIVER, str(out), comm, str(steps), *TRAIN_ARGS, *extra],
                             cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    log = (out / "log.txt").read_text()
    if rc:
        raise RuntimeError(f"{tree} --comm {comm} exited {rc}: {log[-2000:]}")
    if f"taco_jax from {tree / 'taco_jax'}" not in log:  # an installed taco_jax shadowed the tree
        raise RuntimeError(f"{out / 'log.txt'}: the run did not import {tree / 'taco_jax'}")


def summarize(xplane, metrics, skip: int, devices: int) -> dict:
    """Of the trace `xplane` (`*.xplane.pb` of a train run on `devices` simulated devices) and the run's
    `metrics` (metrics.jsonl), per device and step (ms), over the traced steps after the first `skip`:
    "codec" (ops under taco_encode / taco_decode), "collectives" (the other collectives), "other";
    "ffi_call_us" (median FFI call per collective scope); "step_ms" (median step_s of the steps past
    `skip`); "steps" (traced). Raises ValueError if the trace holds `skip` steps or fewer."""
    from taco_jax.train.profile import op_events

    events = op_events(xplane)
    counts = collections.Counter(op for _, _, op, _ in events)
    per_op = statistics.mode(counts.values())  # most ops run once per device and step
    steps = per_op // devices
    if steps <= skip:
        raise ValueError(f"{xplane}: {steps} traced steps, need more than skip={skip}")
    marker = next(op for op, n in counts.items() if n == per_op)
    t0 = [s for s, _, op, _ in events if op == marker][skip * devices]
    sums, calls = collections.Counter(), collections.defaultdict(list)
    for start, dur, op, name in events:
        if start < t0:
            continue
        codec = re.findall(r"taco_(?:encode|decode)", name)
        kind = "codec" if codec else "collectives" if _COLLECTIVE.match(op) else "other"
        sums[kind] += dur
        if codec and op.startswith(("ffi_call", "custom-call")):
            calls["/".join(re.findall(r"transpose|taco_[a-z_]+", name))].append(dur / 1e3)
    n = (steps - skip) * devices
    recs = [json.loads(line) for line in pathlib.Path(metrics).read_text().splitlines()]
    return {**{k: sums[k] / n / 1e6 for k in ("codec", "collectives", "other")},
            "ffi_call_us": {k: statistics.median(v) for k, v in sorted(calls.items())},
            "step_ms": 1e3 * statistics.median(r["step_s"] for r in recs if r["step"] > skip),
            "steps": steps}


def _probe_ratio() -> float | None:
    from experiments.e2e import load_guard

    calibrated = load_guard.load_calibration()[0]
    return None if calibrated is None else statistics.median(load_guard.probe() / calibrated for _ in range(5))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the runs and codec_time.json")
    p.add_argument("--trees", nargs="+", default=[str(ROOT)], help="checkouts to compare (default: this one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=4, help="steps left out at the start (compile, warm-up)")
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="more `taco-jax train` flags, after the default run's (the last one wins)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps <= args.skip or args.skip < 0:
        p.error(f"need --rounds >= 1 and 0 <= --skip < --steps (got --rounds {args.rounds}, --skip {args.skip}, "
                f"--steps {args.steps})")
    trees = [pathlib.Path(t).resolve() for t in args.trees]
    for t in trees:
        if not any((t / "taco_jax" / cli).exists() for cli in ("cli.py", "cli/__init__.py")):  # older, newer trees
            p.error(f"--trees {str(t)!r} is not a taco_jax checkout (no taco_jax/cli)")
        if not (t / "taco_jax" / "kernels" / "_lib" / "libtaco_codec_cpu.so").exists():
            p.error(f"--trees {str(t)!r} has no C++ codec library (taco_jax/kernels/_lib/libtaco_codec_cpu.so): "
                    f"build it (make -C {t}/custom_calls PYTHON={sys.executable}), or the run measures the jnp "
                    "fallback")
    out = pathlib.Path(args.out)
    if earlier := sorted(out.glob("tree*_*_*")):
        p.error(f"--out {str(out)!r} holds runs of an earlier call ({earlier[0].name}, ...): give a new folder")
    result = {"run": run_record(__spec__.name, argv), "trees": [str(t) for t in trees],
              "train_args": TRAIN_ARGS + args.train_args, "skip": args.skip,
              "probe_before": _probe_ratio(), "runs": []}
    for r in range(args.rounds):
        for i, tree in enumerate(trees):
            for comm in ("none", "taco"):
                d = out / f"tree{i}_{comm}_{r}"
                try:
                    run_one(tree, comm, d, args.steps, 2, args.train_args)
                except RuntimeError as e:
                    raise SystemExit(f"codec_time: {e}") from None
                (xplane,) = d.glob("trace/plugins/profile/*/*.xplane.pb")
                s = summarize(xplane, d / "run" / "metrics.jsonl", args.skip, 2)
                result["runs"].append({"round": r, "tree": i, "comm": comm, **s})
                print(f"[codec_time] round {r} tree {i} --comm {comm}: step {s['step_ms']:.1f} ms, codec "
                      f"{s['codec']:.2f} ms per device and step", file=sys.stderr, flush=True)
    result["probe_after"] = _probe_ratio()
    result["trees_summary"] = []
    for i, tree in enumerate(trees):
        taco = [x for x in result["runs"] if x["tree"] == i and x["comm"] == "taco"]
        none = {x["round"]: x for x in result["runs"] if x["tree"] == i and x["comm"] == "none"}
        codec = [x["codec"] for x in taco]
        diff = [x["step_ms"] - none[x["round"]]["step_ms"] for x in taco]
        calls = {k: statistics.median(x["ffi_call_us"][k] for x in taco) for k in taco[0]["ffi_call_us"]}
        result["trees_summary"].append({"tree": str(tree), "codec_ms": statistics.median(codec),
                                        "codec_ms_range": [min(codec), max(codec)], "step_diff_ms": diff,
                                        "ffi_call_us": calls})
        print(f"{tree}: codec {statistics.median(codec):.2f} ms per device and step [{min(codec):.2f}, "
              f"{max(codec):.2f}] over {len(codec)} rounds; TACO - exact step per round: "
              + ", ".join(f"{d:+.1f}" for d in diff) + f" ms (median {statistics.median(diff):+.1f})")
        for k, v in calls.items():
            print(f"    FFI call {k}: median {v:.0f} us")
    ratios = [result["probe_before"], result["probe_after"]]
    if None in ratios:
        print("load probe: not calibrated on this machine (python -m experiments.e2e.load_guard --calibrate-probe)")
    else:
        from experiments.e2e.load_guard import Limits

        print(f"load probe / calibrated time: {ratios[0]:.2f} before, {ratios[1]:.2f} after")
        if max(ratios) > Limits.probe_slowdown:
            print(f"WARNING: the machine was busy (probe above {Limits.probe_slowdown}x its calibrated time): the "
                  "times are slower than a quiet machine's", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_time.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
