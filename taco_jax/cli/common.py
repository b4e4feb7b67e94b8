"""What every `taco-jax` command shares: exit statuses, parser, help format, stderr lines, CPU mesh."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Callable

#: Exit status of a run that started but failed (non-finite loss, a codec's nonfinite="error").
EXIT_RUN_FAILED = 1
#: Exit status of a command refused before it ran (bad flag value, unwritable --out, ...).
EXIT_BAD_INPUT = 2
#: Exit status of `plan --compiler gpu` whose step does not fit the GPU's memory (plan.json and plan.md written).
EXIT_NO_FIT = 3
#: Exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130
#: Exit status of a run stopped by SIGTERM before its first step (128 + SIGTERM, as a shell reports it).
EXIT_TERMINATED = 143


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line naming the bad flag and where the help is, not
    the whole usage (`train` has over a hundred flags); exit status 2 as argparse's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (all flags: {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but flags no subcommand knows are refused by that subcommand's parser (its
        name and help in the error), with the closest flag it has (difflib) where one is close."""
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = next((a.choices[args.command] for a in self._actions
                        if isinstance(a, argparse._SubParsersAction) and getattr(args, "command", None) in a.choices),
                       self)
            flags = [o for a in sub._actions for o in a.option_strings]
            close = [closest_flag(e.split("=")[0], flags) for e in extras if e.startswith("-")]
            hint = "; ".join(f"did you mean {c[0]}?" for c in close if c)
            sub.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({hint})" if hint else ""))
        return args


def closest_flag(typed: str, flags: list[str]) -> list[str]:
    """[the flag `typed` most likely means] or []: the only flag it begins (`--pin` -> `--pin-cpus`; the
    parsers take no abbreviations), else difflib's closest."""
    starts = [f for f in flags if f.startswith(typed)]
    return starts if len(starts) == 1 else difflib.get_close_matches(typed, flags, n=1)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: ...)" after each flag's help, except where the help states its default
    or the default is empty ("" or None: the flag is off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in ("", None) or re.search(r"\bdefault\b", text):
            return text
        return super()._get_help_string(action)

def say(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write per line: lines of several processes never interleave
    sys.stderr.flush()



def error(e: Exception, status: int) -> int:
    say(f"taco-jax: error: {e}")
    return status


def force_cpu_devices(mesh: str, processes: int = 1, wins: str = "") -> None:
    """A simulated CPU mesh needs its device count (mesh size / `processes`) in XLA_FLAGS before jax
    creates its CPU backend (at the first device query, not at `import jax`; importing the config
    imports jax already). Harmless on GPU. A malformed --mesh is left to the config, which names it.
    `wins`: the flag asking for that count (e.g. "--devices 16"), which beats another count in
    XLA_FLAGS (an exported one): replaced, in one line naming both, the other XLA_FLAGS entries kept.
    Empty: a count already there is kept (`main` without `own_process`: the caller's process, whose
    jax may have started)."""
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.train.distributed import DEVICE_COUNT_FLAG, with_device_count

    try:
        sizes = parse_mesh(mesh).values()
    except ValueError:
        return
    n = 1
    for v in sizes:
        n *= v
    n //= max(processes, 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if not n or (DEVICE_COUNT_FLAG in flags and not wins):
        return
    os.environ["XLA_FLAGS"], old = with_device_count(flags, n)
    if old is not None:
        say(f"[taco-jax] warning: $XLA_FLAGS sets {DEVICE_COUNT_FLAG}={old}; replaced by {n}, as {wins} asks "
             "(the other XLA_FLAGS entries are kept)")



def show_warning(message, category, *rest, **kw):
    """warnings.showwarning of the command line: a `FlagWarning` as "[taco-jax] warning: ..." on
    stderr, once per process (a config is checked again where a command derives one from it); any
    other warning as Python shows it."""
    from taco_jax.train.settings import FlagWarning

    if issubclass(category, FlagWarning):
        if str(message) not in show_warning.shown:
            show_warning.shown.add(str(message))
            print(f"[taco-jax] warning: {message}", file=sys.stderr, flush=True)
    else:
        show_warning.python(message, category, *rest, **kw)


show_warning.shown = set()



@dataclasses.dataclass
class Context:
    """What `run(args, ctx)` may need besides its flags: the `parser`, `argv` (None: the process's),
    `own_process` (`cli.main`), `parser_of` / `config_of` (`cli._parser`, `cli.config_from_argv`),
    the `--config` file's policy table (`file_policy`) and deprecation line (`note`)."""

    parser: argparse.ArgumentParser
    argv: list[str] | None
    own_process: bool
    parser_of: Callable
    config_of: Callable
    file_policy: dict | None = None
    note: str = ""
