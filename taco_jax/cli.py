"""`taco-jax` command line: `train` (one run), `compare` (exact vs compressed, same seed and data),
`calibrate` (a per-site policy from captured messages), `launch` (N local processes of one run;
docs/distributed.md), `prepare-data` (your corpus as token files), `sample` (generate text), `plan`
(compile a run on a simulated mesh: memory, bytes, predicted speedup) and `predict` (the cost model
alone). Flags and outputs: docs/training.md, docs/plan.md."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import inspect
import math
import os
import re
import sys
import warnings

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


class _Parser(argparse.ArgumentParser):
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
            close = [_closest_flag(e.split("=")[0], flags) for e in extras if e.startswith("-")]
            hint = "; ".join(f"did you mean {c[0]}?" for c in close if c)
            sub.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({hint})" if hint else ""))
        return args


def _closest_flag(typed: str, flags: list[str]) -> list[str]:
    """[the flag `typed` most likely means] or []: the only flag it begins (`--pin` -> `--pin-cpus`; the
    parsers take no abbreviations), else difflib's closest."""
    starts = [f for f in flags if f.startswith(typed)]
    return starts if len(starts) == 1 else difflib.get_close_matches(typed, flags, n=1)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: ...)" after each flag's help, except where the help states its default
    or the default is empty ("" or None: the flag is off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in ("", None) or re.search(r"\bdefault\b", text):
            return text
        return super()._get_help_string(action)


def _field_help(cls) -> dict[str, str]:
    """`name -> comment` from the `name: type = default  # comment` lines of a dataclass's source
    (the comments are the fields' documentation; simple_parsing reads help the same way). `cls` is a
    top-level class: its source runs from its `class NAME` line in its module's text to the next
    unindented line (`inspect.getsource(cls)` would parse the whole module again for every class)."""
    text = inspect.getsource(sys.modules[cls.__module__])
    src = re.search(rf"^class {cls.__name__}\b.*?(?=^\S|\Z)", text, flags=re.M | re.S)[0]
    line = re.compile(r"^\s+(\w+): [^=\n]+=[^#\n]*#\s*(.+)$", flags=re.M)
    return {m[1]: m[2].strip().replace("%", "%%") for m in line.finditer(src)}  # argparse %-formats help


def _flag_fields():
    """(flag, dataclass, field) of every `train` / `compare` flag, in the order of `--help`: those
    `TrainConfig` stores (`config.FLAGS`: a field of one of its sections), then `CommFlags`'s
    (mapped to the policy by `TrainConfig.from_flags`)."""
    from taco_jax.train.config import FLAGS, SECTIONS, CommFlags

    fields = {cls: {f.name: f for f in dataclasses.fields(cls)} for cls in SECTIONS.values()}
    return [(flag, SECTIONS[s], fields[SECTIONS[s]][f]) for flag, (s, f) in FLAGS.items()] + \
        [(f.name, CommFlags, f) for f in dataclasses.fields(CommFlags)]


def _or_auto(name: str, convert, ok, need: str, show=repr):
    """argparse type of a flag that takes "auto" or a number `convert(text)` with `ok(number)`; a bad
    value is reported by argparse (exit 2) naming it: "{name}={value} must be {need} or 'auto'"."""

    def parse(text: str):
        if text == "auto":
            return text
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r} must be {need} or 'auto'") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{name}={show(value) if show else repr(text)} must be {need} or 'auto'")
        return value

    return parse


def _int_or_auto(name: str, low: int):
    """argparse type of a flag that takes "auto" or an integer >= `low`."""
    return _or_auto(name, int, lambda v: v >= low, f"an integer >= {low}", show=str)


#: argparse type of --step-timeout: "auto" or seconds >= 0 (finite).
_seconds_or_auto = _or_auto("step_timeout", float, lambda v: 0 <= v < float("inf"), "seconds >= 0", show=None)


