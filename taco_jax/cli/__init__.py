"""`taco-jax` command line: `train` (one run), `compare` (exact vs compressed, same seed and data),
`calibrate` (a per-site policy from captured messages), `launch` (N local processes of one run;
docs/distributed.md), `prepare-data` (your corpus as token files), `sample` (generate text), `plan`
(compile a run on a simulated mesh: memory, bytes, predicted speedup) and `predict` (the cost model
alone). Flags and outputs: docs/training.md, docs/plan.md."""

from __future__ import annotations

import gc
import sys
import warnings

from taco_jax.cli import calibrate, launch, plan, prepare_data, sample, train
from taco_jax.cli.common import (  # noqa: F401
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NO_FIT,
    EXIT_RUN_FAILED,
    EXIT_TERMINATED,
    Context,
    Parser,
    error,
    show_warning,
)
from taco_jax.cli.flags import deprecated, train_config, with_config
from taco_jax.train.config import PLAN_UNUSED  # noqa: F401  (where tests and scripts look for it)

#: The command modules, in the order of `taco-jax --help`: each has `NAMES` (its subcommands),
#: `add_parser(sub, explicit)` and `run(args, ctx) -> exit status`.
COMMANDS = (train, plan, launch, calibrate, prepare_data, sample)
#: Subcommand -> its module.
MODULES = {name: module for module in COMMANDS for name in module.NAMES}
#: The subcommands whose flags are `train`'s settings: `--config FILE` applies to them.
FLAG_COMMANDS = ("train", "compare", "plan", "predict")


def _parser(explicit: bool = False):
    """The command line. `explicit`: the `train` / `compare` flags without defaults (which were given)."""
    from taco_jax import __version__

    p = Parser(prog="taco-jax", description=__doc__, allow_abbrev=False)  # a typo is no other flag
    p.add_argument("--version", action="version", version=f"taco-jax {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_parser(sub, explicit)
    for parser in sub.choices.values():  # no abbreviations anywhere: a typo or prefix is refused, not another flag
        parser.allow_abbrev = False
    p.flag_parsers = {name: sub.choices[name] for name in FLAG_COMMANDS}
    return p


def config_from_argv(argv: list[str]):
    """The `TrainConfig` that `taco-jax train ARGV...` / `compare ARGV...` would run (flags and
    `--config FILE` applied; nothing started). Raises ValueError naming a bad value; SystemExit for
    a malformed command line (as argparse)."""
    parser = _parser()
    args, file_policy, note = with_config(parser, parser.parse_args(argv), argv, _parser)
    cfg = train_config(args, file_policy)
    deprecated(note)
    return cfg


def main(argv=None, *, own_process: bool = False) -> int:
    """Runs `taco-jax ARGV...` (default: the process's arguments); returns the exit status.
    `own_process`: the command is the whole process (`run`), so the objects of the modules it
    imports are frozen before a run (`gc.freeze`: they live as long as the process, and the
    collector then walks only what the run creates); an in-process caller's objects are left alone."""
    parser = _parser()
    args = parser.parse_args(argv)
    if warnings.showwarning is not show_warning:  # a flag with no effect: one line, as the CLI's own warnings
        show_warning.python = warnings.showwarning
        warnings.showwarning = show_warning
    ctx = Context(parser, argv, own_process, _parser, config_from_argv)
    if args.command in FLAG_COMMANDS:
        try:
            args, ctx.file_policy, ctx.note = with_config(parser, args, argv, _parser)
        except ValueError as e:
            return error(e, EXIT_BAD_INPUT)
    return MODULES[args.command].run(args, ctx)


def run() -> None:
    """The `taco-jax` command (and `python -m taco_jax`, `python -m taco_jax.cli`): `main(own_process=True)`
    with the process's arguments, its status the exit status. The objects still alive then are frozen
    (`gc.freeze`) before the exit: the interpreter's garbage collections during its shutdown would
    otherwise walk every object of jax, the models and the run (about a CPU second after a tiny run)
    only to free memory the process hands back to the OS anyway. Objects are still released by
    reference counting and exit handlers run as usual; `main` without `own_process` (in-process
    callers: tests, scripts) freezes nothing."""
    from taco_jax.train.deviceless import keep_jax_on_cpu

    keep_jax_on_cpu()  # the CUDA plugin of `.[gpu-compile]` on a machine without a GPU
    status = main(own_process=True)
    gc.freeze()
    sys.exit(status)

