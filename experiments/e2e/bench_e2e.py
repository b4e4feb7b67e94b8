"""End-to-end exact vs TACO on emulated links: tokens/s of real multi-process training runs, paired.

For each link (`--links 250mbit 1gbit none`; `none` = loopback, no namespaces; a two-tier link
`intra=1gbit,inter=250mbit` with `--launch-args "--nodes 2"`), runs
`taco-jax launch --processes P [--link LINK] -- train ...` once per variant (`--variant
NAME=FLAGS`, default `exact="--comm none"` and `taco="--comm taco"`) in `--rounds` rounds, the
variants' order rotated each round so drifting machine load hits all alike. Per run: the median
step time over the steps after `--warmup` (metrics.jsonl `step_s`). Per link and variant: the
median over rounds, and the speedup of every variant over the first one (per-round ratios:
median, min, max).

Also, once per variant: the step without transport (`taco-jax train`, the same mesh in one
process; in-process collectives are memory copies). It runs with the exact collectives' transport
the processes resolve to (`--transport`: the variant's own, else "gloo", what "auto" is in a
multi-process CPU run), so it is the processes' program with only the transport differing: a bf16
message moves as its own bytes, not widened to float32 as XLA:CPU's in-process collectives would
(recorded as `local_transport`). The first variant's one-process step t_local
against its step over a link t gives the communication fraction f = 1 - t_local / t, and with the
wire-byte ratio r = variant / first variant's wire bytes per step (summary.json, compiled HLO, all
mesh axes) the byte bound 1 / ((1 - f) + f · r): the speedup if a variant only cut bytes (overlap
may exceed it). A TACO variant's one-process step minus the exact one is its codec time (the cost
model's input, experiments/e2e/e2e_study.py). On a 2-core host the one-process step shares the cores
the way the processes do; f is clipped at 0 (`comm_fraction_raw` keeps the value).

Writes `<out>/bench_e2e.json` and `<out>/bench_e2e.md` (one row per link and variant, with the
command). The children share a JAX compilation cache (`$JAX_COMPILATION_CACHE_DIR`, default
`<out>/.jax_cache`): it shortens start-up only, never a step. Needs root (network namespaces) for
links other than `none`; see docs/distributed.md, "Emulated links".

  python -m experiments.e2e.bench_e2e --links 250mbit 1gbit none --rounds 3 --steps 8 --out runs/bench_e2e
  python -m experiments.e2e.bench_e2e --links 250mbit --sequence-parallel --no-local \\
      --variant taco="--comm taco" --variant taco_c4="--comm taco --chunks 4"

Timings on a shared or loaded machine are not results. A load guard (experiments/e2e/load_guard.py)
measures the machine before the study, before every round and over every run (other processes' CPU,
a compute probe against its calibration, the load average) and warns on stderr when it is busier than
the study allows; then it does not start, or writes `<out>/bench_e2e.loaded.json` and `.md` (marked
`loaded`, never read as a result) instead of `bench_e2e.json` and exits with status 3.
`--allow-loaded` runs and writes the result anyway, labelled loaded wherever it is printed.
`--wait-quiet SECONDS` waits (up to SECONDS each time) for a busy machine to be quiet instead, checks
it after every round too, and runs a round (or one-process run) it was busy during again; the result
says how often. `--calibrate-probe` times the probe on a quiet machine (experiments/e2e/load_probe.json).
The whole study (models, TP 2/4, SP on/off, bf16/f32, the link sweep, the cost model):
experiments/e2e/e2e_study.py, `make bench-e2e`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from experiments.common import run_record
from experiments.e2e import load_guard
from taco_jax.emulate import LinkSpec
from taco_jax.launch import child_env, cli_command
from taco_jax.models import PRESETS
from taco_jax.util import jsonio

DEFAULT_VARIANTS = ("exact=--comm none", "taco=--comm taco")


def _train_args(a) -> list[str]:
    args = ["--model", a.model, "--mesh", a.mesh, "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--dtype", a.dtype, "--steps", str(a.steps), "--eval-every", str(10 * a.steps), "--eval-batches", "1",
            "--no-progress", "--checkpoint-every", "0"]
    return args + (["--sequence-parallel"] if a.sequence_parallel else []) + shlex.split(a.train_args)


def local_transport(flags: list[str]) -> str:
    """The exact collectives' transport a multi-process CPU run of `flags` (`train` flags) resolves
    to: the last `--transport` among them unless "auto", else "gloo" (`resolve_transport` under
    `jax.distributed` on the CPU). The one-process step runs with it."""
    given = [b for a, b in zip(flags, flags[1:]) if a == "--transport"]
    given += [a.partition("=")[2] for a in flags if a.startswith("--transport=")]
    return given[-1] if given and given[-1] != "auto" else "gloo"


def _run(cmd: list[str], out: pathlib.Path, timeout: float, warmup: int, env: dict) -> dict:
    """Runs one training command into its run folder `out` (this benchmark's own: a folder left by an
    interrupted or loaded earlier run is removed first); returns its median step time (after `warmup`
    steps) and summary."""
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise RuntimeError(f"`{shlex.join(cmd)}` exited with status {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    steps = [json.loads(line)["step_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(steps) <= warmup:
        raise RuntimeError(f"{out}: {len(steps)} steps, need more than --warmup {warmup}")
    summary = json.loads((out / "summary.json").read_text())
    tensor_msgs = sum(d["count"] for d in summary["wire_detail"] if d["axis"] == "tensor")
    return {"step_s": statistics.median(steps[warmup:]), "steps_s": steps, "wall_s": time.perf_counter() - t0,
            "wire_bytes_per_step": summary["wire_bytes_per_step"], "tensor_messages_per_step": tensor_msgs,
            "wire_detail": summary["wire_detail"], "emulated_link": summary.get("emulated_link"),
            "final_train_loss": summary["final_train_loss"]}


def _variants(specs: list[str], p: argparse.ArgumentParser) -> dict[str, list[str]]:
    out = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.isidentifier() or name in out:
            p.error(f"--variant {spec!r}: want NAME=FLAGS with a new identifier NAME (e.g. taco=\"--comm taco\")")
        out[name] = shlex.split(flags)
    if len(out) < 2:
        p.error(f"need at least two variants (the first is the baseline), got {list(out)}")
    return out


def _links(specs: list[str]) -> list[str]:
    out = []
    for s in specs:  # "250mbit,1gbit" (no '=') is a list; "intra=..,inter=.." is one two-tier link
        out += [s] if "=" in s else [x.strip() for x in s.split(",") if x.strip()]
    return out


def _launch_args(launch_args: str, link: str) -> list[str]:
    """`taco-jax launch` flags for one link: `--launch-args` and `--link LINK`; on loopback (`none`) without
    `--nodes K`, which only places processes on an emulated link's nodes (the same processes, unshaped)."""
    args = shlex.split(launch_args)
    if link != "none":
        return [*args, "--link", link]
    out, skip = [], False
    for x in args:
        if not skip and x != "--nodes" and not x.startswith("--nodes="):
            out.append(x)
        skip = x == "--nodes"
    return out