def _add_flag(sp, name, cls, f, helps, explicit: bool = False, hidden: bool = False) -> None:
    """Adds flag `name` (field `f` of `cls`) to `sp` (a parser or an argument group); `explicit`: no
    default (the namespace then holds only given flags); `hidden`: accepted but not listed by --help."""
    from taco_jax.codec.config import TRANSPORTS
    from taco_jax.models import PRESETS

    flag = "--" + name.replace("_", "-")
    help_ = argparse.SUPPRESS if hidden else helps[cls].get(f.name, "")
    default = argparse.SUPPRESS if explicit else ([] if name == "site" else f.default)
    if name == "site":
        sp.add_argument(flag, action="append", default=default, metavar="SITE:FIELD=VALUE,...", help=help_)
    elif f.type in ("bool", bool):
        sp.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
    elif name == "min_bytes":  # an integer or "auto" (taco_jax.perf.resolve_min_bytes)
        sp.add_argument(flag, type=_int_or_auto("min_bytes", 0), default=default, metavar="BYTES|auto", help=help_)
    elif name == "chunks":  # an integer or "auto" (collectives.compressed.auto_chunks)
        sp.add_argument(flag, type=_int_or_auto("chunks", 1), default=default, metavar="K|auto", help=help_)
    elif name == "policy_file":  # `train --policy FILE`; --policy-file: the same flag (field name)
        sp.add_argument("--policy", flag, dest=name, default=default, metavar="FILE", help=help_)
    elif name == "step_timeout":  # seconds or "auto" (train.distributed.StepWatchdog)
        sp.add_argument(flag, type=_seconds_or_auto, default=default, metavar="S|auto", help=help_)
    elif name == "transport":  # codec.config.TRANSPORTS
        sp.add_argument(flag, default=default, choices=TRANSPORTS, help=help_)
    elif name == "model":
        sp.add_argument(flag, default=default, choices=sorted(PRESETS), metavar="PRESET",
                        help=help_ if hidden else f"{help_}: {', '.join(sorted(PRESETS))}")
    else:
        sp.add_argument(flag, type=type(f.default), default=default, help=help_)


def _parser(explicit: bool = False) -> argparse.ArgumentParser:
    """The command line. `explicit`: the `train` / `compare` flags without defaults (which were given)."""
    from taco_jax import __version__
    from taco_jax.train.calibrate import DEFAULT_BUDGET
    from taco_jax.train.config import SECTIONS, CommFlags

    p = _Parser(prog="taco-jax", description=__doc__, allow_abbrev=False)  # a typo is no other flag
    p.add_argument("--version", action="version", version=f"taco-jax {__version__}")
    helps = {cls: _field_help(cls) for cls in (*SECTIONS.values(), CommFlags)}
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train one model"),
                        ("compare", "train exact (every axis), then with the codec flags' policy; plot both")):
        sp = sub.add_parser(name, help=help_, formatter_class=_HelpFormatter,
                            allow_abbrev=False, description=DESCRIPTIONS[name],
                            epilog="Precedence of the codec flags (later wins): --comm and its codec flags, "
                                   "--dp-comm / --pp-comm; --policy FILE (the sites it names); --site. "
                                   "--capture works on data × tensor meshes only (not with stage > 1 or "
                                   "microbatches > 1). Outputs are strict JSON (NaN/Inf as strings).")
        sp.add_argument("--config", default="", metavar="FILE",
                        help="flag values from a TOML file (flag = value; or a run's config.json): the flags "
                             "given on the command line win; docs/training.md")
        for flag, cls, f in _flag_fields():
            _add_flag(sp, flag, cls, f, helps, explicit)
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
    _add_plan(sub, helps, explicit)
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
    cal = sub.add_parser("calibrate", help="choose a codec per TP site from captured messages (train --capture N)",
                         formatter_class=_HelpFormatter, allow_abbrev=False)
    cal.add_argument("--captures", required=True, help="<run>/captures folder written by `train --capture N`")
    cal.add_argument("--out", default="policy.json", help="policy file to write (for `train --policy FILE`)")
    cal.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                     help="max wire bytes per element of a chosen codec (= TACO's E4M3 G=128 dual codec)")
    cal.add_argument("--max-messages", type=int, default=16,
                     help="messages per site in each split (0: all of them; memory and time grow with it)")
    cal.add_argument("--kinds", nargs="+", default=None, help="restrict the candidates to these codec kinds")
    _add_data_and_sample(sub)
    for parser in sub.choices.values():  # no abbreviations anywhere: a typo or prefix is refused, not another flag
        parser.allow_abbrev = False
    p.flag_parsers = {name: sub.choices[name] for name in ("train", "compare", "plan", "predict")}
    return p


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r} must be an integer >= 1") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}={value} must be an integer >= 1")
        return value

    return parse


