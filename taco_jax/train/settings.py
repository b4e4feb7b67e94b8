"""How a setting is declared (`setting`, read back as a `Flag`) and parsed, and the `ConfigError` naming its flag."""

from __future__ import annotations

import dataclasses

from taco_jax.codec import codec_kinds
from taco_jax.models import PRESETS


class FlagWarning(UserWarning):
    """A flag that has no effect on this run (`CommFlags._check_effect`), or a deprecated spelling
    (`--codec-kind`, a flat `--config` key); `taco-jax` prints it as "[taco-jax] warning: ..."."""


class ConfigError(ValueError):
    """A bad setting (a ValueError): its dataclass `field`, its `flag` (underscores) and a message
    naming the value, ending "; set by --FLAG or [SECTION] FIELD"."""

    def __init__(self, field: str, flag: str, message: str):
        super().__init__(message)
        self.field, self.flag = field, flag


#: `setting(applies=...)` -> the commands whose `--help` lists the flag (the others accept it: `PLAN_UNUSED`).
APPLIES = {"both": ("train", "plan", "predict"), "train": ("train",), "train,plan": ("train", "plan")}
#: Placeholders of a setting's help -> the registry listing that replaces them.
LISTINGS = {"{kinds}": lambda: " | ".join(codec_kinds()[1:]), "{presets}": lambda: ", ".join(sorted(PRESETS))}


def setting(default, help: str, *, order: int, flag: str = "", applies: str = "both", parse=None, metavar=None,
            choices=None, aliases: tuple[str, ...] = (), append: bool = False, path: bool = False):
    """A dataclass field that is a command-line setting: `help` (with `LISTINGS`), `order` in
    `--help`, `flag` (where not the field's name), `applies` (`APPLIES`), `parse` / `choices`
    (functions returning the argparse type / choices), `metavar`, `aliases`, `append` (repeatable),
    `path` (recorded absolute). `flags()` and the CLI derive everything else from it."""
    if applies not in APPLIES:
        raise ValueError(f"applies={applies!r} must be one of {sorted(APPLIES)}")
    return dataclasses.field(default=default, metadata={
        "flag": flag, "help": help, "order": order, "applies": APPLIES[applies], "parse": parse,
        "metavar": metavar, "choices": choices, "aliases": aliases, "append": append, "path": path})


@dataclasses.dataclass(frozen=True)
class Flag:
    """One `setting` declaration: flag `name`, `section` (its `--config` table), `field`, `owner` (its
    class); the declaration's keywords read as attributes."""

    name: str
    section: str
    field: dataclasses.Field
    owner: type
    stored: bool = True  # False: a `CommFlags` flag, mapped to the policy

    def __getattr__(self, key):
        try:
            return self.field.metadata[key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def text(self) -> str:
        """The help line, with the registries' listings filled in (`LISTINGS`)."""
        out = self.help
        for key, listing in LISTINGS.items():
            if key in out:
                out = out.replace(key, listing())
        return out


def declared(cls, section: str, stored: bool = True) -> list[Flag]:
    return [Flag(f.metadata["flag"] or f.name, section, f, cls, stored) for f in dataclasses.fields(cls) if f.metadata]


def int_or_auto(name: str, low: int):
    """argparse type of a flag that takes "auto" or an integer >= `low`."""
    return _or_auto(name, int, lambda v: v >= low, f"an integer >= {low}", show=str)


def rule_error(name: str, shown: str, rule: str):
    """argparse.ArgumentTypeError "{name}={shown} {rule}", `rule` kept as an attribute."""
    import argparse

    err = argparse.ArgumentTypeError(f"{name}={shown} {rule}")
    err.rule = rule
    return err


def _or_auto(name: str, convert, ok, need: str, show=repr):
    """argparse type of a flag that takes "auto" or a number `convert(text)` with `ok(number)`; a bad
    value is reported by argparse (exit 2) naming it: "{name}={value} must be {need} or 'auto'"."""
    rule = f"must be {need} or 'auto'"

    def parse(text: str):
        if text == "auto":
            return text
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise rule_error(name, repr(text) if value is None or not show else show(value), rule)
        return value

    return parse


#: argparse type of --step-timeout: "auto" or seconds >= 0 (finite).
seconds_or_auto = _or_auto("step_timeout", float, lambda v: 0 <= v < float("inf"), "seconds >= 0", show=None)


#: Flag -> (section, field) of each flag `TrainConfig` stores (filled by `config.FLAGS`); others are `CommFlags`'.
HOMES: dict[str, tuple[str, str]] = {}


def flag_error(flag: str, message: str) -> ConfigError:
    """The `ConfigError` of `flag`: `message` ending "; set by --FLAG or [SECTION] FIELD"."""
    section, field = HOMES.get(flag, ("communication", flag))
    suffix = f"; set by --{flag.replace('_', '-')} or [{section}] {field}"
    return ConfigError(field, flag, message if message.endswith(suffix) else message + suffix)
