"""The settings of `taco_jax.train.config` as flags, `--config FILE` values, and the `TrainConfig`."""

from __future__ import annotations

import argparse
import difflib
import math

from taco_jax.cli.common import say


def add_flag(sp, flag, explicit: bool = False, hidden: bool = False) -> None:
    """Adds `flag` (a `settings.Flag`) to `sp`; `explicit`: no default (only given flags are set);
    `hidden`: accepted, not listed by --help."""
    names = (*flag.aliases, "--" + flag.name.replace("_", "-"))
    kw = {"default": argparse.SUPPRESS if explicit else ([] if flag.append else flag.field.default),
          "help": argparse.SUPPRESS if hidden else flag.text.replace("%", "%%")}  # argparse %-formats help
    if flag.aliases:
        kw["dest"] = flag.name
    if flag.metavar:
        kw["metavar"] = flag.metavar
    if flag.choices:
        kw["choices"] = flag.choices()
    if flag.append:
        kw["action"] = "append"
    elif isinstance(flag.field.default, bool):
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = flag.parse() if flag.parse else type(flag.field.default)
    sp.add_argument(*names, **kw)


def config_values(sp: argparse.ArgumentParser, path: str, flat: list | None = None) -> tuple[dict, dict | None]:
    """The values of `--config path` as `sp`'s defaults (each checked and typed like its flag) and
    the file's "policy" table (None without one); `flat` receives its deprecated flat keys
    (`config.read_config_file`). Raises ValueError naming the file and the unknown key or bad
    value."""
    from taco_jax.train.config import COMM_FLAGS, FLAGS, read_config_file

    actions = {a.dest: a for a in sp._actions if a.dest not in ("help", "config")}
    values, policy = {}, None
    command = sp.prog.split()[-1]
    for key, value in read_config_file(path, [] if flat is None else flat).items():
        table = FLAGS.get(key) or (("communication", key) if key in COMM_FLAGS else None)  # its table, as given
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
        values[key] = typed(actions[key], value, where)
    return values, policy


def typed(action: argparse.Action, value, where: str):
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
        except argparse.ArgumentTypeError as e:  # its rule ("must be ..."): the value is in `where` already
            raise ValueError(f"{where} {e.rule}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} is not one of {', '.join(map(str, action.choices))}")
    return value



def with_config(parser, args, argv, parser_of) -> tuple[argparse.Namespace, dict | None, str]:
    """`args` re-parsed with `--config FILE`'s values as defaults (the command line wins), the file's
    policy table unless a communication flag replaces it, and its deprecation line (printed once the
    run is accepted). Raises ValueError naming the file and the key."""
    if not args.config:
        return args, None, ""
    from taco_jax.train.config import COMM_FLAGS, flat_note

    sp, flat = parser.flag_parsers[args.command], []
    values, policy = config_values(sp, args.config, flat)
    sp.set_defaults(**values)
    args = parser.parse_args(argv)
    comm = set(COMM_FLAGS)
    if policy is not None and comm & set(values):
        raise ValueError(f"--config {args.config!r} gives a policy table and communication flags "
                         f"({', '.join(sorted(comm & set(values)))}); give one of them")
    given = comm & set(vars(parser_of(explicit=True).parse_args(argv)))
    if policy is not None and given:
        say(f"taco-jax: --config {args.config!r}: its policy is replaced by the command line's "
             f"communication flags ({', '.join('--' + g.replace('_', '-') for g in sorted(given))})")
        policy = None
    return args, policy, flat_note(flat, f"--config {args.config!r}")


def deprecated(note: str) -> None:
    """`note` (a deprecation line; "" for none) as a FlagWarning."""
    if note:
        import warnings

        from taco_jax.train.settings import FlagWarning

        warnings.warn(note, FlagWarning, stacklevel=2)



def train_config(args, file_policy: dict | None):
    """The `TrainConfig` of parsed `train` / `compare` flags (with `--config`'s policy table, if it
    applies). Raises ValueError naming a bad value."""
    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.train.config import COMM_FLAGS, TrainConfig, flags

    values = {fl.name: getattr(args, fl.name) for fl in flags()}  # the one mapping: flags -> TrainConfig
    if file_policy is not None:  # a run's config.json: its policy as it was
        values = {k: v for k, v in values.items() if k not in COMM_FLAGS}
        values["policy"] = CommPolicy.from_dict(file_policy, where=f"--config {args.config!r}: policy")
    cfg = TrainConfig.from_flags(**values)
    cfg.check_shakespeare_vocab()
    return cfg