#: `train` flags that `plan` / `predict` accept (a train --config file works as it is) but do not use
#: (steps, optimization, evaluation, checkpoints, logging, monitoring): not listed by their --help.
#: The line above `predict --paper`'s table: what its numbers are.
PAPER_NOTE = ("cost-model predictions, not measurements (taco_jax/perf/model.py: MFU 0.40, 80 % of datasheet link "
              "bandwidth, the H200-measured codec speed); range: the model's error against the emulated cluster and "
              "COCCL applied to the prediction; published: the measured speed-up the setting is checked against "
              "(docs/emulated.md)")
#: The first lines of `taco-jax train --help` / `compare --help`.
DESCRIPTIONS = {
    "train": "taco-jax train: train one model; writes --out (metrics.jsonl, summary.json, config.json, loss.png, "
             "checkpoints/; docs/training.md).",
    "compare": "taco-jax compare: train the same model twice, same seed and data order: exact on every axis into "
               "OUT/none/, then with the codec flags' policy into OUT/taco/ (whatever its codecs); each folder is a "
               "train run's. Then OUT/loss.png (both losses) and OUT/summary.json (both val losses, wire bytes and "
               "their ratio per mesh axis). OUT is --out.",
}
PLAN_UNUSED = frozenset({
    "steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "adam_b1", "adam_b2", "seed",
    "eval_every", "eval_batches", "export_hf", "allow_nonfinite", "log_every", "capture", "monitor_every",
    "monitor_warn_sqnr", "monitor_min_sqnr", "checkpoint_every", "final_checkpoint", "keep_checkpoints", "resume",
    "resume_fallback", "step_timeout", "emulated_link", "profile_steps", "profile_dir", "tensorboard",
    "overwrite_export"})


def _add_plan(sub, helps, explicit: bool) -> None:
    """The `plan` and `predict` subcommands: `train`'s flags that shape the run (listed; the others
    accepted, `PLAN_UNUSED`) plus the hardware and layout (docs/plan.md)."""
    for name, help_ in (("plan", "compile a run on a simulated mesh without allocating it: per-device memory, wire "
                                 "bytes per axis and site, TACO ops per site, predicted speedup on GPUs"),
                        ("predict", "the cost model alone (about a second): step time exact vs the policy per axis, "
                                    "speedup with its range, --min-bytes auto per site")):
        sp = sub.add_parser(name, help=help_, description=f"taco-jax {name}: {help_}.", formatter_class=_HelpFormatter,
                            allow_abbrev=False, epilog="train's other flags (steps, optimization, evaluation, "
                            "checkpoints, logging) are accepted and unused, so a train --config file works as it is"
                            + ("; plan writes plan.json and plan.md to --out" if name == "plan" else "")
                            + ". docs/plan.md")
        sp.add_argument("--config", default="", metavar="FILE", help="flag values from a TOML file (as train)")
        run = sp.add_argument_group("the run (train's flags that shape the program)")
        comm = sp.add_argument_group("communication (as train)")
        own = sp.add_argument_group(f"{name}: hardware and output")
        for flag, cls, f in _flag_fields():
            hidden = flag in PLAN_UNUSED or (flag == "out" and name == "predict")
            group = own if flag == "out" else comm if cls.__name__ in ("CommFlags", "CommunicationSection") else run
            _add_flag(group, flag, cls, f, helps, explicit, hidden=hidden)
        own.add_argument("--hardware", default="", metavar="NAME",
                         help="declared hardware (taco_jax/perf/hardware.toml: h100, h200, h800, a100, b200, l40s; "
                              "or an entry of --hardware-file); empty: h200, or the file's one entry")
        own.add_argument("--hardware-file", default="", metavar="FILE",
                         help="your own cluster: a TOML file with hardware.toml's schema (docs/plan.md)")
        own.add_argument("--tp-span-nodes", type=_positive_int("tp_span_nodes"), default=None, metavar="K",
                         help="tensor-parallel groups span K nodes (TP over the inter-node link); default: "
                              "inside a node while they fit")
        own.add_argument("--layers", type=_positive_int("layers"), default=None, metavar="L",
                         help="override the model's depth (decoder layers)")
        own.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
        own.add_argument("--devices", type=_positive_int("devices"), default=None, metavar="N",
                         help="devices of the run (default: the mesh size; must equal it)"
                              + ("; plan simulates that many CPU devices" if name == "plan" else ""))
        if name == "plan":
            own.add_argument("--no-compile", action="store_true", help="the cost model only (= predict)")
            own.add_argument("--compiler", choices=("auto", "gpu", "cpu"), default="auto",
                             help="gpu: XLA:GPU compiles the step for --hardware's GPU, no GPU needed (`pip install "
                                  "-e '.[gpu-compile]'`), with a memory verdict (exit 3 when it does not fit); cpu: "
                                  "XLA:CPU on simulated devices; auto: gpu when the CUDA plugin is installed")
            own.add_argument("--extrapolate", action="store_true",
                             help="compile two shallow copies (one and two layers per stage) instead of the whole "
                                  "model and extrapolate the peak memory to its depth (minutes sooner for deep models)")
            sp.set_defaults(out="runs/plan")
        else:
            own.add_argument("--paper", action="store_true",
                             help="the model's GPU table of docs/emulated.md (the paper's settings on each TP link)")


