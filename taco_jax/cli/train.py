"""`taco-jax train` and `taco-jax compare` (exact vs compressed): one set of flags, one runner."""

from __future__ import annotations

import gc
import os
import sys

from taco_jax.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    EXIT_TERMINATED,
    HelpFormatter,
    error,
    force_cpu_devices,
    say,
)
from taco_jax.cli.flags import add_flag, deprecated, train_config

NAMES = ("train", "compare")

#: The first lines of `taco-jax train --help` / `compare --help`.
DESCRIPTIONS = {
    "train": "taco-jax train: train one model; writes --out (metrics.jsonl, summary.json, config.json, loss.png, "
             "checkpoints/; docs/training.md).",
    "compare": "taco-jax compare: train the same model twice, same seed and data order: exact on every axis into "
               "OUT/none/, then with the codec flags' policy into OUT/taco/ (whatever its codecs); each folder is a "
               "train run's. Then OUT/loss.png (both losses) and OUT/summary.json (both val losses, wire bytes and "
               "their ratio per mesh axis). OUT is --out.",
}


def add_parser(sub, explicit: bool = False) -> None:
    """The `train` and `compare` subcommands; `explicit`: their flags without defaults."""
    from taco_jax.train.config import flags

    for name, help_ in (("train", "train one model"),
                        ("compare", "train exact (every axis), then with the codec flags' policy; plot both")):
        sp = sub.add_parser(name, help=help_, formatter_class=HelpFormatter,
                            allow_abbrev=False, description=DESCRIPTIONS[name],
                            epilog="Precedence of the codec flags (later wins): --comm and its codec flags, "
                                   "--dp-comm / --pp-comm; --policy FILE (the sites it names); --site. "
                                   "--capture works on data × tensor meshes only (not with stage > 1 or "
                                   "microbatches > 1). Outputs are strict JSON (NaN/Inf as strings).")
        sp.add_argument("--config", default="", metavar="FILE",
                        help="flag values from a TOML file (flag = value; or a run's config.json): the flags "
                             "given on the command line win; docs/training.md")
        for flag in flags():
            add_flag(sp, flag, explicit)
        sp.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
        sp.add_argument("--distributed", action="store_true",
                        help="multi-process run; unset --coordinator / --num-processes / --process-id are "
                             "auto-detected by JAX (SLURM, Open MPI, ...); docs/distributed.md")
        sp.add_argument("--coordinator", default="", metavar="HOST:PORT",
                        help="coordinator of a multi-process run (process 0's host; empty: "
                             "$JAX_COORDINATOR_ADDRESS; default: %(default)r)")
        sp.add_argument("--num-processes", type=int, default=0,
                        help="process count (0: $JAX_NUM_PROCESSES; default: %(default)s)")
        sp.add_argument("--process-id", type=int, default=-1,
                        help="this process, 0..N-1 (-1: $JAX_PROCESS_ID; default: %(default)s)")


def _interrupted(cfg) -> str:
    """The line of a run stopped by Ctrl-C: where its latest checkpoint is (and how to go on), or how
    to stop with one."""
    import pathlib

    ckpt = pathlib.Path(cfg.checkpoint.out) / "checkpoints"
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []
    if saved:
        return (f"interrupted (Ctrl-C); the latest checkpoint is {ckpt / str(saved[-1])}: give --resume to "
                "continue from it")
    return ("interrupted (Ctrl-C) before any checkpoint; SIGTERM (kill PID) instead checkpoints and stops, and "
            "--checkpoint-every N saves along the way")



def run(args, ctx) -> int:
    """Trains (`compare`: exact, then with the policy) and prints the summary; returns the exit status."""
    from taco_jax.train import distributed

    try:
        dist = distributed.DistConfig.resolve(args.coordinator, args.num_processes, args.process_id,
                                              auto=args.distributed)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    processes = dist.num_processes if dist else 1  # 0: auto-detected (--distributed), not known here
    wins = f"--mesh {args.mesh}" + (f" over --num-processes {processes}" if processes > 1 else "")
    force_cpu_devices(args.mesh, processes, wins=wins if ctx.own_process and processes else "")
    try:
        cfg = train_config(args, ctx.file_policy)  # validates every value before anything runs
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    deprecated(ctx.note)
    import jax

    if dist is not None:
        try:
            distributed.initialize(dist)  # gloo for CPU collectives, then jax.distributed.initialize
        except ValueError as e:  # the coordinator's address in use (checked before the service starts)
            return error(e, EXIT_BAD_INPUT)
    from taco_jax.train import hooks
    from taco_jax.train.compare import compare
    from taco_jax.train.loop import train
    from taco_jax.util.console import summary_block

    if ctx.own_process:
        gc.freeze()
    try:
        result = train(cfg, progress=not args.no_progress) if args.command == "train" else \
            compare(cfg, progress=not args.no_progress)
    except ValueError as e:  # a configuration or output folder that cannot run (before training)
        return error(e, EXIT_BAD_INPUT)
    except FloatingPointError as e:  # non-finite loss, or a codec with nonfinite="error"
        return error(e, EXIT_RUN_FAILED)
    except KeyboardInterrupt:  # Ctrl-C: one line (no traceback) saying what is kept
        say(f"taco-jax: {_interrupted(cfg)}")
        return EXIT_INTERRUPTED
    except hooks.Stopped as e:  # SIGTERM before the first step (one process): one line saying what is kept
        say(f"taco-jax: {e}")
        if ctx.own_process:  # a compilation cut short goes on in XLA's threads, which the interpreter's exit would
            sys.stdout.flush()  # meet half-done (SIGSEGV seen): the process ends here
            os._exit(EXIT_TERMINATED)
        return EXIT_TERMINATED
    if jax.process_index() == 0:  # one summary per run: its key numbers (the rest in summary.json)
        sys.stdout.write(summary_block(result, cfg.checkpoint.out) + "\n")
        sys.stdout.flush()
    return 0