def byte_bound(f: float, r: float) -> float:
    """1 / ((1 − f) + f·r): the speedup if a fraction f of the step scaled with bytes and they shrank to r."""
    return 1.0 / ((1.0 - f) + f * r)


def _bytes(run: dict) -> float:
    return float(sum(run["wire_bytes_per_step"].values()))


#: Flags whose value is itself a list of flags: `--launch-args --pin-cpus` is taken as
#: `--launch-args=--pin-cpus` (argparse alone reads a value that starts with "-" as a missing one).
FLAG_LIST_FLAGS = ("--launch-args", "--train-args")


def _joined(argv: list[str]) -> list[str]:
    """`argv` with each of FLAG_LIST_FLAGS and its following word joined by "=" (the word then may begin
    with "-"); a flag given last stays as it is (argparse names it)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in FLAG_LIST_FLAGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of `main` (its --help)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--links", nargs="+", default=["250mbit", "1gbit", "none"],
                   help="link rates (none = loopback) or one two-tier intra=RATE,inter=RATE per argument")
    p.add_argument("--processes", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--launch-args", default="",
                   help="more `taco-jax launch` flags, e.g. \"--nodes 2\" or --pin-cpus (--nodes is left out on "
                        "loopback, `none`; the one-process steps take none of them)")
    p.add_argument("--mesh", default="data=1,tensor=2", help="mesh (default: data=1,tensor=2)")
    p.add_argument("--model", default="gpt2-narrow", choices=sorted(PRESETS), metavar="PRESET",
                   help="model preset (default: gpt2-narrow)")
    p.add_argument("--batch-size", type=int, default=256, help="sequences per step (default: 256)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: 32)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="(default: bfloat16)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism (default: off)")
    p.add_argument("--train-args", default="", help="more `train` flags for every run (e.g. \"--vocab-size 512\")")
    p.add_argument("--variant", action="append", metavar="NAME=FLAGS",
                   help=f"a compared configuration, repeatable; the first is the baseline "
                   f"(default: {DEFAULT_VARIANTS})")
    p.add_argument("--no-local", action="store_true", help="skip the one-process (transport-free) steps")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its median (default: 2)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per link, variant order rotated each round (default: 2)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run, then it fails")
    p.add_argument("--out", default="runs/bench_e2e",
                   help="result folder (default: %(default)s); its run folders are replaced on a rerun")
    load_guard.add_arguments(p)
    return p


def plan(a: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """The links and the variants ({name: train flags}, the baseline first) of the parsed arguments `a`,
    checked before any run: `p.error` (exit status 2) on a bad count, rate, link or variant."""
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds} must be >= 1")
    if a.warmup < 0 or a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must be > --warmup {a.warmup} >= 0")
    if a.processes < 2:
        p.error(f"--processes {a.processes} must be >= 2")
    links = _links(a.links)
    if not links:
        p.error(f"--links {a.links!r} names no link")
    words = " ".join(shlex.split(a.launch_args)).replace("--nodes=", "--nodes ").split()
    nodes = next((int(x) for f, x in zip(words, words[1:]) if f == "--nodes" and x.isdigit()), 0)
    for link in links:  # before any run: a bad rate fails now, not after the one-process steps
        if link != "none":
            try:
                LinkSpec.parse(link, nodes if "=" in link else 0)
            except ValueError as e:
                p.error(str(e))
    return links, _variants(a.variant or list(DEFAULT_VARIANTS), p)


def run_local(a, variants: dict[str, list[str]], train: list[str], out: pathlib.Path, env: dict,
              guard: load_guard.Guard) -> dict:
    """Each variant's step without transport: one `taco-jax train` process on the same mesh, in
    out/local_<variant>/ -> {variant: `_run`'s dict + "transport"} (empty with --no-local)."""
    local = {}
    if a.no_local:
        return local
    for v, flags in variants.items():
        d = out / f"local_{v}"
        transport = local_transport([*train, *flags])
        for attempt in itertools.count():  # once, unless --wait-quiet discards a busy run
            since = guard.mark()
            with guard.watch(f"one process {v}"):
                local[v] = _run(cli_command("train", *train, *flags, "--transport", transport, "--out", str(d)), d,
                                a.timeout, a.warmup, env)
            print(f"[bench_e2e] one process {v} (--transport {transport}): {local[v]['step_s']:.4f} s/step"
                  f"{guard.run_label(since, attempt)}", flush=True)
            if guard.wait_s > 0:
                guard.check(f"after one process {v}", wait=False)
            if not guard.redo(since, f"one process {v}", attempt):
                break
        local[v]["transport"] = transport
    return local


def run_link(a, link: str, variants: dict[str, list[str]], train: list[str], out: pathlib.Path, env: dict,
             guard: load_guard.Guard) -> dict[str, list[dict]]:
    """`--rounds` rounds of every variant launched on `link` (the order rotated each round), each run in
    out/<link>_<variant>_r<round>/ -> {variant: [`_run`'s dict per round]}."""
    names = list(variants)
    runs = {v: [] for v in names}
    for rnd in range(a.rounds):
        k = rnd % len(names)
        for attempt in itertools.count():  # once, unless --wait-quiet discards a busy round
            if guard.runs_since_check:
                guard.check(f"before {link} round {rnd}")
            since, got = guard.mark(), {}
            for v in names[k:] + names[:k]:
                d = out / f"{link.replace(',', '_').replace('=', '-')}_{v}_r{rnd}"
                launch = ["launch", "--processes", str(a.processes), *_launch_args(a.launch_args, link)]
                with guard.watch(f"{link} round {rnd} {v}"):
                    got[v] = _run(cli_command(*launch, "--", "train", *train, *variants[v], "--out", str(d)),
                                  d, a.timeout, a.warmup, env)
                print(f"[bench_e2e] {link} round {rnd} {v}: {got[v]['step_s']:.4f} s/step"
                      f"{guard.run_label(since, attempt)}", flush=True)
                if guard.will_redo(since, attempt):
                    break  # the round runs again: its other variants now would be discarded too
            if guard.wait_s > 0:
                guard.check(f"after {link} round {rnd}", wait=False)
            if not guard.redo(since, f"{link} round {rnd}", attempt):
                break
        for v in names:
            runs[v].append(got[v])
    return runs


def summarize(a, link: str, runs: dict[str, list[dict]], local: dict, variants: dict[str, list[str]]) -> list[dict]:
    """One row per variant of `link`: median s/step and tokens/s over the rounds, the speedup over the
    first variant (per-round ratios: median, min, max), the communication fraction f of the baseline
    (1 - its one-process step / its launched step; nan without `local`), the byte ratio r and the
    bound 1 / (1 - f (1 - r)), the measured link rate and the wire bytes and messages per step."""
    names = list(variants)
    base = names[0]
    t_base = statistics.median(r["step_s"] for r in runs[base])
    f_raw = 1.0 - local[base]["step_s"] / t_base if local else float("nan")
    f = min(max(f_raw, 0.0), 1.0) if local else float("nan")
    measured = runs[base][0]["emulated_link"]
    rows = []
    for v in names:
        t = statistics.median(r["step_s"] for r in runs[v])
        ratios = [b["step_s"] / x["step_s"] for b, x in zip(runs[base], runs[v])]
        r_bytes = _bytes(runs[v][0]) / _bytes(runs[base][0])
        rows.append({
            "link": link, "variant": v, "flags": shlex.join(variants[v]),
            "measured_bit_per_s": None if not measured else
            {k: m["measured_bit_per_s"] for k, m in measured["tiers"].items()},
            "measured_wire_bit_per_s": None if not measured else
            {k: m["measured_wire_bit_per_s"] for k, m in measured["tiers"].items()
             if "measured_wire_bit_per_s" in m},
            "tokens_per_step": a.batch_size * a.seq_len, "s_per_step": t,
            "tokens_per_s": a.batch_size * a.seq_len / t,
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "local_s_per_step": local[v]["step_s"] if local else None,
            "local_transport": local[v]["transport"] if local else None,
            "comm_fraction": f, "comm_fraction_raw": f_raw, "byte_ratio": r_bytes,
            "byte_bound": byte_bound(f, r_bytes) if local else None,
            "wire_bytes_per_step": runs[v][0]["wire_bytes_per_step"],
            "tensor_messages_per_step": runs[v][0]["tensor_messages_per_step"],
            "wire_detail": runs[v][0]["wire_detail"],  # per axis, op and dtype: count and bytes
            "runs": [{k: x for k, x in r.items() if k not in ("emulated_link", "wire_detail")} for r in runs[v]],
        })
    return rows


def markdown(result: dict) -> list[str]:
    """The lines of bench_e2e.md: a warning above a loaded or waited-out study, the command and one table
    row per link and variant."""
    lg = result["load_guard"]
    busy = [c for c in lg["checks"] if load_guard.counts(c)]
    head = [] if not result["loaded"] else [
        f"**LOADED machine: not a result.** {len(busy)} of {len(lg['checks'])} load checks were "
        f"busier than the study allows (first, {busy[0]['where']}: {'; '.join(busy[0]['reasons'])}).", ""]
    if lg["waited_checks"] or lg["redone"]:
        n = lg["waited_checks"]
        head += [f"Waited out a busy machine (`--wait-quiet {result['config']['wait_quiet']:g}`): {n} busy "
                 f"check{'s' * (n != 1)} waited through; {len(lg['redone'])} runs or rounds discarded after a busy "
                 f"check and run again{': ' + ', '.join(lg['redone']) if lg['redone'] else ''}.", ""]
    lines = [*head, f"`{result['command']}`", "",
             "| link | measured Mbit/s (payload; in frames, where recorded) | variant | s/step | tokens/s | "
             "speedup (median [min, max]) | f | r | bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = "-" if not r["measured_bit_per_s"] else \
            ", ".join(f"{k} {v / 1e6:.0f}" + ("" if k not in (r.get("measured_wire_bit_per_s") or {}) else
                                               f"; {r['measured_wire_bit_per_s'][k] / 1e6:.0f}")
                      for k, v in r["measured_bit_per_s"].items())
        bound = "-" if r["byte_bound"] is None else f"{r['byte_bound']:.2f}×"
        lines.append(f"| {r['link']} | {m} | {r['variant']} | {r['s_per_step']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speedup_median']:.2f}× [{r['speedup_min']:.2f}, {r['speedup_max']:.2f}] | "
                     f"{'-' if r['local_s_per_step'] is None else format(r['comm_fraction'], '.2f')} | "
                     f"{r['byte_ratio']:.3f} | {bound} |")
    return lines


