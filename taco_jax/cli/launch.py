"""`taco-jax launch`: N local processes of one run, optionally behind emulated links."""

from __future__ import annotations

import argparse

from taco_jax.cli.common import EXIT_BAD_INPUT, error

NAMES = ("launch",)


def add_parser(sub, explicit: bool = False) -> None:
    """The `launch` subcommand (`explicit` is unused: no flag of it is a setting)."""
    lp = sub.add_parser("launch", help="run a command as N local processes of one multi-process run (development)",
                        usage="taco-jax launch --processes N [--link RATE | --link intra=RATE,inter=RATE --nodes K] "
                              "[--pin-cpus] [--stop-grace S] [--verbose] -- train [flags ...]\n       taco-jax launch "
                              "--cleanup",
                        allow_abbrev=False)
    lp.add_argument("--processes", type=int, default=0, help="number of local processes")
    lp.add_argument("--link", default=None, metavar="RATE|intra=RATE,inter=RATE",
                    help="emulated cluster: each process in its own network namespace, links shaped to RATE "
                         "(e.g. 1gbit, 100mbit; root only; docs/distributed.md)")
    lp.add_argument("--nodes", type=int, default=0, help="with --link intra=...,inter=...: processes in K nodes")
    lp.add_argument("--cleanup", action="store_true",
                    help="remove the namespaces and hosts files of emulated clusters whose launcher is gone")
    lp.add_argument("--verbose", action="store_true",
                    help="show every line of the processes (also gloo's \"[Gloo] Rank I is connected\" lines)")
    lp.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="keep: the processes' glibc keeps freed memory for reuse instead of mapping large "
                         "buffers anew (GLIBC_TUNABLES, unless already set); default: leave the allocator alone")
    lp.add_argument("--pin-cpus", action="store_true",
                    help="run each process on its own share of the CPUs this launcher may use, as each rank owns "
                         "its GPU: contiguous shares of the sorted CPU list, the first (CPUs mod processes) one CPU "
                         "larger; with more processes than CPUs, process i gets the (i mod CPUs)-th and they share. "
                         "The shares are printed; the codec's thread pool sizes to its share. Default: every "
                         "process on every CPU")
    lp.add_argument("--stop-grace", type=float, default=None, metavar="S",
                    help="seconds the processes get after a SIGTERM or Ctrl-C to the launcher (forwarded to them: "
                         "a checkpoint at the next step) before the launcher kills those still running (SIGKILL), "
                         "removes the namespaces and says what the run kept (default: 30, launch.STOP_GRACE_S)")
    lp.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command for every process (train / compare)")


def run(args, ctx) -> int:
    """Runs the processes (or `--cleanup`); returns the exit status."""
    from taco_jax import emulate
    from taco_jax.launch import launch

    try:
        if args.cleanup:
            emulate.check_available()
            print(f"[launch] removed {len(emulate.cleanup_stale())} stale namespaces; "
                  f"{len(emulate.list_namespaces())} of running launchers left")
            return 0
        if args.processes < 1:
            raise ValueError(f"--processes {args.processes} must be >= 1")
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        known = next(a.choices for a in ctx.parser._actions if isinstance(a, argparse._SubParsersAction))
        own = {o for a in known["launch"]._actions for o in a.option_strings} - {"-h", "--help"}
        misplaced = next((a for a in command if a.split("=")[0] in own), None)
        if misplaced is not None:  # no command takes a launch flag: it was meant for the launcher
            flag = misplaced.split("=")[0]
            raise ValueError(f"launch: {flag} is a flag of `taco-jax launch`, not of the command after `--`; "
                             "put it before `--` (taco-jax launch [launch flags] -- train ...)")
        if command and not command[0].startswith("-") and command[0] not in known:  # before any process starts
            raise ValueError(f"launch: {command[0]!r} is not a taco-jax command; e.g. taco-jax launch --processes "
                             "2 -- train --steps 20")
        return launch(args.processes, command,
                      config_of=ctx.config_of,
                      malloc=args.malloc, link=args.link, nodes=args.nodes, verbose=args.verbose,
                      pin_cpus=args.pin_cpus, stop_grace_s=args.stop_grace)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