def _config_values(sp: argparse.ArgumentParser, path: str) -> tuple[dict, dict | None]:
    """The values of `--config path` as `sp`'s defaults (each checked and typed like its flag) and
    the file's "policy" table (None without one). Raises ValueError naming the file and the
    unknown key or bad value."""
    from taco_jax.train.config import FLAGS, CommFlags, read_config_file

    actions = {a.dest: a for a in sp._actions if a.dest not in ("help", "config")}
    comm = {f.name for f in dataclasses.fields(CommFlags)}
    values, policy = {}, None
    command = sp.prog.split()[-1]
    for key, value in read_config_file(path).items():
        table = FLAGS.get(key) or (("communication", key) if key in comm else None)  # its table, as the file gives it
        where = f"--config {path!r}: " + (f"[{table[0]}] {table[1]}" if table else key) + f"={value!r}"
        if key == "policy" and isinstance(value, dict):
            policy = value
            continue
        if key == "policy" and "policy_file" in actions:  # `policy = "FILE"`, as the flag --policy FILE
            key = "policy_file"
        if key == "out" and command in ("plan", "predict"):  # a train file's run folder: plan writes to its own --out
            continue
        if key not in actions:
            close = difflib.get_close_matches(key, actions, n=1)
            raise ValueError(f"--config {path!r}: unknown key {key!r} (not a flag of {command}"
                             + (f"; did you mean {close[0]!r}?)" if close else ")"))
        values[key] = _typed(actions[key], value, where)
    return values, policy


def _typed(action: argparse.Action, value, where: str):
    """`value` (from a config file) checked as `action`'s flag would check its text. Raises ValueError."""
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"{where} must be a string or a list of strings")
        return list(items)
    if isinstance(value, bool | dict | list) or value is None:
        raise ValueError(f"{where} must be a single {getattr(action.type, '__name__', 'value')}")
    if action.type is float and isinstance(value, int | float | str):
        try:  # text only for what TOML and strict JSON cannot write as numbers: "Infinity", "-Infinity", "NaN"
            number = float(value)
            if isinstance(value, str) and math.isfinite(number):
                raise ValueError(value)
            value = number
        except ValueError:
            raise ValueError(f"{where} must be a number (not text)") from None
    elif action.type is int and not isinstance(value, int):
        raise ValueError(f"{where} must be an integer")
    elif action.type in (str, None) and not isinstance(value, str):
        raise ValueError(f"{where} must be a string")
    elif action.type not in (int, float, str, None):  # e.g. an integer or "auto"
        try:
            value = action.type(str(value))
        except argparse.ArgumentTypeError as e:  # "min_bytes=-3 must be ...": the value is in `where` already
            rule = re.sub(r"^[a-z_]+=\S+ ", "", str(e))
            raise ValueError(f"{where} {rule}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} is not one of {', '.join(map(str, action.choices))}")
    return value


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write per line: lines of several processes never interleave
    sys.stderr.flush()