def main(argv=None, guard: load_guard.Guard | None = None) -> dict:
    """Runs the study of `argv` and returns its result. `guard`: a study's load guard whose first
    check was made (experiments/e2e/e2e_study.py); by default one of this command's own. Raises
    load_guard.Loaded (exit status 3) when the machine was busier than allowed and --allow-loaded is off."""
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(_joined(argv))
    if a.calibrate_probe:
        cal = load_guard.calibrate()
        print(f"[bench_e2e] compute probe: {cal['probe_s']:.3f} s (median of {len(cal['runs_s'])}) on "
              f"{cal['machine']}, written to {load_guard.PROBE_CALIBRATION}")
        return cal
    links, variants = plan(a, p)
    run = run_record(__spec__.name, argv)
    out = pathlib.Path(a.out)
    if guard is None:
        guard = load_guard.Guard(processes=a.processes, allow_loaded=a.allow_loaded, tag="[bench_e2e]",
                                 wait_s=a.wait_quiet)
    if not guard.started:
        guard.check("before the study", start=True)
        guard.refuse_start()
    elif guard.runs_since_check:
        guard.check(f"before {out}")
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str((out / ".jax_cache").resolve()))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    train = _train_args(a)
    local = run_local(a, variants, train, out, env, guard)
    rows = []
    for link in links:
        rows += summarize(a, link, run_link(a, link, variants, train, out, env, guard), local, variants)
    result = {"format": "taco_jax.bench_e2e/3", "run": run, "command": run["command"],
              "config": {**vars(a), "variant": {v: shlex.join(f) for v, f in variants.items()},
                         # the guard's settings (a study passes its own guard)
                         "allow_loaded": guard.allow_loaded, "wait_quiet": guard.wait_s},
              "local": {v: {k: x for k, x in r.items() if k != "emulated_link"} for v, r in local.items()},
              "rows": rows, "note": "timings of a shared/loaded machine are not results; rerun on a quiet one",
              "loaded": guard.loaded, "load_guard": guard.summary()}
    refused = guard.loaded and not guard.allow_loaded
    name = "bench_e2e.loaded" if refused else "bench_e2e"
    jsonio.write(out / f"{name}.json", result)
    lines = markdown(result)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    guard.next_result()
    if refused:
        busy = [c for c in result["load_guard"]["checks"] if load_guard.counts(c)]
        kept = f"; {out / 'bench_e2e.json'} of an earlier run is kept" if (out / "bench_e2e.json").exists() else ""
        load_guard.refuse(f"[bench_e2e] NOT A RESULT: the machine was busier than the study allows "
                          f"({busy[0]['where']}: {'; '.join(busy[0]['reasons'])}). Wrote {out / name}.json "
                          f"(loaded: true), not {out / 'bench_e2e.json'}{kept}. Rerun on a quiet machine, or "
                          "pass --allow-loaded to write it labelled loaded")
    return result

if __name__ == "__main__":
    main()