def _add_data_and_sample(sub) -> None:
    """The `prepare-data` and `sample` subcommands (docs/training.md, "Continue pre-training")."""
    fmt = _HelpFormatter
    pd = sub.add_parser("prepare-data", formatter_class=fmt,
                        help="tokenize text / JSONL files into train.bin, val.bin, meta.json (for train --data)")
    pd.add_argument("inputs", nargs="+", help="text files, folders of them (.txt/.md/.text/.jsonl), JSONL files")
    pd.add_argument("--out", required=True, help="folder to write (train.bin, val.bin, tokenizer.json, meta.json)")
    pd.add_argument("--tokenizer", default="", help="a tokenizers JSON file (an HF tokenizer.json) to encode with")
    pd.add_argument("--init-from", default="", help="HF checkpoint folder whose tokenizer.json to encode with")
    pd.add_argument("--vocab-size", type=int, default=0,
                    help="without --tokenizer / --init-from: train a byte-level BPE of this size (0: 2048)")
    pd.add_argument("--text-field", default="text", help="JSONL: the field holding each document's text")
    pd.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of the token stream held out")
    pd.add_argument("--eot-token", default="<|endoftext|>", help="token appended after every document")
    pd.add_argument("--no-progress", action="store_true", help="no progress bar")
    sa = sub.add_parser("sample", formatter_class=fmt, help="generate text from a run folder or an HF checkpoint")
    sa.add_argument("--from", dest="source", required=True, metavar="RUN_DIR|HF_DIR",
                    help="a run's --out folder (its --export-hf, else its latest checkpoint) or an HF checkpoint")
    sa.add_argument("--prompt", required=True, help="text to continue (encoded with the run's own tokenizer)")
    sa.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample from softmax(logits / T)")
    sa.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    sa.add_argument("--seed", type=int, default=0, help="random seed of the samples")


def _error(e: Exception, status: int) -> int:
    _say(f"taco-jax: error: {e}")
    return status


def _force_cpu_devices(mesh: str, processes: int = 1, wins: str = "") -> None:
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
        _say(f"[taco-jax] warning: $XLA_FLAGS sets {DEVICE_COUNT_FLAG}={old}; replaced by {n}, as {wins} asks "
             "(the other XLA_FLAGS entries are kept)")


def _data_or_sample(args) -> int:
    import json

    try:
        if args.command == "prepare-data":
            from taco_jax.data import prepare_data

            meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, init_from=args.init_from,
                                vocab_size=args.vocab_size, text_field=args.text_field,
                                val_fraction=args.val_fraction, eot_token=args.eot_token,
                                progress=not args.no_progress)
            print(json.dumps({k: v for k, v in meta.items() if k != "sources"} | {"sources": len(meta["sources"])},
                             indent=2))
            return 0
        from taco_jax.train.sample import sample

        for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k)):
            if v < 0:
                raise ValueError(f"{flag} {v} must be an integer >= 0")
        if not (args.temperature >= 0 and math.isfinite(args.temperature)):
            raise ValueError(f"--temperature {args.temperature} must be a finite number >= 0")
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"--seed {args.seed} must be in [0, 2**63) (JAX's seeds)")
        print(sample(args.source, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                     seed=args.seed))
        return 0
    except ValueError as e:
        return _error(e, EXIT_BAD_INPUT)


def _show_warning(message, category, *rest, **kw):
    """warnings.showwarning of the command line: a `FlagWarning` as "[taco-jax] warning: ..." on
    stderr, once per process (a config is checked again where a command derives one from it); any
    other warning as Python shows it."""
    from taco_jax.train.config import FlagWarning

    if issubclass(category, FlagWarning):
        if str(message) not in _show_warning.shown:
            _show_warning.shown.add(str(message))
            print(f"[taco-jax] warning: {message}", file=sys.stderr, flush=True)
    else:
        _show_warning.python(message, category, *rest, **kw)


_show_warning.shown = set()


def main(argv=None, *, own_process: bool = False) -> int:
    """Runs `taco-jax ARGV...` (default: the process's arguments); returns the exit status.
    `own_process`: the command is the whole process (`run`), so the objects of the modules it
    imports are frozen before a run (`gc.freeze`: they live as long as the process, and the
    collector then walks only what the run creates); an in-process caller's objects are left alone."""
    parser = _parser()
    args = parser.parse_args(argv)
    from taco_jax.util import jsonio

    if warnings.showwarning is not _show_warning:  # a flag with no effect: one line, as the CLI's own warnings
        _show_warning.python = warnings.showwarning
        warnings.showwarning = _show_warning

    if args.command == "calibrate":  # one host device; no mesh
        from taco_jax.train.calibrate import main_args

        try:
            if args.max_messages < 0:  # named as the flag (calibrate() names its keyword)
                raise ValueError(f"--max-messages {args.max_messages} must be >= 0 (messages per site in each split; "
                                 "0: all of them)")
            if not args.budget > 0:
                raise ValueError(f"--budget {args.budget:g} must be > 0 (wire bytes per element)")
            result = main_args(args.captures, args.out, args.budget, args.max_messages, args.kinds)
        except ValueError as e:
            return _error(e, EXIT_BAD_INPUT)
        print(jsonio.dumps(result, indent=2))
        return 0
    if args.command in ("prepare-data", "sample"):  # one host device; no mesh
        return _data_or_sample(args)
    if args.command == "launch":
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
            known = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
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
                          config_of=config_from_argv,
                          malloc=args.malloc, link=args.link, nodes=args.nodes, verbose=args.verbose,
                          pin_cpus=args.pin_cpus, stop_grace_s=args.stop_grace)
        except ValueError as e:
            return _error(e, EXIT_BAD_INPUT)
    try:
        args, file_policy = _with_config(parser, args, argv)
    except ValueError as e:
        return _error(e, EXIT_BAD_INPUT)
    if args.command in ("plan", "predict"):
        if args.command == "predict" and args.paper:  # its settings are fixed: another flag would be ignored
            typed = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
            given = sorted(typed - {"--paper", "--json", "--config"})
            if args.config:  # the file's own settings, named as their flags (a file holding only paper = true is fine)
                values, policy = _config_values(parser.flag_parsers["predict"], args.config)
                first = ("--mesh", "--model", "--comm", "--hardware", "--hardware-file", "policy")  # named first
                keys = sorted({"--" + k.replace("_", "-") for k in values} - {"--paper", "--json"}
                              | ({"policy"} if policy is not None else set()),
                              key=lambda k: (first.index(k) if k in first else len(first), k))
                if keys:
                    given.append(f"--config {args.config!r} setting {', '.join(keys[:6])}"
                                 + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
            if given:
                source = "" if "--paper" in typed else f"--config {args.config!r} sets paper = true: "
                return _error(ValueError(f"{source}predict --paper prints the paper's fixed settings and takes no "
                                         f"other flag (got {', '.join(given)}); leave out --paper to predict your own "
                                         "run"),
                              EXIT_BAD_INPUT)
        return _plan(args, file_policy, own_process)
    return _train_or_compare(args, file_policy, own_process)


def _plan(args, file_policy: dict | None, own_process: bool = False) -> int:
    """`taco-jax plan` / `predict` (taco_jax/train/plan.py): checks every value, then prints the table;
    `plan` writes plan.json and plan.md to --out."""
    import json
    import pathlib

    compile_ = args.command == "plan" and not args.no_compile
    wins = (f"--devices {args.devices}" if args.devices else f"--mesh {args.mesh}") if own_process else ""
    if not (args.command == "predict" and args.paper):
        from taco_jax.parallel.mesh import parse_mesh

        try:
            n = 1
            for v in parse_mesh(args.mesh).values():
                n *= v
        except ValueError as e:
            return _error(e, EXIT_BAD_INPUT)
        if args.devices is not None and args.devices != n:
            return _error(ValueError(f"devices={args.devices} differs from the mesh {args.mesh!r} ({n} devices); "
                                     "give the mesh's size"), EXIT_BAD_INPUT)
    compiler = "cpu"
    if compile_:
        from taco_jax.train import deviceless

        compiler, why = args.compiler, deviceless.plugin_error()
        if compiler == "auto":
            compiler = "cpu" if why else "gpu"
        if compiler == "gpu" and why:
            return _error(ValueError(why), EXIT_BAD_INPUT)
        if compiler == "cpu":
            _force_cpu_devices(args.mesh, wins=wins)
    from taco_jax.perf.hardware import get_hardware
    from taco_jax.train import plan as planner

    try:
        if args.command == "predict" and args.paper:
            rows = planner.paper_table()
            print(json.dumps(rows, indent=2) if args.json else "\n".join([PAPER_NOTE, *planner.paper_lines(rows)]))
            return 0
        spec = get_hardware(args.hardware, args.hardware_file or None)
        cfg = planner.with_layers(_train_config(args, file_policy), args.layers)
        if compile_:
            from taco_jax.train.loop import check_out_dir

            out = check_out_dir(args.out)
        devices = None
        if compiler == "gpu":
            if args.compiler == "auto" and spec.target is None:  # the user's entry says nothing of its GPU
                _say(f"plan: hardware {spec.key!r} has no [{spec.key}.target] table: compiling with XLA:CPU")
                _force_cpu_devices(args.mesh, wins=wins)
            else:
                devices = deviceless.gpu_devices(spec, n)
        extrapolate = args.command == "plan" and args.extrapolate
        if extrapolate and devices is None:  # XLA:CPU's peak is no GPU's: nothing to extrapolate for
            raise ValueError("--extrapolate extrapolates XLA:GPU's peak: it needs --compiler gpu (the CUDA plugin and "
                             "a [KEY.target] table), and a compile (not --no-compile)")
        if extrapolate and args.layers is not None:
            raise ValueError(f"--extrapolate compiles shallow copies of the model's own depth; leave out --layers "
                             f"{args.layers}")
        if devices is not None:
            _say(f"plan: XLA:GPU compiles for {spec.hardware.name} on {n} abstract devices (no GPU needed); the CUDA "
                 "plugin's lines \"Could not find cuda drivers on your machine, GPU will not be used\" say just that")
        result = planner.plan(cfg, spec, tp_span_nodes=args.tp_span_nodes, compile=compile_, say=_say,
                              devices=devices, extrapolate=extrapolate)
    except ValueError as e:
        return _error(e, EXIT_BAD_INPUT)
    if args.command == "plan":
        from taco_jax.util import jsonio

        out = pathlib.Path(args.out)
        if (out / "plan.json").exists() or (out / "plan.md").exists():
            _say(f"plan: replacing the previous plan in {out} (give another --out to keep it)")
        out.mkdir(parents=True, exist_ok=True)
        jsonio.write(out / "plan.json", result)
        (out / "plan.md").write_text(planner.markdown(result))
    if args.json:
        from taco_jax.util import jsonio

        print(jsonio.dumps(result, indent=2))
    else:
        print("\n".join(planner.lines(result)))
        if args.command == "plan":
            print(f"written: {pathlib.Path(args.out) / 'plan.json'}, {pathlib.Path(args.out) / 'plan.md'}")
    verdict = result.get("compiled", {}).get("verdict")
    if verdict and verdict["fits"] is False:
        _say(f"plan: the step does not fit the {spec.hardware.name}'s memory (exit {EXIT_NO_FIT})")
        return EXIT_NO_FIT
    return 0


def _with_config(parser, args, argv) -> tuple[argparse.Namespace, dict | None]:
    """`args` re-parsed with `--config FILE`'s values as the defaults (the command line wins), and
    the file's policy table when it applies: when neither the file nor the command line gives a
    communication flag (`CommFlags`; given on the command line, they replace the file's policy).
    Raises ValueError naming the file and the key."""
    if not args.config:
        return args, None
    from taco_jax.train.config import CommFlags

    sp = parser.flag_parsers[args.command]
    values, policy = _config_values(sp, args.config)
    sp.set_defaults(**values)
    args = parser.parse_args(argv)
    comm = {f.name for f in dataclasses.fields(CommFlags)}
    if policy is not None and comm & set(values):
        raise ValueError(f"--config {args.config!r} gives a policy table and communication flags "
                         f"({', '.join(sorted(comm & set(values)))}); give one of them")
    given = comm & set(vars(_parser(explicit=True).parse_args(argv)))
    if policy is not None and given:
        _say(f"taco-jax: --config {args.config!r}: its policy is replaced by the command line's "
             f"communication flags ({', '.join('--' + g.replace('_', '-') for g in sorted(given))})")
        policy = None
    return args, policy


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


def _train_config(args, file_policy: dict | None):
    """The `TrainConfig` of parsed `train` / `compare` flags (with `--config`'s policy table, if it
    applies). Raises ValueError naming a bad value."""
    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.train.config import CommFlags, TrainConfig

    flags = {name: getattr(args, name) for name, _, _ in _flag_fields()}  # the one mapping: flags -> TrainConfig
    if file_policy is not None:  # a run's config.json: its policy as it was
        flags = {k: v for k, v in flags.items() if k not in {f.name for f in dataclasses.fields(CommFlags)}}
        flags["policy"] = CommPolicy.from_dict(file_policy, where=f"--config {args.config!r}: policy")
    cfg = TrainConfig.from_flags(**flags)
    cfg.check_shakespeare_vocab()
    return cfg


def config_from_argv(argv: list[str]):
    """The `TrainConfig` that `taco-jax train ARGV...` / `compare ARGV...` would run (flags and
    `--config FILE` applied; nothing started). Raises ValueError naming a bad value; SystemExit for
    a malformed command line (as argparse)."""
    parser = _parser()
    args, file_policy = _with_config(parser, parser.parse_args(argv), argv)
    return _train_config(args, file_policy)


def _train_or_compare(args, file_policy: dict | None, own_process: bool = False) -> int:
    from taco_jax.train import distributed

    try:
        dist = distributed.DistConfig.resolve(args.coordinator, args.num_processes, args.process_id,
                                              auto=args.distributed)
    except ValueError as e:
        return _error(e, EXIT_BAD_INPUT)
    processes = dist.num_processes if dist else 1  # 0: auto-detected (--distributed), not known here
    wins = f"--mesh {args.mesh}" + (f" over --num-processes {processes}" if processes > 1 else "")
    _force_cpu_devices(args.mesh, processes, wins=wins if own_process and processes else "")
    try:
        cfg = _train_config(args, file_policy)  # validates every value before anything runs
    except ValueError as e:
        return _error(e, EXIT_BAD_INPUT)
    import jax

    if dist is not None:
        try:
            distributed.initialize(dist)  # gloo for CPU collectives, then jax.distributed.initialize
        except ValueError as e:  # the coordinator's address in use (checked before the service starts)
            return _error(e, EXIT_BAD_INPUT)
    from taco_jax.train import hooks
    from taco_jax.train.compare import compare
    from taco_jax.train.loop import train
    from taco_jax.util.console import summary_block

    if own_process:
        gc.freeze()
    try:
        result = train(cfg, progress=not args.no_progress) if args.command == "train" else \
            compare(cfg, progress=not args.no_progress)
    except ValueError as e:  # a configuration or output folder that cannot run (before training)
        return _error(e, EXIT_BAD_INPUT)
    except FloatingPointError as e:  # non-finite loss, or a codec with nonfinite="error"
        return _error(e, EXIT_RUN_FAILED)
    except KeyboardInterrupt:  # Ctrl-C: one line (no traceback) saying what is kept
        _say(f"taco-jax: {_interrupted(cfg)}")
        return EXIT_INTERRUPTED
    except hooks.Stopped as e:  # SIGTERM before the first step (one process): one line saying what is kept
        _say(f"taco-jax: {e}")
        if own_process:  # a compilation cut short goes on in XLA's threads, which the interpreter's exit would
            sys.stdout.flush()  # meet half-done (SIGSEGV seen): the process ends here
            os._exit(EXIT_TERMINATED)
        return EXIT_TERMINATED
    if jax.process_index() == 0:  # one summary per run: its key numbers (the rest in summary.json)
        sys.stdout.write(summary_block(result, cfg.checkpoint.out) + "\n")
        sys.stdout.flush()
    return 0


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


if __name__ == "__main__":
    run()
